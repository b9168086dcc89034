"""Per-row geometry of one forward, shared by both models: which columns are real tokens and where each row
stands, each token's real predecessor, Maglev's query blocks, and the documents of a packed row; and `Step`, the one
protocol of a forward's kind. Plans are built from a forward's inputs and the cache's counts and hold nothing
between forwards.

Packed rows (several documents in one row, as DataCollatorWithFlattening and TRL's padding-free batches make
them) run exactly as their documents in a few right-padded length buckets (lengths rounded up to `align`, the KVM
chunk size, so that every document's chunk grid starts at its own first token), the outputs scattered back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch


# ---- real tokens -------------------------------------------------------------------------------------------
def real_tokens(attention_mask, batch: int, length: int, cached: int, device) -> torch.Tensor | None:
    """[B, T] booleans for this forward's real tokens (None without a mask). The mask covers the new tokens
    or, as generate() passes it, the cached columns and the new tokens; the cached part is in the cache."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in (length,
                                                                                                     cached + length):
        expected = f"[{batch}, {length}]" + (f" or [{batch}, {cached + length}]" if cached else "")
        raise ValueError(f"attention_mask must have shape {expected} (batch, cached + new tokens), "
                         f"got {tuple(attention_mask.shape)}")
    return attention_mask[:, -length:].to(device=device) != 0


def query_positions(start: torch.Tensor, valid: torch.Tensor | None, length: int) -> torch.Tensor:
    """[B, T]: each column's position, its row's count of real tokens before it (`start` [B] read before this
    forward); a padding column gets the position of the next real token."""
    if valid is None:
        return start[:, None] + torch.arange(length, device=start.device)
    return start[:, None] + valid.long().cumsum(dim=1) - valid.long()


def last_real_index(valid: torch.Tensor) -> torch.Tensor:
    """[B, T]: 1 + the index of the last real token at or before t (0 when none)."""
    steps = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    return torch.where(valid, steps, 0).cummax(dim=1).values


def previous_real_index(valid: torch.Tensor) -> torch.Tensor:
    """[B, T]: 1 + the index of the last real token strictly before t (0: the carried state)."""
    last = last_real_index(valid)
    return torch.cat([last.new_zeros(last.shape[0], 1), last[:, :-1]], dim=1)


def gather_columns(first: torch.Tensor, columns: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pick, per row, column `index - 1` of `columns` or `first` (index 0): [B, 1, H] + [B, T, H] -> [B, K, H]."""
    source = torch.cat([first.to(columns.dtype), columns], dim=1)
    return source.gather(1, index[..., None].expand(-1, -1, columns.shape[-1]))


class StepPlan:
    """One forward's view of its tokens: per-row positions, which tokens are real, masks built once.

    `start` [B] is each row's count of real tokens read before. Query positions of padding are those the next
    real token would get (only they read them); padding keys get position -1, which no query sees.
    """

    def __init__(self, start: torch.Tensor, valid: torch.Tensor | None, length: int):
        self.start = start
        self.valid = valid
        self.length = length
        self.query_positions = query_positions(start, valid, length)
        self.before = None if valid is None else self.query_positions - start[:, None]
        self.key_positions = self.query_positions if valid is None else torch.where(valid, self.query_positions, -1)
        self.rows: torch.Tensor | None = None  # the cache rows these rows are (None: every row, in order)
        self._masks: dict = {}

    def column(self, t: int):
        """(start positions, validity) of column t, for writes one column at a time."""
        if self.length == 1:
            return self.start, None if self.valid is None else self.valid[:, 0]
        if self.valid is None:
            return self.start + t, None
        return self.start + self.before[:, t], self.valid[:, t]

    def predecessors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices into [carried, x_0, ..., x_{T-1}] (0 = what the cache carried): each token's real predecessor
        [B, T] and the row's last real token [B, 1], what the next forward carries."""
        valid = self.valid
        if valid is None:
            valid = torch.ones(self.start.shape[0], self.length, dtype=torch.bool, device=self.start.device)
        last = last_real_index(valid)
        return torch.cat([last.new_zeros(last.shape[0], 1), last[:, :-1]], dim=1), last[:, -1:]

    def mask(self, key, build: Callable[[], torch.Tensor]):
        """`build()` once per forward under `key`, shared by the layers."""
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def query_blocks(self, left: int, block: int) -> list[tuple[int, int, int]]:
        """(first key column, first query column, end column) per block of `block` queries: the key columns any
        query of the block can see under a `left` window, so a long chunk costs O(length * (block + left))
        instead of O(length^2). One block when the chunk is short."""
        if self.length <= block + left:
            return [(0, 0, self.length)]

        def build():
            blocks = []
            for begin in range(0, self.length, block):
                # per row, the first column whose key position is within reach of the block's first query
                reach = self.key_positions[:, :begin + 1] >= self.query_positions[:, begin:begin + 1] - left
                first = torch.where(reach.any(dim=1), reach.float().argmax(dim=1), begin)
                blocks.append((int(first.min()), begin, min(begin + block, self.length)))
            return blocks
        return self.mask(("blocks", left, block), build)


# ---- a forward's real tokens, flat --------------------------------------------------------------------------
class RowTokens:
    """A forward's real tokens laid out flat, row after row: row r has read `starts[r]` tokens before and reads
    `counts[r]` now, at flat indices [offsets[r], offsets[r] + counts[r]) with positions starts[r], starts[r] + 1,
    ... Built from a padded batch (`from_batch`: padding never becomes a token) or from requests given flat, one
    after the other (a serving engine's step). Projections and feed-forwards run over the flat tokens; the
    per-row geometry (positions, predecessors) is computed once here and shared by the layers."""

    def __init__(self, starts: list[int], counts: list[int], device, padded: torch.Tensor | None = None,
                 width: int = 0) -> None:
        self.starts, self.counts = list(starts), list(counts)
        self.batch = len(self.starts)
        self.offsets = [0] * self.batch
        for row in range(1, self.batch):
            self.offsets[row] = self.offsets[row - 1] + self.counts[row - 1]
        self.total = sum(self.counts)
        self.device = device
        self.padded = padded  # [total]: each token's index in the flattened [batch * width] input; None: already flat
        self.width = width
        self.start = torch.tensor(self.starts, dtype=torch.long, device=device)
        self.count = torch.tensor(self.counts, dtype=torch.long, device=device)
        self.offset = torch.tensor(self.offsets, dtype=torch.long, device=device)
        self.row = torch.repeat_interleave(torch.arange(self.batch, device=device), self.count, output_size=self.total)
        self.local = torch.arange(self.total, device=device) - self.offset[self.row]  # index within the row's tokens
        self.position = self.start[self.row] + self.local
        self._cache: dict = {}

    @classmethod
    def from_batch(cls, starts: list[int], valid: torch.Tensor | None, batch: int, length: int, device) -> RowTokens:
        """The real tokens of a [batch, length] input (`valid`: which columns are real; None: all)."""
        if valid is None:
            return cls(starts, [length] * batch, device, None, length)
        counts = valid.sum(dim=1).tolist()
        return cls(starts, counts, device, valid.reshape(-1).nonzero().squeeze(1), length)

    @property
    def one_each(self) -> bool:
        """Every row reads exactly one token (a decoding step): flat token i is row i's."""
        return self.padded is None and self.width == 1 or self.total == self.batch and min(self.counts) == 1

    @property
    def fresh_rectangle(self) -> bool:
        """Every row reads the same number of tokens from its first one, with no padding (training batches)."""
        return self.padded is None and not any(self.starts)

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """[total, ...] real tokens of a [batch, width, ...] tensor."""
        flat = x.reshape(self.batch * self.width, *x.shape[2:])
        return flat if self.padded is None else flat[self.padded]

    def unflatten(self, y: torch.Tensor) -> torch.Tensor:
        """[batch, width, ...] from [total, ...] real tokens, zeros at the padding."""
        if self.padded is None:
            return y.view(self.batch, self.width, *y.shape[1:])
        out = y.new_zeros(self.batch * self.width, *y.shape[1:]).index_copy(0, self.padded, y)
        return out.view(self.batch, self.width, *y.shape[1:])

    def once(self, key, build: Callable[[], object]):
        """`build()` once per forward under `key`, shared by the layers."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def predecessors(self, first: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices into [carries (batch rows), a zero row, tokens (total)]: each token's predecessor - the token
        before it, the row's carry when the row has read tokens before, else (a row's very first token) itself
        (`first="first"`) or zero (`"zero"`) - and each row's last token (its carry when it reads none now)."""
        def build():
            tokens = self.batch + 1 + torch.arange(self.total, device=self.device)
            carried = self.start[self.row] > 0
            first_own = tokens if first == "first" else torch.full_like(tokens, self.batch)
            previous = torch.where(self.local > 0, tokens - 1, torch.where(carried, self.row, first_own))
            rows = torch.arange(self.batch, device=self.device)
            last = torch.where(self.count > 0, self.batch + self.offset + self.count, rows)
            return previous, last
        return self.once(("predecessors", first), build)


class Step:
    """One forward's tokens as a model's layers read them, prepared before the forward by the model's
    `prepare_step(cache, input_ids, ...)` (parked on the cache for the forward to take) or by the forward itself.

    Its kinds (a decoding step, a prompt chunk, a serving engine's step over its pages) differ in the methods below,
    so that a model runs one loop whatever the kind."""

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """The forward's tokens [N, ...], flat, of the model's [batch, length, ...] input layout."""
        return x

    def unflatten(self, y: torch.Tensor) -> torch.Tensor:
        """The input layout [batch, length, ...] of flat tokens [N, ...] (zeros at padding)."""
        return y

    def rotary_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The rotary position of each flat token: `position_ids` as the step reads them, else the tokens' own."""
        raise NotImplementedError(f"{type(self).__name__} has no rotary positions")

    def token_shift(self, x: torch.Tensor, mix: torch.Tensor, cache_layer, name: str, first: str) -> torch.Tensor:
        """x + mix * (x[t-1] - x[t]) over each row's flat tokens x [1, N, D], the row's carry of stream `name` in
        `cache_layer` read and updated; a row's very first token reads itself (`first="first"`) or zero
        (`"zero"`)."""
        raise NotImplementedError(f"{type(self).__name__} shifts no tokens")

    def token_shifts(self, streams: list[tuple[torch.Tensor, torch.Tensor, str]], cache_layer,
                     first: str) -> list[torch.Tensor]:
        """`token_shift` of a layer's streams (x, mix, name each) that shift at one point of the forward; a kind
        of step that can shift them in one operation overrides it."""
        return [self.token_shift(x, mix, cache_layer, name, first) for x, mix, name in streams]

    def attend(self, attention, cache_layer, *inputs) -> torch.Tensor:
        """The attention of module `attention` for this kind of step: its queries over its cache layer (None: no
        cache) and the step's own keys, the cache layer updated. `inputs`: the queries, keys and values and what
        else the model's attention reads (KVM's merge gates, Maglev's window)."""
        raise NotImplementedError(f"{type(self).__name__} attends nothing")

    def finish(self, cache) -> None:
        """After the layers: what the cache records of the forward (nothing when it was recorded when prepared)."""


# ---- packed rows ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Document:
    """One document of a packed batch: its row and its columns [start, end)."""

    row: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def boundaries_from_positions(position_ids: torch.Tensor, batch: int) -> list[list[int]] | None:
    """Per row the columns where a document starts (position 0 after the row's first column), or None when no row
    restarts. Each document's positions must count 0, 1, 2, ...; other position ids are left to the model's check."""
    ids = position_ids.detach().to("cpu").long().expand(batch, position_ids.shape[1])
    if not bool((ids[:, 1:] == 0).any()):
        return None
    starts = []
    for row in ids.tolist():
        cuts = [0] + [t for t in range(1, len(row)) if row[t] == 0]
        for begin, end in zip(cuts, cuts[1:] + [len(row)]):
            if row[begin:end] != list(range(end - begin)):
                raise ValueError("position_ids of a packed row must count 0, 1, 2, ... within each document "
                                 f"(a document starting at column {begin} reads {row[begin:end][:8]}...)")
        starts.append(cuts)
    return starts


def boundaries_from_cu_seq_lens(cu_seq_lens: torch.Tensor, batch: int, length: int) -> list[list[int]]:
    """Per row the document starts that `cu_seq_lens_q` (cumulative lengths over the flattened batch) gives."""
    cu = [int(c) for c in cu_seq_lens.detach().to("cpu").reshape(-1).tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != batch * length or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seq_lens_q must rise strictly from 0 to batch * length = {batch * length}, got "
                         f"{cu[:8]}{'...' if len(cu) > 8 else ''}")
    starts: list[list[int]] = [[] for _ in range(batch)]
    for begin, end in zip(cu, cu[1:]):
        row = begin // length
        if (end - 1) // length != row:
            raise ValueError(f"cu_seq_lens_q puts a document across rows (tokens {begin}..{end - 1} of rows of "
                             f"{length}): a document must lie within one row")
        starts[row].append(begin - row * length)
    if any(not cuts or cuts[0] != 0 for cuts in starts):
        raise ValueError("cu_seq_lens_q must start a document at the first column of every row")
    return starts


def boundaries_from_seq_idx(seq_idx: torch.Tensor, batch: int, length: int) -> list[list[int]]:
    """Per row the document starts that `seq_idx` ([batch, length] document ids) gives: where the id changes."""
    if seq_idx.ndim != 2 or tuple(seq_idx.shape) != (batch, length):
        raise ValueError(f"seq_idx must be a [{batch}, {length}] tensor of document ids, got {tuple(seq_idx.shape)}")
    ids = seq_idx.detach().to("cpu").tolist()
    return [[0] + [t for t in range(1, length) if row[t] != row[t - 1]] for row in ids]


def packed_documents(position_ids, attention_mask, kwargs: dict, batch: int, length: int,
                     model_name: str) -> list[Document] | None:
    """The documents of a packed batch, from position_ids restarts, `cu_seq_lens_q` or `seq_idx` (those that are
    given must agree), or None when the batch is not packed (every row one document). A padded batch's
    position_ids are not read here: the model checks them against its own positions, as before."""
    sources = {}
    padded = attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all())
    # a padded batch's position ids hold placeholders on pads (generate() writes 1s there): not restarts
    # one-token steps cannot restart, and reading their ids would stall an accelerator every decoded token
    if length > 1 and not padded and isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2 and position_ids.shape[1] == length \
            and position_ids.shape[0] in (1, batch) and not position_ids.dtype.is_floating_point:
        found = boundaries_from_positions(position_ids, batch)
        if found is not None:
            sources["position_ids"] = found
    if kwargs.get("cu_seq_lens_q") is not None:
        sources["cu_seq_lens_q"] = boundaries_from_cu_seq_lens(kwargs["cu_seq_lens_q"], batch, length)
    if kwargs.get("seq_idx") is not None:
        sources["seq_idx"] = boundaries_from_seq_idx(kwargs["seq_idx"], batch, length)
    if not sources:
        return None
    (first_name, first), *others = sources.items()
    for name, found in others:
        if found != first:
            raise ValueError(f"{first_name} and {name} put the document boundaries in different places; "
                             "pass boundaries that agree (or only one of them)")
    if all(len(cuts) == 1 for cuts in first):
        return None
    if padded:
        raise ValueError(f"{model_name}: a packed batch (documents delimited by {first_name}) cannot also have "
                         "padding (attention_mask zeros); pack without padding, as DataCollatorWithFlattening does")
    return [Document(row, begin, end)
            for row, cuts in enumerate(first) for begin, end in zip(cuts, cuts[1:] + [length])]


def boundary_kwargs(kwargs: dict) -> dict:
    """The keyword arguments that delimit documents (as the causal-LM forward hands them to its base model)."""
    return {name: kwargs[name] for name in ("cu_seq_lens_q", "seq_idx") if kwargs.get(name) is not None}


def refuse_packed_cache(use_cache, cache, model_name: str) -> None:
    """A packed row cannot be cached: a cache carries one state per row, and a packed row holds several."""
    if use_cache is True or cache is not None:
        raise ValueError(f"{model_name}: a packed batch (several documents in one row) cannot be run with a cache "
                         "(use_cache=True or a cache passed): a cache holds one sequence per row. Generate from each "
                         "document as a row of its own; pass use_cache=False for a packed training or scoring forward.")


def length_buckets(documents: list[Document], align: int) -> list[list[Document]]:
    """Documents grouped for batched runs: longest first, lengths rounded up to `align`; a bucket takes the next
    document while it is at least half the bucket's length, so padding stays under half a bucket."""
    def rounded(doc: Document) -> int:
        return -(-doc.length // align) * align

    buckets: list[list[Document]] = []
    for doc in sorted(documents, key=lambda d: -d.length):
        if buckets and 2 * rounded(doc) >= rounded(buckets[-1][0]):
            buckets[-1].append(doc)
        else:
            buckets.append([doc])
    return buckets


def bucket_index(bucket: list[Document], align: int, device: torch.device):
    """For a bucket: its padded length, and (packed rows, packed columns, bucket rows, bucket columns) of its
    real tokens, which gather packed tensors into the bucket and scatter its outputs back."""
    width = -(-bucket[0].length // align) * align
    rows, cols, slots, offsets = [], [], [], []
    for i, doc in enumerate(bucket):
        rows += [doc.row] * doc.length
        cols += range(doc.start, doc.end)
        slots += [i] * doc.length
        offsets += range(doc.length)
    as_index = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return width, (as_index(rows), as_index(cols), as_index(slots), as_index(offsets))


def gather_bucket(packed: torch.Tensor, count: int, width: int, index, fill=0) -> torch.Tensor:
    """A packed [B, T, ...] tensor's documents of one bucket as a right-padded [count, width, ...] batch."""
    rows, cols, slots, offsets = index
    out = packed.new_full((count, width, *packed.shape[2:]), fill)
    out[slots, offsets] = packed[rows, cols]
    return out


def bucket_mask(count: int, width: int, index, device: torch.device) -> torch.Tensor:
    """The attention mask of a bucket: 1 on real tokens, 0 on the right padding."""
    _, _, slots, offsets = index
    mask = torch.zeros(count, width, dtype=torch.long, device=device)
    mask[slots, offsets] = 1
    return mask


def scatter_outputs(outputs: list, indices: list, counts: list[int], batch: int, length: int) -> dict:
    """The buckets' outputs in the packed layout: [count, width, ...] tensors scattered back to [B, T, ...],
    tuples of them likewise, scalars (mean losses over real tokens) as the token-weighted mean; an output some
    bucket lacks (Maglev's prefiller memories, which a one-token document does not make) is None."""
    total = sum(counts)

    def combine(values):
        first = values[0]
        if any(value is None for value in values):
            return None
        if isinstance(first, (tuple, list)):
            return tuple(combine(list(group)) for group in zip(*values))
        if first.ndim == 0:
            return sum(v * (n / total) for v, n in zip(values, counts))
        out = first.new_zeros((batch, length, *first.shape[2:]))
        for value, (rows, cols, slots, offsets) in zip(values, indices):
            out = out.index_put((rows, cols), value[slots, offsets])
        return out

    names = [field.name for field in fields(outputs[0])]
    return {name: combine([getattr(o, name) for o in outputs]) for name in names}
