"""Both models under every generate() strategy: padded batches (left with a mask, right without), chunked
prefill, continuation, beams, assisted and prompt-lookup decoding (exact crop) and saved caches. Each test
runs once per model variant (tests/generation/testers.py) and compares against a simpler path that must agree.
What only one model has is tested in tests/models/<model>/test_<model>_generation.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvm_maglev.models.common.transformers_versions import CACHE_NAME, GENERATE_CACHE_KWARG
from kvm_maglev.package_only.saved_cache import load_cache, save_cache
from tests.generation.testers import PAD, TESTERS, cases, left_padded

ALL = cases()


# ----- padded batches -----------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("tester, variant", ALL)
def test_left_padded_greedy_batch_equals_each_row_alone(tester, variant):
    model = tester.model(variant)
    rows = tester.prompts()
    ids, mask = left_padded(rows)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    batched, width = getattr(out, CACHE_NAME), ids.shape[1]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **kwargs)
        assert torch.equal(out.sequences[i, width:], alone.sequences[0, len(row):]), i
        if tester.row_state is not None:  # the row's cache is the one read alone: same boundaries and merges
            for x, y in zip(tester.row_state(batched, i), tester.row_state(getattr(alone, CACHE_NAME), 0), strict=True):
                assert x.shape == y.shape and torch.allclose(x.to(y.dtype), y, atol=tester.atol), (i, x.shape, y.shape)
    assert tester.row_lengths(batched) == [len(r) + 9 for r in rows]


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["saturation_swa"], maglev=["recurrent", "nanochat_windows"]))
def test_left_padded_sampling_scores_equal_each_row_rescored_alone(tester, variant):
    """Seeded sampling in a padded batch: each step's logits equal the row's own unpadded uncached forward,
    and what fills the padding does not change a single sampled token."""
    model = tester.model(variant)
    rows = tester.prompts((5, 11))
    ids, mask = left_padded(rows)
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, top_k=0, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=PAD)
    torch.manual_seed(5)
    out = model.generate(ids, **kwargs)
    torch.manual_seed(5)
    other_pad = model.generate(torch.where(mask.bool(), ids, 42), **kwargs)
    assert torch.equal(out.sequences[:, ids.shape[1]:], other_pad.sequences[:, ids.shape[1]:])
    logits = torch.stack(out.logits, dim=1)
    for i, row in enumerate(rows):
        full = torch.cat([row, out.sequences[i, ids.shape[1]:]])[None]
        alone = model(full, use_cache=False).logits[0, len(row) - 1:-1]
        assert torch.allclose(logits[i], alone, atol=1e-4), (logits[i] - alone).abs().max()


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", ALL)
def test_right_padded_forward_without_mask_is_causal(tester, variant):
    """lm-eval's loglikelihood: right padding, no mask; the real tokens' logits equal the unpadded ones."""
    model = tester.model(variant)
    rows = tester.prompts((5, 13, 20))
    ids = torch.full((3, 20), PAD, dtype=torch.long)
    mask = torch.zeros(3, 20, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    forwards = (model(ids).logits, model(ids, use_cache=False).logits, model(ids, attention_mask=mask).logits)
    for i, row in enumerate(rows):
        alone = model(row[None], use_cache=False).logits[0]
        for logits in forwards:
            assert torch.allclose(logits[i, :len(row)], alone, atol=1e-5), i


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["saturation_swa"], maglev=["recurrent"]))
def test_padding_inside_decoding_steps_is_skipped(tester, variant):
    """A row may skip steps (mask 0) while others decode: its state is untouched, it stays in the batch."""
    model = tester.model(variant)
    ids = tester.random_ids(2, 16)
    cache = tester.cache_class(model.config)
    model(ids[:, :6], past_key_values=cache)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 6:9] = 0  # row 1 pauses for three columns
    for t in range(6, 16):
        step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits
    reference = model(torch.cat([ids[1:, :6], ids[1:, 9:]], dim=1), use_cache=False).logits[:, -1]
    assert torch.allclose(step[1], reference[0], atol=1e-5)
    assert torch.allclose(step[0], model(ids[:1], use_cache=False).logits[0, -1], atol=1e-5)
    assert tester.row_lengths(cache) == [16, 13] and cache.get_seq_length() == 16


# ----- multi-token steps on a non-empty cache -------------------------------------------------------------
@torch.no_grad()
# the prefiller reads the whole prompt in one forward: chunked prefill is refused (test_maglev_generation.py)
@pytest.mark.parametrize("tester, variant", cases(maglev=["recurrent", "memory_off_ring", "nanochat_windows"]))
def test_prefill_chunks_give_identical_cache_and_logits(tester, variant):
    model = tester.model(variant)
    ids, mask = left_padded(tester.prompts((7, 19, 13)))
    reference = tester.cache_class(model.config)
    whole = model(ids, attention_mask=mask, past_key_values=reference).logits
    for chunk in (1, 7, tester.block):
        cache = tester.cache_class(model.config)
        logits = torch.cat([model(ids[:, s:s + chunk], attention_mask=mask[:, :s + chunk], past_key_values=cache).logits
                            for s in range(0, ids.shape[1], chunk)], dim=1)
        real = mask.bool()
        assert torch.allclose(logits[real], whole[real], atol=1e-5), chunk
        tester.assert_same_state(cache, reference)


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["saturation_swa"], maglev=["recurrent", "memory_off_ring"]))
def test_generate_with_prefill_chunk_size_equals_plain(tester, variant):
    model = tester.model(variant)
    ids, mask = left_padded(tester.prompts((6, 17)))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    for chunk in (1, 7, tester.block):
        chunked = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                 prefill_chunk_size=chunk)
        assert torch.equal(chunked, plain), chunk


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", ALL)
def test_continuation_after_generate_equals_one_call(tester, variant):
    model = tester.model(variant)
    ids, mask = left_padded(tester.prompts((5, 12)))
    kwargs = dict(do_sample=False, pad_token_id=PAD)
    once = model.generate(ids, attention_mask=mask, max_new_tokens=12, **kwargs)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, **kwargs)
    cache = getattr(first, CACHE_NAME)
    assert isinstance(cache, tester.cache_class)
    grown_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
    resumed = model.generate(first.sequences, attention_mask=grown_mask, max_new_tokens=7,
                             **{GENERATE_CACHE_KWARG: cache}, **kwargs)
    assert torch.equal(resumed, once)


# ----- beams ------------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("tester, variant", cases(kvm=["saturation_swa"], maglev=["recurrent"]))
def test_beam_search_with_cache_equals_without(tester, variant, do_sample):
    model = tester.model(variant)
    ids, mask = left_padded(tester.prompts((6, 11)))
    kwargs = dict(attention_mask=mask, max_new_tokens=8, num_beams=4, num_return_sequences=2, do_sample=do_sample,
                  pad_token_id=PAD)
    torch.manual_seed(3)
    cached = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (4, ids.shape[1] + 8)
    assert torch.equal(cached, uncached)


# ----- crop, assisted and prompt-lookup decoding ---------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(maglev=["recurrent", "memory_off_ring", "nanochat_windows"]))
def test_crop_rolls_back_exactly(tester, variant):
    """Whole steps roll back bit for bit; multi-token steps that cross block boundaries (KVM folds, appends,
    merges; Maglev's ring) are partly undone: the cache equals one that never read the removed tokens, and
    continues like it (to float rounding: the two read their tokens in steps of other sizes)."""
    model = tester.model(variant)
    ids, mask = tester.random_ids(2, 10, seed=2), None  # KVM crops inside a step only when rows are aligned
    extra = tester.random_ids(2, 30, seed=3)
    rolled = tester.cache_class(model.config)
    rolled.activate_past_recording()
    assert rolled.is_croppable
    model(ids, attention_mask=mask, past_key_values=rolled)
    model(extra[:, :3], past_key_values=rolled)
    snapshot = [t.clone() for t in tester.state(rolled)]
    model(extra[:, 3:6], past_key_values=rolled)  # crosses a block boundary ...
    model(extra[:, 6:16], past_key_values=rolled)
    rolled.crop(-13)  # ... undone with the step after it
    assert rolled.get_seq_length() == 13
    assert all(torch.equal(a, b) for a, b in zip(tester.state(rolled), snapshot, strict=True))
    rolled.crop(13)  # absolute form: nothing to remove
    rolled.crop(0)
    assert all(torch.equal(a, b) for a, b in zip(tester.state(rolled), snapshot, strict=True))

    model(extra[:, 3:12], past_key_values=rolled)
    rolled.crop(17)  # into the middle of that step
    kept = tester.cache_class(model.config)
    model(ids, attention_mask=mask, past_key_values=kept)
    model(extra[:, :7], past_key_values=kept)
    tester.assert_same_state(rolled, kept)
    a = model(extra[:, 7:20], past_key_values=rolled).logits
    b = model(extra[:, 7:20], past_key_values=kept).logits
    assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="cannot remove"):
        rolled.crop(-1000)


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["power_law"], maglev=["recurrent"]))
def test_recording_widens_to_the_drafts_transformers_announces(tester, variant):
    """transformers >= 5.25 passes `recurrent_states_to_keep` (its draft length): a cache whose own bound is
    shorter records that many single-token steps and crops all of them, exactly."""
    model = tester.model(variant)
    ids, steps = tester.random_ids(1, 6, seed=2), tester.random_ids(1, 5, seed=3)
    rolled = tester.cache_class(model.config, max_rollback=2)
    rolled.activate_past_recording(recurrent_states_to_keep=5)
    model(ids, past_key_values=rolled)
    snapshot = [t.clone() for t in tester.state(rolled)]
    for i in range(5):
        model(steps[:, i:i + 1], past_key_values=rolled)
    rolled.crop(-5)
    assert rolled.get_seq_length() == 6
    assert all(torch.equal(a, b) for a, b in zip(tester.state(rolled), snapshot, strict=True))


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["power_law", "saturation_swa"],
                                                  maglev=["recurrent", "memory_off_ring"]))
def test_assisted_decoding_equals_greedy(tester, variant):
    model = tester.model(variant)
    small = tester.model(variant, seed=3, **tester.small)
    prompt = tester.random_ids(1, 11, seed=4)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    greedy = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, assistant_model=model, **kwargs), greedy)
    assert torch.equal(model.generate(prompt, assistant_model=small, **kwargs), greedy)


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["power_law"], maglev=["recurrent"]))
def test_prompt_lookup_decoding_equals_greedy(tester, variant):
    model = tester.model(variant)
    prompt = tester.random_ids(1, 6, seed=9).repeat(1, 3)  # repeats give lookup candidates
    greedy = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    looked_up = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=PAD,
                               prompt_lookup_num_tokens=3)
    assert torch.equal(looked_up, greedy)


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(TESTERS))
@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(length=st.integers(1, 80), window=st.integers(4, 16))
def test_assisted_and_prompt_lookup_equal_greedy_over_prompt_lengths(name, length, window):
    """The pad id is one that greedy decoding generates: an assistant given no mask must still read that
    token as real (transformers infers the assistant's mask from pad ids, its position_ids count every
    token; Maglev refused the step). Self, smaller assistant and prompt lookup all give greedy's tokens."""
    tester = TESTERS[name]
    variant = next(iter(tester.variants))
    model = tester.model(variant, **tester.window(window))
    small = tester.model(variant, seed=3, **{**tester.small, **tester.window(window)})
    prompt = tester.random_ids(1, length, seed=length + 100 * window)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    generated = model.generate(prompt, pad_token_id=PAD, **kwargs)[0, length:].tolist()
    pad = next((t for t in generated if t not in prompt[0].tolist()), PAD)
    greedy = model.generate(prompt, pad_token_id=pad, **kwargs)
    for extra in (dict(assistant_model=model), dict(assistant_model=small), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(model.generate(prompt, pad_token_id=pad, **kwargs, **extra), greedy), extra


# ----- saved caches -------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["power_law", "saturation_swa"],
                                                  maglev=["recurrent", "nanochat_windows"]))
def test_saved_cache_continues_like_the_live_one(tmp_path, tester, variant):
    model = tester.model(variant)
    ids, mask = left_padded(tester.prompts((6, 17)))
    live = tester.cache_class(model.config)
    model(ids, attention_mask=mask, past_key_values=live)
    save_cache(live, tmp_path / "doc")
    loaded = load_cache(tmp_path / "doc", model, tester.cache_class)
    tester.assert_same_state(loaded, live, atol=0)
    assert loaded.nbytes() == live.nbytes()
    question = tester.random_ids(2, 10, seed=12)
    assert torch.equal(model(question, past_key_values=loaded).logits, model(question, past_key_values=live).logits)
    assert sorted(p.name for p in (tmp_path / "doc").iterdir()) == tester.saved_files


@torch.no_grad()
@pytest.mark.parametrize("tester, variant", cases(kvm=["power_law"], maglev=["recurrent"]))
def test_cache_for_another_config_is_refused(tmp_path, tester, variant):
    model = tester.model(variant)
    field, value = tester.other_config
    other = tester.model(variant, **{field: value})
    cache = tester.cache_class(model.config)
    model(tester.random_ids(1, 5), past_key_values=cache)
    save_cache(cache, tmp_path / "c")
    kind = {"kvm": "KVM", "maglev": "Maglev"}[tester.name]
    with pytest.raises(ValueError, match=field):
        load_cache(tmp_path / "c", other, tester.cache_class)
    with pytest.raises(ValueError, match=f"another {kind} config"):
        other(tester.random_ids(1, 2), past_key_values=cache)
    with pytest.raises(ValueError, match=f"another {kind} config"):
        other.generate(tester.random_ids(1, 6), max_new_tokens=1, pad_token_id=PAD, **{GENERATE_CACHE_KWARG: cache})
    with pytest.raises(ValueError, match=f"not a saved {tester.cache_class.__name__}"):
        load_cache(tmp_path / "missing", model, tester.cache_class)
    with pytest.raises(ValueError, match="empty"):
        save_cache(tester.cache_class(model.config), tmp_path / "empty")
    assert not (tmp_path / "empty").exists()


@torch.no_grad()
@pytest.mark.parametrize("field, value", [("memory_source_layer", 0), ("memory_projection", True),
                                          ("memory_residual_injection", True)])
def test_maglev_cache_of_another_memory_source_is_refused(tmp_path, field, value):
    """The carried memory means what its source made it: a cache saved by a model whose memory comes from
    another layer, or through a projection or residual injection the other lacks, is refused."""
    tester, variant = TESTERS["maglev"], "recurrent"
    model = tester.model(variant)
    assert getattr(model.config, field) != value
    cache = tester.cache_class(model.config)
    model(tester.random_ids(1, 5), past_key_values=cache)
    save_cache(cache, tmp_path / "c")
    with pytest.raises(ValueError, match=field):
        load_cache(tmp_path / "c", tester.model(variant, **{field: value}), tester.cache_class)
