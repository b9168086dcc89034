"""KVMCache: what a KVM model carries between forward calls.

Rows of a batch advance independently: each row has read its own number of real tokens, so its
chunk boundaries, positions, state length and window follow its own length (padding, where
attention_mask is 0, never enters anything). Rows that have read the same number of tokens form a
`RowGroup` whose per-layer caches hold them as one batch; a forward that gives rows different
numbers of real tokens splits a group. Per KVM layer a group holds the compressed state (key sums,
value sums, value norms or counts) and the block window (keys, values, merge gates not yet folded
into the state); per sliding-window layer the last `sliding_window` keys/values. The token-shift
carries (last real token of each shifted stream) are kept per row for the whole batch.

Window buffers grow geometrically and are compacted rarely, so a decode step writes one token
instead of copying the window; the state changes once per chunk. While recording is active
(assisted decoding), each forward keeps what it replaced, so `crop` rolls back exactly.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import torch
from transformers.cache_utils import Cache

from .configuration_kvm import CACHE_CONFIG_FIELDS, KVMConfig
from .saved_cache import SavedCache, tensors_under
from .step_plan import GroupedStepPlan, RowGroup

CACHE_FORMAT = "kvm-cache"
CACHE_FORMAT_VERSION = 1
TENSORS_FILE = "kvm_cache.safetensors"
META_FILE = "kvm_cache.json"


class TokenBuffer:
    """Contiguous [batch, heads, tokens, dim] tensors for a run of absolute positions.

    `begin`/`end` are the absolute positions held. Appends write in place into spare
    capacity (doubling when full) unless autograd tracks the inputs, in which case the
    buffer is rebuilt functionally so that earlier views stay valid for backward. Positions
    below `end` are never overwritten in place, so a snapshot (storage, offset, begin, end)
    stays valid until the buffer is rolled back past it.
    """

    def __init__(self) -> None:
        self.storage: list[torch.Tensor] | None = None
        self.offset = 0  # storage index of position `begin`
        self.begin = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.begin

    def append(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Add tokens at positions [end, end + n)."""
        tensors = [t for t in tensors if t is not None]
        n = tensors[0].shape[2]
        if self.storage is None:
            self.storage = [t[:, :, :0] for t in tensors]
            self.offset = 0
        live = len(self)
        if any(t.requires_grad for t in tensors) or any(s.requires_grad for s in self.storage):
            self.storage = [torch.cat([s[:, :, self.offset : self.offset + live], t], dim=2)
                            for s, t in zip(self.storage, tensors)]
            self.offset = 0
        else:
            self.reserve(n)
            for s, t in zip(self.storage, tensors):
                s[:, :, self.offset + live : self.offset + live + n] = t
        self.end += n

    def reserve(self, n: int) -> None:
        """Make room to append `n` tokens in place: when the spare capacity is short, copy the live
        tokens into a fresh buffer twice their size plus `n`. Called with a chunk's worth at the end
        of a prefill, so the copy happens there and not in a decoding step."""
        if self.storage is None or any(s.requires_grad for s in self.storage):
            return
        live = len(self)
        if self.offset + live + n <= self.storage[0].shape[2]:
            return
        capacity = max(2 * (live + n), 16)
        grown = []
        for s in self.storage:
            fresh = s.new_empty(s.shape[:2] + (capacity,) + s.shape[3:])
            fresh[:, :, :live] = s[:, :, self.offset : self.offset + live]
            grown.append(fresh)
        self.storage, self.offset = grown, 0

    def view(self, start: int, stop: int) -> list[torch.Tensor]:
        """Views of absolute positions [start, stop)."""
        if not self.begin <= start <= stop <= self.end:
            raise IndexError(f"positions [{start}, {stop}) not held (buffer holds [{self.begin}, {self.end}))")
        lo = self.offset + start - self.begin
        return [s[:, :, lo : lo + stop - start] for s in self.storage]

    def live(self) -> list[torch.Tensor]:
        return [] if self.storage is None else self.view(self.begin, self.end)

    def drop_before(self, position: int) -> None:
        """Forget positions before `position`."""
        position = min(max(position, self.begin), self.end)
        self.offset += position - self.begin
        self.begin = position

    def start_at(self, position: int) -> None:
        """Position the (empty) buffer at absolute `position`."""
        self.begin = self.end = position

    def snapshot(self) -> tuple:
        return (None if self.storage is None else list(self.storage), self.offset, self.begin, self.end)

    def restore(self, snapshot: tuple) -> None:
        storage, self.offset, self.begin, self.end = snapshot
        self.storage = None if storage is None else list(storage)

    def load(self, tensors: list[torch.Tensor], begin: int) -> None:
        self.storage = [t.contiguous() for t in tensors] if tensors else None
        self.offset, self.begin = 0, begin
        self.end = begin + (tensors[0].shape[2] if tensors else 0)

    def nbytes(self) -> int:
        if self.storage is None:
            return 0
        return sum(s[:, :, :1].numel() * s.element_size() for s in self.storage) * len(self)

    def take_rows(self, index) -> "TokenBuffer":
        """A buffer holding rows `index` (a slice or index tensor) of this one."""
        taken = TokenBuffer()
        taken.load([t[index] for t in self.live()], self.begin)
        taken.end = self.end
        return taken


class ShiftCarries:
    """Last real token of each token-shifted stream of one layer (attention q/k/v/x, FFN input), per row.

    Rows that have not read a token yet hold zeros. While recording, `journal` keeps each stream's
    whole input of the current forward so that a crop can pick the carry at any of its tokens.
    """

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.journal: dict[str, torch.Tensor] | None = None

    def get(self, name: str) -> torch.Tensor | None:
        return self.values.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        """`value` [B, 1, D]: the new carry (data, detached, as in the research cache)."""
        self.values[name] = value.detach()

    def record(self, name: str, sequence: torch.Tensor) -> None:
        if self.journal is not None:
            self.journal[name] = sequence.detach()

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())

    def map_batch(self, fn) -> None:
        self.values = {k: fn(v) for k, v in self.values.items()}


class KVMLayerCache:
    """State and block window of one KVM layer for one group of rows."""

    is_sliding = False

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window = TokenBuffer()  # keys, values, merge gates (if gated)
        self.state_keys: torch.Tensor | None = None  # sums of layer-normed, rotary-zeroed keys
        self.state_values: torch.Tensor | None = None  # sums of values
        self.state_norms: torch.Tensor | None = None  # float32 slot value norms, or merge counts
        self.read_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # attention-ready state
        self.normed_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # (state keys, their layer norm)
        self.merged_blocks = 0  # blocks j >= 1 already folded into the state
        self.seen = 0
        self.journal: dict | None = None  # what the current forward did, while recording
        self.pending_fold = None  # the next fold, computed ahead by decoding forwards (runtime_kvm.PacedFold)

    @property
    def state_len(self) -> int:
        return 0 if self.state_keys is None else self.state_keys.shape[2]

    def __repr__(self) -> str:
        return f"KVMLayerCache(seen={self.seen}, state_slots={self.state_len}, window_tokens={len(self.window)})"

    def set_state(self, keys: torch.Tensor, values: torch.Tensor, norms: torch.Tensor) -> None:
        self.state_keys, self.state_values, self.state_norms = keys, values, norms
        self.read_cache = None
        self.pending_fold = None  # it started from the state just replaced

    def state(self) -> tuple:
        return (self.state_keys, self.state_values, self.state_norms)

    def normed_state_keys(self) -> torch.Tensor | None:
        """The layer-normed state keys computed to read the current state, if they were."""
        if self.normed_keys is not None and self.normed_keys[0] is self.state_keys:
            return self.normed_keys[1]
        return None

    def note_state_change(self, position: int, kind: str, before_len: int = 0, stop: int = 0) -> None:
        """While recording: the state after a fold ('fold', valid once `position` is read) or after
        first-chunk tokens [position, stop) entered it one slot each ('initial')."""
        if self.journal is not None:
            self.journal["events"].append((position, kind, before_len, stop, self.state(), self.merged_blocks))

    def nbytes(self) -> int:
        state = sum(t.numel() * t.element_size() for t in self.state() if t is not None)
        return state + self.window.nbytes()

    def take_rows(self, index) -> "KVMLayerCache":
        taken = KVMLayerCache()
        taken.window = self.window.take_rows(index)
        if self.state_keys is not None:
            taken.set_state(*(t[index] for t in self.state()))
        taken.merged_blocks, taken.seen = self.merged_blocks, self.seen
        return taken

    def snapshot(self) -> tuple:
        return (self.seen, self.merged_blocks, self.state(), self.read_cache, self.window.snapshot())

    def restore(self, snapshot: tuple) -> None:
        self.seen, self.merged_blocks, state, self.read_cache, window = snapshot
        self.state_keys, self.state_values, self.state_norms = state
        self.pending_fold = None  # its block may have been replaced
        self.window.restore(window)

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {f"window.{i}": t for i, t in enumerate(self.window.live())}
        if self.state_keys is not None:
            named.update(state_keys=self.state_keys, state_values=self.state_values, state_norms=self.state_norms)
        return named

    def load(self, tensors: dict, meta: dict) -> None:
        window = [tensors[f"window.{i}"] for i in range(len([k for k in tensors if k.startswith("window.")]))]
        self.window.load(window, meta["window_begin"])
        if "state_keys" in tensors:
            self.set_state(tensors["state_keys"], tensors["state_values"], tensors["state_norms"])
        self.seen, self.merged_blocks = meta["seen"], meta["merged_blocks"]


class SlidingWindowLayerCache:
    """Last `sliding_window` keys/values of one sliding-window layer for one group of rows."""

    is_sliding = True

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window = TokenBuffer()
        self.seen = 0
        self.merged_blocks = 0
        self.journal: dict | None = None

    @property
    def state_len(self) -> int:
        return -1

    def __repr__(self) -> str:
        return f"SlidingWindowLayerCache(seen={self.seen}, window_tokens={len(self.window)})"

    def nbytes(self) -> int:
        return self.window.nbytes()

    def take_rows(self, index) -> "SlidingWindowLayerCache":
        taken = SlidingWindowLayerCache()
        taken.window, taken.seen = self.window.take_rows(index), self.seen
        return taken

    def snapshot(self) -> tuple:
        return (self.seen, self.window.snapshot())

    def restore(self, snapshot: tuple) -> None:
        self.seen, window = snapshot
        self.window.restore(window)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"window.{i}": t for i, t in enumerate(self.window.live())}

    def load(self, tensors: dict, meta: dict) -> None:
        self.window.load([tensors[f"window.{i}"] for i in range(len(tensors))], meta["window_begin"])
        self.seen = meta["seen"]


def new_layer_cache(config: KVMConfig, layer_idx: int):
    return SlidingWindowLayerCache() if config.is_sliding_window_layer(layer_idx) else KVMLayerCache()


class ForwardRecord:
    """What one recorded forward replaced (layer snapshots, carries, columns) and did (journals)."""

    def __init__(self, cache: "KVMCache", length: int) -> None:
        self.columns = cache.columns
        self.length = length
        self.groups = [(group.rows, [layer.snapshot() for layer in group.layers]) for group in cache.groups]
        self.carries = [dict(c.values) for c in cache.carries]
        self.valid: torch.Tensor | None = None  # the forward's real tokens (None: all)
        self.journals: list | None = None  # per layer (layer journal, carries journal), single-group forwards only


class KVMCache(SavedCache, Cache):
    """Cache of a KVM model; created by the model (`generate` or a forward with use_cache).

    `get_seq_length()` counts columns (padding included), as generate() slices its inputs by it;
    each row's own token count is in `row_lengths()`.
    """

    MODEL_NAME = "KVM"
    CACHE_FORMAT, CACHE_FORMAT_VERSION = CACHE_FORMAT, CACHE_FORMAT_VERSION
    TENSORS_FILE, META_FILE = TENSORS_FILE, META_FILE
    CACHE_CONFIG_FIELDS = CACHE_CONFIG_FIELDS

    def __init__(self, config: KVMConfig, max_rollback: int = 256, **kwargs) -> None:
        super().__init__(layers=[])
        self.config = config
        self.fingerprint = self.config_fingerprint(config)
        self.max_rollback = max_rollback
        self.groups: list[RowGroup] = []
        self.carries = [ShiftCarries() for _ in range(config.num_hidden_layers)]
        self.columns = 0
        self.rows = 0
        self.recording = False
        self.history: deque[ForwardRecord] = deque()

    # ---- what the model uses ----------------------------------------------------------------
    def plan(self, batch: int, length: int, valid: torch.Tensor | None, device) -> GroupedStepPlan:
        """Start rows on the first forward, check the batch size after; split groups by this forward's
        per-row token counts; record what the forward will replace while recording."""
        if not self.groups:
            self.rows = batch
            self.groups = [RowGroup(list(range(batch)), [new_layer_cache(self.config, i)
                                                         for i in range(self.config.num_hidden_layers)])]
        elif batch != self.rows:
            raise ValueError(f"the cache holds {self.rows} rows but the inputs have {batch}; "
                             "use reorder_cache/batch_select_indices/batch_repeat_interleave to change it")
        if self.recording:
            self._record(length, valid, single=len(self.groups) == 1)
        plan = GroupedStepPlan(batch, length, valid, self.groups, device)
        self.groups = plan.groups
        return plan

    def finish(self, plan: GroupedStepPlan) -> None:
        self.columns += plan.length
        if plan.length > 1 and not torch.is_grad_enabled():  # decoding steps that follow write windows in place
            for group in self.groups:
                for layer in group.layers:
                    if not layer.is_sliding:
                        layer.window.reserve(self.config.chunk_size)
        record = self.history[-1] if self.recording and self.history else None
        if record is not None and record.journals is not None and len(self.groups) == 1:
            layers = self.groups[0].layers
            record.journals = [(layer.journal, carries.journal) for layer, carries in zip(layers, self.carries)]
        elif record is not None:
            record.journals = None  # rows read different numbers of tokens: only the whole forward can be undone
        for group in self.groups:
            for layer in group.layers:
                layer.journal = None
        for carries in self.carries:
            carries.journal = None

    def layer_caches(self, layer_idx: int, plan: GroupedStepPlan) -> list:
        return [segment.group.layers[layer_idx] for segment in plan.segments]

    # ---- what generate() asks ---------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        """Crop rolls back only what was recorded (activate_past_recording)."""
        return self.recording

    @property
    def is_initialized(self) -> bool:
        return self.columns > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [self.config.is_sliding_window_layer(i) for i in range(self.config.num_hidden_layers)]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.config.num_hidden_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.config.num_hidden_layers

    @property
    def batch_size(self) -> int:
        return self.rows if self.groups else -1

    def __len__(self) -> int:
        return self.config.num_hidden_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns read so far (padding included)."""
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def row_lengths(self) -> list[int]:
        """Real tokens each row has read."""
        lengths = [0] * self.rows
        for group in self.groups:
            for row in group.rows:
                lengths[row] = group.seen
        return lengths

    def row_state_lengths(self) -> list[list[int]]:
        """State slots per row and layer (-1 for sliding-window layers)."""
        lengths = [[]] * self.rows
        for group in self.groups:
            for row in group.rows:
                lengths[row] = [layer.state_len for layer in group.layers]
        return lengths

    def state_lengths(self) -> list[int]:
        """State slots per layer, the largest over rows (-1 for sliding-window layers)."""
        per_row = self.row_state_lengths()
        if not per_row:
            return [-1 if s else 0 for s in self.is_sliding]
        return [max(column) for column in zip(*per_row)]

    def layer_lengths(self) -> list[int]:
        """Entries per layer for monitors: state slots (KVM layers) or window tokens (sliding-window layers)."""
        lengths = []
        for i, sliding in enumerate(self.is_sliding):
            sizes = [len(g.layers[i].window) if sliding else g.layers[i].state_len for g in self.groups]
            lengths.append(max(sizes, default=0))
        return lengths

    def nbytes(self) -> int:
        """Bytes of the tensors the cache holds (live data, not spare buffer capacity or rollback records)."""
        layers = sum(layer.nbytes() for group in self.groups for layer in group.layers)
        return layers + sum(c.nbytes() for c in self.carries)

    def reset(self) -> None:
        self.__init__(self.config, self.max_rollback)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """New row i is old row beam_idx[i] (beam search)."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(self.rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.arange(self.rows)[indices.cpu() if isinstance(indices, torch.Tensor) else indices]
                          .reshape(-1).tolist())

    def _select_rows(self, source: list[int]) -> None:
        """Rebuild the batch so that new row i holds old row source[i] (rollback records are dropped)."""
        if not self.groups:
            return
        location = {row: (g, local) for g, group in enumerate(self.groups) for local, row in enumerate(group.rows)}
        picked: dict[int, tuple[list[int], list[int]]] = {}
        for new_row, old_row in enumerate(source):
            g, local = location[old_row]
            picked.setdefault(g, ([], []))[0].append(local)
            picked[g][1].append(new_row)
        self.groups = sorted((self.groups[g].take(local, rows) for g, (local, rows) in picked.items()),
                             key=lambda group: group.rows[0])
        for carries in self.carries:
            carries.map_batch(lambda t: t.index_select(0, torch.tensor(source, device=t.device)))
        self.rows = len(source)
        self.history.clear()

    # ---- rollback -----------------------------------------------------------------------------
    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Keep, for the forwards of the last `max_rollback` columns, what each replaced, so `crop` can undo them.
        transformers >= 5.25 passes how many drafted columns it may remove; a larger count widens `max_rollback`."""
        self.recording = True
        if recurrent_states_to_keep is not None:
            self.max_rollback = max(self.max_rollback, int(recurrent_states_to_keep))

    def _record(self, length: int, valid: torch.Tensor | None, single: bool) -> None:
        if length > self.max_rollback:
            self.history.clear()  # never cropped that far back: keep no copy of a long prompt
            return
        record = ForwardRecord(self, length)
        record.valid = valid
        if single:
            record.journals = []
            for layer in self.groups[0].layers:
                layer.journal = {"inputs": None, "events": []}
            for carries in self.carries:
                carries.journal = {}
        self.history.append(record)
        while sum(r.length for r in self.history) - self.history[0].length >= self.max_rollback:
            self.history.popleft()

    def crop(self, max_length: int) -> None:
        """Roll back to `max_length` columns (absolute, > 0) or remove `-max_length` columns (<= 0; 0 removes
        nothing). Exact: state, window, carries and lengths return to what they were after those columns.
        Needs recording (activate_past_recording) since before the removed columns were read."""
        max_length = int(max_length)  # generate may pass a 0-d tensor
        target = self.columns + max_length if max_length <= 0 else min(max_length, self.columns)
        if target >= self.columns:
            return
        history = self.history
        if not history or history[-1].columns + history[-1].length != self.columns or history[0].columns > target:
            reason = ("recording is not active (call activate_past_recording before reading them)" if not self.recording
                      else "they are not recorded (only the last max_rollback columns are)")
            raise ValueError(f"KVMCache cannot remove {self.columns - target} columns: {reason}")
        while history[-1].columns > target:
            history.pop()
        record = history.pop()
        keep = target - record.columns
        if keep and (record.journals is None or (record.valid is not None
                                                 and record.valid[:, :keep].sum(dim=1).unique().numel() > 1)):
            raise ValueError(f"KVMCache cannot remove {self.columns - target} columns: rows read different numbers "
                             "of real tokens in the forward that read them; only that whole forward can be removed")
        self._restore(record)
        if keep:
            self._replay(record, keep)
            record.length = keep  # its journal replays any shorter prefix too
            history.append(record)
        self.columns = target

    def _restore(self, record: ForwardRecord) -> None:
        self.groups = []
        for rows, snapshots in record.groups:
            layers = [new_layer_cache(self.config, i) for i in range(len(snapshots))]
            for layer, snapshot in zip(layers, snapshots):
                layer.restore(snapshot)
            self.groups.append(RowGroup(rows, layers))
        for carries, values in zip(self.carries, record.carries):
            carries.values = dict(values)
        self.columns = record.columns

    def _replay(self, record: ForwardRecord, keep: int) -> None:
        """Redo the first `keep` columns of a recorded single-group forward from its journal (no model needed)."""
        chunk, window_chunks = self.config.chunk_size, self.config.window_chunks
        if record.valid is None:
            real, last_column = keep, None
        else:
            kept = record.valid[:, :keep]
            real = int(kept[0].sum())
            steps = torch.arange(1, keep + 1, device=kept.device)
            last_column = torch.where(kept, steps, 0).amax(dim=1)  # 1 + last real kept column, 0: none
        for layer, carries, (journal, carry_journal) in zip(self.groups[0].layers, self.carries, record.journals):
            for name, sequence in carry_journal.items():
                if last_column is None:
                    carries.values[name] = sequence[:, keep - 1 : keep]
                else:
                    old = carries.values.get(name, sequence.new_zeros(sequence.shape[0], 1, sequence.shape[-1]))
                    source = torch.cat([old.to(sequence.dtype), sequence], dim=1)
                    index = last_column.to(sequence.device)[:, None, None].expand(-1, 1, sequence.shape[-1])
                    carries.values[name] = source.gather(1, index)
            if real == 0:
                continue
            start = layer.seen
            stop = start + real
            inputs = journal["inputs"]
            layer.window.append([t[:, :, :real] if t is not None else None for t in inputs])
            if layer.is_sliding:
                layer.window.drop_before(stop - self.config.sliding_window_size)
            else:
                last_chunk = (stop - 1) // chunk
                layer.window.drop_before(max(0, last_chunk + 1 - window_chunks) * chunk)
                for position, kind, before_len, end, state, merged in journal["events"]:
                    if position >= stop:
                        break
                    if kind == "initial" and stop < end:
                        state = tuple(t[:, :, : before_len + stop - position] for t in state)
                    layer.set_state(*state)
                    layer.merged_blocks = merged
            layer.seen = stop

    def update(self, *args, **kwargs):
        raise NotImplementedError("KVMCache is updated by the KVM layers themselves, not through Cache.update().")

    def get_mask_sizes(self, *args, **kwargs):
        raise NotImplementedError("KVMCache builds its own attention masks.")

    def offload(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache does not support offloading.")

    def prefetch(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache does not support offloading.")

    # ---- saved caches ("prompt caching") ------------------------------------------------------
    def saved_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The tensors and JSON fields `save` writes."""
        if not self.groups or self.columns == 0:
            raise ValueError("the cache is empty: read some tokens before saving it")
        tensors, groups = {}, []
        for g, group in enumerate(self.groups):
            layers = []
            for i, layer in enumerate(group.layers):
                tensors.update({f"groups.{g}.layers.{i}.{name}": t for name, t in layer.tensors().items()})
                layers.append({"seen": layer.seen, "merged_blocks": layer.merged_blocks,
                               "window_begin": layer.window.begin})
            groups.append({"rows": group.rows, "layers": layers})
        for i, carries in enumerate(self.carries):
            tensors.update({f"carries.{i}.{name}": t for name, t in carries.values.items()})
        dtype = next(iter(tensors.values())).dtype
        fields = {"columns": self.columns, "batch_size": self.rows, "dtype": str(dtype).removeprefix("torch."),
                  "groups": groups}
        return tensors, fields

    @classmethod
    def from_saved(cls, config: KVMConfig, meta: dict, tensors: dict[str, torch.Tensor], dtype) -> "KVMCache":
        """The cache `saved_state` described (its tensors keep their saved dtypes)."""
        cache = cls(config)
        cache.columns, cache.rows = meta["columns"], meta["batch_size"]
        for g, group_meta in enumerate(meta["groups"]):
            layers = []
            for i, layer_meta in enumerate(group_meta["layers"]):
                layer = new_layer_cache(config, i)
                layer.load(tensors_under(tensors, f"groups.{g}.layers.{i}."), layer_meta)
                layers.append(layer)
            cache.groups.append(RowGroup(group_meta["rows"], layers))
        for i, carries in enumerate(cache.carries):
            carries.values = tensors_under(tensors, f"carries.{i}.")
        return cache

    def __repr__(self) -> str:
        return (f"KVMCache(columns={self.columns}, rows={self.rows}, groups={len(self.groups)}, "
                f"nbytes={self.nbytes()})")
