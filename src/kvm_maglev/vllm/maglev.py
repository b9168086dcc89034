"""Maglev on vLLM: the decoder P run recurrently by our own model code, its per-request state in vLLM's state pages.

Each decoder layer owns one state page per request (a `MambaBase` layer, so vLLM's cache manager allocates the
pages with the request and frees them with it): the layer's window ring of keys and values (memory already
injected), and the request's carry (the last memory vector and smear's previous-token embedding, read from and
written to layer 0's page; the other layers' carry rows stay unused so that every page has one size). A request's
position is vLLM's token position, so it is not stored.

A forward gathers the scheduled requests' pages into a `MaglevCache` (one row per request, each at its own
position), runs `MaglevModel.forward` on it (token after token, the paper's recurrent prompt processing, padding
skipped per row) and writes the rows back. Chunked prefill continues a row from its pages, and a preempted
request restarts at position 0 with a fresh carry, so both give the tokens of one uninterrupted `generate()`.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig

from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM, MaglevModel
from kvm_maglev.models.maglev.onednn_linear import OneDNNLinear
from kvm_maglev.vllm.pages import PagedStateModel, ScheduledRows, page_layers

MEMORY, EMBEDDING = 0, 1  # rows of the carry state


def ring_slots(config: MaglevConfig, max_model_len: int) -> list[int]:
    """Key/value slots of each layer's ring: its window (`sliding_window - 1` keys before the current one), or at
    most `max_model_len` for a nanochat window wider than any request (positions then never wrap around)."""
    return [min(left, max_model_len) for left in config.decoder_windows]


class VllmMaglevForCausalLM(PagedStateModel):
    """`MaglevForCausalLM` for vLLM: our model and head, a `StatePages` per decoder layer."""

    MODEL_NAME = "Maglev"
    PROMPT_EMBEDDINGS_REFUSED = "smear and value embeddings index token ids"
    SKIPPED_WEIGHTS = ("model.prefiller",)  # a kept prefiller: vLLM runs P recurrently

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.build(vllm_config, MaglevConfig, MaglevModel, OneDNNLinear, "head_rows")
        config, dtype = self.config, vllm_config.model_config.dtype
        slots = ring_slots(config, vllm_config.model_config.max_model_len)
        # per layer: its ring of keys and values, and the request's carry (used in layer 0's page only)
        shapes = [[(config.num_key_value_heads, n, config.head_dim)] * 2 + [(2, config.hidden_size)] for n in slots]
        self.state_layers = page_layers(prefix, shapes, [[dtype] * 3 for _ in slots])

    def gather(self, rows: ScheduledRows) -> MaglevCache:
        """A MaglevCache whose rows are the scheduled requests' pages; rows at position 0 start fresh."""
        cache = MaglevCache(self.config)
        fresh = rows.fresh[:, None]
        carry = self.state_layers[0].kv_cache[2][rows.pages[0]]
        memory_init = self.model.memory_init
        if memory_init is not None:
            start_memory = memory_init.to(carry.dtype).expand_as(carry[:, MEMORY])
            cache.last_memory = torch.where(fresh, start_memory, carry[:, MEMORY])[:, None]
        cache.previous_embedding = torch.where(fresh, 0.0, carry[:, EMBEDDING])[:, None]
        cache.positions = rows.positions
        # generate() counts columns read; a positive count means "continue" (never the prefiller: refused on vLLM)
        cache.seen_tokens = int(rows.positions.max()) + 1
        for store, layer, index in zip(cache.layer_stores, self.state_layers, rows.pages):
            store.grows = False
            store.load_state({"keys": layer.kv_cache[0][index], "values": layer.kv_cache[1][index]})
        return cache

    def scatter(self, rows: ScheduledRows, cache: MaglevCache) -> None:
        """Write the advanced rows back into their pages."""
        for store, layer, index in zip(cache.layer_stores, self.state_layers, rows.pages):
            layer.kv_cache[0][index] = store.keys
            layer.kv_cache[1][index] = store.values
        carry = self.state_layers[0].kv_cache[2]
        if cache.last_memory is not None:
            carry[rows.pages[0], MEMORY] = cache.last_memory[:, 0].to(carry.dtype)
        carry[rows.pages[0], EMBEDDING] = cache.previous_embedding[:, 0].to(carry.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Our head: lm_head, padded rows sliced away, float32, soft-capped (MaglevForCausalLM.logits)."""
        return MaglevForCausalLM.logits(self, hidden_states)
