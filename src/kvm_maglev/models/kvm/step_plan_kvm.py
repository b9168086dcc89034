"""KVM's geometry of one forward, computed once from the rows' positions and shared by the layers: which queries
attend together and where their keys come from (`Pieces`), when each row's state changes (`StateSchedule`), and
`PromptStep`, the kind of `Step` such a forward is. Rows advance independently, so one step may hold decoding rows,
continuing prompts and fresh rows, and every layer runs them in one batched attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.step_plan import RowTokens, Step
from .state_kvm import folded_blocks, slots_after_folds


@dataclass
class Pieces:
    """The forward's queries cut into pieces that attend the same keys: a KVM layer's queries of one chunk of one
    row, or a sliding-window layer's run of up to `sliding_window` queries of one row.

    Each piece has up to `width` queries (`query_index`: flat tokens, the piece's last one repeated past its end so
    that every slot sees a key; `query_pos`, `query_valid`) and reads keys from two places: the layer's cached
    window of its row (`ring_rows`; positions the ring holds before the forward, visible from `query_low` on) and
    this forward's tokens (`new_index` with positions `new_pos`, -1 where none). A query sees the keys at
    positions [query_low, query_pos]."""

    rows: list[int]
    row: torch.Tensor  # [P]
    query_index: torch.Tensor  # [P, width]
    query_pos: torch.Tensor  # [P, width]
    query_valid: torch.Tensor  # [P, width]
    query_low: torch.Tensor  # [P, width]: the first position a query sees
    new_index: torch.Tensor  # [P, keys]
    new_pos: torch.Tensor  # [P, keys]
    reads_ring: bool  # some piece's row has read tokens before this forward
    order: torch.Tensor  # the real query slots of [P * width], in flat token order
    identity_rows: bool  # one piece per row of the batch, in row order: per-row tensors line up with the pieces
    spans: list[tuple[int, int, int, int]]  # (row, first position, last position, lowest key position) per piece
    sliding: int | None
    groups: list[tuple[torch.Tensor | None, Pieces]] | None = None  # `by_width`'s, once made

    @property
    def count(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> torch.Tensor:
        """The flat token of each real query, in the order of `order`."""
        return self.query_index.reshape(-1)[self.order]

    def by_width(self, tokens: RowTokens) -> list[tuple[torch.Tensor | None, Pieces]]:
        """The pieces in groups that attend in one call each - pieces of one query (decoding rows) apart from
        longer ones (prompt chunks), so that no decoding row is padded to a prompt chunk's queries and keys - with
        each group's piece indices (None: all the pieces, in order). Made once, with the pieces."""
        if self.groups is None:
            single = [index for index, span in enumerate(self.spans) if span[1] == span[2]]
            longer = [index for index in range(len(self.spans)) if self.spans[index][1] != self.spans[index][2]]
            self.groups = [(None, self)] if not single or not longer else [
                (torch.tensor(indices, device=tokens.device),
                 cut_pieces(tokens, [self.spans[i] for i in indices], self.sliding)) for indices in (single, longer)]
        return self.groups


def cut_pieces(tokens: RowTokens, spans: list[tuple[int, int, int, int]], sliding: int | None) -> Pieces:
    """`Pieces` from (row, first position, last position, lowest key position) spans, in row and position order.
    `sliding`: a sliding window's size (each query sees its last `sliding` positions), None for a KVM layer (the
    piece's lowest key position holds for every query). Widths come from lists, not generator expressions, and an
    empty list's default by `or`: compiled generation traces this, and dynamo breaks its graph on a generator inside
    `max`/`any` and (torch 2.13) on `max(..., default=...)`."""
    device = tokens.device
    rows = [span[0] for span in spans]
    first = torch.tensor([span[1] for span in spans], dtype=torch.long, device=device)
    last = torch.tensor([span[2] for span in spans], dtype=torch.long, device=device)
    low = torch.tensor([span[3] for span in spans], dtype=torch.long, device=device)
    row = torch.tensor(rows, dtype=torch.long, device=device)
    start, offset = tokens.start[row], tokens.offset[row]
    length = last - first + 1
    width = max([span[2] - span[1] + 1 for span in spans] or [1])
    steps = torch.arange(width, device=device)
    query_valid = steps < length[:, None]
    query_pos = first[:, None] + torch.minimum(steps, length[:, None] - 1)
    query_index = offset[:, None] + query_pos - start[:, None]
    query_low = query_pos - sliding + 1 if sliding is not None else low[:, None].expand_as(query_pos)
    new_first = torch.maximum(low, start)
    keys = max([span[2] - max(span[3], tokens.starts[span[0]]) + 1 for span in spans] or [1])
    key_steps = torch.arange(keys, device=device)
    new_pos = new_first[:, None] + key_steps
    new_valid = new_pos <= last[:, None]
    new_index = torch.where(new_valid, offset[:, None] + new_pos - start[:, None], 0)
    order = torch.tensor([index * width + step for index, span in enumerate(spans)
                          for step in range(span[2] - span[1] + 1)], dtype=torch.long, device=device)
    reads_ring = any([tokens.starts[r] > 0 for r in set(rows)])
    pieces = Pieces(rows, row, query_index, query_pos, query_valid, query_low.clamp(min=0), new_index,
                    torch.where(new_valid, new_pos, -1), reads_ring, order, rows == list(range(tokens.batch)), spans,
                    sliding)
    pieces.by_width(tokens)  # its groups made with it, before any forward reads them
    return pieces


def chunk_pieces(config, tokens: RowTokens) -> Pieces:
    """A KVM layer's pieces: each row's new tokens cut at its chunk boundaries; a query of chunk c sees its chunk
    and the `window_chunks - 1` before it."""
    chunk, window_chunks = config.chunk_size, config.window_chunks
    spans = []
    for row, (start, count) in enumerate(zip(tokens.starts, tokens.counts)):
        for index in range(start // chunk, (start + count - 1) // chunk + 1) if count else ():
            first, last = max(start, index * chunk), min(start + count, (index + 1) * chunk) - 1
            spans.append((row, first, last, max(0, index + 1 - window_chunks) * chunk))
    return cut_pieces(tokens, spans, None)


def sliding_pieces(window: int, tokens: RowTokens) -> Pieces:
    """A sliding-window layer's pieces: each row's new tokens in runs of `window` queries."""
    spans = []
    for row, (start, count) in enumerate(zip(tokens.starts, tokens.counts)):
        for first in range(start, start + count, window):
            last = min(first + window, start + count) - 1
            spans.append((row, first, last, max(0, first - window + 1)))
    return cut_pieces(tokens, spans, window)


def ring_positions(starts: torch.Tensor, size: int) -> torch.Tensor:
    """[rows, size]: the position each slot of a window ring holds after `starts` tokens (position p lives in slot
    p % size); negative where none was written."""
    last = starts[:, None] - 1
    return last - (last - torch.arange(size, device=starts.device)) % size


@dataclass
class FoldRound:
    """One round of folds: rows `rows` (indices into the schedule's `rows`; `members`: the forward's rows) each fold
    block `blocks[i]` into a state of `slots[i]` live slots, appending `appends[i]` of its tokens. `source_ring`
    [rows, chunk] says which of the block's tokens are in the cached window (slot `ring_slot`) and which are this
    forward's (`new_index`); `reads_ring`: some are. The Python lists repeat what the forward decides by, so that
    it reads no tensor to decide."""

    rows: torch.Tensor
    members: torch.Tensor
    blocks: list[int]
    slots: torch.Tensor
    appends: list[int]
    source_ring: torch.Tensor
    ring_slot: torch.Tensor
    new_index: torch.Tensor
    row_list: list[int]
    member_list: list[int]
    reads_ring: bool


@dataclass
class StateSchedule:
    """When each row's state changes in this forward, and which state each piece reads.

    `rows` are the rows whose state changes (first-chunk tokens enter it, or blocks fold into it); `fresh` marks
    those that start from an empty state, `capacity` is the most slots any of them holds afterwards. First-chunk
    tokens: `initial_rows` (indices into `rows`), their flat tokens `initial_index` [r, n] entering slots
    `initial_slot` (one past the end where none), and as flat lists (`first_chunk_*`). `folds` run in rounds. A piece reads state version
    `piece_version[p]` of its row (0: the state before this forward's folds, k: after its k-th fold) with
    `piece_slots[p]` live slots (0: a piece in the front window reads no state; `piece_slot_list` the same
    counts as Python ints)."""

    rows: list[int]
    local: dict[int, int]  # row -> index in `rows`
    fresh: torch.Tensor
    capacity: int
    initial_rows: torch.Tensor
    initial_index: torch.Tensor
    initial_slot: torch.Tensor
    first_chunk_rows: torch.Tensor  # [M] each first-chunk token's row, token (flat) and slot, one per token
    first_chunk_tokens: torch.Tensor
    first_chunk_slots: torch.Tensor
    first_chunk_capacity: int  # the most slots a row holds once they entered
    folds: list[FoldRound]
    piece_version: list[int]
    piece_slots: torch.Tensor
    piece_slot_list: list[int]
    read_slots: int  # the most slots a piece reads
    entered: set[int]  # rows whose state first-chunk tokens entered in this forward (version 0 is not the stored one)
    all_fresh: bool  # every row in `rows` starts from an empty state


def state_schedule(config, tokens: RowTokens, pieces: Pieces) -> StateSchedule:
    """The `StateSchedule` of a KVM layer for `pieces` (the layer's chunk pieces)."""
    chunk, window_chunks = config.chunk_size, config.window_chunks
    size = chunk * window_chunks
    device = tokens.device
    ends = [start + count for start, count in zip(tokens.starts, tokens.counts)]
    most_folds = max([folded_blocks(config, end) for end in ends], default=0)
    table = slots_after_folds(config, most_folds)

    def slots_after(seen: int) -> int:
        return max(seen, 0) if seen <= chunk else table[folded_blocks(config, seen)]

    initial = [row for row, start in enumerate(tokens.starts) if start < chunk and tokens.counts[row] > 0]
    folding = {row: range(folded_blocks(config, tokens.starts[row]) + 1, folded_blocks(config, end) + 1)
               for row, end in enumerate(ends) if folded_blocks(config, end) > folded_blocks(config, tokens.starts[row])}
    rows = sorted(set(initial) | set(folding))
    local = {row: index for index, row in enumerate(rows)}
    capacity = max([slots_after(ends[row]) for row in rows], default=0)

    width = max([min(ends[row], chunk) - tokens.starts[row] for row in initial], default=1)
    initial_index, initial_slot = [], []
    for row in initial:
        start, stop = tokens.starts[row], min(ends[row], chunk)
        positions = list(range(start, stop)) + [stop - 1] * (width - (stop - start))
        initial_index.append([tokens.offsets[row] + position - start for position in positions])
        initial_slot.append(list(range(start, stop)) + [capacity] * (width - (stop - start)))

    folds = []
    for round_index in range(max([len(blocks) for blocks in folding.values()], default=0)):
        members = [row for row in rows if row in folding and len(folding[row]) > round_index]
        blocks = [folding[row][round_index] for row in members]
        slots = [table[block - 1] for block in blocks]
        appends = [min(table[block] - table[block - 1], chunk) for block in blocks]
        positions = torch.tensor([[block * chunk + i for i in range(chunk)] for block in blocks], device=device)
        member = torch.tensor(members, dtype=torch.long, device=device)
        start = tokens.start[member][:, None]
        local_rows = [local[row] for row in members]
        folds.append(FoldRound(torch.tensor(local_rows, device=device), member, blocks,
                               torch.tensor(slots, device=device), appends, positions < start, positions % size,
                               (tokens.offset[member][:, None] + positions - start).clamp(min=0), local_rows, members,
                               any(tokens.starts[row] > block * chunk for row, block in zip(members, blocks))))

    versions, piece_slots = [], []
    for row, position in zip(pieces.rows, (span[1] for span in pieces.spans)):
        index = position // chunk
        if index < window_chunks:
            versions.append(0)
            piece_slots.append(0)
            continue
        versions.append(index - window_chunks - folded_blocks(config, tokens.starts[row]))
        piece_slots.append(table[index - window_chunks])

    def as_tensor(values, columns: int | None = None) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.long, device=device)
        return tensor if columns is None else tensor.view(len(values), columns)

    first_rows, first_tokens, first_slots = [], [], []
    for row in initial:
        start, stop = tokens.starts[row], min(ends[row], chunk)
        first_rows += [row] * (stop - start)
        first_tokens += range(tokens.offsets[row], tokens.offsets[row] + stop - start)
        first_slots += range(start, stop)
    return StateSchedule(
        rows, local, as_tensor([tokens.starts[row] == 0 for row in rows]).bool(), capacity,
        as_tensor([local[row] for row in initial]), as_tensor(initial_index, width), as_tensor(initial_slot, width),
        as_tensor(first_rows), as_tensor(first_tokens), as_tensor(first_slots), max(first_slots, default=-1) + 1,
        folds, versions, as_tensor(piece_slots), piece_slots, max(piece_slots, default=0), set(initial),
        all(tokens.starts[row] == 0 for row in rows))


@dataclass
class PromptStep(Step):
    """Any forward other than a decoding step (prompts, chunks of them, rows at different positions, training),
    prepared before it: its rows' tokens (with the layers' plans made in them), the rotary positions when the
    caller gave them, and the columns the cache moves on by. Its layers run the general path: each row's tokens
    over its window and state by pieces (`KVMAttention.attend_tokens`), token shifts over the rows (`shift_tokens`)."""

    tokens: RowTokens
    positions: torch.Tensor | None
    columns: int

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens.flatten(x)

    def unflatten(self, y: torch.Tensor) -> torch.Tensor:
        return self.tokens.unflatten(y)

    def rotary_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The caller's positions (checked and flattened when the step was prepared), else each token's own."""
        return self.tokens.position if self.positions is None else self.positions

    def token_shift(self, x: torch.Tensor, mix: torch.Tensor, cache_layer, name: str, first: str) -> torch.Tensor:
        return shift_tokens(self.tokens, x, mix, cache_layer, name, first)

    def attend(self, attention, cache_layer, *inputs) -> torch.Tensor:
        """The layer's general attention over the rows' pieces (`attend_tokens`)."""
        return attention.attend_tokens(*inputs, self.tokens, cache_layer)

    def finish(self, cache) -> None:
        """Each row has read its tokens (the layers' records of a recorded forward close)."""
        if cache is not None:
            cache.finish_forward(self.tokens, self.columns)


def shift_tokens(tokens: RowTokens, x: torch.Tensor, mix: torch.Tensor, cache_layer, name: str,
                 first: str) -> torch.Tensor:
    """Token shift x + mix * (x[t-1] - x[t]) over each row's tokens (x: [1, N, D], the forward's flat tokens),
    updating the row's carry of stream `name` in `cache_layer` (None: no cache). A row's first token reads the
    carry when the row has read tokens before, else itself ("first") or zero ("zero")."""
    flat = x[0]
    if cache_layer is None and tokens.fresh_rectangle:
        rows = flat.view(tokens.batch, tokens.width, -1)
        lead = rows[:, :1] if first == "first" else torch.zeros_like(rows[:, :1])
        previous = torch.cat([lead, rows[:, :-1]], dim=1).view_as(flat)
        return x + mix * (previous[None] - x)
    carry = f"carry.{name}"
    if cache_layer is not None:
        cache_layer.ensure(carry, tokens.batch, flat.shape[1:], flat.dtype, flat.device)
    if cache_layer is not None and tokens.one_each and all(tokens.starts) and cache_layer.record is None:
        # a decoding step: each row's carry is its token's predecessor (read before it is overwritten)
        shifted = x + mix * (cache_layer.read(carry).to(flat.dtype)[None] - x)
        cache_layer.write(carry, None, flat.detach())
        return shifted
    carried = cache_layer.read(carry).to(flat.dtype) if cache_layer is not None and any(tokens.starts) \
        else flat.new_zeros(tokens.batch, flat.shape[1])
    source = torch.cat([carried, flat.new_zeros(1, flat.shape[1]), flat])
    previous_index, last_index = tokens.predecessors(first)
    if cache_layer is not None:
        reading = tokens.once("reading rows", lambda: torch.tensor(
            [row for row, count in enumerate(tokens.counts) if count], dtype=torch.long, device=tokens.device))
        cache_layer.write(carry, reading, source[last_index[reading]].detach())
        if cache_layer.record is not None:
            cache_layer.record.shifts[name] = flat.detach()
    return x + mix * (source[previous_index][None] - x)
