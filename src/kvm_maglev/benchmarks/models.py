"""Model shapes and builders for the benchmarks: our models and the baselines users would pick."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from kvm_maglev import cache_sizes


@dataclass(frozen=True)
class Shape:
    """Backbone shape shared by every benchmarked model (default: the research 120M, 4 layers)."""

    num_layers: int = 4
    hidden_size: int = 768
    num_heads: int = 6
    vocab_size: int = 50304
    chunk_len: int = 256  # KVM block size; the sliding-window baselines use KVM's window
    window_chunks: int = 2

    @property
    def window(self) -> int:
        return self.chunk_len * self.window_chunks

    @property
    def mlp_size(self) -> int:
        """SwiGLU width with about the parameters of a 4x two-matrix MLP."""
        return (8 * self.hidden_size) // 3


TINY = Shape(num_layers=2, hidden_size=64, num_heads=2, vocab_size=512, chunk_len=16, window_chunks=2)
# a 1B-class shape for GPU runs: 1.0B parameters (Maglev 2.0B with its separate prefiller)
ONE_B = Shape(num_layers=16, hidden_size=2048, num_heads=16, vocab_size=50304, chunk_len=256, window_chunks=2)
# the default shape with 8 heads, so that 2 and 4 query heads can share a key/value head (GQA builders)
HEADS8 = Shape(num_heads=8)
SHAPES = {"default": Shape(), "tiny": TINY, "1b": ONE_B, "heads8": HEADS8}


def _baseline_fields(shape: Shape) -> dict:
    """Config fields the Llama and Mistral baselines share (multi-head attention, SDPA)."""
    return dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.mlp_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=1 << 20,
        attn_implementation="sdpa",
    )


def _llama(shape: Shape) -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(**_baseline_fields(shape)))


def _mistral(shape: Shape) -> torch.nn.Module:
    return MistralForCausalLM(MistralConfig(sliding_window=shape.window, **_baseline_fields(shape)))


def _kvm(shape: Shape, **budget) -> torch.nn.Module:
    from kvm_maglev import KVMConfig, KVMForCausalLM

    config = KVMConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        chunk_size=shape.chunk_len,
        window_chunks=shape.window_chunks,
        **budget,
    )
    return KVMForCausalLM(config)


def _maglev(shape: Shape, memory_prefill: str) -> torch.nn.Module:
    """Maglev with its prefiller kept, so the same weights serve both prompt modes."""
    from kvm_maglev import MaglevConfig, MaglevForCausalLM

    config = MaglevConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        use_memory=True,
        sliding_window=shape.window,
        has_prefiller=True,
        memory_prefill=memory_prefill,
    )
    return MaglevForCausalLM(config)


MODEL_BUILDERS: dict[str, Callable[[Shape], torch.nn.Module]] = {
    # the research kvm_wd / kvm_sqrt16_wd budgets: 256 fixed slots, or 16 * sqrt(N) (min 256)
    "kvm_fixed": lambda shape: _kvm(
        shape, state_budget_mode="fixed", state_budget_min=shape.chunk_len, state_max_chunks=1
    ),
    "kvm_sqrt16": lambda shape: _kvm(
        shape,
        state_budget_mode="power_law",
        state_budget_factor=16.0,
        state_budget_exponent=0.5,
        state_budget_min=shape.chunk_len,
        state_max_chunks=10000,
    ),
    "maglev": lambda shape: _maglev(shape, "recurrent"),
    "maglev_prefiller": lambda shape: _maglev(shape, "prefiller"),
    "llama_full": _llama,
    "mistral_swa": _mistral,
}


def _grouped(name: str, group: int) -> Callable[[Shape], torch.nn.Module]:
    """MODEL_BUILDERS[name] with `group` query heads per key/value head (grouped-query attention)."""

    def build(shape: Shape) -> torch.nn.Module:
        if shape.num_heads % group:
            raise ValueError(f"{name}_gqa{group} needs a head count divisible by {group}, the shape has "
                             f"{shape.num_heads} (use --shape heads8)")
        model = MODEL_BUILDERS[name](shape)
        config = model.config.to_dict()
        config["num_key_value_heads"] = shape.num_heads // group
        return type(model)(type(model.config).from_dict(config))

    return build


# KVM with grouped-query attention: only on request (`--models`), as its head counts need a fitting shape
GQA_BUILDERS: dict[str, Callable[[Shape], torch.nn.Module]] = {
    f"{name}_gqa{group}": _grouped(name, group) for name in ("kvm_fixed", "kvm_sqrt16") for group in (2, 4)
}
ALL_BUILDERS = {**MODEL_BUILDERS, **GQA_BUILDERS}


def cache_bytes(cache) -> int:
    """Bytes a cache holds: our caches report ``nbytes()``; transformers' caches are summed per layer."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def closed_form_cache_bytes(model: torch.nn.Module, row_tokens: list[int]) -> int | None:
    """Cache size predicted from the config alone, for rows that read `row_tokens` real tokens each.

    Our caches keep each row's own tokens (a padded row holds less, and a KVM row's window depends on
    where it is in its chunk), so the prediction is summed per row; transformers' caches keep every
    column of the padded batch (KV heads x head dim x kept columns).
    """
    config = model.config
    dtype = next(model.parameters()).dtype
    if config.model_type in ("kvm", "maglev"):
        return sum(int(cache_sizes.cache_bytes(config, tokens, batch_size=1, dtype=dtype)) for tokens in row_tokens)
    kept = max(row_tokens)
    if getattr(config, "sliding_window", None):
        kept = min(kept, config.sliding_window - 1)  # the next query brings its own key: window - 1 are kept
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * kept * len(row_tokens) * torch.finfo(dtype).bits // 8
