"""KVMCache: what a KVM model carries between forward calls.

Per KVM layer: the compressed state (key sums, value sums, value norms or counts), the
block window (keys, values, merge gates of the tokens not yet folded into the state) and
the token-shift carries. Per sliding-window layer: the last `sliding_window` keys/values
and the carries. Window buffers grow geometrically and are compacted rarely, so a decode
step writes one token instead of copying the window; the state changes once per chunk.
"""

from __future__ import annotations

from typing import Iterable

import torch
from transformers.cache_utils import Cache

from .configuration_kvm import KVMConfig


class TokenBuffer:
    """Contiguous [batch, heads, tokens, dim] tensors for a run of absolute positions.

    `begin`/`end` are the absolute positions held. Appends write in place into spare
    capacity (doubling when full) unless autograd tracks the inputs, in which case the
    buffer is rebuilt functionally so that earlier views stay valid for backward.
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
            capacity = self.storage[0].shape[2]
            if self.offset + live + n > capacity:
                new_capacity = max(2 * (live + n), 16)
                grown = []
                for s, t in zip(self.storage, tensors):
                    fresh = t.new_empty(t.shape[:2] + (new_capacity,) + t.shape[3:])
                    fresh[:, :, :live] = s[:, :, self.offset : self.offset + live]
                    grown.append(fresh)
                self.storage, self.offset = grown, 0
            for s, t in zip(self.storage, tensors):
                s[:, :, self.offset + live : self.offset + live + n] = t
        self.end += n

    def view(self, start: int, stop: int) -> list[torch.Tensor]:
        """Views of absolute positions [start, stop)."""
        if not self.begin <= start <= stop <= self.end:
            raise IndexError(f"positions [{start}, {stop}) not held (buffer holds [{self.begin}, {self.end}))")
        lo = self.offset + start - self.begin
        return [s[:, :, lo : lo + stop - start] for s in self.storage]

    def drop_before(self, position: int) -> None:
        """Forget positions before `position`."""
        position = min(max(position, self.begin), self.end)
        self.offset += position - self.begin
        self.begin = position

    def start_at(self, position: int) -> None:
        """Position the (empty) buffer at absolute `position`."""
        self.begin = self.end = position

    def nbytes(self) -> int:
        if self.storage is None:
            return 0
        return sum(s[:, :, :1].numel() * s.element_size() for s in self.storage) * len(self)

    def map_batch(self, fn) -> None:
        if self.storage is not None:
            live = [s[:, :, self.offset : self.offset + len(self)] for s in self.storage]
            self.storage = [fn(s).contiguous() for s in live]
            self.offset = 0


class ShiftCarries:
    """Last token of each token-shifted stream (attention q/k/v/x inputs, FFN input)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor | None:
        return self.values.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = value[:, -1:].detach()  # carried across calls as data, like the research cache

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())

    def map_batch(self, fn) -> None:
        self.values = {k: fn(v) for k, v in self.values.items()}


class KVMLayerCache:
    """State, block window and carries of one KVM layer."""

    is_sliding = False

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window = TokenBuffer()  # keys, values, merge gates (if gated)
        self.state_keys: torch.Tensor | None = None  # sums of layer-normed, rotary-zeroed keys
        self.state_values: torch.Tensor | None = None  # sums of values
        self.state_norms: torch.Tensor | None = None  # float32 slot value norms, or merge counts
        self.read_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # attention-ready state
        self.merged_blocks = 0  # blocks j >= 1 already folded into the state
        self.seen = 0
        self.carries = ShiftCarries()

    @property
    def state_len(self) -> int:
        return 0 if self.state_keys is None else self.state_keys.shape[2]

    def __repr__(self) -> str:
        return f"KVMLayerCache(seen={self.seen}, state_slots={self.state_len}, window_tokens={len(self.window)})"

    def set_state(self, keys: torch.Tensor, values: torch.Tensor, norms: torch.Tensor) -> None:
        self.state_keys, self.state_values, self.state_norms = keys, values, norms
        self.read_cache = None

    def nbytes(self) -> int:
        state = sum(t.numel() * t.element_size() for t in (self.state_keys, self.state_values, self.state_norms)
                    if t is not None)
        return state + self.window.nbytes() + self.carries.nbytes()

    def map_batch(self, fn) -> None:
        self.window.map_batch(fn)
        if self.state_keys is not None:
            self.set_state(fn(self.state_keys), fn(self.state_values), fn(self.state_norms))
        self.carries.map_batch(fn)


class SlidingWindowLayerCache:
    """Last `sliding_window` keys/values and carries of one sliding-window layer."""

    is_sliding = True

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window = TokenBuffer()
        self.seen = 0
        self.carries = ShiftCarries()

    @property
    def state_len(self) -> int:
        return -1

    def __repr__(self) -> str:
        return f"SlidingWindowLayerCache(seen={self.seen}, window_tokens={len(self.window)})"

    def nbytes(self) -> int:
        return self.window.nbytes() + self.carries.nbytes()

    def map_batch(self, fn) -> None:
        self.window.map_batch(fn)
        self.carries.map_batch(fn)


class KVMCache(Cache):
    """Cache of a KVM model; created by the model (`generate` or a forward with use_cache)."""

    def __init__(self, config: KVMConfig, **kwargs) -> None:
        layers = [SlidingWindowLayerCache() if config.is_sliding_window_layer(i) else KVMLayerCache()
                  for i in range(config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.config = config

    # ---- what generate() asks ---------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.get_seq_length() > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding for layer in self.layers]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed so far."""
        return self.layers[layer_idx].seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def state_lengths(self) -> list[int]:
        """State slots per layer (-1 for sliding-window layers)."""
        return [layer.state_len for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes of the tensors the cache holds (live data, not spare buffer capacity)."""
        return sum(layer.nbytes() for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder batch rows (beam search)."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def _map_batch(self, fn) -> None:
        for layer in self.layers:
            layer.map_batch(fn)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "KVMCache cannot be cropped yet: tokens already merged into the KVM state cannot be removed "
            "(assisted / prompt-lookup decoding are not supported)."
        )

    def update(self, *args, **kwargs):
        raise NotImplementedError("KVMCache is updated by the KVM layers themselves, not through Cache.update().")

    def get_mask_sizes(self, *args, **kwargs):
        raise NotImplementedError("KVMCache builds its own attention masks.")

    def activate_past_recording(self) -> None:
        raise NotImplementedError("KVMCache cannot record its past for rollback yet (assisted decoding).")

    def offload(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache does not support offloading.")

    def prefetch(self, *args, **kwargs) -> None:
        raise NotImplementedError("KVMCache does not support offloading.")
