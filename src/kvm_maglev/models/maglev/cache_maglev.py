"""MaglevCache: bounded per-layer key/value rings plus the per-sequence recurrent state."""

from typing import Callable

import torch
from transformers.cache_utils import Cache

from .configuration_maglev import MaglevConfig, growing_capacity


class RingKeyValues:
    """The last `capacity` keys/values of one layer in a fixed-size ring (slot = position % capacity)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, start: int):
        """Return the keys/values a chunk starting at `start` attends to (with their positions), then store it."""
        chunk = keys.shape[2]
        positions = torch.arange(start, start + chunk, device=keys.device)
        if self.keys is None:
            self.keys = keys.new_zeros(keys.shape[0], keys.shape[1], self.capacity, keys.shape[3])
            self.values = values.new_zeros(self.keys.shape)
            all_keys, all_values, key_positions = keys, values, positions
        else:
            slots = torch.arange(self.capacity, device=keys.device)
            # Slot s holds the latest position p < start with p % capacity == s (negative: never written).
            slot_positions = start - 1 - (start - 1 - slots) % self.capacity
            all_keys = torch.cat([self.keys, keys], dim=2)
            all_values = torch.cat([self.values, values], dim=2)
            key_positions = torch.cat([slot_positions, positions])
        kept = min(chunk, self.capacity)
        slots = positions[-kept:] % self.capacity
        self.keys.index_copy_(2, slots, keys[:, :, -kept:])
        self.values.index_copy_(2, slots, values[:, :, -kept:])
        return all_keys, all_values, key_positions

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)


class GrowingKeyValues:
    """All keys/values of one layer (nanochat's "L" layers), in a buffer that doubles when full."""

    def __init__(self, window: int):
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, start: int):
        """Append a chunk and return the keys/values its queries can see (with their positions)."""
        chunk = keys.shape[2]
        end = self.length + chunk
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, growing_capacity(end))
        self.keys[:, :, self.length:end] = keys
        self.values[:, :, self.length:end] = values
        self.length = end
        first = max(0, end - chunk - self.window)
        # Buffer index i holds position i: the cache always starts at position 0.
        positions = torch.arange(first, end, device=keys.device)
        return self.keys[:, :, first:end], self.values[:, :, first:end], positions

    def _grow(self, like: torch.Tensor, capacity: int) -> None:
        shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
        new_keys, new_values = like.new_zeros(shape), like.new_zeros(shape)
        if self.keys is not None:
            new_keys[:, :, :self.length] = self.keys[:, :, :self.length]
            new_values[:, :, :self.length] = self.values[:, :, :self.length]
        self.keys, self.values = new_keys, new_values

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)


class MaglevCache(Cache):
    """Cache of a Maglev decoder: per layer the keys/values its window still needs (memory already
    injected), per sequence the last memory vector and smear's previous-token embedding.

    Its size does not depend on how many tokens were read, except for layers with nanochat's
    full window (memory off), which keep every token as nanochat does.
    """

    def __init__(self, config: MaglevConfig):
        super().__init__(layers=[])
        self.config = config
        self.layer_stores = [
            GrowingKeyValues(window) if config.layer_keeps_all_tokens(i) else RingKeyValues(window)
            for i, window in enumerate(config.decoder_windows)
        ]
        self.seen_tokens = 0
        self.last_memory: torch.Tensor | None = None
        self.previous_embedding: torch.Tensor | None = None

    # ----- what the model uses -----------------------------------------------------------
    def advance(self, num_tokens: int, last_embedding: torch.Tensor, last_memory: torch.Tensor | None) -> None:
        """Record a processed chunk: its length, its last (pre-smear) embedding and last memory."""
        self.seen_tokens += num_tokens
        self.previous_embedding = last_embedding
        if last_memory is not None:
            self.last_memory = last_memory

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
        return False

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
        return -1 if self.previous_embedding is None else self.previous_embedding.shape[0]

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        tensors = [t for store in self.layer_stores for t in store.tensors()]
        return tensors + [t for t in (self.last_memory, self.previous_embedding) if t is not None]

    def reset(self) -> None:
        self.__init__(self.config)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for store in self.layer_stores:
            store.map_batch(fn)
        if self.last_memory is not None:
            self.last_memory = fn(self.last_memory)
        if self.previous_embedding is not None:
            self.previous_embedding = fn(self.previous_embedding)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "MaglevCache cannot be cropped yet: its rings and recurrent memory forget the dropped tokens' "
            "predecessors (assisted / prompt-lookup decoding are not supported)")

    def activate_past_recording(self) -> None:
        raise NotImplementedError("MaglevCache cannot record past states yet (assisted decoding is not supported)")

    def update(self, *args, **kwargs):
        raise NotImplementedError("MaglevCache is filled by the Maglev model itself, not through Cache.update")

    def __len__(self) -> int:
        return len(self.layer_stores)

    def __repr__(self) -> str:
        return f"MaglevCache(seen_tokens={self.seen_tokens}, layers={len(self.layer_stores)}, nbytes={self.nbytes()})"
