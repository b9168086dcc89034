"""What only Maglev does under generate() and its cache (the tests both models share are in
tests/generation/test_generation.py): the prefiller's prompt handling, a crop inside a step after a padded
prompt, the flat cache monitor trace, training through the ring, inputs it refuses."""

import pytest
import torch

from kvm_maglev.cache_monitor import CacheMonitor, describe_cache
from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from tests.generation.testers import MAGLEV, left_padded
from tests.models.maglev.test_maglev_model import random_ids, tiny_model

VARIANTS = MAGLEV.variants
WINDOW = MAGLEV.block  # tiny_model's sliding_window


@torch.no_grad()
def test_prefiller_refuses_chunked_prefill():
    model = tiny_model(**VARIANTS["prefiller"])
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        model.generate(random_ids(1, 10), max_new_tokens=2, prefill_chunk_size=4)


@torch.no_grad()
@pytest.mark.parametrize("helper", ["same_model", "small_model", "prompt_lookup"])
def test_assisted_decoding_with_the_prefiller_equals_greedy(helper):
    """The first verification forward carries the prompt and the first drafts: the prefiller reads the prompt
    only and P decodes the drafts recurrently, so tokens and scores equal plain greedy decoding's."""
    model = tiny_model(**VARIANTS["prefiller"])
    prompt = random_ids(1, 6, seed=4).repeat(1, 2)  # repeats give prompt-lookup candidates
    common = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True)
    if helper == "prompt_lookup":
        assist = dict(prompt_lookup_num_tokens=3)
    else:
        assist = dict(assistant_model=model if helper == "same_model" else tiny_model(
            seed=3, num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
            **VARIANTS["prefiller"]))
    greedy = model.generate(prompt, **common)
    assisted = model.generate(prompt, **common, **assist)
    assert torch.equal(assisted.sequences, greedy.sequences)
    assert len(assisted.scores) == len(greedy.scores) == 12
    for ours, plain in zip(assisted.scores, greedy.scores):
        assert torch.allclose(ours, plain, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("shares_blocks", [True, False])
def test_prefiller_left_padded_batch_equals_each_prompt_alone(shares_blocks):
    """Q reads a left-padded batch of prompts longer than its long windows (16 keys back) and a one-token prompt
    (alone, P reads it recurrently): each row's greedy tokens and scores equal its own generate()."""
    model = tiny_model(**{**VARIANTS["prefiller"], "prefiller_shares_blocks": shares_blocks}, sequence_len=16,
                       max_position_embeddings=128)
    rows = MAGLEV.prompts((3, 20, 37, 1, 9), seed=20)
    ids, mask = left_padded(rows)
    common = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True)
    batched = model.generate(ids, attention_mask=mask, **common)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **common)
        assert torch.equal(batched.sequences[i, ids.shape[1]:], alone.sequences[0, len(row):]), len(row)
        for ours, single in zip(batched.scores, alone.scores, strict=True):
            assert torch.allclose(ours[i], single[0], atol=1e-4), (len(row), (ours[i] - single[0]).abs().max())


@torch.no_grad()
def test_crop_inside_a_step_after_a_left_padded_prompt():
    """Maglev crops inside a multi-token step whatever the rows' padding (KVM needs aligned rows): the cache
    equals one that read only the kept tokens, and continues like it."""
    model = tiny_model()
    ids, mask = left_padded(MAGLEV.prompts((4, 10)))
    extra = MAGLEV.random_ids(2, 9, seed=11)
    rolled = MaglevCache(model.config)
    rolled.activate_past_recording()
    model(ids, attention_mask=mask, past_key_values=rolled)
    model(extra[:, :8], past_key_values=rolled)
    rolled.crop(ids.shape[1] + 5)
    kept = MaglevCache(model.config)
    model(ids, attention_mask=mask, past_key_values=kept)
    model(extra[:, :5], past_key_values=kept)
    MAGLEV.assert_same_state(rolled, kept)
    a = model(extra[:, 5:], past_key_values=rolled).logits
    assert torch.allclose(a, model(extra[:, 5:], past_key_values=kept).logits, atol=1e-5)


@torch.no_grad()
def test_inputs_embeds_alone_are_refused():
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):
        tiny_model()(inputs_embeds=torch.zeros(2, 6, 64))


@torch.no_grad()
def test_cache_monitor_traces_generate_without_stopping_it():
    model = tiny_model()
    prompt = random_ids(2, 5)
    with CacheMonitor(model) as monitor:
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, stopping_criteria=[monitor])
    assert out.shape == (2, 17)
    assert len(monitor.trace) == 12
    assert [step["seq_length"] for step in monitor.trace] == list(range(5, 17))
    sizes = {step["nbytes"] for step in monitor.trace}
    assert sizes == {cache_bytes(model.config, 20, batch_size=2, dtype=torch.float32)}  # flat
    assert monitor.trace[-1]["layer_lengths"] == [WINDOW - 1] * model.config.num_hidden_layers
    assert not model._forward_hooks  # removed on exit
    with pytest.raises(TypeError, match="nbytes"):
        describe_cache(object())


@torch.no_grad()
def test_kvm_cache_is_refused():
    kvm = pytest.importorskip("kvm_maglev.models.kvm.cache_kvm")
    from kvm_maglev.models.kvm.configuration_kvm import KVMConfig

    model = tiny_model()
    with pytest.raises(TypeError, match="MaglevCache, got KVMCache"):
        model(random_ids(1, 3), past_key_values=kvm.KVMCache(KVMConfig()))


def test_recurrent_forward_trains_through_the_ring():
    """Without a prefiller, training runs P recurrently: ring writes must not break autograd, and the
    memory reaches memory_init."""
    model = tiny_model(has_prefiller=False).train()
    ids = random_ids(2, 20)
    model(ids, labels=ids).loss.backward()
    assert model.model.memory_init.grad.abs().sum() > 0
    assert model.model.layers[0].self_attn.memory_k_proj.weight.grad.abs().sum() > 0
