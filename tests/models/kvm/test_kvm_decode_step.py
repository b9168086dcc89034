"""KVM's decoding step as one graph (decode_step_kvm) against the general path, its reference: the same tokens,
logits and cache, through first chunks, folds and sliding-window layers in left-padded batches; no graph break in
a step prepared as generate() prepares it; a bounded number of compilations over a generation. Prompt chunks
prepared the same way (`PromptStep`) are one graph each, and compiled they equal eager; so does generate() with a
compiled forward."""

from __future__ import annotations

import pytest
import torch

from kvm_maglev import KVMConfig, KVMForCausalLM
from kvm_maglev.models.common.transformers_versions import GENERATE_CACHE_KWARG
from kvm_maglev.models.kvm.cache_kvm import KVMCache
from kvm_maglev.models.kvm.decode_step_kvm import DecodeStep
from kvm_maglev.models.kvm.step_plan_kvm import PromptStep
from tests.generation.testers import kvm_row_tensors

BASE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, chunk_size=4, window_chunks=2)
VARIANTS = {
    "grouped_fixed": dict(num_key_value_heads=2),
    "power_law_gated_temperatures": dict(num_key_value_heads=2, state_budget_mode="power_law",
                                         state_budget_factor=2.0, state_budget_exponent=0.5, state_budget_min=4,
                                         state_max_chunks=50, sink_slots=1, merge_gate_keys=True,
                                         merge_gate_values=True, head_temperatures=True),
    "sliding_layers_initial_gate": dict(num_hidden_layers=3, sliding_window_every=2, sliding_window=5,
                                        merge_gate_keys=True, merge_gate_initial_state=True, ffn_token_shift=True,
                                        value_residual=True, sliding_window_share_value_residual=False),
    "post_shift_residual_counts": dict(kvm_value_residual_mode="rwkv_post_tokenshift", value_residual=True,
                                       window_chunks=3, state_value_norms=False, block_lambdas=True),
}


def build(variant: str) -> KVMForCausalLM:
    torch.manual_seed(0)
    model = KVMForCausalLM(KVMConfig(**(BASE | VARIANTS[variant])))
    with torch.no_grad():  # weights away from their zero initialisation, so every path carries signal
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 2, 6 and 9 real tokens, left-padded: rows reach first chunks and folds at different steps."""
    ids = torch.randint(1, BASE["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[1, :3] = 0
    return ids * mask, mask


def generate(model: KVMForCausalLM, decode_steps: bool):
    model.model.decode_steps = decode_steps
    ids, mask = padded_prompts()
    cache = KVMCache(model.config)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True, **{GENERATE_CACHE_KWARG: cache})
    finally:
        del model.model.decode_steps  # the class's default again
    return out, cache


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoding_steps_equal_the_general_path(variant):
    model = build(variant)
    reference, reference_cache = generate(model, decode_steps=False)
    stepped, cache = generate(model, decode_steps=True)
    assert torch.equal(stepped.sequences, reference.sequences)
    for ours, theirs in zip(stepped.scores, reference.scores):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert cache.row_lengths() == reference_cache.row_lengths()
    for row in range(3):
        for ours, theirs in zip(kvm_row_tensors(cache, row), kvm_row_tensors(reference_cache, row)):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-5)


def test_generate_takes_the_prepared_steps(monkeypatch):
    """The prompt runs as a PromptStep and every step after it as a DecodeStep, each prepared before its forward
    (a test that the paths above are the ones exercised)."""
    model = build("grouped_fixed")
    taken = []
    for kind in (PromptStep, DecodeStep):  # every forward on a step reads its positions once
        original = kind.rotary_positions
        monkeypatch.setattr(kind, "rotary_positions", lambda step, position_ids, original=original: taken.append(
            type(step).__name__) or original(step, position_ids))
    out, _ = generate(model, decode_steps=True)
    assert taken == ["PromptStep"] + ["DecodeStep"] * (len(out.scores) - 1)


class Stepper:
    """A model stepped as generate() steps it: inputs prepared (the DecodeStep with them), then `forward`."""

    def __init__(self, model: KVMForCausalLM, prompt_tokens: int) -> None:
        self.model = model
        self.ids = torch.randint(1, BASE["vocab_size"], (2, prompt_tokens), generator=torch.Generator().manual_seed(2))
        self.cache = KVMCache(model.config)
        with torch.no_grad():
            logits = model(self.ids, **{GENERATE_CACHE_KWARG: self.cache}).logits
        self.ids = torch.cat([self.ids, logits[:, -1:].argmax(-1)], dim=1)

    @torch.no_grad()
    def inputs(self) -> dict:
        return {"input_ids": self.ids[:, -1:], GENERATE_CACHE_KWARG: self.cache, "use_cache": True} | {
            key: value for key, value in self.model.prepare_inputs_for_generation(
                self.ids, **{GENERATE_CACHE_KWARG: self.cache}, attention_mask=torch.ones_like(self.ids),
                use_cache=True, next_sequence_length=1, cache_position=torch.tensor([self.ids.shape[1] - 1]),
            ).items() if key in ("input_ids", "attention_mask")}

    @torch.no_grad()
    def step(self, forward) -> torch.Tensor:
        logits = forward(**self.inputs()).logits[:, -1]
        self.ids = torch.cat([self.ids, logits.argmax(-1, keepdim=True)], dim=1)
        return logits


def test_a_prepared_decoding_step_traces_whole():
    model = build("sliding_layers_initial_gate")
    stepper = Stepper(model, prompt_tokens=3)  # the next token enters its row's first chunk
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(**stepper.inputs())
    assert explained.graph_break_count == 0, [str(reason.reason) for reason in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_steps_equal_eager_and_compile_a_bounded_number_of_times():
    """fullgraph: a break would raise. 28 steps from position 3 cross the first chunk's end, state growth and folds;
    what changes shape (the state's room, the first chunk's writes) compiles a few times, not every step."""
    model = build("power_law_gated_temperatures")
    eager, compiled = Stepper(model, 3), Stepper(model, 3)
    torch._dynamo.reset()
    forward = torch.compile(model, fullgraph=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(28):
        torch.testing.assert_close(compiled.step(forward), eager.step(model), rtol=0, atol=1e-4)
    assert torch.equal(compiled.ids, eager.ids)
    # 3 here: the first chunk's end, the state's room, the room as a dynamic dimension
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames <= 4


def prompt_chunk_inputs(model: KVMForCausalLM, cache: KVMCache, ids: torch.Tensor, mask: torch.Tensor,
                        part: slice) -> dict:
    """A forward over prompt columns `part` on `cache`, prepared as generate() prepares one (its PromptStep in the
    cache)."""
    prepared = model.prepare_inputs_for_generation(
        ids[:, :part.stop], **{GENERATE_CACHE_KWARG: cache}, attention_mask=mask[:, :part.stop], use_cache=True,
        next_sequence_length=part.stop - part.start, cache_position=torch.arange(part.start, part.stop))
    return {"input_ids": ids[:, part], "attention_mask": mask[:, :part.stop], GENERATE_CACHE_KWARG: cache,
            "use_cache": True} | {key: prepared[key] for key in ("input_ids",) if key in prepared}


def long_prompts(padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 21 tokens, or of 21, 16 and 12 real tokens left-padded: read in two chunks, the second reads
    the first's window and folds blocks into the state (unpadded rows also fold ahead, eagerly)."""
    ids = torch.randint(1, BASE["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
        mask[2, :9] = 0
    return ids * mask, mask


def test_prepared_prompt_chunks_trace_whole():
    """As generate() prepares them, a first chunk and one that reads its window and folds are each one graph."""
    model = build("sliding_layers_initial_gate")
    ids, mask = long_prompts()
    cache = KVMCache(model.config)
    torch._dynamo.reset()
    with torch.no_grad():
        for part in (slice(0, 9), slice(9, 21)):
            inputs = prompt_chunk_inputs(model, cache, ids, mask, part)
            assert type(cache.prepared_step).__name__ == "PromptStep"
            explained = torch._dynamo.explain(model)(**inputs)
            assert explained.graph_break_count == 0, [str(reason.reason) for reason in explained.break_reasons]
            assert explained.graph_count == 1


@pytest.mark.parametrize("variant,padded", [("power_law_gated_temperatures", True),
                                            ("sliding_layers_initial_gate", False)])
def test_compiled_prompt_chunks_equal_eager(variant, padded):
    """fullgraph: a break would raise. Two chunks of a batch give eager's logits and leave its cache. Traced and
    functionalised as inductor receives them ("aot_eager"); inductor's own code for a whole KVM model is compiled
    in tests/generation/test_compile.py (its C++ build would triple this test's time)."""
    model = build(variant)
    ids, mask = long_prompts(padded)
    eager_cache, compiled_cache = KVMCache(model.config), KVMCache(model.config)
    torch._dynamo.reset()
    forward = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for part in (slice(0, 9), slice(9, 21)):
            expected = model(**prompt_chunk_inputs(model, eager_cache, ids, mask, part)).logits
            got = forward(**prompt_chunk_inputs(model, compiled_cache, ids, mask, part)).logits
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert compiled_cache.row_lengths() == eager_cache.row_lengths()
    for row in range(3):
        for ours, theirs in zip(kvm_row_tensors(compiled_cache, row), kvm_row_tensors(eager_cache, row)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_generate_with_a_compiled_forward_equals_eager():
    """generate() with the model's forward compiled whole (fullgraph): the prompt and every decoding step, prepared
    outside the graph, give eager's tokens. Dynamo's own backend: the graphs are under test here (inductor's
    numerics above), and inductor would spend minutes compiling the dynamic-shape step on 2 cores."""
    model = build("power_law_gated_temperatures")
    ids, mask = long_prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kwargs, **{GENERATE_CACHE_KWARG: KVMCache(model.config)})
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    try:
        got = model.generate(ids, **kwargs, **{GENERATE_CACHE_KWARG: KVMCache(model.config)})
    finally:
        del model.forward
    assert torch.equal(got, expected)
