"""Maglev on vLLM: the decoder P (and, for a `memory_prefill="prefiller"` folder, the prefiller Q) run by our own
model code, each request's state in vLLM's state pages, read and written in place.

Each decoder layer owns one state page per request (a `MambaBase` layer, so vLLM's cache manager allocates the pages
with the request and frees them with it): the layer's window ring of keys and values (memory already injected),
under a `MaglevCache` layer's names, and the request's carry (the last memory vector and smear's previous-token
embedding, read from and written to layer 0's page; the other layers' carry rows stay unused so that every page has
one size). A request's position is vLLM's token position, so it is not stored.

Each engine step runs `MaglevModel.forward` on a `MaglevCache` whose layers are bound to the pages
(`MaglevCache.over_pages`). Recurrent folders: one forward; P reads every request's tokens in order, the paper's
recurrent prompt processing, and each recurrent step advances every request that has a token left in one batch
(`MaglevModel.recurrent_rows`). Chunked prefill continues a request from its pages, and a preempted request restarts
at position 0 with a fresh state, so both give the tokens of one uninterrupted `generate()`.

Prefiller folders: each request that starts a prompt (position 0, more than one token) runs in a forward of its
own, as generate()'s first forward: Q reads the prompt in parallel and P runs on it in parallel fed Q's memories,
leaving P's rings and carries in the pages; the other requests continue recurrently in one more forward. The
engine schedules every prompt whole and recomputes a preempted request from its prompt first
(`serving_config.whole_prompt_scheduling`), so a prompt-starting request reads exactly its prompt.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig

from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM, MaglevModel
from kvm_maglev.models.common.onednn_linear import OneDNNLinear
from kvm_maglev.vllm.pages import PagedStateModel, ScheduledStep, page_layers

MEMORY, EMBEDDING = 0, 1  # rows of the carry state


def ring_slots(config: MaglevConfig, max_model_len: int) -> list[int]:
    """Key/value slots of each layer's ring: its window (`sliding_window - 1` keys before the current one), or at
    most `max_model_len` for a nanochat window wider than any request (positions then never wrap around)."""
    return [min(left, max_model_len) for left in config.decoder_windows]


class VllmMaglevForCausalLM(PagedStateModel):
    """`MaglevForCausalLM` for vLLM: our model and head, a `StatePages` per decoder layer."""

    MODEL_NAME = "Maglev"
    PROMPT_EMBEDDINGS_REFUSED = "smear and value embeddings index token ids"
    SKIPPED_WEIGHTS = ("model.prefiller",)  # Q's tensors in a folder whose config builds no Q of its own

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.build(vllm_config, MaglevConfig, MaglevModel, OneDNNLinear, "head_rows")
        config, dtype = self.config, vllm_config.model_config.dtype
        slots = ring_slots(config, vllm_config.model_config.max_model_len)
        # per layer: its ring of keys and values, and the request's carry (used in layer 0's page only)
        shapes = [[(config.num_key_value_heads, n, config.head_dim)] * 2 + [(2, config.hidden_size)] for n in slots]
        self.state_layers = page_layers(prefix, shapes, [[dtype] * 3 for _ in slots])

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
        carry = self.page_tensors(0)[2][step.pages[0]]
        cache = MaglevCache.over_pages(
            self.config, [{"keys": self.page_tensors(i)[0], "values": self.page_tensors(i)[1]}
                          for i in range(len(self.state_layers))],
            step.pages, step.starts, carry[:, MEMORY], carry[:, EMBEDDING], self.model.memory_init)
        ragged = min(step.counts) < width
        outputs = self.model(input_ids=rows.view(-1, width), past_key_values=cache, use_cache=True, return_dict=True,
                             attention_mask=valid.view(-1, width).long() if ragged else None)
        pages = self.page_tensors(0)[2]
        if cache.last_memory is not None:
            pages[step.pages[0], MEMORY] = cache.last_memory[:, 0].to(pages.dtype)
        pages[step.pages[0], EMBEDDING] = cache.previous_embedding[:, 0].to(pages.dtype)
        return outputs.last_hidden_state.reshape(-1, outputs.last_hidden_state.shape[-1])[columns]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Our head: lm_head, padded rows sliced away, float32, soft-capped (MaglevForCausalLM.logits)."""
        return MaglevForCausalLM.logits(self, hidden_states)
