"""KVM's paced fold, kept apart from the math (state_kvm) and from the cache layers that carry it (cache_kvm).

A decoding forward on a dense cache whose rows stand at one position computes ahead, one of state_kvm's fold
stages every few steps, the fold of the block that leaves the window at the next chunk boundary, so that the
boundary step costs what any other step costs (`KVMCacheLayer.fold_ahead`, swapped in by `take_fold_ahead`: the
same tensors bit for bit). An engine's paged cache folds at the boundary, batched. Measurements:
docs/kvm_runtime_notes.md.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .state_kvm import Fold, fold_stages


class PacedFold:
    """A block's fold computed ahead of its chunk boundary, from the state it will fold into: key/value head by
    head, state_kvm's `fold_stages` and then the head's read form (`read`), one stage per `run_next_stage()`; its stride
    spreads the stages over 7/8 of a chunk of decoding steps. The boundary step swaps the result in
    (`KVMCacheLayer.take_fold_ahead`): the same tensors, bit for bit."""

    def __init__(self, fold: Fold, read: Callable[[tuple], tuple], block: int, chunk: int) -> None:
        self.block, self.capacity = block, fold.capacity
        self.heads = fold.state[0].shape[1]
        self.state: list[torch.Tensor] | None = None  # keys, values, norms after the fold
        self.read: list[torch.Tensor] | None = None  # their attention-ready form
        self.stages: list = []
        for head in range(self.heads):
            part = fold.heads(slice(head, head + 1))
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


def paces_folds(cache_layer) -> bool:
    """The one place the paced fold is chosen: the cache layer's `paced_folds` flag (on by default), dense storage,
    eager and without autograd. Training, compiled graphs and a serving engine's pages fold at the boundary."""
    return (cache_layer.paced_folds and cache_layer.index is None and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())
