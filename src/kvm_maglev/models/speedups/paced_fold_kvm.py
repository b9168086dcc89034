"""KVM's paced fold: a decoding forward on a dense cache whose rows stand at one position computes ahead, one of
state_kvm's fold stages every few steps, the fold of the block that leaves the window at the next chunk boundary,
so that the boundary step costs what any other step costs. The boundary swaps it in: the same tensors, bit for bit,
as the fold computed there (the plain path, its reference).

cache_kvm's seam picks this module (`paced_fold_kvm`): `KVMCacheLayer.fold_ahead` hands each forward to
`fold_ahead`, `KVMCacheLayer.take_fold_ahead` asks `take_fold_ahead` for the fold due; the layer only carries the
fold under way (`pending`). An engine's paged cache folds at the boundary, batched. Measurements:
docs/kvm_runtime_notes.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ..kvm.state_kvm import Fold, fold_stages, folded_blocks, slots_after_folds


class PacedFold:
    """A block's fold computed ahead of its chunk boundary, from the state it will fold into: key/value head by
    head, state_kvm's `fold_stages` and then the head's read form (`read`), one stage per `run_next_stage()`; its
    stride spreads the stages over 7/8 of a chunk of decoding steps. The boundary step swaps the result in
    (`take_fold_ahead`): the same tensors, bit for bit."""

    def __init__(self, fold: Fold, read: Callable[[tuple], tuple], block: int, chunk: int) -> None:
        self.block, self.capacity = block, fold.capacity
        self.heads = fold.state[0].shape[1]
        self.state: list[torch.Tensor] | None = None  # keys, values, norms after the fold
        self.read: list[torch.Tensor] | None = None  # their attention-ready form
        self.stages: list = []
        for head in range(self.heads):
            part = head_fold(fold, slice(head, head + 1))
            self.stages += fold_stages(part) + [partial(self.write_result, read, part, head)]
        self.next_stage = 0
        self.stride = max(1, (chunk * 7 // 8) // (len(self.stages) + 1))  # one more: the start

    def write_result(self, read: Callable[[tuple], tuple], fold: Fold, head: int) -> None:
        """Stage: one head's folded state and its read form written into the all-heads tensors."""
        readable = read(fold.state)
        if self.state is None:
            self.state = [t.new_empty(t.shape[:1] + (self.heads,) + t.shape[2:]) for t in fold.state]
            self.read = [t.new_empty(t.shape[:1] + (self.heads,) + t.shape[2:]) for t in readable]
        for whole, piece in zip(self.state + self.read, tuple(fold.state) + tuple(readable)):
            whole[:, head:head + 1] = piece

    @property
    def done(self) -> bool:
        return self.next_stage == len(self.stages)

    def run_next_stage(self) -> None:
        self.stages[self.next_stage]()
        self.next_stage += 1

    def finish(self) -> None:
        while not self.done:
            self.run_next_stage()


def head_fold(fold: Fold, heads: slice) -> Fold:
    """The fold of key/value heads `heads` alone, before any stage has run (of the fold's own classes: a generated
    file's, where it took this module)."""
    block = fold.block
    part = type(block)(*(t[:, heads] for t in (block.keys, block.append_keys, block.append_values, block.merge_keys,
                                                block.merge_values)))
    return type(fold)(tuple(t[:, heads] for t in fold.state), fold.slots,
                      None if fold.reference is None else fold.reference[:, heads], part, fold.appends,
                      fold.sink_slots, fold.normalize, fold.value_norms, fold.score_dtype)


def paces_folds(cache_layer) -> bool:
    """The one place the paced fold is chosen: the cache layer's `paced_folds` flag (on by default), dense storage,
    eager and without autograd. Training, compiled graphs and a serving engine's pages fold at the boundary."""
    return (cache_layer.paced_folds and cache_layer.index is None and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def fold_ahead(cache_layer, starts: list[int], counts: list[int], normalize, dtype: torch.dtype) -> None:
    """When folds are paced (`paces_folds`), after a forward of rows that stood at `starts` and read `counts` tokens
    (or before a decoding step), all at one position: start or advance the fold of the block that leaves the
    window at the next chunk boundary, one stage every `stride` decoding steps, or all of it after a multi-token
    forward (a prefill). With two or more window chunks the block and the state it folds into are final a chunk
    ahead."""
    config, seen = cache_layer.config, starts[0] + counts[0]
    if (not paces_folds(cache_layer) or config.window_chunks < 2 or not seen or len(set(starts)) > 1
            or len(set(counts)) > 1):
        return
    block = (seen - 1) // config.chunk_size + 1 - config.window_chunks
    if block < 1 or folded_blocks(config, seen) != block - 1:
        return
    pending = cache_layer.pending
    if pending is None or pending.block != block:
        table, rows = slots_after_folds(config, block), len(starts)
        whole = cache_layer.ring_fold(None, [block] * rows, [table[-2]] * rows, [table[-1] - table[-2]] * rows,
                                      table[-1], normalize)
        pending = cache_layer.pending = PacedFold(
            whole, partial(cache_layer.read_form, normalize=normalize, dtype=dtype), block, config.chunk_size)
    if counts[0] > 1:
        pending.finish()
    elif not pending.done and seen % pending.stride == 0:
        pending.run_next_stage()


def take_fold_ahead(cache_layer, blocks: list[int], rows: list[int], capacity: int) -> tuple | None:
    """The state and read form of the fold `cache_layer` computed ahead when it is the one due (`rows` folding
    `blocks`: every row its block, at this capacity), else None (the caller folds now). It is used once."""
    pending = cache_layer.pending
    if pending is None or pending.capacity != capacity or set(blocks) != {pending.block} \
            or rows != list(range(cache_layer.tensors["window_keys"].shape[0])):
        return None
    pending.finish()
    cache_layer.pending = None
    return tuple(pending.state), tuple(pending.read)
