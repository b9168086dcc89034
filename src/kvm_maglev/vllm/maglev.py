"""Maglev on vLLM: the decoder P (and, for a `memory_prefill="prefiller"` folder, the prefiller Q) run by our own
model code, each request's state in vLLM's state pages, read and written in place.

Each decoder layer owns one state page per request (a `MambaBase` layer, so vLLM's cache manager allocates the pages
with the request and frees them with it): the layer's window ring of keys and values (memory already injected),
under a `MaglevCache` layer's names, and the request's carry (the last memory vector and smear's previous-token
embedding, read from and written to layer 0's page; the other layers' carry rows stay unused so that every page has
one size). A request's position is vLLM's token position, so it is not stored.

Each engine step runs `MaglevModel.forward` on a `MaglevCache` whose layers are bound to the pages
(`page_caches.maglev_cache_over_pages`). Recurrent folders: one forward; P reads every request's tokens in order, the paper's
recurrent prompt processing, and each recurrent step advances every request that has a token left in one batch
(`MaglevModel.recurrent_rows`). Chunked prefill continues a request from its pages, and a preempted request restarts
at position 0 with a fresh state, so both give the tokens of one uninterrupted `generate()`.

Prefiller folders: each request that starts a prompt (position 0, more than one token) runs in a forward of its
own, as generate()'s first forward: Q reads the prompt in parallel and P runs on it in parallel fed Q's memories,
leaving P's rings and carries in the pages; the other requests continue recurrently in one more forward. The
engine schedules every prompt whole and recomputes a preempted request from its prompt first
(`serving_config.whole_prompt_scheduling`), so a prompt-starting request reads exactly its prompt.

vLLM's default compiles the steps in which every request decodes (one graph; each layer's ring read and written
in the operator `kvm_maglev::ring_attention`, so that no page is an input of the graph), at start-up in vLLM's
warm-up run, so that serving never compiles; `enforce_eager`, tensor parallelism and steps that read prompts run
eager.

Tensor parallelism (`kvm_maglev.vllm.tensor_parallel`): each rank holds the share of P's (and Q's) heads, memory
projections, gates and MLP units that `MaglevConfig.base_model_tp_plan` gives it, its heads' columns of the value
embeddings and its share of the vocabulary; its pages hold its key/value heads' rings and its channels of the carry.
The residual stream, and so the memory vector and smear's embedding, is whole on every rank (the rowwise outputs are
all-reduced): each rank stores its channels of the carry and the step gathers the whole from the ranks, one small
all-gather per forward.
"""

from __future__ import annotations

import torch
from vllm.config import CompilationMode, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from vllm.forward_context import get_forward_context, is_forward_context_available

from kvm_maglev.models.maglev.cache_maglev import MaglevCache, TokenStep
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevModel
from kvm_maglev.models.speedups.onednn_linear import OneDNNLinear
from kvm_maglev.vllm.engine_ops import PagedDecodeStep, PagedRing
from kvm_maglev.vllm.page_caches import maglev_cache_over_pages
from kvm_maglev.vllm.pages import PagedStateModel, ScheduledStep, page_layers
from kvm_maglev.vllm.tensor_parallel import plan_rule, rank_slice, shard_by_plan, split_table_columns

MEMORY, EMBEDDING = 0, 1  # rows of the carry state


def ring_slots(config: MaglevConfig, max_model_len: int) -> list[int]:
    """Key/value slots of each layer's ring: its window (`sliding_window - 1` keys before the current one), or at
    most `max_model_len` for a nanochat window wider than any request (positions then never wrap around)."""
    return [min(left, max_model_len) for left in config.decoder_windows]


class VllmMaglevForCausalLM(PagedStateModel):
    """`MaglevForCausalLM` for vLLM: our model, vLLM's vocabulary-parallel embeddings and head, a `StatePages` per
    decoder layer; under tensor parallelism each rank holds its share of the heads, the MLP and the vocabulary."""

    MODEL_NAME = "Maglev"
    PROMPT_EMBEDDINGS_REFUSED = "smear and value embeddings index token ids"
    SKIPPED_WEIGHTS = ("model.prefiller",)  # Q's tensors in a folder whose config builds no Q of its own

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        device = torch.empty(0).device  # where vLLM builds the model (its default device)
        self.tp_size = get_tensor_model_parallel_world_size()
        with torch.device("meta"):  # no rank holds the whole model, not even while building it
            self.build(vllm_config, MaglevConfig, MaglevModel, OneDNNLinear, "head_rows")
            table_shards = self.split_value_embeddings()
        config, dtype = self.config, vllm_config.model_config.dtype
        # float32 logits, then the cap (compute_logits), as MaglevForCausalLM.logits: no cap in vLLM's processor
        self.split_vocabulary(dtype, config.embedding_rows, config.head_rows, config.vocab_size, soft_cap=None)
        self.shards = shard_by_plan(self, config.base_model_tp_plan, device) | table_shards
        self.split_heads()
        slots = ring_slots(config, vllm_config.model_config.max_model_len)
        kv_heads, carry = config.num_key_value_heads // self.tp_size, config.hidden_size // self.tp_size
        # per layer: its ring of the rank's key/value heads, and the rank's channels of the request's carry (used
        # in layer 0's page only)
        shapes = [[(kv_heads, n, config.head_dim)] * 2 + [(2, carry)] for n in slots]
        self.state_layers = page_layers(prefix, shapes, [[dtype] * 3 for _ in slots])
        for index, pages in enumerate(self.state_layers):  # how the ring operator finds the model (not a submodule)
            pages.__dict__.update(served=self, index=index)
        # vLLM compiles the models it serves unless told not to (enforce_eager). A Maglev engine step is one graph
        # when every request decodes (P reads a prompt token after token): that step runs compiled, the batch a
        # dynamic dimension, its rings read and written in `kvm_maglev::ring_attention`; the others run eager. A
        # compiled function, not a module: the model's parameters stay registered once. One rank only: the split
        # model's sharded parameters have not been traced (tensor parallelism runs eager).
        compiles = vllm_config.compilation_config.mode != CompilationMode.NONE and self.tp_size == 1
        self.compiled_forward = torch.compile(self.model.forward, dynamic=True) if compiles else None
        self.decoding_compiled = False  # the compiled step's graphs made (`compile_decoding_steps`)
        # a compiled step's rings over the pages and its model step (one for all layers, its masks made once), for
        # the operator
        self.step_rings: tuple[list, TokenStep] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The step's head inputs (`PagedStateModel.forward`); vLLM's warm-up run, before any request, first
        compiles the decoding steps, so that no request waits for a compilation."""
        if (self.compiled_forward is not None and not self.decoding_compiled and is_forward_context_available()
                and get_forward_context().attn_metadata is None):
            self.compile_decoding_steps(input_ids)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def compile_decoding_steps(self, input_ids: torch.Tensor) -> None:
        """Compile the step in which every request decodes, for a batch of one and of two rows (from two on the
        batch is a dynamic dimension, so these are every batch size's graphs), after one eager step that makes the
        model's lazily built buffers (rotary frequencies), which the graphs guard on."""
        self.decoding_compiled = True
        self.hold_speedups()  # the served forward's modules, as the steps will find them
        with torch.no_grad():
            tokens, cache = self.scratch_step(input_ids, 1)
            self.model(input_ids=tokens, past_key_values=cache, use_cache=True, return_dict=True)
            for rows in (1, 2):
                tokens, cache = self.scratch_step(input_ids, rows)
                if self.model.prepare_step(cache, tokens) is not None:
                    self.compiled_decoding(tokens, cache)

    def scratch_step(self, input_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, MaglevCache]:
        """A decoding step of `rows` rows as vLLM's steps give it (token ids of `input_ids`' dtype, a cache over pages
        of the state layers' shapes), on scratch pages whose results are dropped; the rows past every ring's width,
        as most decoding steps find them."""
        device, config = input_ids.device, self.config
        rings = [{name: torch.zeros(rows, *shape, dtype=dtype, device=device)
                  for name, shape, dtype in zip(("keys", "values"), pages.shapes, pages.dtypes)}
                 for pages in self.state_layers]
        index = [torch.arange(rows, device=device) for _ in rings]
        position = max(pages.shapes[0][1] for pages in self.state_layers) + 1  # past the widest ring
        carry = torch.zeros(rows, config.hidden_size, dtype=self.state_layers[0].dtypes[2], device=device)
        cache = maglev_cache_over_pages(config, rings, index, [position] * rows, carry, carry, self.model.memory_init)
        return input_ids.new_zeros(rows, 1), cache

    def split_value_embeddings(self) -> dict[str, int]:
        """Under tensor parallelism, each value-embedding table as the rank's columns: layer i's table is added to
        its values head by head, so a rank whose `v_proj` is colwise (the plan) reads only its heads' columns (the
        model's `local_columns` then takes the table as it is). Returns the checkpoint slicing of the tables."""
        tables, plan = self.model.value_embeddings, self.config.base_model_tp_plan
        if self.tp_size == 1 or not tables:
            return {}
        if any(plan_rule(plan, f"layers.{key}.self_attn.v_proj") != "colwise" for key in tables):
            raise ValueError("Maglev on vLLM: the plan does not split v_proj colwise, so the value embeddings' columns "
                             "do not follow the rank's heads")
        return split_table_columns(tables, "model.value_embeddings", self.tp_size)

    def split_heads(self) -> None:
        """Each attention's head counts as this rank's, read from its sharded projections (the forward reads its
        heads from the projections' shapes; these keep the attributes true)."""
        for layers in (self.model.layers, self.model.prefiller_layers or []):
            for block in layers:
                attention = block.self_attn
                attention.num_heads = attention.q_proj.out_features // attention.head_dim
                attention.num_kv_heads = attention.k_proj.out_features // attention.head_dim

    def run_step(self, input_ids: torch.Tensor, step: ScheduledStep) -> torch.Tensor:
        """Head inputs of the step's tokens: one forward over all requests, or, with the prefiller, one forward per
        request that starts a prompt and one over the others (`forward_groups`)."""
        groups = self.forward_groups(step)
        if len(groups) == 1:
            return self.run_rows(input_ids, step)
        hidden = None
        for rows in groups:
            part, tokens = step.select(rows, input_ids.device)
            out = self.run_rows(input_ids[tokens], part)
            if hidden is None:
                hidden = out.new_empty(step.total, out.shape[-1])
            hidden[tokens] = out
        return hidden

    def forward_groups(self, step: ScheduledStep) -> list[list[int]]:
        """The step's requests grouped by forward: with the prefiller, each request that starts a prompt (position 0,
        more than one token: what generate()'s first forward gives Q) alone, then the others together; else all in
        one. A prompt alone is not padded: a batch of prompts would run every row to the longest prompt's length
        (27.0 CPU seconds against 20.5 on the serving benchmark's 8-16k prompts, one contended run)."""
        everyone = list(range(len(step.counts)))
        if self.config.memory_prefill != "prefiller":
            return [everyone]
        prompts = [row for row in everyone if step.starts[row] == 0 and step.counts[row] > 1]
        chosen = set(prompts)
        others = [row for row in everyone if row not in chosen]
        return [[row] for row in prompts] + ([others] if others else [])

    def run_rows(self, input_ids: torch.Tensor, step: ScheduledStep) -> torch.Tensor:
        """One forward of the model over the step's requests as rows (each its own tokens, padding after them), on a
        cache over their pages; then each request's carries back into its page. Rows that all start at position 0
        make the model's first forward (under memory_prefill="prefiller", Q reads their prompts); others continue."""
        tokens = step.row_tokens(input_ids.device)
        width = max(step.counts)
        rows = input_ids.new_zeros(len(step.counts) * width)
        columns = tokens.row * width + tokens.local
        rows[columns] = input_ids
        valid = torch.zeros_like(rows, dtype=torch.bool)
        valid[columns] = True
        carry = self.read_carries(step.pages[0])
        cache = maglev_cache_over_pages(
            self.config, [{"keys": self.page_tensors(i)[0], "values": self.page_tensors(i)[1]}
                          for i in range(len(self.state_layers))],
            step.pages, step.starts, carry[:, MEMORY], carry[:, EMBEDDING], self.model.memory_init)
        ragged = min(step.counts) < width
        if (self.compiled_forward is not None and width == 1 and all(step.starts)
                and self.model.prepare_step(cache, rows.view(-1, 1)) is not None):  # its host side, before the graph
            outputs = self.compiled_decoding(rows.view(-1, 1), cache)
        else:
            outputs = self.model(input_ids=rows.view(-1, width), past_key_values=cache, use_cache=True,
                                 return_dict=True, attention_mask=valid.view(-1, width).long() if ragged else None)
        self.write_carries(step.pages[0], cache)
        return outputs.last_hidden_state.reshape(-1, outputs.last_hidden_state.shape[-1])[columns]

    def compiled_decoding(self, input_ids: torch.Tensor, cache: MaglevCache):
        """A prepared step in which every request decodes, compiled: the rings and the model's step (its masks and
        slots on the rings, made when it was prepared) handed to the operator, the forward given the engine's kind of
        that step (`PagedDecodeStep`) and `PagedRing`s in place of the layers, so that the graph reads no page."""
        rings, step = cache.layers, cache.prepared_step
        self.step_rings = rings, step
        cache.prepared_step = PagedDecodeStep(step)
        cache.layers = [PagedRing(pages.prefix) for pages in self.state_layers]
        try:
            return self.compiled_forward(input_ids=input_ids, past_key_values=cache, use_cache=True, return_dict=True)
        finally:
            cache.layers, self.step_rings = rings, None

    def read_carries(self, pages: torch.Tensor) -> torch.Tensor:
        """The carries [requests, 2, hidden] of the requests on `pages` (layer 0's), whole: under tensor parallelism
        gathered from the ranks' channels."""
        carry = self.page_tensors(0)[2][pages]
        return carry if self.tp_size == 1 else tensor_model_parallel_all_gather(carry, dim=-1)

    def write_carries(self, pages: torch.Tensor, cache: MaglevCache) -> None:
        """Each request's carries after the forward into its page (layer 0's): this rank's channels of them."""
        tensors = self.page_tensors(0)[2]

        def mine(vector: torch.Tensor) -> torch.Tensor:
            return (vector if self.tp_size == 1 else rank_slice(vector, -1)).to(tensors.dtype)
        if cache.last_memory is not None:
            tensors[pages, MEMORY] = mine(cache.last_memory[:, 0])
        tensors[pages, EMBEDDING] = mine(cache.previous_embedding[:, 0])

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The head's logits over the vocabulary (gathered from the ranks, the head's padding rows dropped by vLLM's
        logits processor), float32, then soft-capped, as MaglevForCausalLM.logits; None on a rank that vLLM's
        gather leaves without them."""
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None:
            return None
        logits, cap = logits.float(), self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)
