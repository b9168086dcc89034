"""KVM's decoding step as one graph: every row reads one token, and nothing in the forward waits on the host.

A decoding step's geometry depends only on where each row stands, so it is computed before the forward from the
cache's positions, as tensors (`DecodeStep`, made by `KVMModel.decoding_step`): the token's position, its slot in
each window ring, which ring slots it sees, how many state slots it reads, whether it enters its row's first
chunk. The fold of a block leaving the window needs only tokens the ring already holds, so it runs then too
(`fold_due_blocks`). Under vLLM the same step runs over the engine's pages (each cache layer's page index). The forward
then writes the token into each ring, reads state and window in one softmax (`decode_attention_kvm`) and updates
the token-shift carries: fixed shapes, no `.item()`, no Python over rows - what `torch.compile(fullgraph=True)`
and CUDA graphs need.

The general path (`KVMAttention.attend` over `Pieces` and a `StateSchedule`) is the reference: a decoding step
taken either way gives the same logits and leaves the same cache (tests/models/kvm/test_kvm_decode_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from .cache_kvm import READ, STATE, WINDOW
from .configuration_kvm import folded_blocks, slots_after_folds, state_dtype_for
from .decode_attention_kvm import state_window_attention
from .runtime_kvm import paces_folds, prepare_next_fold, take_fold_ahead
from .state_kvm import readable_state, run_fold
from .step_plan_kvm import ring_positions


@dataclass
class DecodeStep:
    """Where each of a decoding step's rows stands, as the layers read it: position `position` [B] (tokens read
    before), storage row `rows` [B]; per kind of layer the ring slot the token takes and the ring slots it sees,
    itself included ([B, ring]); for KVM layers the state slots it reads [B] (0 in the first `window_chunks`
    chunks) and, when some row is still in its first chunk, which rows enter their state with this token.
    `reach` holds how many leading slots of the state, the window ring and the sliding ring any row reads: an eager
    step reads only those (a traced one reads the whole storage, so that its shapes do not change every step)."""

    position: torch.Tensor
    rows: torch.Tensor
    ring_slot: torch.Tensor
    window_visible: torch.Tensor
    state_slots: torch.Tensor
    first_chunk: torch.Tensor | None
    sliding_slot: torch.Tensor | None
    sliding_visible: torch.Tensor | None
    reach: dict[str, int]

    @property
    def batch(self) -> int:
        return self.position.shape[0]

    @property
    def total(self) -> int:
        """Tokens the step reads: one per row."""
        return self.position.shape[0]

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """[B, ...] tokens of a [B, 1, ...] tensor (one token per row: the flat layout is the rows')."""
        return x.reshape(x.shape[0], *x.shape[2:])

    def unflatten(self, y: torch.Tensor) -> torch.Tensor:
        return y.unsqueeze(1)


def visible_ring(position: torch.Tensor, size: int, first_seen: torch.Tensor) -> torch.Tensor:
    """[B, size]: the ring slots a token at `position` sees once it is written, those holding positions from
    `first_seen` on."""
    held = ring_positions(position + 1, size)
    return (held >= 0) & (held >= first_seen[:, None])


def decode_step(config, seen: list[int], device) -> DecodeStep:
    """The `DecodeStep` of rows that have read `seen` tokens each (all > 0) and read one more."""
    chunk, window_chunks = config.chunk_size, config.window_chunks
    position = torch.tensor(seen, dtype=torch.long, device=device)
    table = slots_after_folds(config, max(0, max(seen) // chunk - window_chunks))
    state_slots = [0 if p // chunk < window_chunks else table[p // chunk - window_chunks] for p in seen]
    window_low = (torch.div(position, chunk, rounding_mode="floor") + 1 - window_chunks).clamp(min=0) * chunk
    sliding_slot = sliding_visible = None
    if config.sliding_window_every:
        size = config.sliding_window_size
        sliding_slot = position % size
        sliding_visible = visible_ring(position, size, position - size + 1)
    first = [p < chunk for p in seen]
    # ring slot p % size holds position p: until a row has read a whole ring, only the leading slots are written
    reach = {"state": max(state_slots), "window": min(config.window_size, max(seen) + 1),
             "sliding": min(config.sliding_window_size, max(seen) + 1)}
    return DecodeStep(position, torch.arange(len(seen), device=device), position % config.window_size,
                      visible_ring(position, config.window_size, window_low),
                      torch.tensor(state_slots, dtype=torch.long, device=device),
                      torch.tensor(first, device=device) if any(first) else None, sliding_slot, sliding_visible, reach)


# ---- before the forward: the folds this step's tokens read -------------------------------------------------
def rows_folding(config, seen: list[int]) -> dict[int, int]:
    """The rows at `seen` whose next token folds a block into their state, with that block: a token starting chunk
    c >= window_chunks + 1 folds block c - window_chunks (all of it in the ring). The same for every KVM layer."""
    return {row: p // config.chunk_size - config.window_chunks for row, p in enumerate(seen)
            if folded_blocks(config, p + 1) > folded_blocks(config, p)}


def fold_due_blocks(attention, cache_layer, seen: list[int], folding: dict[int, int]) -> None:
    """Fold the blocks `folding` (row -> block, `rows_folding`) of rows at `seen` into their states, then advance
    the fold computed ahead for the next boundary (runtime_kvm). Eager: runs before the traced step."""
    config = attention.config
    dtype = cache_layer.tensors["window_keys"].dtype
    if folding:
        due, blocks = list(folding), list(folding.values())
        table = slots_after_folds(config, max(blocks))
        capacity = max(table[block] for block in blocks)
        rows = torch.tensor(due, dtype=torch.long, device=cache_layer.tensors["window_keys"].device)
        ahead = take_fold_ahead(cache_layer, blocks, due, capacity)
        if ahead is None:
            state = run_fold(attention.ring_blocks_fold(cache_layer, rows, blocks, table))
            read = attention.readable(state, dtype)
        else:
            state, read = ahead
        like = {name: (t.shape[1], t.shape[3], t.dtype, t.device) for name, t in zip(STATE + READ, state + read)}
        cache_layer.ensure_state(len(seen), capacity, like)
        for name, tensor in zip(STATE + READ, state + read):
            cache_layer.write(name, rows, tensor)
    if paces_folds(attention, cache_layer):
        prepare_next_fold(cache_layer, seen, [1] * len(seen), config, partial(attention.ring_fold, cache_layer),
                          partial(attention.readable, dtype=dtype))


def make_room_for_first_chunk(cache_layer, seen: list[int]) -> None:
    """Dense storage: state room for the first-chunk slot a row at `seen` enters with its next token (an engine's
    pages have room for a whole request)."""
    entering = [p + 1 for p in seen if p < cache_layer.config.chunk_size]
    if entering and cache_layer.index is None:
        like = {name: (cache_layer.tensors[name].shape[1], cache_layer.tensors[name].shape[3],
                       cache_layer.tensors[name].dtype, cache_layer.tensors[name].device) for name in STATE + READ}
        cache_layer.ensure_state(len(seen), max(entering), like)


# ---- the traced step ----------------------------------------------------------------------------------------
def storage_rows(cache_layer, step: DecodeStep) -> torch.Tensor:
    """Each row's storage row in the layer: its own dense row, or the page an engine bound it to."""
    return step.rows if cache_layer.index is None else cache_layer.index


def attended_storage(cache_layer, names: dict[str, str], step: DecodeStep
                     ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The layer's tensors (`names`: tensor -> the `step.reach` entry of its slots) as the decoding attention reads
    them: the rows' own (dense storage, or pages that are consecutive: a view, no copy), else the whole pages with
    each row's page index; eagerly, only the slots some row reads."""
    if cache_layer.index is None or cache_layer.run is not None:
        page, tensors = None, [cache_layer.read(name) for name in names]
    else:
        page, tensors = cache_layer.index, [cache_layer.tensors[name] for name in names]
    if torch.compiler.is_compiling():  # the whole storage: shapes that hold from step to step
        return page, tensors
    return page, [tensor[:, :, :step.reach[kind]] for tensor, kind in zip(tensors, names.values())]


def decode_token_shift(x: torch.Tensor, mix: torch.Tensor, cache_layer, name: str, step: DecodeStep) -> torch.Tensor:
    """Token shift of one token per row (x: [1, B, D]): its predecessor is the row's carry, which it replaces."""
    carry = cache_layer.tensors[f"carry.{name}"]
    if cache_layer.index is None:  # dense: the carry tensor is the rows'
        shifted = x + mix * (carry.to(x.dtype)[None] - x)
        carry.copy_(x[0])
        return shifted
    shifted = x + mix * (carry[cache_layer.index].to(x.dtype)[None] - x)
    carry[cache_layer.index] = x[0].to(carry.dtype)
    return shifted


def write_slot(tensor: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, values: torch.Tensor,
               keep: torch.Tensor | None = None) -> None:
    """Each row's `values` [B, heads, d] into slot `slot` [B] of its storage row `rows` [B]; where `keep` is true
    the slot keeps what it holds (rows that write nothing this step)."""
    if keep is not None:
        values = torch.where(keep[:, None, None], tensor[rows, :, slot], values.to(tensor.dtype))
    tensor[rows, :, slot] = values.to(tensor.dtype)


def enter_first_chunk(attention, k, v, gate, step: DecodeStep, cache_layer) -> None:
    """Rows still in their first chunk: the token enters the state as slot `position`, with its read form."""
    state_dtype = state_dtype_for(k.dtype)
    state = attention.first_chunk_slots(k, v, gate, slice(None), state_dtype)
    read = readable_state(state, attention.state_key_norm(state[0]), attention.config.state_value_norms, k.dtype)
    slot = torch.where(step.first_chunk, step.position, 0)
    rows = storage_rows(cache_layer, step)
    for name, values in zip(STATE + READ, state + read):
        write_slot(cache_layer.tensors[name], rows, slot, values, ~step.first_chunk)


def decode_kvm_attention(attention, q, k, v, gate, step: DecodeStep, cache_layer) -> torch.Tensor:
    """A KVM layer's attention for one token per row (q [B, H, D], k [B, Hkv, D], v [B, Hkv, Dv], gate [B, Hkv, 1]
    or None): the token into its window ring (and its first-chunk state slot), then one softmax over the row's
    state slots and the ring slots it sees. Returns [B, H, Dv]."""
    names = WINDOW if attention.gated else WINDOW[:2]
    rows, tensors = storage_rows(cache_layer, step), cache_layer.tensors
    for name, values in zip(names, (k, v, gate)):
        write_slot(tensors[name], rows, step.ring_slot, values)
    if step.first_chunk is not None:
        enter_first_chunk(attention, k, v, gate, step, cache_layer)
    page, (state_keys, state_values, window_keys, window_values) = attended_storage(
        cache_layer, {"read_keys": "state", "read_values": "state", "window_keys": "window",
                      "window_values": "window"}, step)
    return state_window_attention(
        q, page, state_keys, state_values, step.state_slots, window_keys, window_values,
        step.window_visible[:, :window_keys.shape[2]],
        attention.temperature("state_temperature"), attention.temperature("window_temperature"),
        q.shape[-1] ** -0.5)


def decode_sliding_attention(attention, q, k, v, step: DecodeStep, cache_layer) -> torch.Tensor:
    """A sliding-window layer's attention for one token per row: the token into the ring, then a softmax over the
    ring slots it sees (no state). Returns [B, H, Dv]."""
    rows, keys, values = storage_rows(cache_layer, step), cache_layer.tensors["window_keys"], \
        cache_layer.tensors["window_values"]
    write_slot(keys, rows, step.sliding_slot, k)
    write_slot(values, rows, step.sliding_slot, v)
    page, (keys, values) = attended_storage(cache_layer, {"window_keys": "sliding", "window_values": "sliding"},
                                            step)
    return state_window_attention(
        q, page, keys[:, :, :0], values[:, :, :0], step.state_slots.new_zeros(step.batch), keys, values,
        step.sliding_visible[:, :keys.shape[2]], None, None, q.shape[-1] ** -0.5)
