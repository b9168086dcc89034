"""Maglev's one-query ring attention, kept apart from the math (modeling_maglev): inside `model.runtime_speedups()`
(runtime_switch), which `generate()` opens, a one-token step attends over a ring as matrix-vector products, without
copying the ring. `MaglevAttention.attend_token` calls `one_query_attention` where its seam found this module and the
`one_query_kernel` flag is on, beside the plain attention it equals up to float rounding.
"""

from __future__ import annotations

import torch


def one_query_attention(q, aside_k, aside_v, ring_keys, ring_values, written, aside) -> torch.Tensor:
    """One query per row [B, H, 1, D] over the ring's `written` slots and the key/value set aside by the token's
    write (`MaglevCacheLayer.update`; seen where `aside` [B, 1, 1, 1]), as `MaglevAttention.attend_token` computes
    it: ring logits as keys @ q, the output as probs @ values."""
    batch, heads, _, dim = q.shape
    kv_heads = aside_k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    # keys @ q (not q @ keys^T), q contiguous and then transposed: on CPU that one-column product reads the
    # ring about three times as fast (a contiguous column vector takes a slower kernel)
    column = grouped.contiguous().transpose(-1, -2)
    ring_scores = (ring_keys @ column).transpose(-1, -2).masked_fill(~written, float("-inf"))
    aside_score = (grouped * aside_k).sum(dim=-1, keepdim=True).masked_fill(~aside, float("-inf"))
    weights = (torch.cat([ring_scores, aside_score], dim=-1).float() * dim ** -0.5).softmax(dim=-1).to(q.dtype)
    y = weights[..., :-1] @ ring_values + weights[..., -1:] * aside_v
    return y.reshape(batch, heads, 1, dim)
