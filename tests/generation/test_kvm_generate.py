"""generate() with the model's own KVMCache produces exactly the tokens of use_cache=False."""

from __future__ import annotations

import pytest
import torch

from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM
from kvm_maglev.models.common.model_inputs import GENERATE_CACHE_KWARG
from tests.returned_cache import returned_cache

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
