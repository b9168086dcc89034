"""What a model's cache holds after n tokens, in closed form from its config alone: for planning (model cards, the
vLLM pages, benchmarks); each equals the cache's own `nbytes()` (tested). A Hub folder's code does not carry it: the
models never size a cache ahead.

    from kvm_maglev.cache_sizes import cache_bytes
    cache_bytes(config, num_tokens, batch_size=1, dtype=torch.bfloat16)
"""

from __future__ import annotations

import torch

from .models.kvm.state_kvm import state_dtype_for, state_slots_after, window_start
from .models.maglev.cache_maglev import growing_capacity, windows_grow


def cache_bytes(config, num_tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a KVM or Maglev cache holds after `num_tokens` tokens (what its `nbytes()` reports)."""
    return {"kvm": kvm_cache_bytes, "maglev": maglev_cache_bytes}[model_type(config)](
        config, num_tokens, batch_size, dtype)


def full_attention_cache_bytes(config, num_tokens: int, batch_size: int = 1,
                               dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a plain full-attention key/value cache of the same shape holding `num_tokens` tokens."""
    item = element_size(dtype)
    if model_type(config) == "kvm":
        per_token = config.kv_heads * (config.qk_head_dim + config.v_head_dim) * item
        return config.num_hidden_layers * batch_size * max(num_tokens, 0) * per_token
    check_sizes(num_tokens, batch_size)
    return 2 * config.num_hidden_layers * config.kv_dim * num_tokens * batch_size * item


def kvm_cache_bytes(config, num_tokens: int, batch_size: int, dtype: torch.dtype) -> int:
    """A KVMCache's bytes: per layer its token-shift carries, its window and, in a KVM layer, its state."""
    item, state_item = element_size(dtype), element_size(state_dtype_for(dtype))
    heads, dk, dv = config.kv_heads, config.qk_head_dim, config.v_head_dim
    q, k, vv, hidden = config.num_attention_heads * dk, heads * dk, heads * dv, config.hidden_size
    if num_tokens <= 0:
        return 0
    total = 0
    for layer_idx in range(config.num_hidden_layers):
        sliding = config.is_sliding_window_layer(layer_idx)
        shift = hidden * item if config.ffn_token_shift else 0
        if config.sliding_window_token_shift if sliding else config.kvm_token_shift:
            shift += (q + k + vv) * item
        mode = config.sliding_window_value_residual_mode if sliding else config.kvm_value_residual_mode
        if config.value_residual and mode == "rwkv_post_tokenshift":
            shift += hidden * item
        window = num_tokens - window_start(config, sliding, num_tokens)
        total += batch_size * shift
        if sliding:
            total += batch_size * heads * window * (dk + dv) * item
            continue
        gate = 1 if config.merge_gate_keys or config.merge_gate_values else 0
        total += batch_size * heads * window * (dk + dv + gate) * item
        total += batch_size * heads * state_slots_after(config, num_tokens) * ((dk + dv) * state_item + 4)
    return total


def maglev_cache_bytes(config, num_tokens: int, batch_size: int, dtype: torch.dtype) -> int:
    """A MaglevCache's bytes: constant from the first token with a sliding window, and once `num_tokens` reaches
    the widest window otherwise."""
    check_sizes(num_tokens, batch_size)
    if num_tokens == 0:
        return 0
    element = element_size(dtype)
    per_token = 2 * config.kv_dim * element * batch_size
    slots = growing_capacity(num_tokens)
    total = sum(per_token * (min(left, slots) if windows_grow(config) else left) for left in config.decoder_windows)
    total += 8 * batch_size  # each row's int64 position (real tokens read)
    total += batch_size * config.hidden_size * element  # smear's previous embedding
    if config.use_memory:
        total += batch_size * config.hidden_size * element  # last memory vector
    return total


def model_type(config) -> str:
    """`config`'s model type, one of ours (else ValueError)."""
    if config.model_type not in ("kvm", "maglev"):
        raise ValueError(f"cache sizes are known for KVM and Maglev configs, not model_type={config.model_type!r}")
    return config.model_type


def check_sizes(num_tokens: int, batch_size: int) -> None:
    if num_tokens < 0 or batch_size < 1:
        raise ValueError(f"num_tokens must be >= 0 and batch_size >= 1, got {num_tokens}, {batch_size}")


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
