"""What only KVM does under generate() and its cache (the tests both models share are in
tests/generation/test_generation.py): generate() with the model's own KVMCache gives exactly the tokens of
use_cache=False (greedy, chunked prefill, sampling, beams, a user's cache) on a model with sliding-window layers;
padded training forwards, sampling with padding, a crop by real tokens inside a masked step, the cache monitor's
state lengths, inputs_embeds without ids."""

from __future__ import annotations

import pytest
import torch

from kvm_maglev.cache_monitor import CacheMonitor, describe_cache
from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.models.common.transformers_versions import GENERATE_CACHE_KWARG, returned_cache
from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.state_kvm import state_slots_after
from tests.generation.testers import KVM, PAD, left_padded

# layers 0 and 2 are sliding-window layers (sliding_window_every=2): generate() runs both kinds of KVM layer
CONFIG = dict(
    vocab_size=61, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, rotary_dim=8, chunk_size=4,
    window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0, state_budget_min=4,
    state_max_chunks=100, sliding_window_every=2, sliding_window=5, sliding_window_rotary_dim=16,
)


@pytest.fixture(scope="module")
def model() -> KVMForCausalLM:
    torch.manual_seed(0)
    model = KVMForCausalLM(KVMConfig(**CONFIG)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def prompt(batch: int, length: int) -> torch.Tensor:
    # token 0 is the pad id: keeping it out of prompts keeps generate from building a padding mask
    return torch.randint(1, 61, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))


def generate_both(model, inputs, seed=0, **kwargs):
    outputs = []
    for use_cache in (True, False):
        torch.manual_seed(seed)
        outputs.append(model.generate(inputs, max_new_tokens=26, min_new_tokens=26, use_cache=use_cache,
                                      pad_token_id=0, **kwargs))
    return outputs


@pytest.mark.parametrize("length", [1, 3, 4, 8, 9])
def test_greedy_matches_uncached(model, length):
    cached, uncached = generate_both(model, prompt(1, length), do_sample=False)
    assert cached.shape == (1, length + 26)
    assert torch.equal(cached, uncached)


def test_chunked_prefill_matches_uncached(model):
    """prefill_chunk_size feeds the prompt in multi-token steps on a non-empty cache."""
    inputs = prompt(2, 11)
    chunked = model.generate(inputs, max_new_tokens=12, do_sample=False, pad_token_id=0, prefill_chunk_size=3)
    plain = model.generate(inputs, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(chunked, plain)


def test_sampling_batch_and_num_return_sequences_match_uncached(model):
    cached, uncached = generate_both(model, prompt(2, 6), seed=7, do_sample=True, top_k=0, temperature=1.5,
                                     num_return_sequences=3)
    assert cached.shape == (6, 32)
    assert torch.equal(cached, uncached)
    assert len({tuple(row.tolist()) for row in cached}) > 1  # sampling actually varied


def test_generate_uses_kvm_cache_and_continues_a_user_cache(model):
    inputs = prompt(2, 5)
    out = model.generate(inputs, max_new_tokens=10, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    cache = returned_cache(out)
    assert isinstance(cache, KVMCache)
    assert cache.get_seq_length() == 14  # the last generated token is not fed back
    user_cache = KVMCache(model.config)
    again = model.generate(inputs, max_new_tokens=10, do_sample=False, pad_token_id=0,
                           **{GENERATE_CACHE_KWARG: user_cache})
    assert torch.equal(again, out.sequences)
    assert user_cache.get_seq_length() == 14


def test_beam_search_reorders_the_cache(model):
    cached, uncached = generate_both(model, prompt(1, 6), do_sample=False, num_beams=3, early_stopping=False)
    assert torch.equal(cached, uncached)


@torch.no_grad()
def test_padded_batch_in_a_training_forward_without_cache():
    """A padded batch without a cache (evaluation, training with padding) equals each row alone."""
    model = KVM.model("power_law")
    rows = KVM.prompts((7, 12))
    ids, mask = left_padded(rows)
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    for i, row in enumerate(rows):
        alone = model(row[None], use_cache=False).logits[0]
        assert torch.allclose(logits[i, -len(row):], alone, atol=1e-5)
        assert torch.isfinite(logits[i]).all()


@torch.no_grad()
def test_sampling_num_return_sequences_with_padding_equals_uncached():
    model = KVM.model("power_law")
    ids, mask = left_padded(KVM.prompts((3, 10)))
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, num_return_sequences=3, pad_token_id=PAD)
    torch.manual_seed(11)
    cached = model.generate(ids, **kwargs)
    torch.manual_seed(11)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (6, ids.shape[1] + 9) and torch.equal(cached, uncached)


@torch.no_grad()
def test_crop_with_padding_in_the_step():
    """A step whose mask has zeros (transformers' assistant masks do) is rolled back by its real tokens."""
    model = KVM.model("power_law")
    ids = KVM.random_ids(1, 20, seed=4)
    cache = KVMCache(model.config)
    cache.activate_past_recording()
    model(ids[:, :9], cache=cache)
    mask = torch.ones(1, 15, dtype=torch.long)
    mask[0, 10:12] = 0
    model(ids[:, 9:15], attention_mask=mask, cache=cache)
    cache.crop(11)  # keeps column 9 (real) and 10 (padding)
    assert cache.row_lengths() == [10]
    kept = KVMCache(model.config)
    model(ids[:, :10], cache=kept)
    for x, y in zip(KVM.state(cache), KVM.state(kept), strict=True):
        assert x.shape == y.shape and torch.allclose(x.to(y.dtype), y, atol=KVM.atol)


@torch.no_grad()
def test_cache_monitor_traces_state_lengths_and_bytes():
    model = KVM.model("power_law")
    ids = KVM.random_ids(2, 5)
    with CacheMonitor(model) as monitor:
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD, stopping_criteria=[monitor])
    assert out.shape == (2, 17)
    assert [step["seq_length"] for step in monitor.trace] == list(range(5, 17))
    config = model.config
    for step in monitor.trace:
        assert step["type"] == "KVMCache" and step["batch_size"] == 2
        assert step["layer_lengths"] == [state_slots_after(config, step["seq_length"])] * config.num_hidden_layers
        assert step["nbytes"] == cache_bytes(config, step["seq_length"], batch_size=2, dtype=torch.float32)
    assert describe_cache(KVMCache(config))["layer_lengths"] == [0, 0]


@torch.no_grad()
def test_inputs_embeds_alone_equal_the_ids_forward():
    """KVM reads inputs_embeds without ids (Maglev refuses them: its value embeddings need the ids)."""
    model = KVM.model("power_law")
    ids = KVM.random_ids(2, 6)
    embeds = model.get_input_embeddings()(ids)
    assert torch.allclose(model(inputs_embeds=embeds, use_cache=False).logits, model(ids, use_cache=False).logits)
