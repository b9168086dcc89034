"""vLLM config checks for our recurrent-state models: what cannot be exact is turned off or refused by name."""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

logger = logging.getLogger("kvm_maglev.vllm")


class RecurrentStateServing(VerifyAndUpdateConfig):
    """Prefix caching off (a request's state after a shared prefix is not stored per block), speculative decoding
    refused (a rejected draft would need the state rolled back), the prefiller refused (it reads a whole prompt
    at once, which chunked prefill and preemption do not guarantee), a tensor-parallel size that does not split
    the heads refused, the state pages sized for the request."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        """Adjust `vllm_config` in place, or raise a ValueError naming the unsupported feature."""
        model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
        architecture = model_config.architecture
        if vllm_config.speculative_config is not None:
            raise ValueError(f"{architecture}: speculative decoding is not supported on vLLM (rejected drafts would "
                             "need the recurrent state rolled back, which vLLM's state pages do not keep); "
                             "remove --speculative-config")
        if getattr(model_config.hf_config, "memory_prefill", "recurrent") == "prefiller":
            raise ValueError(f"{architecture}: memory_prefill='prefiller' is not served on vLLM (the prefiller must "
                             "read a whole prompt at once; chunked prefill and preemption split it); serve with "
                             "--hf-overrides '{\"memory_prefill\": \"recurrent\"}'")
        check_tensor_parallel(architecture, model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)
        if cache_config.enable_prefix_caching:
            logger.warning("%s: prefix caching turned off: the recurrent state after a shared prefix is not kept "
                           "per block, so cached prefixes would give other tokens", architecture)
            cache_config.enable_prefix_caching = False
        cache_config.mamba_cache_mode = "none"
        if cache_config.mamba_block_size is None:
            cache_config.mamba_block_size = model_config.max_model_len


def check_tensor_parallel(architecture: str, config, tp_size: int) -> None:
    """Raise a ValueError at start-up for a tensor-parallel size the model cannot be split by: any size above 1 for
    Maglev (not split yet), for KVM one that does not divide its heads, key/value heads and MLP units."""
    if tp_size == 1:
        return
    if architecture == "MaglevForCausalLM":
        raise ValueError(f"{architecture}: tensor_parallel_size={tp_size} is not supported on vLLM (the plugin's "
                         "Maglev holds every head on every rank); serve it with tensor_parallel_size=1")
    from kvm_maglev.vllm.tensor_parallel import check_divisible

    check_divisible(architecture, {"num_attention_heads": config.num_attention_heads,
                                   "num_key_value_heads": config.kv_heads, "intermediate_size": config.ffn_size},
                    tp_size)
