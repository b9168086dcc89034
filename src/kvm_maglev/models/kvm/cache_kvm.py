"""KVMCache: what a KVM model carries between forward calls, one layer object per decoder layer (`cache.layers`).

Each row stands at its own position (the real tokens it has read; padding enters nothing). Per row, a KVM layer
holds its block window as a ring (position p in slot p % window_size), its state padded to a capacity, the state's
attention-ready form (recomputed only when the state changes, once per chunk) and the token-shift carries; a
sliding-window layer its ring and carries. How much of each is live follows from the row's position (the one rule
of state_kvm). While recording (assisted decoding) each layer also keeps what a forward computed
(`KVMLayerRecord`), so that `crop` can redo the kept columns of a forward it falls inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common.config_fields import own_fields
from ..common.row_storage import LayerRecord, RowCache, RowCacheLayer, StepRecord
from ..common.seams import package_speedups
from ..common.step_plan import RowTokens
from .configuration_kvm import KVMConfig
from .state_kvm import Fold, block_fold, readable_state, run_fold, slots_after_folds, state_slots_after, window_start

WINDOW = ("window_keys", "window_values", "window_gates")
STATE = ("state_keys", "state_values", "state_norms")
READ = ("read_keys", "read_values")
# the config fields a saved cache does not depend on: every other field decides what the cache holds or how a
# model reads it (`KVMCache.CACHE_CONFIG_FIELDS`)
NOT_IN_CACHE = ("max_position_embeddings", "tie_word_embeddings", "use_cache", "pad_token_id", "bos_token_id",
                "eos_token_id")

# the seam of the paced fold (speedups/paced_fold_kvm): decoding forwards compute the next fold ahead and its
# boundary swaps it in; None, and every fold runs at its boundary (the same tensors)
paced_fold_kvm = package_speedups("paced_fold_kvm")


@dataclass
class KVMLayerRecord(LayerRecord):
    """What one recorded forward did in one layer: what its writes replaced and, to redo its first columns, its new
    keys/values/gates, each state it computed (the rows, the state and its read form, and how many of the row's
    tokens it follows), and the token-shift inputs."""

    inputs: tuple | None = None
    first_chunk: tuple | None = None  # (rows, slots, state + read form slot values) of the first-chunk tokens
    states: list = field(default_factory=list)  # (rows, the token count from which each holds, state + read form)
    shifts: dict = field(default_factory=dict)  # stream -> [tokens, width] inputs


class RingLayer(RowCacheLayer):
    """What both kinds of layer hold, on transformers' cache-layer API (`RowCacheLayer`): a ring of the newest keys
    and values (position p in slot p % ring size), the token-shift carries, and how a decoding step writes its
    token and reads what attention needs (`update`)."""

    ring_names = WINDOW  # the ring tensors a decoding step writes (merge gates: when the layer has them)
    read_names = READ  # the state tensors its attention reads beside the ring (none for a sliding layer)
    record_type = KVMLayerRecord

    def __init__(self, config: KVMConfig, layer_idx: int, ring_size: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.ring_size = config, layer_idx, ring_size

    def reset(self) -> None:
        super().reset()
        self.record, self.pending = None, None

    def undo(self, record: KVMLayerRecord) -> None:
        super().undo(record)
        self.pending = None  # a fold computed ahead from what was undone

    def redo(self, record: KVMLayerRecord, tokens: RowTokens, kept: list[int]) -> None:
        """Redo each row's first `kept` tokens of an undone forward from its record (no model needed): the kept
        tokens into the row's window, the state it had computed after them, its carries at its last kept token."""
        device = tokens.device
        for row, (start, offset, count) in enumerate(zip(tokens.starts, tokens.offsets, kept)):
            if not count:
                continue
            index = torch.tensor([row], device=device)
            stop = start + count
            flat = torch.arange(offset + max(0, count - self.ring_size), offset + count, device=device)
            slots = tokens.position[flat] % self.ring_size
            for name, inputs in zip(WINDOW, record.inputs):
                if inputs is not None:
                    self.write(name, index.expand(len(flat)), inputs[flat], slots)
            for stream, inputs in record.shifts.items():
                self.write(f"carry.{stream}", index, inputs[offset + count - 1][None])
            if record.first_chunk is not None:  # the kept first-chunk tokens' slots
                rows, first_slots, values = record.first_chunk
                entered = ((rows == row) & (first_slots < stop)).nonzero().squeeze(1)
                for name, tensor in zip(STATE + READ, values):
                    self.write(name, rows[entered], tensor[entered], first_slots[entered])
            state = None if self.is_sliding else latest_state(record.states, row, stop)
            if state is not None:
                for name, tensor in zip(STATE + READ, state):
                    self.write(name, index, tensor)

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
    (`fold_due`), computing the next fold ahead where the seam found the paced fold (`fold_ahead`)."""

    def __init__(self, config: KVMConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, config.window_size)
        self.pending = None  # the next fold, computed ahead by decoding forwards (paced_fold_kvm.PacedFold)

    # With the paced fold, a forward on dense storage computes the next fold ahead (paced_fold_kvm.paces_folds says
    # when); False folds at the chunk boundary instead (the same tensors).
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
        """After a forward of rows that stood at `starts` and read `counts` tokens (or before a decoding step): where
        the seam found the paced fold, start or advance the next fold ahead (`paced_fold_kvm.fold_ahead`); without
        it nothing, and each fold runs at its boundary."""
        if paced_fold_kvm is not None:
            paced_fold_kvm.fold_ahead(self, starts, counts, normalize, dtype)

    def take_fold_ahead(self, blocks: list[int], rows: list[int], capacity: int) -> tuple | None:
        """The fold computed ahead when it is the one due (`rows` folding `blocks` at this capacity), used once;
        else None and the caller folds now."""
        return None if self.pending is None else paced_fold_kvm.take_fold_ahead(self, blocks, rows, capacity)

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


class KVMCache(RowCache):
    """Cache of a KVM model; created by the model (`generate` or a forward with use_cache).

    `layers[i]` is decoder layer i's storage. `get_seq_length()` counts columns (padding included), as generate()
    slices its inputs by it; each row's own token count is in `row_lengths()`.
    """

    MODEL_NAME = "KVM"
    # the config fields what the cache holds depends on (`check_compatible`; a saved cache's fingerprint)
    CACHE_CONFIG_FIELDS = tuple(declared.name for declared in own_fields(KVMConfig)
                                if declared.name not in NOT_IN_CACHE)
    ROW_START = "each row's ring, state and carries follow its own real tokens"

    def __init__(self, config: KVMConfig, max_rollback: int = 256, **kwargs) -> None:
        layers = [(SlidingWindowCacheLayer if config.is_sliding_window_layer(i) else KVMCacheLayer)(config, i)
                  for i in range(config.num_hidden_layers)]
        super().__init__(config, layers, max_rollback)
        self.seen: list[int] = []  # real tokens each row has read
        self.rows = 0
        self.paged = False

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
        """Before a forward over `tokens`: start rows on the first forward, check the batch after; open the layers'
        records while recording."""
        self.row_starts(tokens.batch)
        if not self.rows:
            self.rows, self.seen = tokens.batch, [0] * tokens.batch
        if self.records_steps_of(tokens.width if tokens.width else max(tokens.counts, default=0)):
            self.remember(StepRecord(self.columns, tokens.width, {"seen": list(self.seen)},
                                     [layer.open_record() for layer in self.layers], tokens))

    def count_decoding_step(self) -> None:
        """Every row reads one more token (a decoding step, whose forward then needs no bookkeeping)."""
        self.seen = [seen + 1 for seen in self.seen]
        self.columns += 1

    def finish_forward(self, tokens: RowTokens, columns: int) -> None:
        """After a forward: each row has read its tokens; the layers' records close."""
        self.seen = [start + count for start, count in zip(tokens.starts, tokens.counts)]
        self.columns += columns
        for layer in self.layers:
            layer.close_record()

    # ---- what the cache holds -----------------------------------------------------------------------------------
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

    def select_rows(self, source: list[int]) -> None:
        """New row i holds old row source[i] (`RowCache.change_rows`)."""
        for layer in self.layers:
            layer.map_rows(lambda t: t.index_select(0, torch.tensor(source, device=t.device)))
            layer.pending = None
        self.seen = [self.seen[row] for row in source]
        self.rows = len(source)

    def redo(self, step: StepRecord, keep: int) -> None:
        """Redo the first `keep` columns of an undone forward from its layers' records: each row's tokens in
        them."""
        tokens = step.tokens
        kept = [min(count, keep) for count in tokens.counts]
        if tokens.padded is not None:
            columns = (tokens.padded % tokens.width).tolist()
            kept = [sum(1 for i in range(offset, offset + count) if columns[i] < keep)
                    for offset, count in zip(tokens.offsets, tokens.counts)]
        for layer, record in zip(self.layers, step.layers):
            layer.redo(record, tokens, kept)
        self.seen = [start + count for start, count in zip(tokens.starts, kept)]


def latest_state(states: list, row: int, stop: int) -> tuple | None:
    """The last state (with its read form) a recorded forward computed for `row` that is the row's state after
    `stop` tokens (None: the row's state did not change by then). Each recorded state is (rows, the token count
    from which it holds per row, its tensors)."""
    found = None
    for rows, valid_from, tensors in states:
        if row in rows and valid_from[rows.index(row)] <= stop:
            local = rows.index(row)
            found = tuple(t[local:local + 1] for t in tensors)
    return found
