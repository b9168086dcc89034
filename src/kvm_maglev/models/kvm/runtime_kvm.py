"""Inference speed-ups for KVM models, kept apart from the math (modeling_kvm, state_kvm).

Whatever steps the model (generate(), a loop of one's own), a decoding forward on a dense cache whose rows stand at
one position computes ahead the fold of the block that leaves the window at the next chunk boundary, one of
state_kvm's fold stages every few decoding steps, so that the boundary step costs what any other step costs: the
cache's layers carry the fold under way (`pending`), `KVMAttention.attend` advances it (`prepare_next_fold`) and
its fold round swaps it in (`take_fold_ahead`). A serving engine's paged cache folds at the boundary, batched.
Inside `model.runtime_speedups()` (runtime_switch), which `generate()` opens, also:
- linear layers compute on oneDNN, batched steps on blocked weight copies (onednn_linear);
- a step of one query per piece on CPU in float32 computes its logits as matrix-vector products
  (`one_query_logits`, which `modeling_kvm.joint_attention` takes when `KVMAttention.one_query_kernel` is on,
  beside the plain products it equals).
Each computes what the plain path computes: the fold bit for bit, the others up to float rounding. Measurements behind them: docs/kvm_runtime_notes.md.
"""

from __future__ import annotations

from functools import partial

import torch

from .state_kvm import fold_stages, folded_blocks, slots_after_folds


def one_query_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`queries @ keys^T` ([P, Hkv, G, D] queries, one per query head of a group) computed as keys @ queries: on
    CPU that product reads each key about twice as fast when a group holds one or two queries (a contiguous column
    of queries, transposed, takes the matrix-vector kernel)."""
    return torch.matmul(keys, queries.contiguous().transpose(-1, -2)).transpose(-1, -2)


class PacedFold:
    """The fold of window block `block` for every row of a dense cache (its rows at one position), computed ahead
    of its chunk boundary from the state it will fold into: key/value head by head, state_kvm's `fold_stages`
    and then the head's read form, one stage per `advance()`; its stride spreads the stages over 7/8 of a chunk
    of decoding steps. The boundary step swaps the result in (`take_fold_ahead`): the same tensors, bit for bit."""

    def __init__(self, attention, cache_layer, block: int, slots: int, appends: int, capacity: int) -> None:
        self.block, self.capacity = block, capacity
        whole = attention.ring_fold(cache_layer, block, slots, appends, capacity)
        self.dtype = cache_layer.tensors["window_keys"].dtype  # the read form's: the model's
        self.heads = whole.state[0].shape[1]
        self.state: list[torch.Tensor] | None = None  # keys, values, norms after the fold
        self.read: list[torch.Tensor] | None = None  # their attention-ready form
        self.stages: list = []
        for head in range(self.heads):
            fold = whole.heads(slice(head, head + 1))
            self.stages += fold_stages(fold) + [partial(self.write_result, attention, fold, head)]
        self.next_stage = 0
        self.stride = max(1, (attention.config.chunk_size * 7 // 8) // (len(self.stages) + 1))  # one more: the start

    def write_result(self, attention, fold, head: int) -> None:
        """Stage: one head's folded state and its read form written into the all-heads tensors."""
        if self.state is None:
            self.state = [t.new_empty(t.shape[:1] + (self.heads,) + t.shape[2:]) for t in fold.state]
            self.read = None
        read = attention.readable(fold.state, self.dtype)
        if self.read is None:
            self.read = [t.new_empty(t.shape[:1] + (self.heads,) + t.shape[2:]) for t in read]
        for whole, piece in zip(self.state + self.read, tuple(fold.state) + tuple(read)):
            whole[:, head:head + 1] = piece

    @property
    def done(self) -> bool:
        return self.next_stage == len(self.stages)

    def advance(self) -> None:
        self.stages[self.next_stage]()
        self.next_stage += 1

    def finish(self) -> None:
        while not self.done:
            self.advance()


def prepare_next_fold(attention, cache_layer, tokens) -> None:
    """After a decoding forward on a dense cache whose rows stand at one position: start or advance the fold of the
    block that leaves the window at the next chunk boundary, one stage every `stride` decoding steps, or all of it
    after a multi-token forward (a prefill). With two or more window chunks the block and the state it folds into
    are final a chunk ahead."""
    config = attention.config
    chunk, window_chunks = config.chunk_size, config.window_chunks
    seen = tokens.starts[0] + tokens.counts[0]
    if window_chunks < 2 or not seen or len(set(tokens.starts)) > 1 or len(set(tokens.counts)) > 1:
        return
    block = (seen - 1) // chunk + 1 - window_chunks
    if block < 1 or folded_blocks(config, seen) != block - 1:
        return
    fold = cache_layer.pending
    if fold is None or fold.block != block:
        table = slots_after_folds(config, block)
        fold = cache_layer.pending = PacedFold(attention, cache_layer, block, table[-2], table[-1] - table[-2],
                                               table[-1])
    if tokens.counts[0] > 1:
        fold.finish()
    elif not fold.done and seen % fold.stride == 0:
        fold.advance()


def take_fold_ahead(cache_layer, fold, capacity: int) -> tuple | None:
    """The state and read form of a fold computed ahead when it is this round's (every row folding its block, at
    this capacity), else None (the caller folds now). The fold is used once."""
    pending = getattr(cache_layer, "pending", None)
    if pending is None or pending.capacity != capacity or set(fold.blocks) != {pending.block} \
            or fold.members.tolist() != list(range(cache_layer.tensors["window_keys"].shape[0])):
        return None
    pending.finish()
    cache_layer.pending = None
    return tuple(pending.state), tuple(pending.read)
