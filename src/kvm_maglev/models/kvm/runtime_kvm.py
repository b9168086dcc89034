"""Inference speed-ups for KVM models, kept apart from the math (modeling_kvm, state_kvm).

Whatever steps the model (generate(), a server's own loop), a forward without autograd that has a cache
computes ahead the fold of the block that leaves the window at the next chunk boundary, a stage every
few decoding steps, so that the boundary step costs what any other step costs: the cache's layers carry
the fold under way (`pending_fold`), `KVMAttention.forward` advances it and `fold_block` swaps it in.
Inside `runtime_speedups(model)`, which `model.runtime_speedups()` returns and `generate()` opens, also:
- linear layers compute on oneDNN, batched steps on blocked weight copies (onednn_linear);
- a one-query decoding step on CPU in float32 reads the state and window as matrix-vector products.
Each computes what the plain path computes: the fold bit for bit, the others up to float rounding.
Measurements behind them: docs/kvm_runtime_notes.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .runtime_switch import speedups_switched_on
from .state_kvm import (
    Overflow,
    append_slots,
    merge_into_slots,
    most_similar_slot,
    novelty,
    query_slice,
    similarity_rows,
)


def one_query_attention(q, window_q, keys, values, state_keys, state_value_columns, scale: float) -> torch.Tensor:
    """The joint softmax of `KVMAttention.attend_state_and_window` for one query per row: logits as keys @ q,
    the state's output as value columns @ probs, the window's as a probability-weighted sum of its values.
    On CPU these read each key and value about twice as fast as q @ keys^T and probs @ values (float32 only:
    in half precision the weighted sum would round its products before adding them)."""
    # vectors enter the products as transposed contiguous rows: as contiguous columns they take a slow kernel
    state_logits = torch.matmul(state_keys, q.contiguous().transpose(-1, -2)).transpose(-1, -2)  # [B, H, 1, slots]
    window_logits = torch.matmul(keys, window_q.contiguous().transpose(-1, -2)).transpose(-1, -2)
    probs = torch.softmax(torch.cat([state_logits, window_logits], dim=-1).float() * scale, dim=-1).to(values.dtype)
    slots = state_keys.shape[2]
    state_part = torch.matmul(state_value_columns, probs[..., :slots].transpose(-1, -2)).transpose(-1, -2)
    return state_part + (probs[..., slots:].transpose(-1, -2) * values).sum(dim=2, keepdim=True)


class HeadFold:
    """One head's share of a fold computed ahead: the steps of `state_kvm.fold_overflow`, each a stage."""

    def __init__(self, attention, state: tuple, normed: torch.Tensor | None, block: Overflow, n_append: int,
                 head: int, fold: "PacedFold") -> None:
        self.attention, self.fold = attention, fold
        self.heads = slice(head, head + 1)
        self.state = tuple(t[:, self.heads] for t in state)
        # layer-normed state keys: those at hand for reading this state, or normed at the first stage
        self.reference = None if normed is None else normed[:, self.heads]
        self.block = block.heads(self.heads)
        self.n_append = n_append
        self.scores: list[torch.Tensor] = []
        self.merge_keys, self.merge_values = self.block.merge_keys, self.block.merge_values
        self.slots: list[torch.Tensor] = []

    def stages(self) -> list[Callable[[], None]]:
        """The stages in order: novelty row blocks, appends, similarity row blocks, merge, read form."""
        tokens, slots = self.block.keys.shape[2], self.state[0].shape[2]
        appended = min(max(self.n_append, 0), tokens)
        stages: list[Callable[[], None]] = []
        if 0 < appended < tokens:
            stages += [partial(self.rank, rows) for rows in similarity_rows(tokens, slots)]
        if appended:
            stages.append(self.append)
        stages += [partial(self.match, rows) for rows in similarity_rows(tokens - appended, slots + appended)]
        return stages + [self.merge, self.read]

    def normed_state_keys(self) -> torch.Tensor:
        if self.reference is None:
            self.reference = self.attention.state_key_norm(self.state[0])
        return self.reference

    def rank(self, rows: slice) -> None:
        self.scores.append(novelty(self.block.keys[:, :, rows], self.normed_state_keys()))

    def append(self) -> None:
        scores = torch.cat(self.scores, dim=2) if self.scores else None
        append_keys, append_values, self.merge_keys, self.merge_values = self.block.split(self.n_append, scores)
        self.state = append_slots(self.state, append_keys, append_values, self.attention.config.state_value_norms)
        normalize = self.attention.state_key_norm
        self.reference = torch.cat([self.normed_state_keys(), normalize(append_keys)], dim=2)

    def match(self, rows: slice) -> None:
        protected = min(self.attention.config.sink_slots, self.state[0].shape[2])
        self.slots.append(most_similar_slot(self.merge_keys[:, :, rows], self.normed_state_keys(), protected,
                                            self.fold.score_dtype))

    def merge(self) -> None:
        if self.slots:
            slot = torch.cat(self.slots, dim=2)
            self.state = merge_into_slots(self.state, self.merge_keys, self.merge_values, slot,
                                          self.attention.config.state_value_norms)
        self.fold.state = write_head(self.fold.state, self.state, self.heads, self.fold.num_heads)

    def read(self) -> None:
        normed = self.attention.state_key_norm(self.state[0])
        read = self.attention.readable(self.state, normed, self.fold.dtype, self.heads)  # the group's query heads
        group = self.attention.config.kv_group_size
        self.fold.read = write_head(self.fold.read, read, query_slice(self.heads, group), self.fold.num_heads * group)


def write_head(full: list[torch.Tensor] | None, part, heads: slice, num_heads: int) -> list[torch.Tensor]:
    """Write one head's tensors into the all-heads tensors, allocating those on the first head."""
    if full is None:
        full = [t.new_empty(t.shape[:1] + (num_heads,) + t.shape[2:]) for t in part]
    for whole, piece in zip(full, part):
        whole[:, heads] = piece
    return full


class PacedFold:
    """The fold of window block `block` computed ahead of its chunk boundary, one stage per `advance()`,
    from the state it started on; its stride spreads its stages over 7/8 of a chunk of decoding steps."""

    def __init__(self, attention, cache, block: int) -> None:
        self.block, self.source = block, cache.state_keys
        self.dtype = cache.window.storage[0].dtype  # the read form's: the queries', as the window keys'
        self.score_dtype = attention.merge_score_dtype(cache)
        self.state: list[torch.Tensor] | None = None  # keys, values, norms after the fold
        self.read: list[torch.Tensor] | None = None  # their attention-ready form
        overflow = attention.overflow(cache, block, cache.state_keys.dtype)
        n_append = attention.append_count(block, cache.state_len)
        self.num_heads = cache.state_keys.shape[1]  # key/value heads: the rank's own under tensor parallelism
        heads = [HeadFold(attention, cache.state(), cache.normed_state_keys(), overflow, n_append, head, self)
                 for head in range(self.num_heads)]
        self.stages = [stage for head in heads for stage in head.stages()]
        self.next_stage = 0
        chunk = attention.config.chunk_size
        self.stride = max(1, (chunk * 7 // 8) // (len(self.stages) + 1))  # one stride more for where it starts

    @property
    def done(self) -> bool:
        return self.next_stage == len(self.stages)

    def advance(self) -> None:
        self.stages[self.next_stage]()
        self.next_stage += 1

    def finish(self) -> None:
        while not self.done:
            self.advance()


def prepare_next_fold(attention, cache, whole: bool) -> None:
    """Start or advance the fold of the block that leaves the window at the next chunk boundary: one stage
    every `stride` decoding steps, or all of it after a multi-token forward (`whole`, e.g. a prefill). With
    two or more window chunks the block and the state it folds into are final a chunk ahead."""
    chunk, window_chunks = attention.config.chunk_size, attention.config.window_chunks
    if window_chunks < 2 or cache.seen == 0:
        return
    block = (cache.seen - 1) // chunk + 1 - window_chunks
    if block < 1 or cache.merged_blocks != block - 1:
        return
    fold = cache.pending_fold
    if fold is None or fold.block != block or fold.source is not cache.state_keys:
        fold = cache.pending_fold = PacedFold(attention, cache, block)
    if whole:
        fold.finish()
    elif not fold.done and cache.seen % fold.stride == 0:
        fold.advance()


def advance_folds(attention, caches, whole: bool) -> None:
    """After a forward of `attention` without autograd: start or advance each layer cache's next fold
    (`prepare_next_fold`); a forward that builds a graph folds at the boundary, as training does."""
    if torch.is_grad_enabled():
        return
    for cache in caches:
        prepare_next_fold(attention, cache, whole)


def take_fold_ahead(cache, block: int) -> bool:
    """Swap in the fold computed ahead when it is block `block`'s, from the cache's current state; False
    when the caller must fold now."""
    fold = cache.pending_fold
    if fold is None or fold.block != block or fold.source is not cache.state_keys:
        return False
    fold.finish()
    cache.set_state(*fold.state)
    cache.read_cache = tuple(fold.read)
    return True


class FastKVMAttention:
    """Mixed into a KVM attention module inside `runtime_speedups`: its speed-ups over the plain methods."""

    def attend_state_and_window(self, q, keys, values, state_keys, state_value_columns) -> torch.Tensor:
        if q.shape[2] == 1 and q.device.type == "cpu" and q.dtype == torch.float32:
            window_q = q * self.temperature("window_temperature")
            return one_query_attention(q, window_q, keys, values, state_keys, state_value_columns,
                                       1.0 / math.sqrt(q.shape[-1]))
        return super().attend_state_and_window(q, keys, values, state_keys, state_value_columns)


def runtime_speedups(model: nn.Module, attention_class: type) -> contextlib.AbstractContextManager:
    """A block in which `model` runs with the speed-ups above (its `attention_class` modules take
    FastKVMAttention's methods); on leaving it the model is plain again. Nested blocks are free."""
    return speedups_switched_on(model, attention_class, FastKVMAttention)


def attend_chunks_at_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reads: list, chunk: int,
                          window_chunks: int, window_temperature: torch.Tensor | float, attend) -> torch.Tensor:
    """`KVMAttention`'s chunk loop over a fresh forward's tokens as one attention call: every chunk's
    queries over its state (`reads[c]`: keys [G, H, slots, D] and value columns [G, H, Dv, slots] as
    `read_state` gives them, None for the front chunks, which read no state) and its causal block window.

    Chunks become a batch dimension: states are padded to the largest one and windows gathered as
    `window_chunks` shifted copies of the blocks (zero blocks before the first), masked. `attend(q, keys,
    values, mask)` is the model's softmax attention. q, k, v: [G, H, T, D]; returns [G, H, T, Dv].
    """
    groups, heads, length, _ = q.shape
    count = len(reads)  # chunks, the last one possibly partial

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [G, chunks, H, chunk, D], the layout attention takes
        x = F.pad(x, (0, 0, 0, count * chunk - length))
        return x.view(groups, heads, count, chunk, x.shape[-1]).transpose(1, 2)

    def windows(x: torch.Tensor) -> torch.Tensor:  # [G, chunks, H, window_chunks * chunk, D]
        x = F.pad(blocks(x), (0, 0, 0, 0, 0, 0, window_chunks - 1, 0))
        return torch.cat([x[:, offset : offset + count] for offset in range(window_chunks)], dim=3)

    # the window temperature scales keys here (the loop scales queries): the same logits
    window_k, window_v = windows(k * window_temperature), windows(v)
    sizes = [0 if read is None else read[0].shape[2] for read in reads]
    slots = max(sizes)

    def stacked(index: int, dim: int) -> torch.Tensor:  # [G, chunks, H, slots, dim]: every chunk's state, padded
        parts = []
        for read in reads:
            if read is None:
                parts.append(q.new_zeros(groups, heads, slots, dim))
                continue
            part = read[index] if index == 0 else read[index].transpose(-1, -2)
            parts.append(F.pad(part, (0, 0, 0, slots - part.shape[2])))
        return torch.stack(parts, dim=1)

    keys = torch.cat([stacked(0, k.shape[-1]), window_k], dim=3).flatten(0, 1)
    values = torch.cat([stacked(1, v.shape[-1]), window_v], dim=3).flatten(0, 1)
    # state slot s is seen by chunk c when the chunk has that many slots; window key m by query i when it is at
    # or before the query and not before position 0
    state_seen = torch.arange(slots, device=q.device) < torch.tensor(sizes, device=q.device).unsqueeze(1)
    query = torch.arange(chunk, device=q.device).view(1, chunk, 1)
    key = torch.arange(window_chunks * chunk, device=q.device).view(1, 1, -1)
    first_block = (window_chunks - 1 - torch.arange(count, device=q.device)).clamp(min=0).view(count, 1, 1)
    window_seen = (key <= query + (window_chunks - 1) * chunk) & (key >= first_block * chunk)
    mask = torch.cat([state_seen.unsqueeze(1).expand(count, chunk, slots), window_seen], dim=2)
    mask = mask.unsqueeze(1).repeat(groups, 1, 1, 1)  # [G * chunks, 1, chunk, keys]
    y = attend(blocks(q).flatten(0, 1), keys, values, mask)  # [G * chunks, H, chunk, Dv]
    y = y.view(groups, count, heads, chunk, -1).transpose(1, 2).flatten(2, 3)
    return y[:, :, :length]
