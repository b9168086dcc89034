"""Per-row tensors of a cache layer (`RowStorage`), whoever owns them: a cache's own dense tensors (one storage row
per batch row) or a serving engine's pages (one per request), read and written in place the same way; and on it what
both models' caches share: the cache layer (`RowCacheLayer`, which records what a step overwrites for crop) and the
cache (`RowCache`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .step_plan import Step


def refused(reason: str):
    """A method refusing a call of transformers' cache API that does not apply: NotImplementedError with `reason`
    (a format string of `name`, the class's name, and `self`)."""
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(reason.format(name=type(self).__name__, self=self))
    return refuse


@dataclass
class LayerRecord:
    """What one recorded step did to a cache layer: the values its writes replaced, in order (undone newest first);
    a layer that redoes part of a step adds what it needs (`RowCacheLayer.record_type`)."""

    replaced: list = field(default_factory=list)  # (tensor name, where, the values the write replaced)


class RowStorage:
    """A layer's tensors, each [storage rows, ...], and the storage row of each of the forward's rows (`index`;
    None: storage row i is row i). Reading all rows of a dense storage is the tensor itself, no copy; writes go
    into the tensors in place and, while a record is open, keep what they replaced."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.index: torch.Tensor | None = None
        self.run: slice | None = None  # `index` as a slice when it is a run of consecutive storage rows
        self.record: LayerRecord | None = None  # while recording a step: where its writes keep what they replace

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
        if self.record is not None:
            self.record.replaced.append((name, where, tensor[where].clone()))
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

    def map_rows(self, fn) -> None:
        self.tensors = {name: fn(tensor) for name, tensor in self.tensors.items()}


class RowCacheLayer(RowStorage, CacheLayerMixin):
    """A cache layer of per-row tensors on transformers' cache-layer API: what applies works, the rest refuses with
    its reason (each row stands at its own position, which the cache keeps; the layers hold rings and states,
    not one key and one value tensor)."""

    supports_early_init = False  # storage is made by the first forward, for its rows
    is_sliding = False
    record_type: type[LayerRecord] = LayerRecord  # what a recorded step keeps in this kind of layer

    def __init__(self) -> None:
        RowStorage.__init__(self)  # not CacheLayerMixin's: no single keys/values tensors here

    def open_record(self) -> LayerRecord:
        """Record a step: until `close_record` the layer's writes keep what they replace in the record returned,
        which the cache keeps for `undo`."""
        self.record = self.record_type()
        return self.record

    def close_record(self) -> None:
        self.record = None

    def undo(self, record: LayerRecord) -> None:
        """Put back what a recorded step overwrote, newest write first."""
        for name, where, old in reversed(record.replaced):
            self.tensors[name][where] = old

    @property
    def is_initialized(self) -> bool:
        return bool(self.tensors)

    # transformers' cache-layer calls that do not apply, each refused with its reason
    lazy_initialization = refused("{name} makes its storage in the first forward, for its rows: rings (and states) "
                                  "per row, not one key and one value tensor")
    update = refused("{name} is written by its model's attention, not through Cache.update()")
    get_seq_length = refused("{name}'s rows stand at their own positions: ask the cache (`get_seq_length()` counts "
                             "columns, `row_lengths()` each row's tokens)")
    get_mask_sizes = refused("{name}: the model builds its own masks over ring slots, per row")
    offload = prefetch = refused("{name} stays on the model's device (no offloading)")

    def get_max_length(self) -> int:
        return -1  # no maximum sequence length: the rings slide

    def reset(self) -> None:
        self.tensors = {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Storage row i becomes old row beam_idx[i] (the cache moves the rows' positions with them)."""
        self.map_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))


@dataclass
class StepRecord:
    """One recorded step of a cache: the columns read before it and by it, the cache's own row state before it
    (attribute -> value, put back when it is undone), its layers' records and, for a step a crop may fall inside,
    its tokens (what `RowCache.redo` needs)."""

    columns: int
    width: int
    rows: dict
    layers: list[LayerRecord]
    tokens: object = None


class RowCache(Cache):
    """A cache of rows that each stand at their own position, one `RowCacheLayer` per decoder layer: `columns`
    read (padding included: generate() slices its inputs by it), transformers' queries answered or refused with
    the reason, row changes, and rollback (while recording, each step keeps the rows' state and each layer what the
    step overwrote: `crop` undoes steps). A model's cache adds `rows`, `select_rows` and its own state."""

    MODEL_NAME: str  # as errors name the model
    CACHE_CONFIG_FIELDS: tuple[str, ...]
    ROW_START: str  # what each row starts from on the first forward

    def __init__(self, config, layers: list[RowCacheLayer], max_rollback: int) -> None:
        super().__init__(layers=layers)
        self.config, self.max_rollback = config, max_rollback
        self.columns = 0
        self.recording = False
        self.history: deque[StepRecord] = deque()  # while recording: the last steps, oldest first
        self.prepared_step: Step | None = None  # the next forward's, prepared before it (the model's `prepare_step`)

    def take_prepared_step(self) -> Step | None:
        """The step prepared for the next forward (None: none), which that forward takes."""
        step, self.prepared_step = self.prepared_step, None
        return step

    def check_compatible(self, config) -> None:
        """Refuse to serve a model whose config differs in a field that decides what the cache holds."""
        if config is self.config:
            return
        differences = [f"{name}: cache {getattr(self.config, name)!r} vs model {getattr(config, name)!r}"
                       for name in self.CACHE_CONFIG_FIELDS if getattr(self.config, name) != getattr(config, name)]
        if differences:
            raise ValueError(f"this {type(self).__name__} was made for another {self.MODEL_NAME} config: "
                             + "; ".join(differences))

    # ---- what transformers' generic code asks -----------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        """False: generate() would then compile its own decode forward (CUDA graphs, its 4D masks); the models'
        prepared decode steps trace as one graph when `model.forward` is compiled (docs/serving.md)."""
        return False

    @property
    def is_croppable(self) -> bool:
        """Crop rolls back only what was recorded (activate_past_recording)."""
        return self.recording

    @property
    def is_initialized(self) -> bool:
        """Whether the rows exist (the first forward makes them)."""
        return self.rows > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding for layer in self.layers]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def batch_size(self) -> int:
        return self.rows if self.rows else -1

    @property
    def max_batch_size(self) -> int:
        """The rows the cache holds, fixed by its first forward (-1 before)."""
        return self.batch_size

    @property
    def max_cache_len(self) -> int:
        """-1: no maximum length (rings and states bound the cache's size, not the number of tokens read)."""
        return -1

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns read so far (padding included)."""
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the rows carry state from earlier forwards."""
        return self.columns > 0

    # transformers' cache calls that do not apply, each refused with its reason
    early_initialization = refused("{name} starts its rows on the first forward: {self.ROW_START}")
    increase_count = refused("{name} has no convolution states to count: the model counts its columns")
    update = refused("{name} is filled by the {self.MODEL_NAME} model itself, not through Cache.update()")
    update_conv_state = refused("{name} has no convolution states (its layers hold rings of window keys and values, "
                                "which the {self.MODEL_NAME} model writes itself)")
    update_recurrent_state = refused("{name} has no linear-attention recurrent states: what each row carries is the "
                                     "{self.MODEL_NAME} model's own")
    get_mask_sizes = refused("{name} builds its own masks (ring slots per layer, a position per row), so "
                             "transformers' mask sizes do not describe it")
    offload = refused("{name} does not support offloading: its layers stay on the model's device")
    prefetch = refused("{name} does not support offloading, so there is nothing to prefetch")

    def reset(self) -> None:
        self.__init__(self.config, self.max_rollback)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(columns={self.columns}, rows={self.rows}, nbytes={self.nbytes()})"

    # ---- row changes (beam search, batch selection) ---------------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """New row i is old row beam_idx[i] (beam search)."""
        self.change_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.change_rows([row for row in range(self.rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.rows:  # no rows yet: the first forward starts them
            self.change_rows(torch.arange(self.rows)[indices.cpu() if isinstance(indices, torch.Tensor) else indices]
                             .reshape(-1).tolist())

    def change_rows(self, source: list[int]) -> None:
        """Rebuild the batch so that new row i holds old row source[i]; rollback records are dropped (they hold
        the old rows)."""
        if self.rows:
            self.select_rows(source)
            self.history.clear()

    # ---- rollback ---------------------------------------------------------------------------------------------
    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Keep, for the steps of the last `max_rollback` columns, what each overwrote, so `crop` can undo them.
        transformers >= 5.25 passes how many drafted columns it may remove; a larger count widens
        `max_rollback`."""
        self.recording = True
        if recurrent_states_to_keep is not None:
            self.max_rollback = max(self.max_rollback, int(recurrent_states_to_keep))

    def records_steps_of(self, width: int) -> bool:
        """Whether a step of `width` columns is recorded: while recording, one no longer than `max_rollback` (never
        cropped that far back: no copy of a long prompt is kept, and the records before it are dropped)."""
        if width > self.max_rollback:
            self.history.clear()
        return self.recording and width <= self.max_rollback

    def remember(self, step: StepRecord) -> None:
        """Keep a recorded step, and only as many earlier ones as the last `max_rollback` columns need."""
        self.history.append(step)
        while sum(record.width for record in self.history) - self.history[0].width >= self.max_rollback:
            self.history.popleft()

    def crop(self, max_length: int) -> None:
        """Roll back to `max_length` columns (absolute, > 0) or remove `-max_length` columns (<= 0; 0 removes
        nothing). Exact: every layer's tensors and every row's state return to what they were after those
        columns. Needs recording (activate_past_recording) since before the removed columns were read."""
        max_length = int(max_length)  # generate may pass a 0-d tensor
        target = self.columns + max_length if max_length <= 0 else min(max_length, self.columns)
        if target >= self.columns:
            return
        history = self.history
        if not history or history[-1].columns + history[-1].width != self.columns or history[0].columns > target:
            reason = ("recording is not active (call activate_past_recording before reading them)"
                      if not self.recording else "they are not recorded (only the last max_rollback columns are)")
            raise ValueError(f"{type(self).__name__} cannot remove {self.columns - target} columns: {reason}")
        while history[-1].columns > target:
            self.undo(history.pop())
        step = history.pop()
        self.undo(step)
        if target > step.columns:
            self.redo(step, target - step.columns)
        self.columns = target

    def undo(self, step: StepRecord) -> None:
        """Put back everything a recorded step overwrote, its layers' writes and the rows' state."""
        for layer, record in zip(self.layers, step.layers):
            layer.undo(record)
        for name, value in step.rows.items():
            setattr(self, name, value)
        self.columns = step.columns

    def redo(self, step: StepRecord, keep: int) -> None:
        """Redo the first `keep` columns of an undone step: the model's, where its steps are longer than a
        column."""
        raise NotImplementedError(f"{type(self).__name__} records steps of one column: a crop never falls inside "
                                  "one")
