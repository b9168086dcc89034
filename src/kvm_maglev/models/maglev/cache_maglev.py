"""MaglevCache: bounded per-layer key/value rings plus the per-row recurrent state.

Rows of a batch advance independently: each row has its own position (the number of real tokens
it has read), and padding (attention_mask == 0) never enters a window, the memory or the smear
carry. While recording is active (assisted decoding), every column remembers what it overwrote
so that `crop` rolls the cache back exactly.
"""

import json
import os
from collections import deque
from typing import Callable, NamedTuple

import torch
from transformers.cache_utils import Cache

from .configuration_maglev import MaglevConfig, growing_capacity

CACHE_FORMAT = "maglev-cache"
# Queries per attention call when a long chunk runs in parallel (prefiller prompts, training). Each call
# computes its block's queries against QUERY_BLOCK + window keys, masked, so smaller blocks waste less:
# a 4096-token prefiller prompt (window 512, 2 cores) took 4.15 s with 1024, 3.48 s with 256, 3.49 with 128.
QUERY_BLOCK = 256
CACHE_FORMAT_VERSION = 1
TENSORS_FILE = "maglev_cache.safetensors"
META_FILE = "maglev_cache.json"

# Config fields that decide what a cache holds and how a model reads it (training-only fields excluded).
CACHE_CONFIG_FIELDS = (
    "vocab_size", "pad_vocab_size_to", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "sequence_len", "window_pattern",
    "rope_theta",
    "rms_norm_eps", "qk_norm_scale", "use_value_embeddings", "value_embedding_gate_channels",
    "value_embedding_gate_scale", "use_smear", "smear_gate_channels", "use_backout", "backout_layer",
    "use_layer_lambdas", "use_memory", "sliding_window", "memory_gate_channels",
)


def config_fingerprint(config: MaglevConfig) -> dict:
    """The config fields a cache depends on, as plain JSON values."""
    return {name: getattr(config, name) for name in CACHE_CONFIG_FIELDS}


def fingerprint_mismatch(expected: dict, found: dict) -> list[str]:
    """Names of the fields where two fingerprints differ (with both values)."""
    names = sorted(set(expected) | set(found))
    return [f"{n}: cache {found.get(n)!r} vs model {expected.get(n)!r}"
            for n in names if expected.get(n) != found.get(n)]


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


def visible_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, left: int) -> torch.Tensor:
    """[B, 1, Tq, Tk]: a query sees real keys (position >= 0) from `left` positions back up to its own."""
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    return ((k >= 0) & (k <= q) & (k >= q - left))[:, None]


class StepContext:
    """One forward's view of its tokens: per-row positions, which tokens are real, masks built once.

    Query positions of padding are those the next real token would get (only they read them);
    padding keys get position -1, which no query sees.
    """

    def __init__(self, start: torch.Tensor, valid: torch.Tensor | None, length: int, record: bool = False):
        self.start = start
        self.valid = valid
        self.length = length
        if valid is None:
            self.query_positions = start[:, None] + torch.arange(length, device=start.device)
            self.key_positions = self.query_positions
            self.before = None
        else:
            self.before = valid.long().cumsum(dim=1) - valid.long()
            self.query_positions = start[:, None] + self.before
            self.key_positions = torch.where(valid, self.query_positions, -1)
        self.records = [[] for _ in range(length)] if record else None
        self._masks: dict = {}

    def column(self, t: int):
        """(start positions, validity) of column t, for writes one column at a time."""
        if self.length == 1:
            return self.start, None if self.valid is None else self.valid[:, 0]
        if self.valid is None:
            return self.start + t, None
        return self.start + self.before[:, t], self.valid[:, t]

    def mask(self, key, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def query_blocks(self, left: int) -> list[tuple[int, int, int]]:
        """(first key column, first query column, end column) per block of QUERY_BLOCK queries: the key
        columns any query of the block can see under a `left` window, so a long chunk costs
        O(length * (QUERY_BLOCK + left)) instead of O(length^2). One block when the chunk is short."""
        if self.length <= QUERY_BLOCK + left:
            return [(0, 0, self.length)]

        def build():
            blocks = []
            for begin in range(0, self.length, QUERY_BLOCK):
                # per row, the first column whose key position is within reach of the block's first query
                reach = self.key_positions[:, :begin + 1] >= self.query_positions[:, begin:begin + 1] - left
                first = torch.where(reach.any(dim=1), reach.float().argmax(dim=1), begin)
                blocks.append((int(first.min()), begin, min(begin + QUERY_BLOCK, self.length)))
            return blocks
        return self.mask(("blocks", left), build)

    def block_mask(self, left: int, block: tuple[int, int, int]) -> torch.Tensor:
        """Mask of one block's queries over the chunk's key columns [lo, end): each token sees itself and
        the real keys within `left` positions. Columns stay causal too: a padding query has the position
        of the next real token and must not see that token's key (it would leak the label of a
        left-padded row's first token)."""
        lo, begin, end = block

        def build():
            key_columns = torch.arange(lo, end, device=self.start.device)[None, :]
            query_columns = torch.arange(begin, end, device=self.start.device)[:, None]
            seen = visible_keys(self.query_positions[:, begin:end], self.key_positions[:, lo:end], left)
            return (seen & (key_columns <= query_columns)) | (key_columns == query_columns)
        return self.mask(("block", left, begin), build)

    def windowed_attention(self, q, k, v, left: int, attend, prefix_mask=None, prefix=None) -> torch.Tensor:
        """Attention of the chunk's queries over `prefix` keys/values (e.g. a ring, with `prefix_mask(begin,
        end)`) and the chunk's own keys within `left`, block by block of queries."""
        outputs = []
        for block in self.query_blocks(left):
            lo, begin, end = block
            mask = self.block_mask(left, block)
            keys, values = k[:, :, lo:end], v[:, :, lo:end]
            if prefix is not None:
                mask = torch.cat([prefix_mask(begin, end), mask], dim=-1)
                keys, values = torch.cat([prefix[0], keys], dim=2), torch.cat([prefix[1], values], dim=2)
            outputs.append(attend(q[:, :, begin:end], keys, values, mask))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _tracks_grad(*tensors: torch.Tensor) -> bool:
    """Writes go out of place when autograd tracks them: attention saved the old ring for its backward
    pass (recurrent training through the cache); otherwise in place, with no copy of the window."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def sdpa(q, keys, values, mask):
    """Scaled dot-product attention with a boolean mask (grouped KV heads allowed)."""
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


class RingKeyValues:
    """The last `capacity` (= window) keys/values of one layer per row; position p lives in slot p % capacity."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Attention of the chunk's queries over the ring and the chunk, then store the chunk."""
        if self.keys is None:
            self.keys = k.new_zeros(k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.values = torch.zeros_like(self.keys)
        if ctx.length == 1:
            y = self._attend_one(q, k, v, ctx)
        else:
            slots = torch.arange(self.capacity, device=k.device)
            last = ctx.start[:, None] - 1
            slot_positions = last - (last - slots) % self.capacity  # negative: never written

            def ring_mask(begin: int, end: int) -> torch.Tensor:
                return ctx.mask(("ring", self.capacity, begin), lambda: visible_keys(
                    ctx.query_positions[:, begin:end], slot_positions, self.capacity))
            y = ctx.windowed_attention(q, k, v, self.capacity, sdpa, ring_mask, (self.keys, self.values))
        if ctx.records is None and ctx.length > 1:
            self._write_chunk(k, v, ctx)
        else:
            for t in range(ctx.length):
                start, valid = ctx.column(t)
                if ctx.length == 1:  # one slot index per step, shared by the layers
                    slot = ctx.mask(("slot", self.capacity), lambda: (start % self.capacity).view(-1, 1, 1, 1))
                else:
                    slot = (start % self.capacity).view(-1, 1, 1, 1)
                record = None if ctx.records is None else ctx.records[t]
                self._write_column(k[:, :, t:t + 1], v[:, :, t:t + 1], slot, valid, record)
        return y

    def _attend_one(self, q, k, v, ctx):
        """One query per row against the ring (no copy of it) and itself; slots below the row's position are written."""
        batch, heads, _, dim = q.shape
        kv_heads = k.shape[1]
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
        written = ctx.mask(("ring1", self.capacity), lambda: (
            torch.arange(self.capacity, device=q.device) < ctx.start[:, None])[:, None, None, :])
        # keys @ q (not q @ keys^T), q contiguous and then transposed: on CPU that one-column product reads
        # the ring about three times as fast (a contiguous column vector takes a slower kernel)
        column = grouped.contiguous().transpose(-1, -2)
        ring_scores = (self.keys @ column).transpose(-1, -2).masked_fill(~written, float("-inf"))
        own_score = (grouped * k).sum(dim=-1, keepdim=True)
        weights = (torch.cat([ring_scores, own_score], dim=-1).float() * dim ** -0.5).softmax(dim=-1).to(q.dtype)
        y = weights[..., :-1] @ self.values + weights[..., -1:] * v
        return y.reshape(batch, heads, 1, dim)

    def _write_column(self, k, v, slot, valid, record) -> None:
        """Write one column in place (padding rows keep their slot); remember the old slot when recording."""
        slot = slot.expand_as(k)
        if valid is not None or record is not None:
            old_k, old_v = self.keys.gather(2, slot), self.values.gather(2, slot)
            if valid is not None:
                keep = valid.view(-1, 1, 1, 1)
                k, v = torch.where(keep, k, old_k), torch.where(keep, v, old_v)
            if record is not None:
                record.append((slot, old_k, old_v))
        if _tracks_grad(k, self.keys):
            self.keys, self.values = self.keys.scatter(2, slot, k), self.values.scatter(2, slot, v)
        else:
            self.keys.scatter_(2, slot, k)
            self.values.scatter_(2, slot, v)

    def _write_chunk(self, k, v, ctx) -> None:
        """Each slot takes the newest real chunk token that maps to it, else keeps its content."""
        length = ctx.length
        count = length if ctx.valid is None else ctx.valid.sum(dim=1, keepdim=True)
        start = ctx.start[:, None]
        last = start + count - 1
        newest = last - (last - torch.arange(self.capacity, device=k.device)) % self.capacity
        from_chunk = (newest >= start)[:, None, :, None]
        rank = (newest - start).clamp(min=0)
        if ctx.valid is None:
            index = rank
        else:
            index = torch.searchsorted(ctx.valid.long().cumsum(dim=1), rank + 1)
        index = index.clamp(max=length - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys = torch.where(from_chunk, k.gather(2, index), self.keys)
        values = torch.where(from_chunk, v.gather(2, index), self.values)
        if _tracks_grad(k, self.keys):
            self.keys, self.values = keys, values
        else:
            self.keys.copy_(keys)
            self.values.copy_(values)

    def undo(self, record) -> None:
        slot, old_k, old_v = record
        self.keys.scatter_(2, slot, old_k)
        self.values.scatter_(2, slot, old_v)

    def length(self) -> int:
        return 0 if self.keys is None else self.capacity

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def state(self) -> dict:
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}

    def load_state(self, state: dict) -> None:
        self.keys, self.values = state["keys"].contiguous(), state["values"].contiguous()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)


class GrowingKeyValues:
    """Every column's keys/values of one layer (nanochat's "L" layers), in a buffer that doubles when full.

    Padding columns are stored too (position -1, never seen), so all rows share one length.
    """

    def __init__(self, window: int):
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.used = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        end = self.used + ctx.length
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(k, growing_capacity(end))
        if ctx.valid is not None:  # padding columns hold zeros: saved and compared states do not depend on them
            real = ctx.valid[:, None, :, None]
            k, v = torch.where(real, k, 0.0), torch.where(real, v, 0.0)
        self.keys[:, :, self.used:end] = k
        self.values[:, :, self.used:end] = v
        self.positions[:, self.used:end] = ctx.key_positions
        columns = torch.arange(end, device=k.device)

        def build():
            query_columns = (self.used + torch.arange(ctx.length, device=k.device))[:, None]
            seen = visible_keys(ctx.query_positions, self.positions[:, :end], self.window)
            return (seen & (columns[None, :] <= query_columns)) | (columns[None, :] == query_columns)
        mask = ctx.mask(("all", self.window), build)
        y = sdpa(q, self.keys[:, :, :end], self.values[:, :, :end], mask)
        self.used = end
        if ctx.records is not None:
            for record in ctx.records:
                record.append(None)
        return y

    def _grow(self, like: torch.Tensor, capacity: int) -> None:
        shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        positions = torch.full((like.shape[0], capacity), -1, dtype=torch.long, device=like.device)
        if self.keys is not None:
            keys[:, :, :self.used] = self.keys[:, :, :self.used]
            values[:, :, :self.used] = self.values[:, :, :self.used]
            positions[:, :self.used] = self.positions[:, :self.used]
        self.keys, self.values, self.positions = keys, values, positions

    def undo(self, record) -> None:
        self.used -= 1

    def length(self) -> int:
        return self.used

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.positions) if t is not None]

    def state(self) -> dict:
        if self.keys is None:
            return {}
        return {"keys": self.keys[:, :, :self.used], "values": self.values[:, :, :self.used],
                "positions": self.positions[:, :self.used]}

    def load_state(self, state: dict) -> None:
        keys = state["keys"]
        self.keys, self.used = None, 0
        self._grow(keys, growing_capacity(keys.shape[2]))
        self.used = keys.shape[2]
        self.keys[:, :, :self.used] = keys
        self.values[:, :, :self.used] = state["values"]
        self.positions[:, :self.used] = state["positions"]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.keys is not None:
            self.keys, self.values, self.positions = fn(self.keys), fn(self.values), fn(self.positions)


class ColumnRecord(NamedTuple):
    """What one column changed: the row states before it and, per layer, the slots it overwrote."""

    positions: torch.Tensor
    memory: torch.Tensor | None
    embedding: torch.Tensor
    layers: list


class MaglevCache(Cache):
    """Cache of a Maglev decoder: per layer the keys/values its window still needs (memory already
    injected), per row its position, last memory vector and smear's previous-token embedding.

    Its size does not depend on how many tokens were read, except for layers with nanochat's
    full window (memory off), which keep every token as nanochat does. `get_seq_length()` counts
    columns (padding included), as generate() slices its inputs by it.
    """

    def __init__(self, config: MaglevConfig, max_rollback: int = 256):
        super().__init__(layers=[])
        self.config = config
        self.fingerprint = config_fingerprint(config)
        self.max_rollback = max_rollback
        self.layer_stores = [
            GrowingKeyValues(window) if config.layer_keeps_all_tokens(i) else RingKeyValues(window)
            for i, window in enumerate(config.decoder_windows)
        ]
        self.seen_tokens = 0
        self.positions: torch.Tensor | None = None
        self.last_memory: torch.Tensor | None = None
        self.previous_embedding: torch.Tensor | None = None
        self.recording = False
        self.history: deque[ColumnRecord] = deque(maxlen=max_rollback)

    # ----- what the model uses -----------------------------------------------------------
    def check_compatible(self, config: MaglevConfig) -> None:
        """Refuse a cache made for a model with another architecture."""
        if config is self.config:
            return
        differences = fingerprint_mismatch(config_fingerprint(config), self.fingerprint)
        if differences:
            raise ValueError("this MaglevCache was made for another Maglev config: " + "; ".join(differences))

    def prepare(self, batch_size: int, like: torch.Tensor, memory_init: torch.Tensor | None) -> None:
        """Start empty rows on the first forward (smear predecessor 0 = no smear, memory = memory_init);
        later forwards must keep the batch size."""
        if self.positions is None:
            hidden = self.config.hidden_size
            self.positions = torch.zeros(batch_size, dtype=torch.long, device=like.device)
            self.previous_embedding = like.new_zeros(batch_size, 1, hidden)
            if memory_init is not None:
                self.last_memory = memory_init.to(like.dtype).expand(batch_size, 1, hidden)
        elif self.positions.shape[0] != batch_size:
            raise ValueError(f"the cache holds {self.positions.shape[0]} rows but the inputs have {batch_size}; "
                             "use reorder_cache/batch_select_indices/batch_repeat_interleave to change it")

    def step_context(self, valid: torch.Tensor | None, length: int) -> StepContext:
        return StepContext(self.positions, valid, length, record=self.recording)

    def advance(self, ctx: StepContext, embeddings: torch.Tensor, memories: torch.Tensor | None) -> None:
        """Record a processed chunk: per row its real-token count, last real (pre-smear) embedding and memory."""
        if ctx.length == 1:
            if ctx.records is not None:
                self.history.append(ColumnRecord(self.positions, self.last_memory, self.previous_embedding,
                                                 ctx.records[0]))
            if ctx.valid is None:
                self.positions = self.positions + 1
                self.previous_embedding = embeddings
                if memories is not None:
                    self.last_memory = memories
            else:
                keep = ctx.valid[:, :, None]
                self.positions = self.positions + ctx.valid[:, 0]
                self.previous_embedding = torch.where(keep, embeddings, self.previous_embedding)
                if memories is not None:
                    self.last_memory = torch.where(keep, memories.to(self.last_memory.dtype), self.last_memory)
        else:
            valid = ctx.valid if ctx.valid is not None else embeddings.new_ones(embeddings.shape[:2], dtype=torch.bool)
            if ctx.records is not None:
                previous = previous_real_index(valid)
                before_embeddings = gather_columns(self.previous_embedding, embeddings, previous)
                before_memories = (None if memories is None
                                   else gather_columns(self.last_memory, memories, previous))
                before_positions = self.positions[:, None] + (valid.long().cumsum(dim=1) - valid.long())
                for t in range(ctx.length):
                    self.history.append(ColumnRecord(
                        before_positions[:, t], None if memories is None else before_memories[:, t:t + 1],
                        before_embeddings[:, t:t + 1], ctx.records[t]))
            last = last_real_index(valid)[:, -1:]
            self.previous_embedding = gather_columns(self.previous_embedding, embeddings, last)
            if memories is not None:
                self.last_memory = gather_columns(self.last_memory, memories, last)
            self.positions = self.positions + valid.sum(dim=1)
        self.seen_tokens += ctx.length

    # ----- Cache API --------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        """Crop can roll back only what was recorded (activate_past_recording)."""
        return self.recording

    @property
    def is_sliding(self) -> list[bool]:
        return [isinstance(store, RingKeyValues) for store in self.layer_stores]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layer_stores)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layer_stores)

    @property
    def batch_size(self) -> int:
        return -1 if self.positions is None else self.positions.shape[0]

    def layer_lengths(self) -> list[int]:
        """Key/value entries each layer holds (ring capacity, or columns for full-window layers)."""
        return [store.length() for store in self.layer_stores]

    def nbytes(self) -> int:
        """Bytes held by the cache's state (rollback records, kept only while recording, not included)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        tensors = [t for store in self.layer_stores for t in store.tensors()]
        return tensors + [t for t in (self.positions, self.last_memory, self.previous_embedding) if t is not None]

    def reset(self) -> None:
        self.__init__(self.config, self.max_rollback)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for store in self.layer_stores:
            store.map_batch(fn)
        self.positions, self.last_memory, self.previous_embedding = (
            None if t is None else fn(t) for t in (self.positions, self.last_memory, self.previous_embedding))
        records = list(self.history)
        self.history.clear()
        for record in records:
            layers = [None if layer is None else tuple(fn(t) for t in layer) for layer in record.layers]
            self.history.append(ColumnRecord(fn(record.positions), None if record.memory is None else fn(record.memory),
                                             fn(record.embedding), layers))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def activate_past_recording(self) -> None:
        """Remember, for the last `max_rollback` columns, what each overwrote, so `crop` can undo them."""
        self.recording = True

    def crop(self, max_length: int) -> None:
        """Roll back to `max_length` columns (absolute, > 0) or remove `-max_length` columns (<= 0; 0 removes nothing).

        Exact: every window slot, memory, smear carry and position returns to its earlier value. Needs
        recording (activate_past_recording) since before those columns were read.
        """
        remove = -max_length if max_length <= 0 else self.seen_tokens - max_length
        if remove <= 0:
            return
        if remove > len(self.history):
            reason = ("recording is not active (call activate_past_recording before reading them)"
                      if not self.recording else f"only the last {len(self.history)} columns are recorded")
            raise ValueError(f"MaglevCache cannot remove {remove} columns: {reason}")
        for _ in range(remove):
            record = self.history.pop()
            self.positions, self.last_memory = record.positions, record.memory
            self.previous_embedding = record.embedding
            for store, layer_record in zip(self.layer_stores, record.layers):
                store.undo(layer_record)
        self.seen_tokens -= remove

    def update(self, *args, **kwargs):
        raise NotImplementedError("MaglevCache is filled by the Maglev model itself, not through Cache.update")

    # ----- saved caches ("prompt caching") ------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the cache to folder `path`: tensors as safetensors plus a JSON with the config fingerprint."""
        from safetensors.torch import save_file

        if self.positions is None:
            raise ValueError("the cache is empty: read some tokens before saving it")
        tensors = {"positions": self.positions, "previous_embedding": self.previous_embedding}
        if self.last_memory is not None:
            tensors["last_memory"] = self.last_memory
        for i, store in enumerate(self.layer_stores):
            tensors.update({f"layers.{i}.{name}": t for name, t in store.state().items()})
        meta = {"format": CACHE_FORMAT, "version": CACHE_FORMAT_VERSION, "seen_tokens": self.seen_tokens,
                "batch_size": self.batch_size, "dtype": str(self.previous_embedding.dtype).removeprefix("torch."),
                "config": self.fingerprint}
        os.makedirs(path, exist_ok=True)
        tensor_path, meta_path = os.path.join(path, TENSORS_FILE), os.path.join(path, META_FILE)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tensor_path + ".tmp")
        with open(meta_path + ".tmp", "w") as handle:
            json.dump(meta, handle, indent=2)
        os.replace(tensor_path + ".tmp", tensor_path)
        os.replace(meta_path + ".tmp", meta_path)

    @classmethod
    def load(cls, path: str | os.PathLike, model) -> "MaglevCache":
        """Read a cache written by `save` for `model`; refuses one made for another config."""
        from safetensors.torch import load_file

        meta_path, tensor_path = os.path.join(path, META_FILE), os.path.join(path, TENSORS_FILE)
        if not (os.path.isfile(meta_path) and os.path.isfile(tensor_path)):
            raise ValueError(f"{path} is not a saved MaglevCache (needs {META_FILE} and {TENSORS_FILE})")
        with open(meta_path) as handle:
            meta = json.load(handle)
        if meta.get("format") != CACHE_FORMAT or meta.get("version") != CACHE_FORMAT_VERSION:
            raise ValueError(f"{meta_path} is not a {CACHE_FORMAT} version {CACHE_FORMAT_VERSION} file")
        config = model.config
        differences = fingerprint_mismatch(config_fingerprint(config), meta.get("config", {}))
        if differences:
            raise ValueError(f"the cache in {path} was made for another Maglev config: " + "; ".join(differences))
        device, dtype = model.device, model.dtype
        # fresh copies: on CPU the loaded tensors are views into the file's buffer at any byte offset, and
        # unaligned data takes other vector kernels, which round differently from the live cache
        tensors = {k: v.clone() for k, v in load_file(tensor_path, device=str(device)).items()}
        cache = cls(config)
        cache.seen_tokens = meta["seen_tokens"]
        cache.positions = tensors["positions"]
        cache.previous_embedding = tensors["previous_embedding"].to(dtype)
        cache.last_memory = tensors["last_memory"].to(dtype) if "last_memory" in tensors else None
        for i, store in enumerate(cache.layer_stores):
            prefix = f"layers.{i}."
            state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                store.load_state({k: v if k == "positions" else v.to(dtype) for k, v in state.items()})
        return cache

    def __len__(self) -> int:
        return len(self.layer_stores)

    def __repr__(self) -> str:
        return f"MaglevCache(seen_tokens={self.seen_tokens}, layers={len(self.layer_stores)}, nbytes={self.nbytes()})"
