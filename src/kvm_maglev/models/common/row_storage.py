"""Per-row tensors of a cache layer, addressed by row, whoever owns them: a cache's own dense tensors (one storage
row per batch row, generate()) or a serving engine's pages (one page per request, bound for each step). The layer code
reads and writes through it the same way in both cases, in place."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class RowStorage:
    """A layer's tensors, each [storage rows, ...], and the storage row of each of the forward's rows (`index`;
    None: storage row i is row i). Reading all rows of a dense storage is the tensor itself, no copy; writes go
    into the tensors in place and, while a journal is open, keep what they replaced."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.index: torch.Tensor | None = None
        self.run: slice | None = None  # `index` as a slice when it is a run of consecutive storage rows
        self.replaced: list | None = None  # while recording: (name, where, the values a write replaced)

    def bind(self, tensors: dict[str, torch.Tensor], index: torch.Tensor) -> None:
        """Read and write `tensors` (an engine's pages, [pages, ...] each), the forward's rows being storage rows
        `index`. When those are consecutive (requests admitted together often hold consecutive pages), reading
        all rows is a view of the pages, not a copy."""
        self.tensors, self.index = tensors, index
        pages = index.tolist()
        consecutive = bool(pages) and pages == list(range(pages[0], pages[0] + len(pages)))
        self.run = slice(pages[0], pages[0] + len(pages)) if consecutive else None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, rows: torch.Tensor | None = None, slots: int | None = None) -> torch.Tensor:
        """[rows, ...] of tensor `name` (all rows: `rows` None); only its first `slots` slots (dim 2) when given."""
        # storage rows of the forward's rows, resolved here rather than in a helper: a decoding step reads and
        # writes every layer's ring through these methods, one call each
        tensor = self.tensors[name]
        index = rows if self.index is None else self.index if rows is None else self.index[rows]
        if rows is None and self.run is not None:
            index, tensor = None, tensor[self.run]
        if slots is not None and slots < tensor.shape[2]:
            return tensor[:, :, :slots] if index is None else tensor[index, :, :slots]
        return tensor if index is None else tensor[index]

    def read_slots(self, name: str, rows: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        """[n, ...]: slot `slots[i]` (dim 2) of row `rows[i]` of tensor `name` (rows None: every row, in order), what
        `write` with `slots` replaces."""
        tensor = self.tensors[name]
        index = rows if self.index is None else self.index if rows is None else self.index[rows]
        if index is None:
            index = torch.arange(tensor.shape[0], device=tensor.device)
        return tensor[index, :, slots]

    def write(self, name: str, rows: torch.Tensor | None, values: torch.Tensor,
              slots: torch.Tensor | None = None) -> None:
        """Write `values` into rows `rows` (None: all) of tensor `name`: whole rows (their leading slots when
        `values` holds fewer), or one slot per row (`slots`: [n] slots of dim 2, values [n, heads, dim]). Under
        autograd, with values that carry gradients, the tensor is replaced rather than written in place (what
        attention read from it stays as it was for the backward pass)."""
        tensor = self.tensors[name]
        index = rows if self.index is None else self.index if rows is None else self.index[rows]
        if index is None:
            index = torch.arange(tensor.shape[0], device=tensor.device) if slots is not None else slice(None)
        if slots is not None:
            where = (index, slice(None), slots)
        elif values.dim() > 2 and values.shape[2] < tensor.shape[2]:
            where = (index, slice(None), slice(0, values.shape[2]))
        else:
            where = (index,)
        if self.replaced is not None:
            self.replaced.append((name, where, tensor[where].clone()))
        if torch.is_grad_enabled() and values.requires_grad:
            tensor = self.tensors[name] = tensor.clone()
        tensor[where] = values.to(tensor.dtype)

    def ensure(self, name: str, rows: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        """Dense storage: tensor `name` for `rows` rows with at least `shape` ([heads, slots, dim]: the slot count
        grows, geometrically, keeping what it holds), zeros where new."""
        tensor = self.tensors.get(name)
        if tensor is None:
            self.tensors[name] = torch.zeros(rows, *shape, dtype=dtype, device=device)
            return
        if len(shape) == 3 and tensor.shape[2] < shape[1]:
            grown = tensor.new_zeros(tensor.shape[0], tensor.shape[1], max(shape[1], 2 * tensor.shape[2]),
                                     tensor.shape[3])
            grown[:, :, :tensor.shape[2]] = tensor
            self.tensors[name] = grown

    def zero_rows(self, rows: torch.Tensor) -> None:
        """Empty rows `rows` (a request starting at position 0 on pages another request used)."""
        for name in self.tensors:
            self.write(name, rows, torch.zeros((), dtype=self.tensors[name].dtype, device=rows.device))

    def map_rows(self, fn) -> None:
        self.tensors = {name: fn(tensor) for name, tensor in self.tensors.items()}


class RowCacheLayer(RowStorage, CacheLayerMixin):
    """A cache layer of per-row tensors on transformers' cache-layer API: what applies works, the rest refuses with
    its reason (each row stands at its own position, which the cache keeps; the layers hold rings and states,
    not one key and one value tensor)."""

    supports_early_init = False  # storage is made by the first forward, for its rows

    def __init__(self) -> None:
        RowStorage.__init__(self)  # not CacheLayerMixin's: no single keys/values tensors here

    @property
    def is_initialized(self) -> bool:
        return bool(self.tensors)

    def lazy_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{type(self).__name__} makes its storage in the first forward, for its rows: "
                                  "rings (and states) per row, not one key and one value tensor")

    def update(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is written by its model's attention, not through "
                                  "Cache.update()")

    def get_seq_length(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}'s rows stand at their own positions: ask the cache "
                                  "(`get_seq_length()` counts columns, `row_lengths()` each row's tokens)")

    def get_max_length(self) -> int:
        return -1  # no maximum sequence length: the rings slide

    def get_mask_sizes(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: the model builds its own masks over ring slots, per row")

    def offload(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} stays on the model's device (no offloading)")

    def prefetch(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} stays on the model's device (no offloading)")

    def reset(self) -> None:
        self.tensors = {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Storage row i becomes old row beam_idx[i] (the cache moves the rows' positions with them)."""
        self.map_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))
