"""Every Maglev cache is bounded: nanochat's "L" layers attend `sequence_len` tokens back, so their cache keeps
that window (as a ring that grows up to it) instead of every token; cached decoding past `sequence_len` equals
the uncached forward, which applies the same bound."""

import pytest
import torch

from kvm_maglev.cache_sizes import cache_bytes, full_attention_cache_bytes
from kvm_maglev.convert.cards import cache_table_rows
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from tests.models.maglev.test_maglev_model import random_ids, tiny_model

SEQUENCE_LEN = 24  # the L window; S windows are a quarter of it rounded up to 128


def nanochat_model(**overrides):
    """Memory off, nanochat's window pattern; usable context far past the training length."""
    fields = dict(use_memory=False, sliding_window=None, window_pattern="SL", sequence_len=SEQUENCE_LEN,
                  max_position_embeddings=4096)
    return tiny_model(**{**fields, **overrides})


@torch.no_grad()
def test_uncached_forward_attends_sequence_len_tokens_back():
    """One L layer without smear: a token's logits depend on itself and the `sequence_len` tokens before it only
    (rotary is relative), so they equal a fresh forward over just those tokens - the simple expectation."""
    model = nanochat_model(num_hidden_layers=1, window_pattern="L", use_smear=False)
    ids = random_ids(1, 3 * SEQUENCE_LEN)
    logits = model(ids, use_cache=False).logits
    for t in (SEQUENCE_LEN, 2 * SEQUENCE_LEN + 5, ids.shape[1] - 1):
        alone = model(ids[:, t - SEQUENCE_LEN:t + 1], use_cache=False).logits[:, -1]
        assert torch.allclose(logits[:, t], alone, atol=1e-4), t
    # one token more of context changes nothing, one fewer does: the bound is exactly sequence_len
    longer = model(ids[:, t - SEQUENCE_LEN - 1:t + 1], use_cache=False).logits[:, -1]
    assert torch.allclose(longer, alone, atol=1e-4)
    assert not torch.allclose(model(ids[:, t - SEQUENCE_LEN + 1:t + 1], use_cache=False).logits[:, -1], alone,
                              atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [5, 40])
def test_cached_decoding_past_sequence_len_equals_uncached_and_stops_growing(prompt_len):
    model = nanochat_model()
    config = model.config
    widest = max(config.decoder_windows)
    ids = random_ids(2, widest + 3 * SEQUENCE_LEN)
    uncached = model(ids, use_cache=False).logits
    cache = MaglevCache(config)
    steps = [model(ids[:, :prompt_len], past_key_values=cache).logits]
    sizes = [cache.nbytes()]
    for t in range(prompt_len, ids.shape[1]):
        steps.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
        sizes.append(cache.nbytes())
        assert sizes[-1] == cache_bytes(config, t + 1, batch_size=2, dtype=torch.float32)
    assert torch.allclose(torch.cat(steps, dim=1), uncached, atol=1e-4)
    # the rings grew up to their windows, then stayed: the L layers hold sequence_len keys, not every token
    assert cache.layer_lengths() == config.decoder_windows
    assert sizes == sorted(sizes) and len(set(sizes[widest:])) == 1
    bound = cache_bytes(config, widest, batch_size=2, dtype=torch.float32)
    assert sizes[-1] == bound == cache_bytes(config, 10**7, batch_size=2, dtype=torch.float32)


@torch.no_grad()
def test_generate_past_every_window_equals_the_uncached_loop():
    """generate() (runtime speed-ups on) past the widest window, so every ring has wrapped around."""
    model = nanochat_model()
    prompt = random_ids(1, 10, seed=3)
    new_tokens = max(model.config.decoder_windows) + SEQUENCE_LEN
    generated = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(generated, model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                                 use_cache=False))


def test_model_card_table_is_bounded_like_cache_bytes():
    """The card's cache column is config.cache_bytes: the same at every length past the widest window."""
    config = nanochat_model().config
    rows = cache_table_rows(config).splitlines()
    assert len({row.split("|")[2] for row in rows}) == 1
    assert cache_bytes(config, 4096) == cache_bytes(config, 1048576) < full_attention_cache_bytes(config, 4096)
