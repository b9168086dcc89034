"""vLLM config checks for our recurrent-state models: what cannot be exact is turned off or refused by name."""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

logger = logging.getLogger("kvm_maglev.vllm")


class RecurrentStateServing(VerifyAndUpdateConfig):
    """Prefix caching off (a request's state after a shared prefix is not stored per block), speculative decoding
    refused (a rejected draft would need the state rolled back), the prefiller refused (it reads a whole prompt
    at once, which chunked prefill and preemption do not guarantee), the state pages sized for the request."""

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
        if cache_config.enable_prefix_caching:
            logger.warning("%s: prefix caching turned off: the recurrent state after a shared prefix is not kept "
                           "per block, so cached prefixes would give other tokens", architecture)
            cache_config.enable_prefix_caching = False
        if architecture == "KVMForCausalLM":
            split_at_state_operators(vllm_config.compilation_config)
        cache_config.mamba_cache_mode = "none"
        if cache_config.mamba_block_size is None:
            cache_config.mamba_block_size = model_config.max_model_len


def split_at_state_operators(compilation_config) -> None:
    """KVM's compiled graph splits at its state operators (engine_ops), as vLLM's own models split at attention:
    they run per-request host work, which a captured CUDA graph could not replay."""
    from kvm_maglev.vllm.engine_ops import SPLITTING_OPS

    current = list(compilation_config.splitting_ops or [])
    compilation_config.splitting_ops = current + [op for op in SPLITTING_OPS if op not in current]
