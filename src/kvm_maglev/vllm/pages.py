"""What both served models share: per-layer state pages that vLLM's cache manager allocates per request, and the
scheduled tokens of one engine step laid out as rows (one per request) for our models' batched forwards.

A request's position is vLLM's token position, so no page stores it; a request at position 0 (new, or preempted
and recomputed) starts from a fresh state whatever its pages hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum


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
    """A `StatePages` per layer, named `<prefix>.state_layers.<i>` as vLLM's forward context knows them."""
    name = f"{prefix}.state_layers" if prefix else "state_layers"
    return nn.ModuleList([StatePages(s, d, f"{name}.{i}") for i, (s, d) in enumerate(zip(shapes, dtypes))])


@dataclass
class ScheduledRows:
    """One engine step's tokens as rows: `tokens` [requests, width] (zero past each request's count), `valid`
    marks the scheduled ones, `positions` is each request's first scheduled position (tokens it has read before),
    `pages[i]` the page index of each request in layer i's tensors, `count` the scheduled tokens in all."""

    tokens: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    pages: list[torch.Tensor]
    count: int

    @property
    def ragged(self) -> bool:
        """Whether requests were given different numbers of tokens (then `valid` is the attention mask)."""
        return not bool(self.valid.all())

    @property
    def fresh(self) -> torch.Tensor:
        """[requests] True where a request starts at position 0 (new or preempted): its pages are not read."""
        return self.positions == 0

    def flat(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, dim] hidden states in vLLM's token order from [requests, width, dim]; vLLM may pad its token
        count past the scheduled tokens (those rows stay zero)."""
        out = hidden.new_zeros(rows, hidden.shape[-1])
        out[:self.count] = hidden[self.valid]
        return out


def scheduled_rows(layers: nn.ModuleList, input_ids: torch.Tensor, positions: torch.Tensor) -> ScheduledRows | None:
    """The step's `ScheduledRows` from vLLM's forward context, or None in its profiling and warm-up runs (no
    request, no pages)."""
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return None
    if isinstance(metadata, list):  # one dict per micro-batch (ubatching); a single one here
        metadata = metadata[0]
    first = metadata[layers[0].prefix]
    requests = first.num_decodes + first.num_prefills
    starts = first.query_start_loc[:requests + 1].tolist()
    lengths = [end - begin for begin, end in zip(starts[:-1], starts[1:])]
    width = max(lengths)
    tokens = input_ids.new_zeros(requests, width)
    valid = torch.zeros(requests, width, dtype=torch.bool, device=input_ids.device)
    for row, (begin, length) in enumerate(zip(starts, lengths)):
        tokens[row, :length] = input_ids[begin:begin + length]
        valid[row, :length] = True
    first_positions = positions[torch.tensor(starts[:-1], device=positions.device)].long()
    pages = [metadata[layer.prefix].state_indices_tensor[:requests].long() for layer in layers]
    return ScheduledRows(tokens, valid, first_positions, pages, starts[-1])


class PagedStateModel(nn.Module, HasInnerState, IsAttentionFree):
    """What a served model of this package does each engine step: gather the scheduled requests' pages into the
    model's own cache (one row per request, each at its own position), run the model's batched forward on it (padding
    skipped per row, as `generate()` does) and write the rows back. Subclasses set `model`, `lm_head`, `config` and
    `state_layers` (`build` sets the first three) and define `gather`, `scatter` and `compute_logits`."""

    MODEL_NAME = ""  # in error messages
    PROMPT_EMBEDDINGS_REFUSED = ""  # why prompt embeddings are refused
    # checkpoint tensors the served model does not hold (prefixes), skipped when loading
    SKIPPED_WEIGHTS: tuple[str, ...] = ()
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

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (vLLM's interface; the forward reads token ids)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Head inputs [tokens, hidden] of the scheduled tokens, each request advanced from its state pages."""
        if inputs_embeds is not None:
            raise ValueError(f"{self.MODEL_NAME} on vLLM: prompt embeddings are not supported "
                             f"({self.PROMPT_EMBEDDINGS_REFUSED})")
        rows = scheduled_rows(self.state_layers, input_ids, positions)
        if rows is None:  # vLLM's profiling and warm-up runs: no request, no pages
            return torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.lm_head.weight.dtype,
                               device=input_ids.device)
        cache = self.gather(rows)
        self.hold_speedups()
        with torch.no_grad():
            outputs = self.model(input_ids=rows.tokens, attention_mask=rows.valid.long() if rows.ragged else None,
                                 past_key_values=cache, use_cache=True, return_dict=True)
        self.scatter(rows, cache)
        return rows.flat(outputs.last_hidden_state, input_ids.shape[0])

    def hold_speedups(self) -> None:
        """Open the model's runtime speed-ups (same math up to rounding) once, for the engine's life: generate()
        holds them for a whole generation, and a serving step is a single forward; leaving the block after each
        step would drop the linears' blocked weight copies, remade at the next."""
        if self.speedups is None:
            self.speedups = contextlib.ExitStack()
            # over the whole served module, the head included, as generate() opens them over the causal LM
            self.speedups.enter_context(type(self.model).runtime_speedups(self))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a folder's safetensors into the parameters of the same names; a tied head counts as loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                if name.startswith(self.SKIPPED_WEIGHTS) or name == "lm_head.weight":
                    continue
                raise ValueError(f"{self.MODEL_NAME} on vLLM: the checkpoint has a tensor {name!r} the model does "
                                 "not have")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{self.MODEL_NAME} on vLLM: {name} has shape {tuple(tensor.shape)} in the "
                                 f"checkpoint, {tuple(param.shape)} in the model")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
