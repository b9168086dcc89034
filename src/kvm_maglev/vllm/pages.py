"""What both served models share: per-layer state pages that vLLM's cache manager allocates per request, and the
scheduled tokens of one engine step (request after request, flat) for our models' batched forwards.

A request's position is vLLM's token position, so no page stores it; a request at position 0 (new, or preempted
and recomputed) starts from an empty state whatever its pages hold.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from kvm_maglev.models.common.step_plan import RowTokens
from kvm_maglev.models.common.tensor_parallel import local_tensor
from kvm_maglev.vllm.engine_linears import use_engine_linears
from kvm_maglev.vllm.page_caches import step_page_indices
from kvm_maglev.vllm.tensor_parallel import rank_slice

logger = logging.getLogger("vllm.kvm_maglev")  # under vLLM's logger: its handler prints our INFO lines with its own


class StatePages(nn.Module, MambaBase):
    """One layer's state pages: a tensor per entry of `shapes`/`dtypes`, per request (vLLM binds them to
    `kv_cache`). Pages of different layers may differ in size; vLLM pads them to the largest."""

    def __init__(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], prefix: str):
        super().__init__()
        if len(shapes) != len(dtypes):
            raise ValueError(f"{prefix}: {len(shapes)} state shapes but {len(dtypes)} dtypes")
        self.prefix = prefix
        self.shapes = tuple(tuple(shape) for shape in shapes)
        self.dtypes = tuple(dtypes)
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self  # how vLLM finds the layer to allocate and bind its pages

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # the linear-attention metadata carries what we read: per-request query starts and state page indices
        return MambaAttentionBackendEnum.LINEAR


def page_layers(prefix: str, shapes: list[list[tuple[int, ...]]], dtypes: list[list[torch.dtype]]) -> nn.ModuleList:
    """A `StatePages` per layer, named `<prefix>.state_layers.<i>` as vLLM's forward context knows them. With prefix
    caching on, logs what each cached block holds."""
    name = f"{prefix}.state_layers" if prefix else "state_layers"
    layers = nn.ModuleList([StatePages(s, d, f"{name}.{i}") for i, (s, d) in enumerate(zip(shapes, dtypes))])
    cache_config = get_current_vllm_config().cache_config
    if cache_config.mamba_cache_mode == "align":
        logger.info("prefix caching: each cached block of %d tokens holds the request's state, %d bytes (%d layers' "
                    "pages, each padded to the largest)", cache_config.mamba_block_size, cached_block_bytes(layers),
                    len(layers))
    return layers


def page_bytes(layer: StatePages) -> int:
    """The bytes of one page of `layer`: its state tensors, packed one after another."""
    return sum(prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in zip(layer.get_state_shape(), layer.get_state_dtype()))


def cached_block_bytes(layers: nn.ModuleList) -> int:
    """The bytes a cached block of prefix caching holds: one page per layer, as vLLM allocates them (every layer's
    page padded to the largest)."""
    return len(layers) * max(page_bytes(layer) for layer in layers)


def whole_page_copy(spans: dict[int, int]):
    """vLLM's state copy function for align-mode prefix caching, copying a layer's whole page: `spans` maps the
    address of each layer's first page tensor to the bytes of its page. vLLM calls it with a layer's first state
    tensor; the layer's other tensors follow it in the same page (`MambaBase.bind_kv_cache`), so one span copies
    every one, whatever their number (layers of one model differ in it)."""

    def copy(state: torch.Tensor, block_ids: list[int], block: int, accepted_tokens: int) -> MambaCopySpec:
        source = state[block_ids[block + accepted_tokens - 1]]  # no speculative decoding: accepted_tokens is 1
        return MambaCopySpec(start_addr=source.data_ptr(), num_elements=spans[state.data_ptr()] // state.element_size())
    return copy


@dataclass
class ScheduledStep:
    """One engine step's scheduled tokens, request after request: request r reads `counts[r]` tokens from position
    `starts[r]` (the tokens it has read before); `pages[i]` holds each request's page index in layer i's tensors;
    `total` is the number of scheduled tokens (vLLM may pad its token count past them)."""

    starts: list[int]
    counts: list[int]
    pages: list[torch.Tensor]
    total: int

    def row_tokens(self, device) -> RowTokens:
        """The step's tokens as the models lay out a forward's tokens: flat, request after request."""
        return RowTokens(self.starts, self.counts, device)

    def select(self, rows: list[int], device) -> tuple[ScheduledStep, torch.Tensor]:
        """The step of requests `rows` alone (in that order) and the indices of their tokens in this step's flat
        tokens, for a model that runs a step's requests in more than one forward."""
        bounds = [0]
        for count in self.counts:
            bounds.append(bounds[-1] + count)
        tokens = torch.cat([torch.arange(bounds[row], bounds[row + 1], device=device) for row in rows])
        index = torch.tensor(rows, device=self.pages[0].device)
        part = ScheduledStep([self.starts[row] for row in rows], [self.counts[row] for row in rows],
                             [pages[index] for pages in self.pages], len(tokens))
        return part, tokens


def scheduled_step(layers: nn.ModuleList, positions: torch.Tensor) -> ScheduledStep | None:
    """The step's `ScheduledStep` from vLLM's forward context, or None in its profiling and warm-up runs (no
    request, no pages)."""
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return None
    if isinstance(metadata, list):  # one dict per micro-batch (ubatching); a single one here
        metadata = metadata[0]
    first = metadata[layers[0].prefix]
    requests = first.num_decodes + first.num_prefills
    bounds = first.query_start_loc[:requests + 1].tolist()
    counts = [end - begin for begin, end in zip(bounds[:-1], bounds[1:])]
    starts = positions[first.query_start_loc[:requests]].tolist()
    pages = step_page_indices([metadata[layer.prefix].state_indices_tensor for layer in layers], requests)
    return ScheduledStep(starts, counts, pages, bounds[-1])


class PagedStateModel(nn.Module, HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching):
    """What a served model of this package does each engine step: run its model's layers over the step's scheduled
    tokens, all requests in one batched forward whatever their positions, each request's state read and written in
    place in its pages. Subclasses set `model`, `lm_head`, `config` and `state_layers` (`build` sets the first
    three) and define `run_step` and `compute_logits`."""

    MODEL_NAME = ""  # in error messages
    PROMPT_EMBEDDINGS_REFUSED = ""  # why prompt embeddings are refused
    # checkpoint tensors the served model does not hold (prefixes), skipped when loading
    SKIPPED_WEIGHTS: tuple[str, ...] = ()
    # per checkpoint tensor split across tensor-parallel ranks, the dimension to slice to this rank's share
    # (`tensor_parallel.shard_by_plan`); empty: every tensor loaded whole
    shards: dict[str, int] = {}
    speedups: contextlib.ExitStack | None = None  # the model's runtime speed-ups, held open (`hold_speedups`)

    def build(self, vllm_config, config_class: type, model_class: type, head_class: type, head_rows: str) -> None:
        """Set `config` (the folder's, as `config_class`), `model` (`model_class` in the served dtype) and `lm_head`
        (a `head_class` linear, as the model's own head, of `config.<head_rows>` rows, tied to the embeddings when
        the config ties them)."""
        config = vllm_config.model_config.hf_config
        if not isinstance(config, config_class):
            config = config_class(**config.to_dict())
        self.config = config
        dtype = vllm_config.model_config.dtype
        self.model = model_class(config).to(dtype)
        self.lm_head = head_class(config.hidden_size, getattr(config, head_rows), bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def split_vocabulary(self, dtype: torch.dtype, embedding_rows: int, head_rows: int, vocab_size: int,
                         soft_cap: float | None) -> None:
        """Embeddings and head as vLLM's vocabulary-parallel layers of the checkpoint's rows (tied when the config
        ties them); vLLM's logits processor gathers the ranks' logits, keeps the first `vocab_size` (the head's
        padding rows dropped) and applies `soft_cap` (None: none)."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        config = self.config
        self.model.embed_tokens = VocabParallelEmbedding(embedding_rows, config.hidden_size, params_dtype=dtype,
                                                         prefix="model.embed_tokens")
        self.lm_head = ParallelLMHead(head_rows, config.hidden_size, params_dtype=dtype, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(head_rows, org_vocab_size=vocab_size, soft_cap=soft_cap)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (vLLM's interface; the forward reads token ids)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Head inputs [tokens, hidden] of the scheduled tokens, each request advanced from its state pages."""
        if inputs_embeds is not None:
            raise ValueError(f"{self.MODEL_NAME} on vLLM: prompt embeddings are not supported "
                             f"({self.PROMPT_EMBEDDINGS_REFUSED})")
        step = scheduled_step(self.state_layers, positions)
        if step is None:  # vLLM's profiling and warm-up runs: no request, no pages
            return torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.lm_head.weight.dtype,
                               device=input_ids.device)
        self.hold_speedups()
        with torch.no_grad():
            hidden = self.run_step(input_ids[:step.total], step)
        return F.pad(hidden, (0, 0, 0, input_ids.shape[0] - step.total))

    def get_mamba_state_copy_funcs(self, mamba_types: set) -> dict:
        """For prefix caching (vLLM's align mode): each layer's whole page copied as one span, from a request's
        state at the last block it completed into the block it writes next, or from a cached block into a request
        that continues a cached prefix. Called by vLLM's model runner once the pages are bound."""
        spans = {}
        for layer in self.state_layers:
            first, size = layer.kv_cache[0], page_bytes(layer)
            if size % first.element_size():
                raise ValueError(f"{layer.prefix}: a page of {size} bytes is not a whole number of its first tensor's "
                                 f"{first.dtype} elements, which vLLM's copy counts in")
            # layers whose pages share one tensor (vLLM may bind several layers to one buffer, every page padded
            # to the largest) share a key: the largest page is copied, within the block's padded page
            spans[first.data_ptr()] = max(size, spans.get(first.data_ptr(), 0))
        return {mamba_type: (whole_page_copy(spans),) for mamba_type in mamba_types}

    def page_tensors(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s page tensors, [pages, ...] each, as vLLM bound them."""
        return tuple(self.state_layers[layer].kv_cache)

    def hold_speedups(self) -> None:
        """Open the model's runtime speed-ups (same math up to rounding) once, for the engine's life: generate()
        holds them for a whole generation, and a serving step is a single forward; leaving the block after each
        step would drop the linears' blocked weight copies, remade at the next."""
        if self.speedups is None:
            self.speedups = contextlib.ExitStack()
            # over the whole served module, the head included, as generate() opens them over the causal LM
            self.speedups.enter_context(type(self.model).runtime_speedups(self))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a folder's safetensors into the parameters of the same names, each split one (`shards`) sliced to
        this rank's share (vLLM's vocabulary-parallel layers slice their own); a tied head counts as loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name in self.shards:
                tensor = rank_slice(tensor, self.shards[name])
            if name not in params:
                if name.startswith(self.SKIPPED_WEIGHTS) or name == "lm_head.weight":
                    continue
                raise ValueError(f"{self.MODEL_NAME} on vLLM: the checkpoint has a tensor {name!r} the model does "
                                 "not have")
            param = params[name]
            loaded.add(name)
            if hasattr(param, "weight_loader"):  # a vLLM layer's parameter: it takes its own share
                param.weight_loader(param, tensor)
                continue
            param = local_tensor(param)  # a tensor-parallel parameter: this rank's share, sliced by the caller
            if param.shape != tensor.shape:
                raise ValueError(f"{self.MODEL_NAME} on vLLM: {name} has shape {tuple(tensor.shape)} in the "
                                 f"checkpoint, {tuple(param.shape)} in the model")
            with torch.no_grad():
                param.copy_(tensor)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        vllm_config = get_current_vllm_config()
        if get_tensor_model_parallel_world_size() == 1 and vllm_config.quant_config is None:
            use_engine_linears(self.model, vllm_config.model_config.dtype)  # vLLM's product, as its Llama's
        return loaded
