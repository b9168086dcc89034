"""Inference speed-ups for Maglev models, kept apart from the math (modeling_maglev).

Inside `runtime_speedups(model)`, which `model.runtime_speedups()` returns and `generate()` opens:
- linear layers compute on oneDNN, batched steps on blocked weight copies (onednn_linear);
- a one-token step attends over a ring as matrix-vector products, without copying the ring.
Each computes what the plain path computes, up to float rounding.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .runtime_switch import speedups_switched_on


def one_query_attention(q, k, v, ring_keys, ring_values, written) -> torch.Tensor:
    """One query per row [B, H, 1, D] over the ring's `written` slots and its own key/value, as
    `MaglevAttention.attend_ring` computes it: ring logits as keys @ q, the output as probs @ values."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    # keys @ q (not q @ keys^T), q contiguous and then transposed: on CPU that one-column product reads the
    # ring about three times as fast (a contiguous column vector takes a slower kernel)
    column = grouped.contiguous().transpose(-1, -2)
    ring_scores = (ring_keys @ column).transpose(-1, -2).masked_fill(~written, float("-inf"))
    own_score = (grouped * k).sum(dim=-1, keepdim=True)
    weights = (torch.cat([ring_scores, own_score], dim=-1).float() * dim ** -0.5).softmax(dim=-1).to(q.dtype)
    y = weights[..., :-1] @ ring_values + weights[..., -1:] * v
    return y.reshape(batch, heads, 1, dim)


class FastMaglevAttention:
    """Mixed into a Maglev attention module inside `runtime_speedups`: its speed-ups over the plain methods."""

    def attend_ring(self, q, k, v, ring, plan) -> torch.Tensor:
        if plan.length == 1:
            keys, values = ring.read(k)
            return one_query_attention(q, k, v, keys, values, ring.written(plan))
        return super().attend_ring(q, k, v, ring, plan)


def runtime_speedups(model: nn.Module, attention_class: type) -> contextlib.AbstractContextManager:
    """A block in which `model` runs with the speed-ups above; on leaving it the model is plain again."""
    return speedups_switched_on(model, attention_class, FastMaglevAttention)
