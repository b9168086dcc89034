"""KVM on vLLM: our model code, each request's state in vLLM's state pages, read and written in place.

Per decoder layer and request one page (a `MambaBase` layer, so vLLM's cache manager allocates it with the request
and frees it with it) holds what a `KVMCache` layer holds for one row, under the same names:
- a KVM layer: its window ring (keys, values and merge gates of the last `window_chunks` chunks), its state (key
  sums, value sums, value norms or counts) and the state's attention-ready form, sized for `max_model_len` - exact
  for a fixed budget, the most a request reaches for a growing one (`state_slots_after`);
- a sliding-window layer: its ring of the last `sliding_window` keys and values;
- the layer's token-shift carries (the last token of each shifted stream), one vector.
How much of each is live follows from the request's position, vLLM's token position (state_kvm's one rule).

Each engine step runs `KVMModel.forward` once over every scheduled token of every request - decoding rows and
prefill chunks together, whatever their positions. vLLM compiles it (its `support_torch_compile`, unless
`enforce_eager`): the traced graph holds the projections, norms and feed-forwards, and splits at the operators of
`engine_ops` (token shifts, attention), which run each layer's per-request work: when every request decodes,
`decode_kvm`'s functions over the pages (with `COMPILE_DECODE`, compiled in vLLM's warm-up run: `warm_up_shift`),
else eagerly on a `KVMCache` whose layers are bound to the pages (`page_caches.kvm_cache_over_pages`, built
once per step): no copy into a cache and back. A request at
position 0 (new, or preempted and recomputed) starts from an empty state; a chunked prompt continues from its pages.
Folds run at the chunk boundary, batched over the requests that cross one in the step.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context

from kvm_maglev.models.common.step_plan import Step
from kvm_maglev.models.kvm.cache_kvm import KVMCache
from kvm_maglev.models.kvm.configuration_kvm import KVMConfig
from kvm_maglev.models.kvm.modeling_kvm import KVMModel
from kvm_maglev.models.kvm.state_kvm import state_dtype_for, state_slots_after
from kvm_maglev.models.kvm.step_plan_kvm import PromptStep
from kvm_maglev.models.speedups.onednn_linear import OneDNNLinear
from kvm_maglev.vllm.decode_kvm import (
    MIN_COMPILED_ROWS,
    EngineDecode,
    decode_attention,
    decode_shift,
    engine_decode,
    enter_first_chunks,
    fold_due,
    reach,
    scratch_pages,
    state_slot_table,
    warm_up_positions,
    warming_up,
)
from kvm_maglev.vllm.engine_ops import PagedStep
from kvm_maglev.vllm.page_caches import kvm_cache_over_pages, layer_carries
from kvm_maglev.vllm.pages import PagedStateModel, page_layers, scheduled_step
from kvm_maglev.vllm.tensor_parallel import shard_by_plan


def page_layout(config: KVMConfig, model: KVMModel, max_len: int, dtype: torch.dtype) -> list[list[tuple]]:
    """Per decoder layer the (name, shape, dtype) of each page tensor: as a KVMCache layer names and shapes its
    tensors for one row, windows at their width, states at the most slots `max_len` tokens reach; the carries as
    one vector, its streams side by side. Heads and carries are the layer's own: under tensor parallelism a rank's
    pages hold only its key/value heads and its channels of the shifted streams."""
    dk, dv = config.qk_head_dim, config.v_head_dim
    slots, state_dtype = state_slots_after(config, max_len), state_dtype_for(dtype)
    layout = []
    for layer in model.layers:
        heads = layer.self_attn.kv_heads
        if layer.sliding:
            size = config.sliding_window_size
            tensors = [("window_keys", (heads, size, dk), dtype), ("window_values", (heads, size, dv), dtype)]
        else:
            size = config.window_size
            window = [("window_keys", (heads, size, dk), dtype), ("window_values", (heads, size, dv), dtype),
                      ("window_gates", (heads, size, 1), dtype)]
            state = [("state_keys", (heads, slots, dk), state_dtype), ("state_values", (heads, slots, dv), state_dtype),
                     ("state_norms", (heads, slots, 1), torch.float32)]
            read = [("read_keys", (heads, slots, dk), dtype), ("read_values", (heads, slots, dv), dtype)]
            tensors = window[:3 if layer.self_attn.gated else 2] + state + read
        widths = sum(width for _, width in layer_carries(layer))
        if widths:
            tensors.append(("carries", (widths,), dtype))
        layout.append(tensors)
    return layout


def name_pages(layout: list[list[tuple]], model: KVMModel,
               tensors: list[tuple[torch.Tensor, ...]]) -> list[dict[str, torch.Tensor]]:
    """Each layer's page tensors (`tensors[i]`, in `page_layout` order) under a KVMCache layer's names; the carry
    vector's streams as column views."""
    named = []
    for layer_layout, layer, layer_tensors in zip(layout, model.layers, tensors):
        pages = dict(zip((name for name, _, _ in layer_layout), layer_tensors))
        carries, begin = pages.pop("carries", None), 0
        for stream, width in layer_carries(layer):
            pages[f"carry.{stream}"] = carries[:, begin:begin + width]
            begin += width
        named.append(pages)
    return named


def carry_columns(pages: dict[str, torch.Tensor], layer, streams: list[str]) -> torch.Tensor:
    """The carry columns of a layer's `streams`, consecutive in its carries (`layer_carries`), as one view of its
    named pages (`name_pages`)."""
    order = [stream for stream, _ in layer_carries(layer)]
    if streams[0] not in order or order[order.index(streams[0]):order.index(streams[0]) + len(streams)] != streams:
        raise ValueError(f"streams {streams} are not consecutive in the layer's carries {order}")
    first, width = pages[f"carry.{streams[0]}"], sum(pages[f"carry.{name}"].shape[1] for name in streams)
    # the streams' columns lie side by side in the carry vector: one view from the first one's
    return first.as_strided((first.shape[0], width), first.stride(), first.storage_offset())


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class VllmKVMForCausalLM(PagedStateModel):
    """`KVMForCausalLM` for vLLM: our model and head, a `StatePages` per decoder layer; the forward compiled by
    vLLM, split at the state operators; under tensor parallelism each rank holds its share of the heads, the MLP
    and the vocabulary (`kvm_maglev.vllm.tensor_parallel`)."""

    MODEL_NAME = "KVM"
    # decode_kvm's functions compiled at start-up where vLLM compiles: off, since compiled they served fewer output
    # tokens per CPU second than eager on the serve benchmark's decode-heavy (605 against 773, docs/serving.md)
    COMPILE_DECODE = False
    PROMPT_EMBEDDINGS_REFUSED = "token shifts and the state are driven by the model's own embeddings of token ids"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        device = torch.empty(0).device  # where vLLM builds the model (its default device)
        with torch.device("meta"):  # no rank holds the whole model, not even while building it
            self.build(vllm_config, KVMConfig, KVMModel, OneDNNLinear, "vocab_size")
        dtype = vllm_config.model_config.dtype
        # KVM's head has exactly vocab_size rows; vLLM applies the soft cap
        self.split_vocabulary(dtype, self.config.vocab_size, self.config.vocab_size, self.config.vocab_size,
                              self.config.logit_softcap or None)
        self.shards = shard_by_plan(self, self.config.base_model_tp_plan, device)
        self.split_heads()
        for layer in self.model.layers:  # prompt pieces attend their key sets merged (speedups/merged_attention_kvm)
            layer.self_attn.merged_key_sets = True
        self.layout = page_layout(self.config, self.model, vllm_config.model_config.max_model_len, dtype)
        self.state_layers = page_layers(prefix, [[shape for _, shape, _ in layer] for layer in self.layout],
                                        [[dtype for _, _, dtype in layer] for layer in self.layout])
        self.bound: list[dict[str, torch.Tensor]] | None = None  # page tensors by name, once vLLM has bound them
        self.carry_views: dict[tuple[int, str], torch.Tensor] = {}  # `carry_columns`, made once
        for index, pages in enumerate(self.state_layers):
            # how the state operators find their layer (set on the instance's dict: not a submodule)
            pages.__dict__.update(served=self, index=index)
        self.pages_view = SimpleNamespace(layers=self.state_layers)  # the layers' handles on their pages
        self.rows: tuple | None = None  # (attention metadata, the step's rows: `step_rows`) of the step under way
        max_len = vllm_config.model_config.max_model_len
        # a decoding token's live state slots by block: on the model's device, which every layer's attention reads
        self.slot_table = state_slot_table(self.config, max_len).to(device)
        self.slot_list = self.slot_table.tolist()
        # decode_kvm's functions compiled where vLLM compiles (not under enforce_eager; one rank: the sharded
        # layers' steps have not been compiled), in its warm-up run, once per operator site (`warmed`), on scratch
        # pages (`scratch`); a site not warmed up, or a step of one request, runs eagerly
        compiles = vllm_config.compilation_config.mode != CompilationMode.NONE
        self.compile_decode = self.COMPILE_DECODE and compiles and get_tensor_model_parallel_world_size() == 1
        self.max_len = max_len
        self.warmed: set[tuple[int, str]] = set()
        self.scratch: list[dict[str, torch.Tensor]] | None = None

    def split_heads(self) -> None:
        """Each attention's head counts as this rank's, read from its sharded projections: its carries, pages and
        the attention's own shape check follow them (a tensor-parallel size of 1 leaves them whole)."""
        for layer in self.model.layers:
            attention = layer.self_attn
            attention.num_heads = attention.q_proj.out_features // attention.head_dim
            attention.kv_heads = attention.k_proj.out_features // attention.head_dim

    def named_pages(self) -> list[dict[str, torch.Tensor]]:
        """Each layer's page tensors under a KVMCache layer's names (`name_pages`), once vLLM has bound them."""
        if self.bound is None:
            self.bound = name_pages(self.layout, self.model, [self.page_tensors(i) for i in range(len(self.layout))])
        return self.bound

    def carry_columns(self, index: int, streams: str) -> torch.Tensor:
        """`carry_columns` of layer `index`'s pages for streams `streams` (names joined by commas), made once."""
        if (index, streams) not in self.carry_views:
            self.carry_views[index, streams] = carry_columns(self.named_pages()[index], self.model.layers[index],
                                                             streams.split(","))
        return self.carry_views[index, streams]

    def runs_compiled(self, index: int, site: str, rows: EngineDecode) -> bool:
        """Whether operator site `site` of layer `index` runs this decoding step's compiled form: compiled at
        start-up, and the step of at least `MIN_COMPILED_ROWS` requests."""
        return (index, site) in self.warmed and rows.count >= MIN_COMPILED_ROWS

    def scratch_named_pages(self, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """`named_pages` over scratch pages (`scratch_pages`), for the warm-up: a page per warm-up request and two
        more, made once."""
        if self.scratch is None:
            tensors = scratch_pages(self.layout, MIN_COMPILED_ROWS + 3, device)
            self.scratch = name_pages(self.layout, self.model, tensors)
        return self.scratch

    def warm_up_shift(self, index: int, streams: str, x: torch.Tensor, mix: torch.Tensor) -> None:
        """Compile layer `index`'s token shift of `streams` in vLLM's warm-up run (inside the operator, so under
        `warming_up`: a served step's dispatch state): a step of `MIN_COMPILED_ROWS` + 1 requests over scratch pages,
        on inputs of the kinds the operator gives it while serving (new packed tensors of `x`'s dtype, zeros: what
        the warm-up writes is never read; `mix` copied)."""
        rows, device = MIN_COMPILED_ROWS + 1, x.device
        with warming_up():
            carry = carry_columns(self.scratch_named_pages(device)[index], self.model.layers[index],
                                  streams.split(","))
            tokens = torch.zeros(1, rows, x.shape[-1], dtype=x.dtype, device=device)
            decode_shift(tokens, mix.clone(), carry, torch.arange(rows, device=device), rows,
                         torch.empty_like(tokens), compiled=True)
        self.warmed.add((index, streams))

    def warm_up_attention(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          gate: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Compile layer `index`'s decoding attention in vLLM's warm-up run (as `warm_up_shift`): steps of
        `MIN_COMPILED_ROWS` + 1 requests over scratch pages at `warm_up_positions`, its positions of the kind of
        vLLM's (`positions`)."""
        rows, device = MIN_COMPILED_ROWS + 1, q.device
        with warming_up():
            layer, pages = self.model.layers[index], self.scratch_named_pages(device)[index]
            page = torch.arange(rows, device=device)

            def new(tensor: torch.Tensor | None) -> torch.Tensor | None:
                return None if tensor is None else torch.zeros(rows, *tensor.shape[1:], dtype=tensor.dtype,
                                                               device=device)
            for seen in warm_up_positions(self.config, self.max_len, rows):
                with torch.inference_mode(positions.is_inference()):
                    position = torch.tensor(seen, dtype=positions.dtype, device=positions.device)
                decode = EngineDecode(rows, seen, position, [page] * len(self.layout),
                                      reach(self.config, self.slot_list, seen))
                output = torch.empty(rows, q.shape[1], v.shape[-1], dtype=v.dtype, device=device)
                decode_attention(layer.self_attn, new(q), new(k), new(v), new(gate), decode, page, output, pages,
                                 None if layer.sliding else self.slot_table, True)
        self.warmed.add((index, "attention"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Head inputs [tokens, hidden] of the scheduled tokens (and zeros for vLLM's padding), each request
        advanced from its state pages. Traced once by vLLM: nothing here depends on the step's schedule, which
        only the state operators read."""
        if inputs_embeds is not None:
            raise ValueError(f"{self.MODEL_NAME} on vLLM: prompt embeddings are not supported "
                             f"({self.PROMPT_EMBEDDINGS_REFUSED})")
        if not torch.compiler.is_compiling():
            self.hold_speedups()
        with torch.no_grad():
            return self.model(input_ids=input_ids, position_ids=positions, cache=self.pages_view, use_cache=False,
                              step=PagedStep(positions)).last_hidden_state

    def step_rows(self, positions: torch.Tensor) -> EngineDecode | tuple[Step, int, KVMCache] | None:
        """The engine step's scheduled tokens, built by the first state operator of the step and shared by the
        others: an `EngineDecode` when every request decodes (decode_kvm; its folds done), else the model's own
        `PromptStep`, the token count and a cache over the pages; None in vLLM's profiling and warm-up runs (no
        request, no pages)."""
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return None
        if self.rows is None or self.rows[0] is not metadata:
            self.rows = (metadata, self.build_rows(metadata, positions))
        return self.rows[1]

    def build_rows(self, metadata, positions: torch.Tensor) -> EngineDecode | tuple[Step, int, KVMCache]:
        """`step_rows` of a new engine step."""
        if isinstance(metadata, list):  # one dict per micro-batch (ubatching); a single one here
            metadata = metadata[0]
        layers = [metadata[layer.prefix] for layer in self.state_layers]
        decode = engine_decode(self.config, self.slot_list, layers[0],
                               [layer.state_indices_tensor for layer in layers], positions)
        if decode is not None:
            enter_first_chunks(self.model, self.named_pages(), decode.pages, decode.seen, [1] * decode.count)
            fold_due(self.model, self.named_pages(), decode)
            return decode
        step = scheduled_step(self.state_layers, positions)
        enter_first_chunks(self.model, self.named_pages(), step.pages, step.starts, step.counts)
        cache = kvm_cache_over_pages(self.config, self.named_pages(), step.pages, step.starts)
        tokens = step.row_tokens(positions.device)
        cache.prepare(tokens)
        return PromptStep(tokens, None, 0), step.total, cache  # the pages hold the positions: no columns to count

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The head's logits over the whole vocabulary, soft-capped when the config sets a cap (as
        KVMForCausalLM.logits), in float32; None on a rank that vLLM's gather leaves without them."""
        logits = self.logits_processor(self.lm_head, hidden_states)
        return None if logits is None else logits.float()
