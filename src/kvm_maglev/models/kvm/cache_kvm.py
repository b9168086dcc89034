"""KVMCache: what a KVM model carries between forward calls, one layer object per decoder layer (`cache.layers`).

Every row of a batch is at its own position, the number of real tokens it has read (padding never enters
anything), and a forward may advance rows by different numbers of tokens. Per row, a KVM layer holds its block
window as a ring (keys, values and merge gates of positions `window_start(n)` .. n - 1, position p in slot
p % window_size), its state (key sums, value sums, value norms or counts) padded to a capacity, the state's
attention-ready form (recomputed only when the state changes, once per chunk), and the token-shift carries (the
last real token of each shifted stream); a sliding-window layer its ring of the last `sliding_window` keys and
values and its carries. How much of each is live follows from the row's position (state_kvm's one rule).

A layer's tensors are addressed by row (`RowStorage`): generate()'s cache owns dense tensors with one storage row
per batch row; a serving engine binds its own per-request pages (`KVMCache.over_pages`) and the same layer code
reads and writes them in place. While recording (assisted decoding) every write keeps what it replaced and each
forward keeps what it computed, so `crop` rolls back exactly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers.cache_utils import Cache

from ..common.row_storage import RowCacheLayer
from ..common.saved_cache import SavedCache, tensors_under
from ..common.step_plan import RowTokens
from .configuration_kvm import (
    CACHE_CONFIG_FIELDS,
    KVMConfig,
    folded_blocks,
    slots_after_folds,
    state_slots_after,
    window_start,
)
from .runtime_kvm import PacedFold, paces_folds
from .state_kvm import Fold, block_fold, readable_state, run_fold

CACHE_FORMAT = "kvm-cache"
CACHE_FORMAT_VERSION = 2  # 2: per-row positions and window rings (no row groups)
TENSORS_FILE = "kvm_cache.safetensors"
META_FILE = "kvm_cache.json"
WINDOW = ("window_keys", "window_values", "window_gates")
STATE = ("state_keys", "state_values", "state_norms")
READ = ("read_keys", "read_values")


@dataclass
class LayerJournal:
    """What one recorded forward did in one layer: its new keys/values/gates, each state it computed (the rows,
    the state and its read form, and how many of the row's tokens it follows), and the token-shift inputs."""

    inputs: tuple | None = None
    first_chunk: tuple | None = None  # (rows, slots, state + read form slot values) of the first-chunk tokens
    states: list = field(default_factory=list)  # (rows, the token count from which each holds, state + read form)
    shifts: dict = field(default_factory=dict)  # stream -> [tokens, width] inputs


class RingLayer(RowCacheLayer):
    """What both kinds of layer hold, on transformers' cache-layer API (`RowCacheLayer`): a ring of the newest keys
    and values (position p in slot p % ring size), the token-shift carries, and how a decoding step writes its
    token and reads what attention needs (`update`)."""

    is_sliding = False
    ring_names = WINDOW  # the ring tensors a decoding step writes (merge gates: when the layer has them)
    read_names = READ  # the state tensors its attention reads beside the ring (none for a sliding layer)

    def __init__(self, config: KVMConfig, layer_idx: int, ring_size: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.ring_size = config, layer_idx, ring_size
        self.journal: LayerJournal | None = None

    def reset(self) -> None:
        super().reset()
        self.journal, self.pending = None, None

    def update(self, keys: torch.Tensor, values: torch.Tensor, gates: torch.Tensor | None, step,
               entering: tuple | None = None) -> tuple:
        """A decoding step's token (keys [B, Hkv, D], values, merge gates or None) into each row's ring slot and,
        for rows still in their first chunk, `entering` (its state slot and read form, one slot) into slot
        `position`; returns what the step's attention reads: the page of each row (None: row i is storage row
        i), the state's read keys and values (empty for a sliding layer) and the ring's keys and values."""
        rows = step.rows if self.index is None else self.index
        slot = step.sliding_slot if self.is_sliding else step.ring_slot
        for name, new in zip(self.ring_names, (keys, values, gates)):
            if new is not None:
                self.tensors[name][rows, :, slot] = new.to(self.tensors[name].dtype)
        if entering is not None:
            slot, keep = torch.where(step.first_chunk, step.position, 0), ~step.first_chunk[:, None, None]
            for name, new in zip(STATE + READ, entering):
                tensor = self.tensors[name]
                tensor[rows, :, slot] = torch.where(keep, tensor[rows, :, slot], new.to(tensor.dtype))
        # the rows' own storage when it is theirs (dense, or consecutive pages: a view), else every page and the
        # rows' page index; an eager step reads only the slots some row reads, a traced one all (fixed shapes)
        page = self.index if self.index is not None and self.run is None else None
        read = [page]
        for name in self.read_names + WINDOW[:2]:
            tensor = self.tensors[name] if self.run is None else self.tensors[name][self.run]
            kind = "state" if name in READ else "sliding" if self.is_sliding else "window"
            read.append(tensor if torch.compiler.is_compiling() else tensor[:, :, :step.reach[kind]])
        return tuple(read)


class KVMCacheLayer(RingLayer):
    """One KVM layer's storage: window ring (WINDOW), state (STATE, padded), its read form (READ), carries; and the
    state's updates a decoding step makes before its forward: folding the blocks that leave the window
    (`fold_due`), computing the next fold ahead (`fold_ahead`, runtime_kvm's paced fold)."""

    def __init__(self, config: KVMConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, config.window_size)
        self.pending = None  # the next fold, computed ahead by decoding forwards (runtime_kvm.PacedFold)

    # A forward on dense storage computes the next fold ahead (runtime_kvm.paces_folds says when); False folds at the
    # chunk boundary instead (the same tensors).
    paced_folds = True

    def live_slots(self, seen: int) -> int:
        return state_slots_after(self.config, seen)

    def live_window(self, seen: int) -> int:
        return seen - window_start(self.config, False, seen)

    def ensure_state(self, rows: int, capacity: int, like: dict[str, tuple]) -> None:
        """Dense storage: room for `capacity` slots (`like`: name -> (heads, dim, dtype, device) of new tensors)."""
        for name, (heads, dim, dtype, device) in like.items():
            self.ensure(name, rows, (heads, capacity, dim), dtype, device)

    def read_form(self, state: tuple, normalize, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention-ready form of a (padded) state; `normalize`: the layer's state-key norm."""
        return readable_state(state, normalize(state[0]), self.config.state_value_norms, dtype)

    def ring_fold(self, rows: torch.Tensor | None, blocks: list[int], slots: list[int], appends: list[int],
                  capacity: int, normalize) -> Fold:
        """The fold of window block `blocks[i]` of storage row `rows[i]` (None: every row), its tokens all in the
        ring, into the stored state (`slots[i]` live, `appends[i]` to append, padded to `capacity`)."""
        chunk, device = self.config.chunk_size, self.tensors["window_keys"].device
        steps = torch.arange(chunk, device=device)
        ring_slots = (torch.tensor(blocks, device=device)[:, None] * chunk + steps) % self.ring_size
        tokens = []
        for name in WINDOW if "window_gates" in self.tensors else WINDOW[:2]:
            ring = self.read(name, rows)
            tokens.append(ring.gather(2, ring_slots[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3])))
        state = tuple(fit_slots(self.read(name, rows), capacity) for name in STATE)
        live = torch.tensor(slots, dtype=torch.long, device=device)
        return block_fold(self.config, normalize, state, live, tokens, appends, state[0].dtype)

    def fold_due(self, seen: list[int], folding: dict[int, int], normalize) -> None:
        """Before a decoding step of rows at `seen`: fold the blocks `folding` (row -> block) into their rows'
        states - the fold computed ahead when it is this one - and advance the next fold computed ahead."""
        dtype = self.tensors["window_keys"].dtype
        if folding:
            due, blocks = list(folding), list(folding.values())
            table = slots_after_folds(self.config, max(blocks))
            capacity = max(table[block] for block in blocks)
            rows = torch.tensor(due, dtype=torch.long, device=self.tensors["window_keys"].device)
            ahead = self.take_fold_ahead(blocks, due, capacity)
            if ahead is None:
                state = run_fold(self.ring_fold(rows, blocks, [table[block - 1] for block in blocks],
                                                [table[block] - table[block - 1] for block in blocks], capacity,
                                                normalize))
                ahead = state, self.read_form(state, normalize, dtype)
            self.store(rows, len(seen), capacity, ahead[0] + ahead[1])
        self.fold_ahead(seen, [1] * len(seen), normalize, dtype)

    def store(self, rows: torch.Tensor, batch: int, capacity: int, tensors: tuple) -> None:
        """States and their read forms (STATE + READ order) into storage rows `rows`, room made in dense storage."""
        like = {name: (t.shape[1], t.shape[3], t.dtype, t.device) for name, t in zip(STATE + READ, tensors)}
        self.ensure_state(batch, capacity, like)
        for name, tensor in zip(STATE + READ, tensors):
            self.write(name, rows, tensor.detach())

    def fold_ahead(self, starts: list[int], counts: list[int], normalize, dtype: torch.dtype) -> None:
        """When folds are paced (runtime_kvm.paces_folds), after a forward of rows that stood at `starts` and read
        `counts` tokens (or before a decoding step), all at one position: start or advance the fold of the block
        that leaves the window at the next chunk boundary, one stage every `stride` decoding steps, or all of it
        after a multi-token forward (a prefill). With two or more window chunks the block and the state it folds
        into are final a chunk ahead."""
        config, seen = self.config, starts[0] + counts[0]
        if (not paces_folds(self) or config.window_chunks < 2 or not seen or len(set(starts)) > 1
                or len(set(counts)) > 1):
            return
        block = (seen - 1) // config.chunk_size + 1 - config.window_chunks
        if block < 1 or folded_blocks(config, seen) != block - 1:
            return
        if self.pending is None or self.pending.block != block:
            table, rows = slots_after_folds(config, block), len(starts)
            whole = self.ring_fold(None, [block] * rows, [table[-2]] * rows, [table[-1] - table[-2]] * rows,
                                   table[-1], normalize)
            self.pending = PacedFold(whole, partial(self.read_form, normalize=normalize, dtype=dtype), block,
                                     config.chunk_size)
        if counts[0] > 1:
            self.pending.finish()
        elif not self.pending.done and seen % self.pending.stride == 0:
            self.pending.run_next_stage()

    def take_fold_ahead(self, blocks: list[int], rows: list[int], capacity: int) -> tuple | None:
        """The state and read form of the fold computed ahead when it is the one due (`rows` folding `blocks`:
        every row its block, at this capacity), else None (the caller folds now). It is used once."""
        pending = self.pending
        if pending is None or pending.capacity != capacity or set(blocks) != {pending.block} \
                or rows != list(range(self.tensors["window_keys"].shape[0])):
            return None
        pending.finish()
        self.pending = None
        return tuple(pending.state), tuple(pending.read)

    def make_room_for_first_chunk(self, seen: list[int]) -> None:
        """Dense storage: state room for the first-chunk slot a row at `seen` enters with its next token (an
        engine's pages have room for a whole request)."""
        entering = [p + 1 for p in seen if p < self.config.chunk_size]
        if entering and self.index is None:
            like = {name: (self.tensors[name].shape[1], self.tensors[name].shape[3], self.tensors[name].dtype,
                           self.tensors[name].device) for name in STATE + READ}
            self.ensure_state(len(seen), max(entering), like)


class SlidingWindowCacheLayer(RingLayer):
    """One sliding-window layer's storage: its ring of the last `sliding_window` keys and values, carries."""

    is_sliding = True
    ring_names, read_names = WINDOW[:2], ()
    pending = None  # no state, no fold

    def __init__(self, config: KVMConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, config.sliding_window_size)

    def live_slots(self, seen: int) -> int:
        return -1

    def live_window(self, seen: int) -> int:
        return seen - window_start(self.config, True, seen)


def fit_slots(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """`tensor` [r, H, S, d] cut or zero-padded to `slots` slots."""
    if tensor.shape[2] >= slots:
        return tensor[:, :, :slots]
    return torch.nn.functional.pad(tensor, (0, 0, 0, slots - tensor.shape[2]))


def new_cache_layer(config: KVMConfig, layer_idx: int) -> RingLayer:
    cls = SlidingWindowCacheLayer if config.is_sliding_window_layer(layer_idx) else KVMCacheLayer
    return cls(config, layer_idx)


@dataclass
class ForwardRecord:
    """One recorded forward: where the rows stood before it, its tokens, and each layer's writes and journal."""

    seen: list[int]
    columns: int
    tokens: RowTokens
    replaced: list = field(default_factory=list)  # per layer: what its writes replaced
    journals: list = field(default_factory=list)  # per layer: LayerJournal


class KVMCache(SavedCache, Cache):
    """Cache of a KVM model; created by the model (`generate` or a forward with use_cache).

    `layers[i]` is decoder layer i's storage. `get_seq_length()` counts columns (padding included), as generate()
    slices its inputs by it; each row's own token count is in `row_lengths()`.
    """

    MODEL_NAME = "KVM"
    CACHE_FORMAT, CACHE_FORMAT_VERSION = CACHE_FORMAT, CACHE_FORMAT_VERSION
    TENSORS_FILE, META_FILE = TENSORS_FILE, META_FILE
    CACHE_CONFIG_FIELDS = CACHE_CONFIG_FIELDS

    def __init__(self, config: KVMConfig, max_rollback: int = 256, **kwargs) -> None:
        super().__init__(layers=[new_cache_layer(config, i) for i in range(config.num_hidden_layers)])
        self.config = config
        self.fingerprint = self.config_fingerprint(config)
        self.max_rollback = max_rollback
        self.seen: list[int] = []  # real tokens each row has read
        self.columns = 0
        self.rows = 0
        self.paged = False
        self.recording = False
        self.history: deque[ForwardRecord] = deque()
        self.prepared_step = None  # the next forward's `Step`, prepared before it (`KVMModel.prepare_step`)

    @classmethod
    def over_pages(cls, config: KVMConfig, pages: list[dict[str, torch.Tensor]], index: list[torch.Tensor],
                   seen: list[int]) -> KVMCache:
        """A cache whose layers read and write a serving engine's pages in place: `pages[i]` are layer i's page
        tensors (named as the layers name them, [pages, ...]), `index[i]` the page of each row in them, `seen`
        each row's position."""
        cache = cls(config)
        for layer, tensors, pages_of_rows in zip(cache.layers, pages, index):
            layer.bind(tensors, pages_of_rows)
        cache.seen, cache.rows, cache.paged = list(seen), len(seen), True
        return cache

    # ---- what the model uses ----------------------------------------------------------------------------
    def row_starts(self, batch: int) -> list[int]:
        """Where each of a forward's `batch` rows stands (all at 0 on the first forward); another batch size than
        the cache holds is refused."""
        if not self.rows:
            return [0] * batch
        if batch != self.rows:
            raise ValueError(f"the cache holds {self.rows} rows but the inputs have {batch}; "
                             "use reorder_cache/batch_select_indices/batch_repeat_interleave to change it")
        return list(self.seen)

    def prepare(self, tokens: RowTokens) -> None:
        """Before a forward over `tokens`: start rows on the first forward, check the batch after; empty the
        storage of rows that start over on used pages; open the journals while recording."""
        self.row_starts(tokens.batch)
        if not self.rows:
            self.rows, self.seen = tokens.batch, [0] * tokens.batch
        if self.paged:
            fresh = [row for row, (start, count) in enumerate(zip(tokens.starts, tokens.counts)) if not start and count]
            if fresh:
                index = torch.tensor(fresh, device=tokens.device)
                for layer in self.layers:
                    layer.zero_rows(index)
        if self.recording:
            self._record(tokens)

    def take_prepared_step(self):
        """The step prepared for the next forward (None: none), which that forward takes."""
        step, self.prepared_step = self.prepared_step, None
        return step

    def count_decoding_step(self) -> None:
        """Every row reads one more token (a decoding step, whose forward then needs no bookkeeping)."""
        self.seen = [seen + 1 for seen in self.seen]
        self.columns += 1

    def finish_forward(self, tokens: RowTokens, columns: int) -> None:
        """After a forward: each row has read its tokens; the journals close."""
        self.seen = [start + count for start, count in zip(tokens.starts, tokens.counts)]
        self.columns += columns
        for layer in self.layers:
            layer.replaced, layer.journal = None, None

    # ---- what generate() asks -----------------------------------------------------------------------------
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

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns read so far (padding included)."""
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def row_lengths(self) -> list[int]:
        """Real tokens each row has read."""
        return list(self.seen)

    def row_state_lengths(self) -> list[list[int]]:
        """State slots per row and layer (-1 for sliding-window layers)."""
        return [[layer.live_slots(seen) for layer in self.layers] for seen in self.seen]

    def state_lengths(self) -> list[int]:
        """State slots per layer, the largest over rows (-1 for sliding-window layers)."""
        return [max((layer.live_slots(seen) for seen in self.seen), default=-1 if layer.is_sliding else 0)
                for layer in self.layers]

    def layer_lengths(self) -> list[int]:
        """Entries per layer for monitors: state slots (KVM layers) or window tokens (sliding-window layers)."""
        return [max(((layer.live_window(seen) if layer.is_sliding else layer.live_slots(seen)) for seen in self.seen),
                    default=0) for layer in self.layers]

    def row_tensors(self, row: int) -> list[torch.Tensor]:
        """What the cache holds for one row, live entries only, the window in position order: per layer its
        window, state and carries (for comparing caches row by row)."""
        seen, out = self.seen[row], []
        index = torch.tensor([row])
        for layer in self.layers:
            begin = seen - layer.live_window(seen)
            slots = (torch.arange(begin, seen) % layer.ring_size)
            for name in sorted(layer.tensors):
                tensor = layer.read(name, index)
                if name in WINDOW:
                    out.append(tensor[:, :, slots])
                elif name in STATE or name in READ:
                    out.append(tensor[:, :, :layer.live_slots(seen)])
                elif seen:
                    out.append(tensor)
        return out

    def nbytes(self) -> int:
        """Bytes of the live data the cache holds: each row's window tokens, state slots and carries (not spare
        capacity, not the state's read form, not rollback records)."""
        total = 0
        for layer in self.layers:
            for name, tensor in layer.tensors.items():
                if name in READ:
                    continue
                per_entry = tensor[0].numel() * tensor.element_size()
                if name in WINDOW or name in STATE:
                    per_entry //= tensor.shape[2]
                for seen in self.seen:
                    if not seen:
                        continue
                    if name in WINDOW:
                        total += per_entry * layer.live_window(seen)
                    elif name in STATE:
                        total += per_entry * layer.live_slots(seen)
                    else:
                        total += per_entry
        return total

    def reset(self) -> None:
        self.__init__(self.config, self.max_rollback)

    def early_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache starts its rows on the first forward: each row's ring, state and "
                                  "carries follow its own real tokens")

    def increase_count(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache has no convolution states to count: the model counts its columns")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """New row i is old row beam_idx[i] (beam search)."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(self.rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.rows:  # no rows yet: the first forward starts them
            return
        self._select_rows(torch.arange(self.rows)[indices.cpu() if isinstance(indices, torch.Tensor) else indices]
                          .reshape(-1).tolist())

    def _select_rows(self, source: list[int]) -> None:
        """Rebuild the batch so that new row i holds old row source[i] (rollback records are dropped)."""
        if not self.rows:
            return
        for layer in self.layers:
            layer.map_rows(lambda t: t.index_select(0, torch.tensor(source, device=t.device)))
            layer.pending = None
        self.seen = [self.seen[row] for row in source]
        self.rows = len(source)
        self.history.clear()

    # ---- rollback -----------------------------------------------------------------------------------------
    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Keep, for the forwards of the last `max_rollback` columns, what each replaced and computed, so `crop`
        can undo them. transformers >= 5.25 passes how many drafted columns it may remove; a larger count widens
        `max_rollback`."""
        self.recording = True
        if recurrent_states_to_keep is not None:
            self.max_rollback = max(self.max_rollback, int(recurrent_states_to_keep))

    def _record(self, tokens: RowTokens) -> None:
        length = tokens.width if tokens.width else max(tokens.counts, default=0)
        if length > self.max_rollback:
            self.history.clear()  # never cropped that far back: keep no copy of a long prompt
            return
        record = ForwardRecord(list(self.seen), self.columns, tokens)
        for layer in self.layers:
            layer.replaced, layer.journal = [], LayerJournal()
            record.replaced.append(layer.replaced)
            record.journals.append(layer.journal)
        self.history.append(record)
        while sum(r.tokens.width for r in self.history) - self.history[0].tokens.width >= self.max_rollback:
            self.history.popleft()

    def crop(self, max_length: int) -> None:
        """Roll back to `max_length` columns (absolute, > 0) or remove `-max_length` columns (<= 0; 0 removes
        nothing). Exact: state, window, carries and positions return to what they were after those columns.
        Needs recording (activate_past_recording) since before the removed columns were read."""
        max_length = int(max_length)  # generate may pass a 0-d tensor
        target = self.columns + max_length if max_length <= 0 else min(max_length, self.columns)
        if target >= self.columns:
            return
        history = self.history
        if not history or history[-1].columns + history[-1].tokens.width != self.columns \
                or history[0].columns > target:
            reason = ("recording is not active (call activate_past_recording before reading them)" if not self.recording
                      else "they are not recorded (only the last max_rollback columns are)")
            raise ValueError(f"KVMCache cannot remove {self.columns - target} columns: {reason}")
        while history[-1].columns > target:
            self._undo(history.pop())
        record = history.pop()
        keep = target - record.columns
        self._undo(record)
        if keep:
            self._replay(record, keep)
        self.columns = target

    def _undo(self, record: ForwardRecord) -> None:
        """Put back everything a recorded forward overwrote, newest write first."""
        for layer, writes in zip(self.layers, record.replaced):
            layer.pending = None
            for name, where, old in reversed(writes):
                layer.tensors[name][where] = old
        self.seen, self.columns = list(record.seen), record.columns

    def _replay(self, record: ForwardRecord, keep: int) -> None:
        """Redo the first `keep` columns of a recorded forward from its journals (no model needed): each row's kept
        tokens into its window, the state it had computed after them, its carries at its last kept token."""
        tokens = record.tokens
        kept = [min(count, keep) for count in tokens.counts]
        if tokens.padded is not None:
            columns = (tokens.padded % tokens.width).tolist()
            kept = [sum(1 for i in range(offset, offset + count) if columns[i] < keep)
                    for offset, count in zip(tokens.offsets, tokens.counts)]
        device = tokens.device
        for layer, journal in zip(self.layers, record.journals):
            for row, (start, offset, count) in enumerate(zip(tokens.starts, tokens.offsets, kept)):
                if not count:
                    continue
                index = torch.tensor([row], device=device)
                stop = start + count
                flat = torch.arange(offset + max(0, count - layer.ring_size), offset + count, device=device)
                slots = tokens.position[flat] % layer.ring_size
                for name, inputs in zip(WINDOW, journal.inputs):
                    if inputs is not None:
                        layer.write(name, index.expand(len(flat)), inputs[flat], slots)
                for stream, inputs in journal.shifts.items():
                    layer.write(f"carry.{stream}", index, inputs[offset + count - 1][None])
                if journal.first_chunk is not None:  # the kept first-chunk tokens' slots
                    rows, first_slots, values = journal.first_chunk
                    entered = ((rows == row) & (first_slots < stop)).nonzero().squeeze(1)
                    for name, tensor in zip(STATE + READ, values):
                        layer.write(name, rows[entered], tensor[entered], first_slots[entered])
                state = None if layer.is_sliding else latest_state(journal.states, row, stop)
                if state is not None:
                    for name, tensor in zip(STATE + READ, state):
                        layer.write(name, index, tensor)
        self.seen = [start + count for start, count in zip(tokens.starts, kept)]

    def update(self, *args, **kwargs):
        raise NotImplementedError("KVMCache is updated by the KVM layers themselves, not through Cache.update().")

    def get_mask_sizes(self, *args, **kwargs):
        raise NotImplementedError("KVMCache builds its own attention masks.")

    def offload(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache does not support offloading.")

    def prefetch(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache does not support offloading.")

    # ---- saved caches ("prompt caching") ------------------------------------------------------------------
    def saved_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The tensors and JSON fields `save` writes."""
        if not self.rows or self.columns == 0:
            raise ValueError("the cache is empty: read some tokens before saving it")
        tensors = {f"layers.{i}.{name}": tensor for i, layer in enumerate(self.layers)
                   for name, tensor in layer.tensors.items()}
        dtype = self.layers[0].tensors["window_keys"].dtype
        fields = {"columns": self.columns, "batch_size": self.rows, "seen": self.seen,
                  "dtype": str(dtype).removeprefix("torch.")}
        return tensors, fields

    @classmethod
    def from_saved(cls, config: KVMConfig, meta: dict, tensors: dict[str, torch.Tensor], dtype) -> KVMCache:
        """The cache `saved_state` described (its tensors keep their saved dtypes)."""
        cache = cls(config)
        cache.columns, cache.rows, cache.seen = meta["columns"], meta["batch_size"], list(meta["seen"])
        for i, layer in enumerate(cache.layers):
            layer.tensors = tensors_under(tensors, f"layers.{i}.")
        return cache

    def __repr__(self) -> str:
        return f"KVMCache(columns={self.columns}, rows={self.rows}, nbytes={self.nbytes()})"


def latest_state(states: list, row: int, stop: int) -> tuple | None:
    """The last state (with its read form) a recorded forward computed for `row` that is the row's state after
    `stop` tokens (None: the row's state did not change by then). Each journal entry is (rows, the token count
    from which it holds per row, its tensors)."""
    found = None
    for rows, valid_from, tensors in states:
        if row in rows and valid_from[rows.index(row)] <= stop:
            local = rows.index(row)
            found = tuple(t[local:local + 1] for t in tensors)
    return found
