"""A "prefiller" prompt whose caller reads only the last logits (generate()'s logits_to_keep=1) runs P only on
the columns that reach them or the cache: the same last logits, cache and continuation as P over the whole prompt."""

import pytest
import torch

from kvm_maglev import MaglevConfig, MaglevForCausalLM
from kvm_maglev.models.common.transformers_versions import CACHE_NAME, GENERATE_CACHE_KWARG
from kvm_maglev.models.maglev.cache_maglev import MaglevCache

WINDOW, LAYERS = 8, 3
NEEDED = 2 + LAYERS * (WINDOW - 1)  # P's columns: each layer's left context stacked, smear's token, the last one


def model(seed: int = 0) -> MaglevForCausalLM:
    torch.manual_seed(seed)
    config = MaglevConfig(vocab_size=97, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                          num_key_value_heads=2, use_memory=True, sliding_window=WINDOW, has_prefiller=True,
                          memory_prefill="prefiller", prefiller_window_pattern="L", prefiller_shares_blocks=False,
                          sequence_len=128, max_position_embeddings=256)
    built = MaglevForCausalLM(config).eval().double()  # float64: what the skip leaves out shows above rounding
    with torch.no_grad():  # away from the init's zeros, so every path carries signal
        for parameter in built.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return built


def p_columns(maglev: MaglevForCausalLM) -> list:
    """Records the column count of each P pass over a chunk."""
    seen = []
    original = maglev.model.decode_chunk

    def counting(input_ids, *args, **kwargs):
        seen.append(input_ids.shape[1])
        return original(input_ids, *args, **kwargs)

    maglev.model.decode_chunk = counting
    return seen


def cache_state(cache: MaglevCache) -> list:
    return [cache.positions, cache.last_memory, cache.previous_embedding,
            *[layer.tensors[name] for layer in cache.layers for name in ("keys", "values")]]


@pytest.mark.parametrize("padding", [0, 5])
@torch.no_grad()
def test_last_logits_cache_and_continuation_match_the_whole_prompt(padding):
    maglev = model()
    seen = p_columns(maglev)
    ids = torch.randint(3, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0  # left padding before the skipped columns leaves the rows' last NEEDED tokens real
    following = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    results = {}
    for keep in (0, 1):
        out = maglev(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=keep,
                     **{GENERATE_CACHE_KWARG: MaglevCache(maglev.config)})
        cache = getattr(out, CACHE_NAME)  # the release's name: `cache` from transformers 5.24, else past_key_values
        after = maglev(input_ids=following, attention_mask=torch.cat([mask, torch.ones_like(following)], dim=1),
                       use_cache=True, **{GENERATE_CACHE_KWARG: cache})
        results[keep] = [out.logits[:, -1], after.logits, *cache_state(cache)]
    assert seen == [70, NEEDED]  # the whole prompt, then the skipped one (continuations run recurrently)
    for whole, skipped in zip(results[0], results[1]):
        if whole.dtype.is_floating_point:
            torch.testing.assert_close(skipped, whole, atol=1e-9, rtol=1e-9)
        else:
            assert torch.equal(skipped, whole)


@torch.no_grad()
def test_generate_tokens_match_and_the_skip_is_taken():
    maglev = model(1)
    ids = torch.randint(3, 97, (1, 60), generator=torch.Generator().manual_seed(3))
    seen = p_columns(maglev)
    skipped = maglev.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert seen == [NEEDED]
    maglev.model.skippable_columns = lambda *args: 0  # P over the whole prompt
    whole = maglev.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert seen == [NEEDED, 60]
    assert torch.equal(skipped, whole)


@torch.no_grad()
def test_no_skip_where_a_row_has_padding_in_the_kept_columns_or_all_positions_are_read():
    maglev = model(2)
    seen = p_columns(maglev)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # row 1 has 10 real tokens: padding inside the last NEEDED columns
    maglev(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1, cache=MaglevCache(maglev.config))
    maglev(input_ids=ids, use_cache=True, logits_to_keep=1, output_hidden_states=True, cache=MaglevCache(maglev.config))
    maglev(input_ids=ids, use_cache=False)  # every position's logits
    assert seen == [40, 40, 40]
    assert not maglev.model.last_position_only  # the forward's switch does not outlive it
