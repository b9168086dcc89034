"""A Maglev decode step as generate() runs it (its host side prepared by `prepare_inputs_for_generation`) traces as
one graph: no graph break, no recompilation from one step to the next, the same tokens as eager."""

import pytest
import torch

from kvm_maglev.models.common.transformers_versions import GENERATE_CACHE_KWARG
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from tests.models.maglev.test_maglev_model import VOCAB, random_ids, tiny_model


def left_padded_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 12 columns, the second left-padded by 4."""
    ids = random_ids(2, 12, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def step_inputs(model, sequence: torch.Tensor, mask: torch.Tensor, cache: MaglevCache) -> dict:
    """generate()'s inputs for the next decode step of `sequence` (its mask covers every column so far)."""
    return model.prepare_inputs_for_generation(sequence, next_sequence_length=1, attention_mask=mask,
                                               use_cache=True, **{GENERATE_CACHE_KWARG: cache})


def prompted(model, ids, mask) -> tuple[MaglevCache, torch.Tensor]:
    """A cache that read the prompt, and the greedy next token."""
    cache = MaglevCache(model.config)
    logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    return cache, logits[:, -1:].argmax(-1)


def counting_compile(forward):
    """`torch.compile(forward, fullgraph=True)` with a backend that keeps each graph it compiles (run as traced)."""
    graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs):
        graphs.append(graph)
        return graph.forward

    return torch.compile(forward, backend=backend, fullgraph=True), graphs


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, {"use_memory": False}], ids=["memory", "memory_off"])
def test_decode_step_traces_without_graph_breaks(overrides):
    model = tiny_model(**overrides)
    ids, mask = left_padded_prompt()
    cache, token = prompted(model, ids, mask)
    sequence, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**step_inputs(model, sequence, mask, cache))
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1



@torch.no_grad()
def test_fullgraph_decode_steps_equal_eager_and_compile_once():
    """Five decode steps of a left-padded batch through `torch.compile(forward, fullgraph=True)` give eager's logits
    and tokens; the growing attention mask does not recompile (one graph for all the steps)."""
    model = tiny_model()
    ids, mask = left_padded_prompt()
    compiled, graphs = counting_compile(model.forward)
    torch._dynamo.reset()
    runs = {}
    for name, forward in (("eager", model.forward), ("compiled", compiled)):
        cache, token = prompted(model, ids, mask)
        sequence, step_mask, logits = ids, mask, []
        for _ in range(5):
            sequence = torch.cat([sequence, token], 1)
            step_mask = torch.cat([step_mask, torch.ones_like(token)], 1)
            step = forward(**step_inputs(model, sequence, step_mask, cache)).logits
            logits.append(step)
            token = step[:, -1:].argmax(-1)
        runs[name] = (torch.cat(logits, 1), sequence, cache.get_seq_length())
    assert len(graphs) == 1
    assert torch.equal(runs["compiled"][0], runs["eager"][0])
    assert torch.equal(runs["compiled"][1], runs["eager"][1])
    assert runs["compiled"][2] == runs["eager"][2] == ids.shape[1] + 5


@torch.no_grad()
def test_a_new_batch_size_recompiles_once():
    """Decode steps of batches of 2, 3 and 4 rows: the second size makes the batch a dynamic dimension, the third
    reuses that graph."""
    model = tiny_model()
    compiled, graphs = counting_compile(model.forward)
    torch._dynamo.reset()
    for batch in (2, 3, 4):
        ids = random_ids(batch, 9, seed=batch)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        cache, token = prompted(model, ids, mask)
        for _ in range(3):
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
            token = compiled(**step_inputs(model, ids, mask, cache)).logits[:, -1:].argmax(-1)
    assert len(graphs) == 2


@torch.no_grad()
def test_prepared_steps_equal_the_uncached_forward():
    """generate()'s path (prepared steps) against the uncached recurrent forward on a left-padded batch."""
    model = tiny_model()
    ids, mask = left_padded_prompt()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True)
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], 1)
    uncached = model(out.sequences[:, :-1], attention_mask=full_mask[:, :-1], use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), uncached[:, ids.shape[1] - 1:], rtol=1e-4, atol=1e-4)


def test_a_step_prepared_twice_counts_once_and_is_forgotten_when_not_run():
    model = tiny_model()
    ids, mask = left_padded_prompt()
    with torch.no_grad():
        cache, token = prompted(model, ids, mask)
    assert model.model.prepare_step(cache, token) is not None
    assert model.model.prepare_step(cache, token) is not None
    assert cache.get_seq_length() == ids.shape[1] + 1
    with torch.no_grad():
        model(token, past_key_values=cache, use_cache=False)  # inputs a prepared step does not take: cancelled
    assert cache.prepared_step is None and cache.get_seq_length() == ids.shape[1]
    assert model.model.prepare_step(cache, token) is not None
    cache.activate_past_recording()
    cache.crop(-0)
    assert cache.prepared_step is None and cache.get_seq_length() == ids.shape[1]
    assert model.model.prepare_step(cache, token) is None  # recording: rollback records need the general path
    assert model.model.prepare_step(cache, random_ids(2, 2) % VOCAB) is None  # several tokens: not a step


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, {"use_memory": False}], ids=["memory", "memory_off"])
def test_decode_step_equals_the_general_one_token_forward_exactly(overrides):
    """The decode step ([rows, hidden] tokens, heads laid out for attention at once) against the general forward of
    one token per row ([rows, 1, hidden]; a recording cache takes it, for rollback): the same logits and cache,
    bit for bit, on a left-padded batch."""
    model = tiny_model(**overrides)
    ids, mask = left_padded_prompt()
    runs = []
    for recording in (False, True):
        cache, token = prompted(model, ids, mask)
        if recording:
            cache.activate_past_recording()
        logits = []
        for _ in range(4):
            step = model(token, past_key_values=cache).logits
            logits.append(step)
            token = step[:, -1:].argmax(-1)
        rings = [t for layer in cache.layers for t in layer.tensors.values()]
        state = [cache.positions, cache.previous_embedding] + rings
        runs.append((torch.cat(logits, 1), state))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_rotary_is_nanochats_rotation_of_the_two_halves():
    from kvm_maglev.models.maglev.modeling_maglev import apply_rotary, rotary_tables
    x = torch.randn(2, 5, 3, 16)
    inv_freq = 1.0 / (100000 ** (torch.arange(0, 16, 2).float() / 16))
    positions = torch.arange(10).view(2, 5)
    freqs = positions.float()[:, :, None, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[..., :8], x[..., 8:]
    assert torch.equal(apply_rotary(x, *rotary_tables(inv_freq, positions, x.dtype)),
                       torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1))


PREFILLER = dict(prefiller_shares_blocks=False, memory_prefill="prefiller")


def prompt_inputs(model, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """generate()'s inputs for the first forward (the prompt) on a fresh cache."""
    return model.prepare_inputs_for_generation(ids, attention_mask=mask, use_cache=True, is_first_iteration=True,
                                               **{GENERATE_CACHE_KWARG: MaglevCache(model.config)})


@torch.no_grad()
def test_prefiller_prompt_traces_without_graph_breaks():
    model = tiny_model(**PREFILLER)
    ids, mask = left_padded_prompt()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**prompt_inputs(model, ids, mask))
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1


@torch.no_grad()
def test_fullgraph_prefiller_prompts_equal_eager_and_recompile_once():
    """Left-padded prompts of 12, 10 and 7 tokens read by the prefiller under `torch.compile(forward,
    fullgraph=True)`: eager's logits and cache; the second length makes the length dynamic, the third reuses it."""
    model = tiny_model(**PREFILLER)
    compiled, graphs = counting_compile(model.forward)
    torch._dynamo.reset()
    for length in (12, 10, 7):
        ids = random_ids(2, length, seed=length)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        runs = []
        for forward in (model.forward, compiled):
            inputs = prompt_inputs(model, ids, mask)
            logits = forward(**inputs).logits
            cache = inputs[GENERATE_CACHE_KWARG]
            runs.append((logits, cache.get_seq_length(), cache.last_memory, cache.layers[0].tensors["keys"]))
        assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] == length
        assert torch.equal(runs[0][2], runs[1][2]) and torch.equal(runs[0][3], runs[1][3])
    assert len(graphs) == 2
