"""Decoding attention of KVM: one query per row over its row's live state slots and visible window ring slots, one
softmax, read in place by a per-row page index (dense storage under generate(), an engine's pages under vLLM).

`state_window_attention_torch` is `joint_attention` of modeling_kvm in static shapes (no host syncs, traceable with
fullgraph=True), and the reference of the optional Triton kernel that the seam `decoding_attention` picks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..common.seams import package_speedups

# the seam of the Triton kernel (speedups/decode_kernel_kvm): the module where Triton and the package's speed-ups
# are, else None and the torch path runs
decode_kernel_kvm = package_speedups("decode_kernel_kvm")


def at_least_float32(x: Tensor) -> Tensor:
    """`x` in at least float32: KVM's attention inputs, whichever path reads them (so all paths round alike)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def state_window_attention_torch(q: Tensor, page: Tensor | None, state_keys: Tensor, state_values: Tensor,
                                 state_slots: Tensor, window_keys: Tensor, window_values: Tensor,
                                 window_visible: Tensor, state_temperature: Tensor | None,
                                 window_temperature: Tensor | None, scale: float) -> Tensor:
    """The reference: each row's pages gathered (`page` None: row i is page i, read without a copy), both
    segments' logits masked and concatenated, one softmax, in at least float32 (as `at_least_float32` widens the
    other paths' inputs). Queries [B, H, D] (query head h under key/value head h // groups), output [B, H, Dv] in
    the window values' dtype."""
    if page is not None:
        state_keys, state_values = state_keys[page], state_values[page]
        window_keys, window_values = window_keys[page], window_values[page]
    batch, heads, dim = q.shape
    kv_heads, capacity = state_keys.shape[1], state_keys.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    queries = q.to(wide).view(batch, kv_heads, heads // kv_heads, dim)
    live = torch.arange(capacity, device=q.device) < state_slots[:, None]  # [B, S]
    logits = []
    for keys, visible, temperature in ((state_keys, live, state_temperature),
                                       (window_keys, window_visible, window_temperature)):
        scaled = queries if temperature is None else queries * temperature.view(kv_heads, -1, 1).to(wide)
        scores = torch.matmul(scaled, keys.to(torch.promote_types(keys.dtype, torch.float32)).transpose(-1, -2))
        logits.append(scores.masked_fill(~visible[:, None, None], float("-inf")))
    probs = torch.softmax(torch.cat(logits, dim=-1) * scale, dim=-1)
    out = (torch.matmul(probs[..., :capacity], state_values.to(torch.promote_types(state_values.dtype, torch.float32)))
           + torch.matmul(probs[..., capacity:],
                          window_values.to(torch.promote_types(window_values.dtype, torch.float32))))
    return out.to(window_values.dtype).view(batch, heads, -1)


def decoding_attention(q: Tensor, state_keys: Tensor, state_values: Tensor, window_keys: Tensor,
                       window_values: Tensor) -> Callable[..., Tensor]:
    """The seam of the decoding attention (each row's query [B, H, D] over its page's live state slots and visible
    ring slots, one softmax, [B, H, Dv]): the Triton kernel where the seam found it and it applies
    (`use_triton_kernel`: CUDA, tensors it reads), else the torch reference it equals. Both take
    `state_window_attention_torch`'s arguments."""
    if decode_kernel_kvm is not None and q.is_cuda and decode_kernel_kvm.use_triton_kernel(
            q, state_keys, state_values, window_keys, window_values):
        return decode_kernel_kvm.state_window_attention_triton
    return state_window_attention_torch
