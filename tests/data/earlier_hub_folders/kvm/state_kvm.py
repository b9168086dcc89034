"""The key-value-means state: how big it may grow and how a block enters it, as small pure functions.

A state is three tensors per layer: key sums [B, H, slots, D] (layer-normed, rotary channels zeroed),
value sums [B, H, slots, Dv] and float32 value norms or merge counts [B, H, slots, 1], H the key/value heads
(query heads of a group read their key/value head's state, `query_slice`). How many slots it may have is the
budget rule (`state_budget`, `append_count`). A block leaving the window enters it in stages (`Fold`):
score the block's tokens against the slots (`score_overflow`), choose the most novel to append while the
state is below its budget (`choose_appends`), append them (`append`), route the rest to their most similar
slot (`route_merges`, sink slots protected) and add them to it (`merge`); attention reads the state
renormalised (`readable_state`). `run_fold` runs a fold's stages at once (the full forward);
runtime_kvm runs the same stages one per decoding step. No cache, no module, no device tuning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

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


# ---- the budget rule -------------------------------------------------------------------------------
def round_down(value: int, multiple: int) -> int:
    """`value` (at least 0) rounded down to a multiple of `multiple`."""
    return (max(value, 0) // max(multiple, 1)) * max(multiple, 1)


def state_budget(config, context_len: int) -> int:
    """Budget target of the state after `context_len` tokens (the config's `state_budget_*` fields), at most
    `max_state_slots`, before the coverage cap of `append_count`."""
    if config.state_budget_mode == "fixed":
        target = config.state_budget_min
    elif config.state_budget_mode == "power_law":
        target = int(math.floor(config.state_budget_factor * float(max(context_len, 0)) ** config.state_budget_exponent))
        target = max(round_down(target, config.state_budget_round_to), config.state_budget_min)
    else:
        n, t = float(config.state_budget_saturation), float(max(context_len, 0))
        target = int(math.floor(n * t / (n + t)))
        target = max(round_down(target, config.state_budget_round_to), config.state_budget_min)
    return min(target, config.max_state_slots)


def append_count(config, block: int, slots: int) -> int:
    """Tokens of window block `block` (>= 1) appended to a `slots`-slot state: up to the budget of the context
    the state then covers, at most what that context holds, at most the block; the rest are merged."""
    chunk = config.chunk_size
    budget = state_budget(config, (block + config.window_chunks) * chunk)
    return min(max(min(budget, (block + 1) * chunk), slots) - slots, chunk)


# ---- a block entering the state, in stages -----------------------------------------------------------
@dataclass
class Fold:
    """A block's fold into a state under way: the state so far and what each stage has computed for the next.

    `reference` holds the layer-normed keys of the state's slots (appended ones included); None until the
    first stage that needs them norms them with `normalize`. Similarities run in `similarity_rows` blocks,
    each its own stage, so that the stages of a fold computed at once or one per step are the same products.
    """

    state: State
    reference: torch.Tensor | None
    block: Overflow
    n_append: int
    sink_slots: int
    normalize: Callable[[torch.Tensor], torch.Tensor]
    value_norms: bool
    score_dtype: torch.dtype | None = None  # routing similarities' dtype (None: the keys')
    scores: list[torch.Tensor] = field(default_factory=list)  # novelty of the block's tokens, row block by block
    merge_keys: torch.Tensor | None = None  # the tokens to merge, once chosen
    merge_values: torch.Tensor | None = None
    append_keys: torch.Tensor | None = None  # the tokens to append, once chosen
    append_values: torch.Tensor | None = None
    slots: list[torch.Tensor] = field(default_factory=list)  # each merge token's slot, row block by block

    @property
    def appended(self) -> int:
        """How many of the block's tokens become new slots."""
        return min(max(self.n_append, 0), self.block.keys.shape[2])

    def reference_keys(self) -> torch.Tensor:
        """Layer-normed keys of the state's slots, normed at the first call when none were given."""
        if self.reference is None:
            self.reference = self.normalize(self.state[0])
        return self.reference

    def heads(self, heads: slice) -> "Fold":
        """The fold of key/value heads `heads` alone (before any stage has run)."""
        return Fold(tuple(t[:, heads] for t in self.state), None if self.reference is None else self.reference[:, heads],
                    self.block.heads(heads), self.n_append, self.sink_slots, self.normalize, self.value_norms,
                    self.score_dtype)


def score_overflow(fold: Fold, rows: slice) -> None:
    """Stage: the novelty of block tokens `rows` against the state's slots."""
    fold.scores.append(novelty(fold.block.keys[:, :, rows], fold.reference_keys()))


def choose_appends(fold: Fold) -> None:
    """Stage: the tokens to append, the most novel while the state is below its budget, and those to merge."""
    scores = torch.cat(fold.scores, dim=2) if fold.scores else None
    fold.append_keys, fold.append_values, fold.merge_keys, fold.merge_values = fold.block.split(fold.n_append, scores)


def append(fold: Fold) -> None:
    """Stage: the chosen tokens become new slots, and their normed keys join the reference merges route by."""
    reference = fold.reference_keys()
    fold.state = append_slots(fold.state, fold.append_keys, fold.append_values, fold.value_norms)
    fold.reference = torch.cat([reference, fold.normalize(fold.append_keys)], dim=2)


def route_merges(fold: Fold, rows: slice) -> None:
    """Stage: the slot each of merge tokens `rows` enters, its most similar one past the sink slots."""
    protected = min(fold.sink_slots, fold.state[0].shape[2])
    fold.slots.append(most_similar_slot(fold.merge_keys[:, :, rows], fold.reference_keys(), protected,
                                        fold.score_dtype))


def merge(fold: Fold) -> None:
    """Stage: the merge tokens added to their slots."""
    if fold.slots:
        fold.state = merge_into_slots(fold.state, fold.merge_keys, fold.merge_values, torch.cat(fold.slots, dim=2),
                                      fold.value_norms)


def fold_stages(fold: Fold) -> list[Callable[[], None]]:
    """The stages of `fold` in order: novelty row blocks (when some but not all tokens are appended), the
    choice, the append (when any), routing row blocks, the merge."""
    tokens, slots, appended = fold.block.keys.shape[2], fold.state[0].shape[2], fold.appended
    stages: list[Callable[[], None]] = []
    if 0 < appended < tokens:
        stages += [partial(score_overflow, fold, rows) for rows in similarity_rows(tokens, slots)]
    stages.append(partial(choose_appends, fold))
    if appended:
        stages.append(partial(append, fold))
    stages += [partial(route_merges, fold, rows) for rows in similarity_rows(tokens - appended, slots + appended)]
    return stages + [partial(merge, fold)]


def run_fold(fold: Fold) -> State:
    """The state after every stage of `fold`, run at once."""
    for stage in fold_stages(fold):
        stage()
    return fold.state


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
