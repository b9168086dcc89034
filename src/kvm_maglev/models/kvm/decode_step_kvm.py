"""KVM's decoding step as one graph: every row reads one token, and nothing in the forward waits on the host.

A decoding step's geometry depends only on where each row stands, so `DecodeStep` holds it as tensors made before
the forward, and the folds its tokens read run then too (the cache layers' `fold_due`, for the rows
`rows_folding` names): fixed shapes, no `.item()`, no Python over rows - what `torch.compile(fullgraph=True)` and
CUDA graphs need. The general path (`KVMAttention.attend` over `Pieces`) is its reference: the same logits and the
same cache (tests/models/kvm/test_kvm_decode_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.step_plan import Step
from .state_kvm import folded_blocks, slots_after_folds
from .step_plan_kvm import ring_positions


@dataclass
class DecodeStep(Step):
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

    def rotary_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The rows' positions, or the last column of `position_ids` (generate() passes every column's)."""
        if position_ids is None:
            return self.position
        return position_ids[:, -1].to(self.position.device).expand(self.batch)

    def token_shift(self, x: torch.Tensor, mix: torch.Tensor, cache_layer, name: str, first: str) -> torch.Tensor:
        """One token per row: its predecessor is the row's carry, which it then replaces (every row has read
        tokens before, so `first` never applies)."""
        carry = cache_layer.tensors[f"carry.{name}"]
        if cache_layer.index is None:  # dense: the carry tensor is the rows'
            shifted = x + mix * (carry.to(x.dtype)[None] - x)
            carry.copy_(x[0])
        else:
            shifted = x + mix * (carry[cache_layer.index].to(x.dtype)[None] - x)
            carry[cache_layer.index] = x[0].to(carry.dtype)
        return shifted

    def attend(self, attention, cache_layer, *inputs) -> torch.Tensor:
        """The layer's one-graph decoding attention (`attend_decoding`)."""
        return attention.attend_decoding(*inputs, self, cache_layer)


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
