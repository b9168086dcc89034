"""Packed rows (several documents in one row, as DataCollatorWithFlattening and TRL's padding-free batches make
them): where each document lies, and a plan that runs the documents as if each were alone in its row.

Both models run a right-padded batch exactly (they are causal, so trailing pads never reach a real token) and
batch rows independently. A packed row is therefore run exactly by splitting it into its documents, gathering
them into a few length buckets (lengths rounded up to `align`, the KVM chunk size, so every document's chunk
grid starts at its own first token), running each bucket as an ordinary unpacked batch, and scattering the
outputs back to the packed layout, where the head and the loss run as usual."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


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
