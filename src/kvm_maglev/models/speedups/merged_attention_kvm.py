"""KVM's prompt pieces over their key sets (`modeling_kvm.KeySet`: state, ring, earlier tokens, own tokens) as one
flash-attention call per set, merged by the sets' log-sum-exp, instead of one fused call over the sets joined
(`modeling_kvm.fused_attention`, the reference it equals up to float rounding).

Joining copies every set's keys and values and a mask of [pieces, queries, keys] each call, and the fused kernel
then computes every masked block. Here nothing is joined: a temperature scales the queries instead of a set's keys;
a set whose mask has one row per piece (state, ring, earlier tokens of a KVM layer) takes it as a broadcast mask;
and a piece's own tokens (`KeySet.causal`) take the kernel's causal mode, which skips the blocks above the
diagonal. On CPU, where torch's flash kernel returns the log-sum-exp it needs
(`_scaled_dot_product_flash_attention_for_cpu`); elsewhere the fused call runs. Measurements: docs/serving.md.
"""

from __future__ import annotations

import torch

# torch's CPU flash attention, which returns each query's log-sum-exp beside its output
FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def applies(q: torch.Tensor, key_sets: list) -> bool:
    """Whether `attend_key_sets` runs for queries `q` over `key_sets`: on CPU, outside compiled graphs, float32 once
    widened (as the reference widens half precision), the pieces' own tokens among the sets (`KeySet.causal`: a set
    every query sees a key of, on which the others are merged)."""
    return (FLASH is not None and q.device.type == "cpu" and not torch.compiler.is_compiling()
            and torch.promote_types(q.dtype, torch.float32) == torch.float32
            and any(key_set.causal for key_set in key_sets))


def attend_key_sets(q: torch.Tensor, key_sets: list, groups: int) -> torch.Tensor:
    """`fused_attention` (its arguments, its result: queries [P, Q, H, D] over every key set in one softmax, output
    [P, Q, H, Dv] in the values' dtype) as a flash call per set, the sets' results merged in turn by their
    log-sum-exp, each only over the pieces that see some key of it."""
    queries = q.float().transpose(1, 2)  # [P, H, Q, D]
    results = [(key_set.causal, *attend_key_set(queries, key_set, groups)) for key_set in key_sets
               if key_set.keys.shape[2]]
    # the pieces' own tokens first: each query sees its own, so every log-sum-exp merged on is finite
    _, _, out, lse = results.pop(next(index for index, result in enumerate(results) if result[0]))
    for _, pieces, set_out, set_lse in results:
        if pieces is None:
            out, lse = merged(out, lse, set_out, set_lse)
        elif len(pieces):
            out[pieces], lse[pieces] = merged(out[pieces], lse[pieces], set_out, set_lse)
    return out.transpose(1, 2).to(key_sets[-1].values.dtype)


def merged(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor,
           other_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over two sets of keys from each one's output [..., Dv] and log-sum-exp [...] (`lse` finite)."""
    top = torch.maximum(lse, other_lse)
    weight, other_weight = (lse - top).exp(), (other_lse - top).exp()
    total = weight + other_weight
    out = (out * (weight / total)[..., None]).addcmul_(other, (other_weight / total)[..., None])
    return out, top + total.log()


def attend_key_set(queries: torch.Tensor, key_set, groups: int) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                         torch.Tensor | None]:
    """Queries [P, H, Q, D] (float32) over one key set, only the pieces that see some key of it (a piece of a row's
    first chunk reads no state, nor earlier tokens): those pieces (None: all), and their output [p, H, Q, Dv] and
    log-sum-exp [p, H, Q] (None where no piece sees any), 0 and -inf for a query that sees none of the set's keys."""
    pieces = None
    if not key_set.causal:
        seen = key_set.visible.flatten(1).any(-1)
        if not bool(seen.all()):
            pieces = seen.nonzero()[:, 0]
            if not len(pieces):  # a ring none of these pieces' rows has written yet
                return pieces, None, None
            queries = queries[pieces]
            key_set = key_set._replace(keys=key_set.keys[pieces], values=key_set.values[pieces],
                                       visible=key_set.visible[pieces])
    keys, values = key_set.keys.float(), key_set.values.float()
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    if key_set.temperature is not None:
        queries = queries * key_set.temperature.view(1, -1, 1, 1).to(queries.dtype)
    if key_set.causal:
        out, lse = FLASH(queries, keys, values, is_causal=True)
        return pieces, out, lse
    visible = key_set.visible  # [p, Q or 1, K]
    mask = torch.zeros(visible.shape, dtype=queries.dtype, device=queries.device).masked_fill_(~visible, -torch.inf)
    out, lse = FLASH(queries, keys, values, attn_mask=mask[:, None])
    seeing = visible.any(-1)  # [p, Q or 1]
    if not bool(seeing.all()):  # the kernel leaves a query that sees no key a finite log-sum-exp
        lse = lse.masked_fill(~seeing[:, None], -torch.inf)
        out = out.masked_fill(~seeing[:, None, :, None], 0.0)
    return pieces, out, lse
