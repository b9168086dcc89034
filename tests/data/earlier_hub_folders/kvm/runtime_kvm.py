"""Inference speed-ups for KVM models, kept apart from the math (modeling_kvm, state_kvm).

Whatever steps the model (generate(), a server's own loop), a forward without autograd that has a cache
computes ahead the fold of the block that leaves the window at the next chunk boundary, one of
state_kvm's fold stages every few decoding steps, so that the boundary step costs what any other step
costs: the cache's layers carry the fold under way (`pending_fold`), `KVMAttention.cached_step` advances it
(`prepare_next_fold`) and `KVMAttention.fold_block` swaps it in (`take_fold_ahead`).
Inside `model.runtime_speedups()` (runtime_switch), which `generate()` opens, also:
- linear layers compute on oneDNN, batched steps on blocked weight copies (onednn_linear);
- a one-query decoding step on CPU in float32 reads the state and window as matrix-vector products
  (`one_query_attention`, which `KVMAttention.attend_state_and_window` calls when its `one_query_kernel`
  flag is on, beside the plain products it equals).
Each computes what the plain path computes: the fold bit for bit, the others up to float rounding.
Measurements behind them: docs/kvm_runtime_notes.md.
"""

from __future__ import annotations

from functools import partial

import torch

from .state_kvm import Fold, fold_stages, query_slice


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


def write_head(full: list[torch.Tensor] | None, part, heads: slice, num_heads: int) -> list[torch.Tensor]:
    """Write one head's tensors into the all-heads tensors, allocating those on the first head."""
    if full is None:
        full = [t.new_empty(t.shape[:1] + (num_heads,) + t.shape[2:]) for t in part]
    for whole, piece in zip(full, part):
        whole[:, heads] = piece
    return full


class PacedFold:
    """The fold of window block `block` computed ahead of its chunk boundary, from the state it started on:
    head by head, state_kvm's `fold_stages` and then the head's read form, one stage per `advance()`; its
    stride spreads the stages over 7/8 of a chunk of decoding steps."""

    def __init__(self, attention, cache, block: int) -> None:
        self.block, self.source = block, cache.state_keys
        self.dtype = cache.window.storage[0].dtype  # the read form's: the queries', as the window keys'
        self.state: list[torch.Tensor] | None = None  # keys, values, norms after the fold
        self.read: list[torch.Tensor] | None = None  # their attention-ready form
        whole = attention.block_fold(cache, block, cache.state_keys.dtype)
        self.num_heads = cache.state_keys.shape[1]  # key/value heads: the rank's own under tensor parallelism
        self.stages: list = []
        for head in range(self.num_heads):
            fold = whole.heads(slice(head, head + 1))
            self.stages += fold_stages(fold) + [partial(self.write_result, attention, fold, slice(head, head + 1))]
        self.next_stage = 0
        self.stride = max(1, (attention.config.chunk_size * 7 // 8) // (len(self.stages) + 1))  # one more: the start

    def write_result(self, attention, fold: Fold, heads: slice) -> None:
        """Stage: one head's folded state and its read form (`KVMAttention.readable`, for the group's query
        heads) written into the all-heads tensors."""
        self.state = write_head(self.state, fold.state, heads, self.num_heads)
        read = attention.readable(fold.state, attention.state_key_norm(fold.state[0]), self.dtype, heads)
        group = attention.config.kv_group_size
        self.read = write_head(self.read, read, query_slice(heads, group), self.num_heads * group)

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
