"""One KVM decoding query per row over its row's state slots and window ring, read from the storage by row.

The torch path is the reference (static shapes, no host synchronisation: it traces whole under torch.compile).
"""

from __future__ import annotations

import torch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def segment_logits(q: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """[B, Hkv, groups, K] logits of queries [B, Hkv, groups, D] (scaled per query head by `temperature` [H])
    against keys [B, Hkv, K, D]."""
    if temperature is not None:
        q = q * temperature.view(1, q.shape[1], q.shape[2], 1).to(q.dtype)
    return torch.matmul(q, at_least_float32(keys).transpose(-1, -2))


def state_window_attention_torch(q: torch.Tensor, page: torch.Tensor | None, state_keys: torch.Tensor,
                                 state_values: torch.Tensor, state_slots: torch.Tensor, window_keys: torch.Tensor,
                                 window_values: torch.Tensor, window_visible: torch.Tensor,
                                 state_temperature: torch.Tensor | None, window_temperature: torch.Tensor | None,
                                 scale: float) -> torch.Tensor:
    """Queries q [B, H, D] over the state slots below `state_slots` [B] and the visible ring slots
    (`window_visible` [B, W]) of storage rows `page` [B] (None: row i is storage row i), in one softmax.
    Query head h reads key/value head h // (H / Hkv). Returns [B, H, Dv] in the values' dtype."""
    if page is not None:
        state_keys, state_values = state_keys[page], state_values[page]
        window_keys, window_values = window_keys[page], window_values[page]
    batch, heads, dim = q.shape
    kv_heads = window_keys.shape[1]
    grouped = at_least_float32(q).view(batch, kv_heads, heads // kv_heads, dim)
    live = torch.arange(state_keys.shape[2], device=q.device) < state_slots[:, None]
    logits = torch.cat([
        segment_logits(grouped, state_keys, state_temperature).masked_fill(~live[:, None, None], float("-inf")),
        segment_logits(grouped, window_keys, window_temperature).masked_fill(~window_visible[:, None, None],
                                                                             float("-inf")),
    ], dim=-1)
    probs = torch.softmax(logits * scale, dim=-1)
    slots = state_keys.shape[2]
    out = torch.matmul(probs[..., :slots], at_least_float32(state_values)) \
        + torch.matmul(probs[..., slots:], at_least_float32(window_values))
    return out.to(window_values.dtype).view(batch, heads, -1)


def state_window_attention(*args, **kwargs) -> torch.Tensor:
    return state_window_attention_torch(*args, **kwargs)
