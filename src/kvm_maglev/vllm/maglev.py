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

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM, MaglevModel

MEMORY, EMBEDDING = 0, 1  # rows of the carry state


def ring_slots(config: MaglevConfig, max_model_len: int) -> list[int]:
    """Key/value slots of each layer's ring: its window (`sliding_window - 1` keys before the current one), or at
    most `max_model_len` for a nanochat window wider than any request (positions then never wrap around)."""
    return [min(left, max_model_len) for left in config.decoder_windows]


class MaglevStateLayer(nn.Module, MambaBase):
    """The state pages of one decoder layer: keys and values [kv_heads, slots, head_dim] and the carry [2, hidden]."""

    def __init__(self, config: MaglevConfig, slots: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.shape = (config.num_key_value_heads, slots, config.head_dim)
        self.hidden_size = config.hidden_size
        self.dtype = dtype
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self  # how vLLM finds the layer to allocate and bind its pages

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shape, self.shape, (2, self.hidden_size)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.dtype, self.dtype, self.dtype

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # the linear-attention metadata carries what we read: per-request query starts and state page indices
        return MambaAttentionBackendEnum.LINEAR


class VllmMaglevForCausalLM(nn.Module, HasInnerState, IsAttentionFree):
    """`MaglevForCausalLM` for vLLM: our model and head, one `MaglevStateLayer` per decoder layer."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if not isinstance(config, MaglevConfig):
            config = MaglevConfig(**config.to_dict())
        self.config = config
        dtype = vllm_config.model_config.dtype
        self.model = MaglevModel(config).to(dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.head_rows, bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        slots = ring_slots(config, vllm_config.model_config.max_model_len)
        self.state_layers = nn.ModuleList([
            MaglevStateLayer(config, slots[i], dtype, f"{prefix}state_layers.{i}" if not prefix
                             else f"{prefix}.state_layers.{i}") for i in range(config.num_hidden_layers)])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (vLLM's interface); Maglev itself reads token ids, not embeddings."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Head inputs [tokens, hidden] of the scheduled tokens, each request advanced from its state pages."""
        if inputs_embeds is not None:
            raise ValueError("Maglev reads token ids (smear and value embeddings index them); prompt embeddings "
                             "are not supported")
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # vLLM's profiling and warm-up runs: no request, no pages
            return torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.lm_head.weight.dtype,
                               device=input_ids.device)
        if isinstance(metadata, list):  # one dict per micro-batch (ubatching); a single one here
            metadata = metadata[0]
        layers = [(layer, metadata[layer.prefix]) for layer in self.state_layers]
        first = layers[0][1]
        starts = first.query_start_loc.tolist()
        requests = first.num_decodes + first.num_prefills
        starts = starts[:requests + 1]
        lengths = [end - begin for begin, end in zip(starts[:-1], starts[1:])]
        width = max(lengths)
        tokens = input_ids.new_zeros(requests, width)
        valid = torch.zeros(requests, width, dtype=torch.bool, device=input_ids.device)
        for row, (begin, length) in enumerate(zip(starts, lengths)):
            tokens[row, :length] = input_ids[begin:begin + length]
            valid[row, :length] = True
        row_positions = positions[torch.tensor(starts[:-1], device=positions.device)].long()
        cache = self.gather(layers, row_positions)
        # generate() runs the model inside its runtime speed-ups; so does serving (same math up to rounding)
        with torch.no_grad(), self.model.runtime_speedups():
            outputs = self.model(input_ids=tokens, attention_mask=None if min(lengths) == width else valid.long(),
                                 past_key_values=cache, use_cache=True, return_dict=True)
        self.scatter(layers, cache)
        # one row per input position: vLLM may pad the token count past the scheduled tokens (rows left at zero)
        hidden = outputs.last_hidden_state.new_zeros(input_ids.shape[0], self.config.hidden_size)
        hidden[:starts[-1]] = outputs.last_hidden_state[valid]
        return hidden

    def gather(self, layers, row_positions: torch.Tensor) -> MaglevCache:
        """A MaglevCache whose rows are the scheduled requests' pages; rows at position 0 start fresh."""
        config = self.config
        cache = MaglevCache(config)
        fresh = (row_positions == 0)[:, None]
        carry_layer, carry_metadata = layers[0]
        carry = carry_layer.kv_cache[2][carry_metadata.state_indices_tensor[:len(row_positions)].long()]
        dtype = carry.dtype
        memory_init = self.model.memory_init
        if memory_init is not None:
            start_memory = memory_init.to(dtype).expand_as(carry[:, MEMORY])
            cache.last_memory = torch.where(fresh, start_memory, carry[:, MEMORY])[:, None]
        cache.previous_embedding = torch.where(fresh, 0.0, carry[:, EMBEDDING])[:, None]
        cache.positions = row_positions
        # generate() counts columns read; a positive count means "continue" (never the prefiller: refused on vLLM)
        cache.seen_tokens = int(row_positions.max()) + 1
        for store, (layer, metadata) in zip(cache.layer_stores, layers):
            index = metadata.state_indices_tensor[:len(row_positions)].long()
            store.grows = False
            store.load_state({"keys": layer.kv_cache[0][index], "values": layer.kv_cache[1][index]})
        return cache

    def scatter(self, layers, cache: MaglevCache) -> None:
        """Write the advanced rows back into their pages."""
        rows = cache.positions.shape[0]
        for store, (layer, metadata) in zip(cache.layer_stores, layers):
            index = metadata.state_indices_tensor[:rows].long()
            layer.kv_cache[0][index] = store.keys
            layer.kv_cache[1][index] = store.values
        carry_layer, carry_metadata = layers[0]
        index = carry_metadata.state_indices_tensor[:rows].long()
        carry = carry_layer.kv_cache[2]
        if cache.last_memory is not None:
            carry[index, MEMORY] = cache.last_memory[:, 0].to(carry.dtype)
        carry[index, EMBEDDING] = cache.previous_embedding[:, 0].to(carry.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Our head: lm_head, padded rows sliced away, float32, soft-capped (MaglevForCausalLM.logits)."""
        return MaglevForCausalLM.logits(self, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a folder's safetensors (P's keys; a kept prefiller is skipped: vLLM runs P recurrently)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                if name.startswith("model.prefiller") or name in ("lm_head.weight",):
                    continue
                raise ValueError(f"Maglev on vLLM: the checkpoint has a tensor {name!r} the model does not have")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"Maglev on vLLM: {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                                 f"{tuple(param.shape)} in the model")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
