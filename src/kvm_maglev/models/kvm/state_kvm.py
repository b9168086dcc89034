"""The key-value-means state: how much a layer holds after n tokens, how a block enters the state and how attention
reads it, as small pure functions (no cache, no module, no device tuning).

How much: the one rule, read by the step plans, the cache layers, the vLLM page layout and the cache sizes. A
KVM layer's window starts at `window_start`; `folded_blocks` blocks have left it for the state, which then holds
`state_slots_after` slots: the first chunk, then what `append_count` appends of each folded block, up to the
config's budget (`state_budget`).

A state is three tensors per layer: key sums [B, H, slots, D] (layer-normed, rotary channels zeroed), value sums
[B, H, slots, Dv] and float32 value norms or merge counts [B, H, slots, 1], padded; `slots` [B] says how many are
live. A block leaving the window enters in stages (`Fold`): score its tokens against the slots (`score_overflow`),
choose the most novel to append while the state is below its budget (`choose_appends`), append them (`append`),
route the rest to their most similar slot (`route_merges`, sink slots protected) and add them to it (`merge`).
`run_fold` runs the stages at once; the paced fold (speedups/paced_fold_kvm) one every few decoding steps.
Attention reads the state renormalised (`readable_state`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # key sums, value sums, value norms (or counts)

# Block tokens x state slots per similarity product. The products run in row blocks of this size so that a fold
# spread over decoding steps (speedups/paced_fold_kvm) computes exactly the products of one computed at once: a
# product's rounding can depend on how many rows it has, and a near tie would then pick another slot.
SIMILARITY_BLOCK = 64 * 1024


# ---- what a layer holds after n tokens (the one rule) ----------------------------------------------------
def window_start(config, sliding: bool, seen: int) -> int:
    """First position a layer's window holds after `seen` tokens: a sliding-window layer's last `sliding_window`
    tokens; a KVM layer's chunk-aligned blocks, the newest (possibly partial) one and `window_chunks - 1` before."""
    if sliding:
        return max(0, seen - config.sliding_window_size)
    chunk = config.chunk_size
    return max(0, (seen - 1) // chunk + 1 - config.window_chunks) * chunk


def folded_blocks(config, seen: int) -> int:
    """Blocks j >= 1 folded into a KVM layer's state after `seen` tokens: block j leaves the window when the
    first token of chunk j + window_chunks arrives (block 0, the first chunk, enters token by token)."""
    return max(0, (seen - 1) // config.chunk_size - config.window_chunks)


def state_slots_after(config, seen: int) -> int:
    """Slots of a KVM layer's state after `seen` tokens: the first chunk's tokens, one slot each, then what
    `append_count` appends of each folded block."""
    if seen <= config.chunk_size:
        return max(seen, 0)
    return slots_after_folds(config, folded_blocks(config, seen))[-1]


def slots_after_folds(config, blocks: int) -> list[int]:
    """Slots of a KVM layer's state once its first chunk and then 0, 1, ..., `blocks` blocks have entered it."""
    slots = [config.chunk_size]
    for block in range(1, blocks + 1):
        slots.append(slots[-1] + append_count(config, block, slots[-1]))
    return slots


# ---- the budget rule -------------------------------------------------------------------------------------
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


# ---- small pieces of the state math ----------------------------------------------------------------------
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


def live_slots(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, 1, 1, capacity]: which slots of a padded state are live in each row."""
    return (torch.arange(capacity, device=slots.device) < slots[:, None])[:, None, None, :]


@torch.no_grad()  # only an order comes out of it
def novelty(keys: torch.Tensor, reference: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """float32 [B, H, T]: each token's largest similarity to the (layer-normed) live state keys; low is novel."""
    similarity = torch.matmul(keys, reference.transpose(-1, -2)).float()
    return similarity.masked_fill(~live, float("-inf")).amax(dim=-1)


@torch.no_grad()  # only indices come out of it
def most_similar_slot(keys: torch.Tensor, reference: torch.Tensor, allowed: torch.Tensor,
                      score_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, H, T, 1]: the slot each token merges into, its most similar `allowed` one (live, past the sinks); the
    similarities scored in `score_dtype` (None: the keys' dtype), where a coarse dtype can tie or flip them."""
    if score_dtype is not None:
        keys, reference = keys.to(score_dtype), reference.to(score_dtype)
    similarity = torch.matmul(keys, reference.transpose(-1, -2))
    return similarity.masked_fill(~allowed, float("-inf")).argmax(dim=-1, keepdim=True)


def scatter_slots(state: torch.Tensor, slot: torch.Tensor, tokens: torch.Tensor, add: bool) -> torch.Tensor:
    """`state` [B, H, S, d] with each token [B, H, T, d] written into (or added to) its slot [B, H, T, 1]; a token
    routed to slot S (one past the end) goes nowhere. Tokens reach a slot in their order, as one by one."""
    padded = F.pad(state, (0, 0, 0, 1))
    index = slot.expand(*slot.shape[:-1], tokens.shape[-1])
    padded = padded.scatter_add(2, index, tokens) if add else padded.scatter(2, index, tokens)
    return padded[:, :, :-1]


@dataclass(frozen=True)
class Overflow:
    """A block leaving the window as the state takes it: `keys` rank the tokens' novelty; the append and merge
    forms carry the merge gate where the config applies it."""

    keys: torch.Tensor
    append_keys: torch.Tensor
    append_values: torch.Tensor
    merge_keys: torch.Tensor
    merge_values: torch.Tensor


# ---- a block entering the state, in stages ----------------------------------------------------------------
@dataclass
class Fold:
    """A block's fold into a state under way, for a batch of rows: the state so far and what each stage has
    computed for the next.

    `state` is padded to a capacity that holds every row's slots after the fold; `slots` [B] are the live slots
    before it and `appends` the block tokens each row appends (Python ints, so that no stage waits on a tensor's
    value). `reference`: the state's keys layer-normed by the first stage that needs them. Similarities run in
    `similarity_rows` blocks, each a stage, so that a fold computed at once or one stage per step makes the same
    products.
    """

    state: State
    slots: torch.Tensor
    reference: torch.Tensor | None
    block: Overflow
    appends: list[int]
    sink_slots: int
    normalize: Callable[[torch.Tensor], torch.Tensor]
    value_norms: bool
    score_dtype: torch.dtype | None = None  # routing similarities' dtype (None: the keys')
    scores: list[torch.Tensor] = field(default_factory=list)  # novelty of the block's tokens, row block by row block
    appended: torch.Tensor | None = None  # [B, H, T, 1] bool: the tokens that become new slots, once chosen
    routes: list[torch.Tensor] = field(default_factory=list)  # each token's slot, row block by row block
    n_append: torch.Tensor = field(init=False, repr=False)  # [B]: `appends` as a tensor, made once

    def __post_init__(self) -> None:
        self.n_append = torch.tensor(self.appends, dtype=torch.long, device=self.slots.device)

    @property
    def tokens(self) -> int:
        return self.block.keys.shape[2]

    @property
    def capacity(self) -> int:
        return self.state[0].shape[2]

    @property
    def slots_after(self) -> torch.Tensor:
        """[B]: live slots once the chosen tokens are appended."""
        return self.slots + self.n_append.clamp(0, self.tokens)

    def reference_keys(self) -> torch.Tensor:
        """Layer-normed keys of the state's slots, normed at the first call when none were given."""
        if self.reference is None:
            self.reference = self.normalize(self.state[0])
        return self.reference


def score_overflow(fold: Fold, rows: slice) -> None:
    """Stage: the novelty of block tokens `rows` against each row's live slots."""
    live = live_slots(fold.slots, fold.capacity)
    fold.scores.append(novelty(fold.block.keys[:, :, rows], fold.reference_keys(), live))


def choose_appends(fold: Fold) -> None:
    """Stage: in each row the `n_append` most novel tokens, to append while the state is below its budget (all
    of them, or none, without scoring)."""
    shape = fold.block.keys.shape[:3]
    count = fold.n_append.view(-1, 1, 1)
    if fold.scores:
        order = torch.argsort(torch.cat(fold.scores, dim=2), dim=-1, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(shape[2], device=order.device).expand(shape))
        fold.appended = (rank < count)[..., None]
    else:
        fold.appended = (torch.zeros(shape, dtype=torch.long, device=count.device) < count)[..., None]


def append(fold: Fold) -> None:
    """Stage: the chosen tokens become new slots after each row's live ones, in token order, and their normed
    keys join the reference merges route by."""
    end = fold.capacity
    order = fold.appended.long().cumsum(dim=2) - 1
    slot = torch.where(fold.appended, fold.slots.view(-1, 1, 1, 1) + order, end)
    reference = fold.reference_keys()
    keys, values, norms = fold.state
    block = fold.block
    fold.state = (scatter_slots(keys, slot, block.append_keys.to(keys.dtype), add=False),
                  scatter_slots(values, slot, block.append_values.to(values.dtype), add=False),
                  scatter_slots(norms, slot, slot_norms(block.append_values, fold.value_norms), add=False))
    fold.reference = scatter_slots(reference, slot, fold.normalize(block.append_keys.to(keys.dtype)), add=False)


def route_merges(fold: Fold, rows: slice) -> None:
    """Stage: the slot each of block tokens `rows` would merge into, its most similar live slot past the sinks
    (appended tokens are routed too, and ignored)."""
    after = fold.slots_after
    slot = torch.arange(fold.capacity, device=after.device)
    protected = torch.minimum(after, torch.full_like(after, fold.sink_slots))
    allowed = ((slot < after[:, None]) & (slot >= protected[:, None]))[:, None, None, :]
    fold.routes.append(most_similar_slot(fold.block.merge_keys[:, :, rows], fold.reference_keys(), allowed,
                                         fold.score_dtype))


def merge(fold: Fold) -> None:
    """Stage: the tokens not appended added to their slots (winner take all)."""
    merged = ~fold.appended if fold.appended is not None else torch.ones_like(fold.routes[0], dtype=torch.bool)
    slot = torch.where(merged, torch.cat(fold.routes, dim=2), fold.capacity)
    keys, values, norms = fold.state
    keys = scatter_slots(keys, slot, fold.block.merge_keys.to(keys.dtype), add=True)
    values = scatter_slots(values, slot, fold.block.merge_values.to(values.dtype), add=True)
    if not fold.value_norms:
        # The research code sums its one-hot merge matrix over slots, so each merged block adds one to every
        # slot's count (the published no-vlens ablation was trained that way).
        norms = norms + merged.any(dim=2, keepdim=True).to(norms.dtype)
    fold.state = (keys, values, norms)


def fold_stages(fold: Fold) -> list[Callable[[], None]]:
    """The stages of `fold` in order: novelty row blocks (when a row appends some but not all tokens), the
    choice, the append (when a row appends), routing row blocks (when a row merges), the merge."""
    tokens, capacity = fold.tokens, fold.capacity
    appends = [min(max(count, 0), tokens) for count in fold.appends]
    stages: list[Callable[[], None]] = []
    if any(0 < count < tokens for count in appends):
        stages += [partial(score_overflow, fold, rows) for rows in similarity_rows(tokens, capacity)]
    stages.append(partial(choose_appends, fold))
    if any(count > 0 for count in appends):
        stages.append(partial(append, fold))
    if any(count < tokens for count in appends):
        stages += [partial(route_merges, fold, rows) for rows in similarity_rows(tokens, capacity)]
        stages.append(partial(merge, fold))
    return stages


def merge_score_dtype(routing: str, model_dtype: torch.dtype, state_dtype: torch.dtype) -> torch.dtype:
    """dtype the merge routing is scored in (config.merge_routing_dtype): float32 or the finer state dtype,
    or the model's own dtype (its window keys'), as the research mixer scores it under bfloat16."""
    if routing == "model":
        return model_dtype
    return torch.promote_types(state_dtype, torch.float32)


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """State sums accumulate many tokens: float16 would overflow and bfloat16's 8-bit mantissa drops
    each new token once a sum is large, so both keep the state in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def block_fold(config, normalize: Callable[[torch.Tensor], torch.Tensor], state: State, slots: torch.Tensor,
               block: list[torch.Tensor], appends: list[int], state_dtype: torch.dtype) -> Fold:
    """The fold of window blocks (keys, values and, when the layer has them, merge gates: [B, H, chunk, d]) into
    `state` (`slots` [B] live): the block as the state takes it (rotary channels zeroed, keys normed by
    `normalize`, the merge gate applied where the config says), `appends` tokens per row appended."""
    keys = state_keys(block[0].to(state_dtype), config.rotary_dim, normalize)
    values = block[1].to(state_dtype)
    gates = block[2].to(state_dtype) if len(block) > 2 else None
    merge_keys = keys * gates if config.merge_gate_keys else keys
    merge_values = values * gates if config.merge_gate_values else values
    if config.merge_gate_appends:
        overflow = Overflow(keys, merge_keys, merge_values, merge_keys, merge_values)
    else:
        overflow = Overflow(keys, keys, values, merge_keys, merge_values)
    return Fold(state, slots, None, overflow, list(appends), config.sink_slots, normalize, config.state_value_norms,
                merge_score_dtype(config.merge_routing_dtype, block[0].dtype, state_dtype))


def run_fold(fold: Fold) -> State:
    """The state after every stage of `fold`, run at once."""
    for stage in fold_stages(fold):
        stage()
    return fold.state


def readable_state(state: State, normed_keys: torch.Tensor, value_norms: bool,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [B, H, slots, D] and values [B, H, slots, Dv] as attention reads them: layer-normed keys; value sums
    renormalised to their slot's recorded norm, or averaged. (The per-head state temperature scales the queries.)"""
    state_values, norms = state[1], state[2]
    if value_norms:
        values = F.normalize(state_values.float(), dim=-1) * norms
    else:
        values = state_values / norms.clamp(min=1)  # padded slots hold a count of 0
    return normed_keys.to(dtype), values.to(dtype)
