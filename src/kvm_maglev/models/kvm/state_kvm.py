"""The key-value-means state as small pure functions: no cache, no module, no device tuning.

A state is three tensors per layer: key sums [B, H, slots, D] (layer-normed, rotary channels zeroed),
value sums [B, H, slots, Dv] and float32 value norms or merge counts [B, H, slots, 1], H the key/value heads
(query heads of a group read their key/value head's state, `query_slice`). A block leaving
the window enters it by `fold_overflow`: its most novel tokens are appended while the state is below
its budget, the rest are added to their most similar slot (sink slots protected). Attention reads the
state through `readable_state`. modeling_kvm calls these at once; runtime_kvm spreads the same calls
over decoding steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # key sums, value sums, value norms (or counts)

# Block tokens x state slots per similarity product. The products run in row blocks of this size so
# that a fold spread over decoding steps (runtime_kvm) computes exactly the products of one computed
# at once: a product's rounding can depend on how many rows it has, and a near tie would then pick
# another slot.
SIMILARITY_BLOCK = 64 * 1024


def similarity_rows(tokens: int, slots: int) -> list[slice]:
    """The row blocks in which `tokens` block tokens are compared with `slots` state slots."""
    size = max(1, SIMILARITY_BLOCK // max(1, slots))
    return [slice(begin, begin + size) for begin in range(0, tokens, size)]


def state_keys(k: torch.Tensor, rotary_dim: int, normalize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Keys as they enter the state: rotary channels zeroed (slots have no position), then layer-normed."""
    return normalize(torch.cat([torch.zeros_like(k[..., :rotary_dim]), k[..., rotary_dim:]], dim=-1))


def slot_norms(values: torch.Tensor, value_norms: bool) -> torch.Tensor:
    """float32 norm of each new slot's value (kept for reading), or a count of 1 when norms are off."""
    if value_norms:
        return torch.linalg.vector_norm(values.float(), dim=-1, keepdim=True)
    return values.new_ones(values.shape[:-1] + (1,), dtype=torch.float32)


def append_slots(state: State, keys: torch.Tensor, values: torch.Tensor, value_norms: bool) -> State:
    """The state with one new slot per token of keys/values [B, H, T, D]."""
    state_keys_, state_values, norms = state
    return (torch.cat([state_keys_, keys], dim=2), torch.cat([state_values, values], dim=2),
            torch.cat([norms, slot_norms(values, value_norms)], dim=2))


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Tokens `index` [B, H, N] of x [B, H, T, D]."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


@torch.no_grad()  # only an order comes out of it
def novelty(keys: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """float32 [B, H, T]: each token's largest similarity to the (layer-normed) state keys; low is novel."""
    parts = [torch.matmul(keys[:, :, rows], reference.transpose(-1, -2)).float().amax(dim=-1)
             for rows in similarity_rows(keys.shape[2], reference.shape[2])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def split_by_novelty(scores: torch.Tensor, n_append: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (each ascending) to append, the `n_append` most novel, and to merge, the rest."""
    order = torch.argsort(scores, dim=-1)
    return order[..., :n_append].sort(dim=-1).values, order[..., n_append:].sort(dim=-1).values


@torch.no_grad()  # only indices come out of it
def most_similar_slot(keys: torch.Tensor, reference: torch.Tensor, protected: int,
                      score_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, H, T, 1]: the slot each token merges into, its most similar one past the `protected` sinks; the
    similarities scored in `score_dtype` (None: the keys' dtype), where a coarse dtype can tie or flip them."""
    if score_dtype is not None:
        keys, reference = keys.to(score_dtype), reference.to(score_dtype)
    parts = []
    for rows in similarity_rows(keys.shape[2], reference.shape[2]):
        similarity = torch.matmul(keys[:, :, rows], reference.transpose(-1, -2))
        similarity[..., :protected] = float("-inf")
        parts.append(similarity.argmax(dim=-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def merge_into_slots(state: State, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor,
                     value_norms: bool) -> State:
    """Add each token's key and value to its slot's sums (winner take all)."""
    state_keys_, state_values, norms = state
    state_keys_ = state_keys_.scatter_add(2, slot.expand_as(keys), keys)
    state_values = state_values.scatter_add(2, slot.expand_as(values), values)
    if not value_norms:
        # The research code sums its one-hot merge matrix over slots, so each merged block adds one to
        # every slot's count (the published no-vlens ablation was trained that way).
        norms = norms + 1
    return state_keys_, state_values, norms


@dataclass(frozen=True)
class Overflow:
    """A block leaving the window as the state takes it: `keys` rank the tokens' novelty; the append and
    merge forms carry the merge gate where the config applies it."""

    keys: torch.Tensor
    append_keys: torch.Tensor
    append_values: torch.Tensor
    merge_keys: torch.Tensor
    merge_values: torch.Tensor

    def heads(self, heads: slice) -> "Overflow":
        return Overflow(*(t[:, heads] for t in (self.keys, self.append_keys, self.append_values,
                                                 self.merge_keys, self.merge_values)))

    def split(self, n_append: int, scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor, torch.Tensor]:
        """Tokens to append (keys, values) and to merge (keys, values), given novelty `scores` when
        some but not all tokens are appended."""
        tokens = self.keys.shape[2]
        if n_append <= 0:
            empty = self.keys[:, :, :0]
            return empty, self.append_values[:, :, :0], self.merge_keys, self.merge_values
        if n_append >= tokens:
            return self.append_keys, self.append_values, self.merge_keys[:, :, :0], self.merge_values[:, :, :0]
        append, merge = split_by_novelty(scores, n_append)
        return (gather_tokens(self.append_keys, append), gather_tokens(self.append_values, append),
                gather_tokens(self.merge_keys, merge), gather_tokens(self.merge_values, merge))


def fold_overflow(state: State, reference: torch.Tensor, block: Overflow, n_append: int, sink_slots: int,
                  normalize: Callable[[torch.Tensor], torch.Tensor], value_norms: bool,
                  score_dtype: torch.dtype | None = None) -> State:
    """The state after `block` enters it: its `n_append` most novel tokens (by similarity to `reference`,
    the layer-normed state keys) become new slots, the others merge into their most similar slot (similarities
    scored in `score_dtype`)."""
    scores = novelty(block.keys, reference) if 0 < n_append < block.keys.shape[2] else None
    append_keys, append_values, merge_keys, merge_values = block.split(n_append, scores)
    if append_keys.shape[2]:
        state = append_slots(state, append_keys, append_values, value_norms)
        reference = torch.cat([reference, normalize(append_keys)], dim=2)
    if merge_keys.shape[2] == 0:
        return state
    slot = most_similar_slot(merge_keys, reference, min(sink_slots, state[0].shape[2]), score_dtype)
    return merge_into_slots(state, merge_keys, merge_values, slot, value_norms)


def query_slice(kv_heads: slice, group: int) -> slice:
    """The query heads that read key/value heads `kv_heads` (a step-1 slice), `group` query heads each."""
    start = None if kv_heads.start is None else kv_heads.start * group
    stop = None if kv_heads.stop is None else kv_heads.stop * group
    return slice(start, stop)


def readable_state(state: State, normed_keys: torch.Tensor, temperature: torch.Tensor | float, value_norms: bool,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [B, H, slots, D] and value columns [B, H, Dv, slots] as attention reads them: layer-normed,
    temperature-scaled keys; value sums renormalised to their slot's recorded norm, or averaged."""
    state_values, norms = state[1], state[2]
    if value_norms:
        values = F.normalize(state_values.float(), dim=-1) * norms
    else:
        values = state_values / norms
    # stored transposed: a one-query decoding step reads them fastest as columns (runtime_kvm)
    return (normed_keys * temperature).to(dtype), values.to(dtype).transpose(-1, -2).contiguous()
