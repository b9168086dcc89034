"""MaglevCache: bounded per-layer key/value rings plus the per-row recurrent state.

Rows of a batch advance independently: each row has its own position (the number of real tokens
it has read), and padding (attention_mask == 0) never enters a window, the memory or the smear
carry. While recording is active (assisted decoding), every column is a recorded step: each layer keeps what
it overwrote and the cache the rows' state before it, so that `crop` rolls the cache back exactly.
"""

from dataclasses import dataclass

import torch

from ..common.row_storage import LayerRecord, RowCache, RowCacheLayer, StepRecord
from ..common.step_plan import Step, StepPlan, gather_columns
from .configuration_maglev import MaglevConfig


def visible_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, left: int) -> torch.Tensor:
    """[B, 1, Tq, Tk]: a query sees real keys (position >= 0) from `left` positions back up to its own."""
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    return ((k >= 0) & (k <= q) & (k >= q - left))[:, None]


def windows_grow(config: MaglevConfig) -> bool:
    """Whether the cache's per-layer rings grow with the tokens read up to their windows: with nanochat's window
    pattern, whose windows span the training context; a uniform `sliding_window` ring is whole at once."""
    return config.sliding_window is None


def growing_capacity(num_tokens: int) -> int:
    """Capacity of a geometrically grown key/value buffer holding `num_tokens` tokens."""
    capacity = 16
    while capacity < num_tokens:
        capacity *= 2
    return capacity


@dataclass(frozen=True)
class RingStep:
    """Where one token per row meets the rings of one capacity and window, made before the forward so that the
    layers only read it. The token is written into its slot first (`MaglevCacheLayer.update`) and the key it
    displaces is set aside, so the token's attention reads the ring as written and the set-aside key: the same keys
    as the ring before the write and the token. Hence: the mask over the written ring's slots and the set-aside key
    (`mask` [B, 1, 1, capacity + 1]), the written ring's slots the token sees (`written` [B, 1, 1, capacity], the
    one-query kernel's mask) and whether it sees the set-aside key (`aside` [B, 1, 1, 1]); the slot each row's
    token takes (`slot` [B]) in rows `rows` (None: every row), and which rows read a real token (`valid` [B]; None:
    all; a padding token writes nothing and is itself set aside)."""

    mask: torch.Tensor | None
    written: torch.Tensor | None
    aside: torch.Tensor | None
    slot: torch.Tensor
    rows: torch.Tensor | None
    valid: torch.Tensor | None

    @classmethod
    def of(cls, plan: StepPlan, ring: "MaglevCacheLayer", rows: torch.Tensor | None) -> "RingStep":
        """The step of a one-token `plan` over rings like `ring`: a query sees the slots within its window and
        always its own key."""
        slots = visible_keys(plan.query_positions, ring.slot_positions(plan), ring.window)
        written = (torch.arange(ring.capacity, device=plan.start.device) < plan.start[:, None])[:, None, None, :]
        slot = plan.start % ring.capacity
        valid = None if plan.valid is None else plan.valid[:, 0]
        # the token's own slot (where a real token is written): seen, and what it held is what is set aside
        own = (torch.arange(ring.capacity, device=slot.device) == slot[:, None])[:, None, None, :]
        real = torch.ones_like(own[..., :1]) if valid is None else valid[:, None, None, None]
        own = own & real

        def after_write(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return seen | own, torch.where(real, (seen & own).any(dim=-1, keepdim=True), True)
        written_after, aside = after_write(written)
        return cls(torch.cat(after_write(slots), dim=-1), written_after, aside, slot, rows, valid)


class MaglevCacheLayer(RowCacheLayer):
    """One decoder layer's ring of the last `window` keys/values of each row ("keys", "values" [rows, Hkv, capacity,
    D], memory already injected), on transformers' cache-layer API (`RowCacheLayer`); position p lives in slot
    p % capacity.

    A growing ring (nanochat's window pattern, whose windows span the training context) starts small and doubles
    up to its window with the columns read, so a short sequence keeps a short cache; until it reaches its window
    it holds every position read in the slot of that number (none has wrapped around).
    """

    is_sliding = True

    def __init__(self, window: int, grows: bool = False):
        super().__init__()
        self.window = window
        self.grows = grows
        self.capacity = min(window, growing_capacity(0)) if grows else window
        self.batch = 0  # rows of a dense ring (set by the cache)
        self.records: list[LayerRecord] | None = None  # while recording, one per column of the forward
        self.step: RingStep | None = None  # a one-token forward's masks and slots (`MaglevCache.ring_steps`)

    def reset(self) -> None:
        self.__init__(self.window, self.grows)

    def reserve(self, columns: int) -> None:
        """Make room before a forward that ends at `columns` columns: a growing ring takes more slots (up to its
        window), its written slots kept in place."""
        if not self.grows or self.capacity == self.window:
            return
        capacity = min(self.window, growing_capacity(columns))
        if capacity > self.capacity and "keys" in self:
            for name in ("keys", "values"):
                tensor = self.tensors[name]
                extra = tensor.new_zeros(*tensor.shape[:2], capacity - self.capacity, tensor.shape[3])
                self.tensors[name] = torch.cat([tensor, extra], dim=2)
        self.capacity = max(capacity, self.capacity)

    def shrink(self, columns: int) -> None:
        """After a crop to `columns` columns: a growing ring gives back the slots only removed columns took (they
        hold zeros again), so its state is that of a ring that never read them."""
        capacity = min(self.window, growing_capacity(columns))
        if not self.grows or capacity >= self.capacity:
            return
        if "keys" in self:
            self.tensors = {name: t[:, :, :capacity].clone() for name, t in self.tensors.items()}
        self.capacity = capacity

    def read_ring(self, like: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, H, capacity, D] of rows `rows` (None: all) before this chunk is written."""
        self.make_ring(like)
        return self.read("keys", rows), self.read("values", rows)

    def make_ring(self, like: torch.Tensor) -> None:
        """A dense ring's storage on its first forward: zeros shaped like `like` [B, H, T, D]."""
        if "keys" not in self:
            for name in ("keys", "values"):
                self.tensors[name] = like.new_zeros(self.batch, like.shape[1], self.capacity, like.shape[3])

    def update(self, k: torch.Tensor, v: torch.Tensor, step: "TokenStep") -> tuple[torch.Tensor, ...]:
        """A one-token step's token per row (keys and values [B, Hkv, 1, D]) into its ring slot (the layer's
        `RingStep`, made with the step); returns what its attention reads: the ring's keys and values as written
        ([B, Hkv, capacity, D] of the step's rows; the storage itself where it can be, no copy) and the key and value
        set aside ([B, Hkv, 1, D]: what the token displaced from its slot, or the token itself where it is padding,
        which writes nothing). The ring before the write and the token are the same keys (`RingStep`)."""
        self.make_ring(k)
        aside = self.write_slots(k[:, :, 0], v[:, :, 0], self.step)
        return (self.read("keys", step.rows), self.read("values", step.rows), aside[0][:, :, None],
                aside[1][:, :, None])

    def write_slots(self, k: torch.Tensor, v: torch.Tensor, step: "RingStep") -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row (k, v [B, Hkv, D]) into the slots of `step`; padding rows keep theirs (while recording,
        the layer's record keeps what the writes replace). Returns the key and value set aside per row (`update`)."""
        old_k = self.read_slots("keys", step.rows, step.slot)
        old_v = self.read_slots("values", step.rows, step.slot)
        aside_k, aside_v = old_k, old_v
        if step.valid is not None:
            keep = step.valid.view(-1, 1, 1)
            k, aside_k = torch.where(keep, k, old_k), torch.where(keep, old_k, k)
            v, aside_v = torch.where(keep, v, old_v), torch.where(keep, old_v, v)
        self.write("keys", step.rows, k, step.slot)
        self.write("values", step.rows, v, step.slot)
        return aside_k, aside_v

    def slot_positions(self, plan: "StepPlan") -> torch.Tensor:
        """[B, capacity]: the position each slot holds before this chunk (negative: never written)."""
        slots = torch.arange(self.capacity, device=plan.start.device)
        last = plan.start[:, None] - 1
        return last - (last - slots) % self.capacity

    def write_chunk(self, k: torch.Tensor, v: torch.Tensor, plan: "StepPlan") -> None:
        """Store the chunk's keys/values [B, H, T, D] of the plan's rows: each row's newest real tokens replace its
        oldest slots; at once, or column by column while recording (each column's writes go to its own record)."""
        if self.records is None:
            self._write_chunk(k, v, plan)
            return
        for t in range(plan.length):
            start, valid = plan.column(t)
            self.record = self.records[t]
            self.write_slots(k[:, :, t], v[:, :, t], RingStep(None, None, None, start % self.capacity, plan.rows, valid))

    def _write_chunk(self, k, v, plan) -> None:
        """Each slot takes the newest real chunk token that maps to it, else keeps its content."""
        length = plan.length
        count = length if plan.valid is None else plan.valid.sum(dim=1, keepdim=True)
        start = plan.start[:, None]
        last = start + count - 1
        newest = last - (last - torch.arange(self.capacity, device=k.device)) % self.capacity
        from_chunk = (newest >= start)[:, None, :, None]
        rank = (newest - start).clamp(min=0)
        if plan.valid is None:
            index = rank
        else:
            index = torch.searchsorted(plan.valid.long().cumsum(dim=1), rank + 1)
        index = index.clamp(max=length - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        rows = plan.rows
        keys = torch.where(from_chunk, k.gather(2, index), self.read("keys", rows))
        values = torch.where(from_chunk, v.gather(2, index), self.read("values", rows))
        self.write("keys", rows, keys)
        self.write("values", rows, values)

    def open_records(self, columns: int | None) -> None:
        """Record each of a forward's `columns` columns as a step of its own (None: not recording)."""
        self.records = None if columns is None else [self.open_record() for _ in range(columns)]
        self.record = None if columns is None else self.records[0]

    def length(self) -> int:
        return self.capacity if "keys" in self else 0


class PlannedStep(Step):
    """A Maglev step over its forward's plan (`plan`, a `StepPlan`: the rows' positions, their real tokens, masks
    made once), whose positions and real tokens it reads as its own. `counted`: its columns were counted when it
    was prepared."""

    counted = False

    def __init__(self, start: torch.Tensor, valid: torch.Tensor | None, length: int,
                 rows: torch.Tensor | None = None) -> None:
        self.plan = StepPlan(start, valid, length)
        self.plan.rows = rows

    @property
    def start(self) -> torch.Tensor:
        return self.plan.start

    @property
    def valid(self) -> torch.Tensor | None:
        return self.plan.valid

    @property
    def length(self) -> int:
        return self.plan.length

    @property
    def rows(self) -> torch.Tensor | None:
        return self.plan.rows

    @property
    def query_positions(self) -> torch.Tensor:
        return self.plan.query_positions


class ChunkStep(PlannedStep):
    """Several tokens per row, or any forward without a cache: each layer's queries over the ring before the chunk
    and the chunk's own keys, block by block of queries, then the chunk written (`MaglevAttention.attend_chunk`)."""

    def attend(self, attention, cache_layer, q, k, v, window: int) -> torch.Tensor:
        return attention.attend_chunk(q, k, v, window, cache_layer, self.plan)


class TokenStep(PlannedStep):
    """One token for each of rows `rows` (None: every row) on a cache: on each cache layer the `RingStep` of its
    masks and slots, made with the step (`MaglevCache.ring_steps`), so that the token is written and read without
    building them (`MaglevAttention.attend_token`). Prepared for a forward (`MaglevModel.prepare_step`), it is a
    decoding step, which runs as one graph (`MaglevModel.decode_step`)."""

    def attend(self, attention, cache_layer, q, k, v, window: int) -> torch.Tensor:
        return attention.attend_token(q, k, v, cache_layer, self)

    def run(self, model, input_ids: torch.Tensor, cache: "MaglevCache", output_hidden_states):
        """The prepared forward: a decoding step."""
        return model.decode_step(input_ids, cache, self, output_hidden_states)


@dataclass
class PrefillStep(Step):
    """A "prefiller" prompt prepared before its forward (`MaglevModel.prepare_step`): its real tokens ([B, T]
    booleans; None: all) and its column count, already counted (read on the host only: a compiled forward takes its
    length from its input, a dynamic size). It runs as `MaglevModel.prefill_step`, on a `ChunkStep` of its input."""

    valid: torch.Tensor | None
    length: int
    counted = True

    def run(self, model, input_ids: torch.Tensor, cache: "MaglevCache", output_hidden_states):
        """The prepared forward: Q reads the prompt, P runs on it in parallel."""
        return model.prefill_step(input_ids, cache, self, output_hidden_states)


class MaglevCache(RowCache):
    """Cache of a Maglev decoder: per layer the keys/values its window still needs (memory already
    injected), per row its position, last memory vector and smear's previous-token embedding.

    Its size is bounded by the windows: a sliding_window ring is whole from the first token; with nanochat's
    window pattern (memory off) each ring grows with the columns read up to its window (`sequence_len` for
    an "L" layer), then stays. `get_seq_length()` counts columns (padding included), as generate() slices its
    inputs by it.
    """

    MODEL_NAME = "Maglev"
    # the config fields what the cache holds depends on (`check_compatible`; a saved cache's fingerprint)
    CACHE_CONFIG_FIELDS = (
        "vocab_size", "pad_vocab_size_to", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "sequence_len", "window_pattern",
        "rope_theta", "rms_norm_eps", "qk_norm_scale", "use_value_embeddings", "value_embedding_gate_channels",
        "value_embedding_gate_scale", "use_smear", "smear_gate_channels", "use_backout", "backout_layer",
        "use_layer_lambdas", "use_memory", "sliding_window", "memory_gate_channels", "memory_source_layer",
        "memory_projection", "memory_residual_injection",
    )
    ROW_START = "each row's memory starts at the model's learned memory_init, which the cache does not hold"

    def __init__(self, config: MaglevConfig, max_rollback: int = 256):
        super().__init__(config, [MaglevCacheLayer(window, grows=windows_grow(config))
                                  for window in config.decoder_windows], max_rollback)
        self.positions: torch.Tensor | None = None
        self.last_memory: torch.Tensor | None = None
        self.previous_embedding: torch.Tensor | None = None
        self.prompt_length: int | None = None  # set by assisted decoding: its first forward also carries drafts
        # whether the running forward's columns are recorded (`forward_step` opened the layers' records): the cache
        # knows, since an engine's compiled step puts layers of its own in the cache layers' place
        self.recording_forward = False

    # ----- what the model uses -----------------------------------------------------------
    def prepare(self, batch_size: int, like: torch.Tensor, memory_init: torch.Tensor | None) -> None:
        """Start empty rows on the first forward (smear predecessor 0 = no smear, memory = memory_init);
        later forwards must keep the batch size."""
        if self.positions is None:
            hidden = self.config.hidden_size
            for layer in self.layers:
                layer.batch = batch_size
            self.positions = torch.zeros(batch_size, dtype=torch.long, device=like.device)
            self.previous_embedding = like.new_zeros(batch_size, 1, hidden)
            if memory_init is not None:
                self.last_memory = memory_init.to(like.dtype).expand(batch_size, 1, hidden)
        elif self.positions.shape[0] != batch_size:
            raise ValueError(f"the cache holds {self.positions.shape[0]} rows but the inputs have {batch_size}; "
                             "use reorder_cache/batch_select_indices/batch_repeat_interleave to change it")

    def take_prompt_length(self, length: int) -> int:
        """How many of a first forward's `length` tokens are the prompt: all, unless generate() marked fewer
        (assisted decoding). The mark is used once."""
        prompt, self.prompt_length = self.prompt_length, None
        return length if prompt is None else min(prompt, length)

    def reserve(self, length: int) -> None:
        """Growing rings make room for `length` more columns."""
        for store in self.layers:
            store.reserve(self.columns + length)

    def forward_step(self, valid: torch.Tensor | None, length: int) -> TokenStep | ChunkStep:
        """The step of a forward over `length` new columns (`valid`: its real tokens): one token per row or a chunk;
        growing rings make room for them first, and while recording each column gets its record."""
        self.reserve(length)
        columns = length if self.records_steps_of(1) else None
        self.recording_forward = columns is not None
        for layer in self.layers:
            layer.open_records(columns)
        if length > 1:
            return ChunkStep(self.positions, valid, length)
        return self.ring_steps(TokenStep(self.positions, valid, 1))

    def prepare_columns(self, valid: torch.Tensor | None, length: int = 1) -> Step:
        """The host side of a prepared forward of `length` columns (`valid` [B, length]: its real tokens), done before
        it so that the forward reads only tensors: growing rings make room, the columns are counted and a decoding
        step's rings get their masks and slots. The step is parked as `prepared_step` (and returned); preparing again
        before the forward ran replaces the earlier preparation."""
        self.cancel_prepared_step()
        self.reserve(length)
        self.columns += length
        # a prompt's plan is made when it runs: its input gives its length
        step = PrefillStep(valid, length) if length > 1 else self.ring_steps(TokenStep(self.positions, valid, 1))
        step.counted = True
        self.prepared_step = step
        return step

    def cancel_prepared_step(self) -> None:
        """Forget a prepared forward that did not run (its columns uncounted), before the cache is changed."""
        if self.prepared_step is not None:
            self.columns -= self.prepared_step.length
            self.prepared_step = None

    def token_step(self, rows: torch.Tensor | None) -> TokenStep:
        """The step of one token for each of rows `rows` alone (None: every row), a recurrent step of the rows with
        tokens left."""
        return self.ring_steps(TokenStep(self.positions if rows is None else self.positions[rows], None, 1, rows))

    def ring_steps(self, step: TokenStep) -> TokenStep:
        """Give each layer the `RingStep` of one-token `step` (made once for the layers of one capacity and window),
        before the forward: its attention and ring write then read masks and slots instead of building them."""
        steps = {}
        # dense rings written in every row share one row index; an engine's pages resolve their own rows
        every_row = torch.arange(step.start.shape[0], device=step.start.device) if step.rows is None else None
        for layer in self.layers:
            key = (layer.capacity, layer.window)
            if key not in steps:
                rows = every_row if step.rows is None and layer.index is None else step.rows
                steps[key] = RingStep.of(step.plan, layer, rows)
            layer.step = steps[key]
        return step

    def finish_rows(self, rows: torch.Tensor, embeddings: torch.Tensor, memories: torch.Tensor | None) -> None:
        """Record one token read by each of rows `rows` (its pre-smear embedding and memory, [rows, 1, H]); the
        forward counts its columns itself."""
        self.positions = self.positions.index_add(0, rows, torch.ones_like(rows))
        self.previous_embedding = self.previous_embedding.index_copy(0, rows, embeddings.to(self.previous_embedding.dtype))
        if memories is not None:
            self.last_memory = self.last_memory.index_copy(0, rows, memories.to(self.last_memory.dtype))

    def finish_forward(self, step: PlannedStep, embeddings: torch.Tensor, memories: torch.Tensor | None) -> None:
        """Record a processed step: per row its real-token count, last real (pre-smear) embedding and memory; its
        columns, unless they were counted when it was prepared."""
        plan = step.plan
        recorded, self.recording_forward = self.recording_forward, False
        if plan.length == 1:
            if recorded:
                self.remember_column(0, self.positions, self.last_memory, self.previous_embedding)
            if plan.valid is None:
                self.positions = self.positions + 1
                self.previous_embedding = embeddings
                if memories is not None:
                    self.last_memory = memories
            else:
                keep = plan.valid[:, :, None]
                self.positions = self.positions + plan.valid[:, 0]
                self.previous_embedding = torch.where(keep, embeddings, self.previous_embedding)
                if memories is not None:
                    self.last_memory = torch.where(keep, memories.to(self.last_memory.dtype), self.last_memory)
        else:
            previous, last = plan.predecessors()
            if recorded:
                before_embeddings = gather_columns(self.previous_embedding, embeddings, previous)
                before_memories = (None if memories is None
                                   else gather_columns(self.last_memory, memories, previous))
                before_positions = plan.query_positions  # the plan starts at this cache's positions
                for t in range(plan.length):
                    self.remember_column(t, before_positions[:, t],
                                         None if memories is None else before_memories[:, t:t + 1],
                                         before_embeddings[:, t:t + 1])
            self.previous_embedding = gather_columns(self.previous_embedding, embeddings, last)
            if memories is not None:
                self.last_memory = gather_columns(self.last_memory, memories, last)
            self.positions = self.positions + (plan.length if plan.valid is None else plan.valid.sum(dim=1))
        if not step.counted:
            self.columns += plan.length
        if recorded:
            for layer in self.layers:
                layer.open_records(None)

    def remember_column(self, t: int, positions: torch.Tensor, memory: torch.Tensor | None,
                        embedding: torch.Tensor) -> None:
        """Keep column `t` of a recorded forward as a step: the rows' state before it and its layers' records."""
        rows = {"positions": positions, "last_memory": memory, "previous_embedding": embedding}
        self.remember(StepRecord(self.columns + t, 1, rows, [layer.records[t] for layer in self.layers]))

    # ----- what the cache holds ------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """The rows the cache holds (0 before the first forward)."""
        return 0 if self.positions is None else self.positions.shape[0]

    def layer_lengths(self) -> list[int]:
        """Key/value slots each layer holds (its ring's capacity; 0 before the first forward)."""
        return [store.length() for store in self.layers]

    def nbytes(self) -> int:
        """Bytes held by the cache's state (rollback records, kept only while recording, not included)."""
        tensors = [t for store in self.layers for t in store.tensors.values()]
        tensors += [t for t in (self.positions, self.last_memory, self.previous_embedding) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def select_rows(self, source: list[int]) -> None:
        """New row i holds old row source[i] (`RowCache.change_rows`); a prepared forward is prepared again, its
        plan having been made for the rows as they were."""
        index = torch.tensor(source)

        def select(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.index_select(0, index.to(tensor.device))

        for store in self.layers:
            store.map_rows(select)
        self.positions, self.last_memory, self.previous_embedding = (
            None if t is None else select(t) for t in (self.positions, self.last_memory, self.previous_embedding))
        if self.prepared_step is not None:  # prepared again: its plan was made for the rows as they were
            valid = self.prepared_step.valid
            self.prepare_columns(None if valid is None else select(valid), self.prepared_step.length)

    def crop(self, max_length: int) -> None:
        """`RowCache.crop`, after forgetting a prepared forward that did not run; growing rings then give back the
        slots only removed columns took."""
        self.cancel_prepared_step()
        columns = self.columns
        super().crop(max_length)
        if self.columns < columns:
            for store in self.layers:
                store.shrink(self.columns)
