"""What only KVM does under generate() and its cache (the tests both models share are in
tests/generation/test_generation.py): padded training forwards, sampling with padding, a crop by real tokens
inside a masked step, the cache monitor's state lengths, inputs_embeds without ids."""

from __future__ import annotations

import torch

from kvm_maglev.cache_monitor import CacheMonitor, describe_cache
from kvm_maglev.models.kvm import KVMCache
from tests.generation.testers import KVM, PAD, left_padded


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
    prompt = KVM.random_ids(2, 5)
    with CacheMonitor(model) as monitor:
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=PAD, stopping_criteria=[monitor])
    assert out.shape == (2, 17)
    assert [step["seq_length"] for step in monitor.trace] == list(range(5, 17))
    config = model.config
    for step in monitor.trace:
        assert step["type"] == "KVMCache" and step["batch_size"] == 2
        assert step["layer_lengths"] == [config.state_slots_after(step["seq_length"])] * config.num_hidden_layers
        assert step["nbytes"] == config.cache_bytes(step["seq_length"], batch_size=2, dtype=torch.float32)
    assert describe_cache(KVMCache(config))["layer_lengths"] == [0, 0]


@torch.no_grad()
def test_inputs_embeds_alone_equal_the_ids_forward():
    """KVM reads inputs_embeds without ids (Maglev refuses them: its value embeddings need the ids)."""
    model = KVM.model("power_law")
    ids = KVM.random_ids(2, 6)
    embeds = model.get_input_embeddings()(ids)
    assert torch.allclose(model(inputs_embeds=embeds, use_cache=False).logits, model(ids, use_cache=False).logits)
