"""Maglev under every generate() strategy: padded batches, chunked prefill, continuation, beams,
assisted and prompt-lookup decoding (exact crop), saved caches, the cache monitor and bad inputs.
Each test compares against a simpler path that must agree."""

import pytest
import torch
from tests.models.maglev.test_maglev_model import VOCAB, random_ids, tiny_model
from transformers import DynamicCache

from kvm_maglev.cache_monitor import CacheMonitor, describe_cache
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.model_inputs import CACHE_NAME, GENERATE_CACHE_KWARG

PAD = 0
WINDOW = 8  # tiny_model's sliding_window
# memory on (recurrent), memory off with a sliding window (parallel ring chunks), nanochat windows
# (full-window layers that keep every column), prompts read by the prefiller
VARIANTS = {
    "recurrent": {},
    "memory_off_ring": dict(use_memory=False),
    "nanochat_windows": dict(use_memory=False, sliding_window=None),
    "prefiller": dict(prefiller_shares_blocks=False, memory_prefill="prefiller"),
}



def left_padded(rows: list[torch.Tensor], pad: int = PAD):
    """Rows of different lengths, left-padded into one batch, and their mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


def prompts(lengths=(3, 9, 14), seed=7) -> list[torch.Tensor]:
    """Row lengths below, just past and well past the window; no pad id inside (generate would mask it)."""
    return [random_ids(1, n, seed=seed + i)[0] % (VOCAB - 1) + 1 for i, n in enumerate(lengths)]


def cache_state(cache: MaglevCache) -> list[torch.Tensor]:
    tensors = [cache.positions, cache.previous_embedding]
    tensors += [] if cache.last_memory is None else [cache.last_memory]
    for store in cache.layer_stores:
        tensors += list(store.state().values())
    return tensors


def assert_same_state(a: MaglevCache, b: MaglevCache, atol=1e-5):
    assert a.get_seq_length() == b.get_seq_length()
    for x, y in zip(cache_state(a), cache_state(b), strict=True):
        assert x.shape == y.shape and torch.allclose(x.to(y.dtype), y, atol=atol), (x - y).abs().max()


# ----- padded batches -----------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_greedy_batch_equals_each_row_alone(variant):
    model = tiny_model(**VARIANTS[variant])
    rows = prompts()
    ids, mask = left_padded(rows)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=10, do_sample=False, pad_token_id=PAD)
        assert torch.equal(batched[i, ids.shape[1]:], alone[0, len(row):]), i


@torch.no_grad()
@pytest.mark.parametrize("variant", ["recurrent", "nanochat_windows"])
def test_left_padded_sampling_scores_equal_each_row_rescored_alone(variant):
    """Seeded sampling in a padded batch: each step's logits equal the row's own unpadded uncached forward,
    and what fills the padding does not change a single sampled token."""
    model = tiny_model(**VARIANTS[variant])
    rows = prompts((4, 11))
    ids, mask = left_padded(rows)
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, top_k=30, return_dict_in_generate=True,
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
@pytest.mark.parametrize("variant", VARIANTS)
def test_right_padded_forward_without_mask_is_causal(variant):
    """lm-eval's loglikelihood: right padding, no mask; the real tokens' logits equal the unpadded ones."""
    model = tiny_model(**VARIANTS[variant])
    rows = prompts((5, 13, 20))
    width = 20
    ids = torch.full((3, width), PAD, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    no_mask = model(ids).logits
    with_mask = model(ids, attention_mask=mask).logits
    for i, row in enumerate(rows):
        alone = model(row[None], use_cache=False).logits[0]
        assert torch.allclose(no_mask[i, :len(row)], alone, atol=1e-5)
        assert torch.allclose(with_mask[i, :len(row)], alone, atol=1e-5)


@torch.no_grad()
def test_padding_inside_decoding_steps_is_skipped():
    """A row may skip steps (mask 0) while others decode; its state is untouched by them."""
    model = tiny_model()
    ids = random_ids(2, 12)
    cache = MaglevCache(model.config)
    model(ids[:, :6], past_key_values=cache)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 6:9] = 0  # row 1 pauses for three columns
    for t in range(6, 12):
        step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits
    reference = model(torch.cat([ids[1:, :6], ids[1:, 9:]], dim=1), use_cache=False).logits[:, -1]
    assert torch.allclose(step[1], reference[0], atol=1e-5)
    assert cache.positions.tolist() == [12, 9]


# ----- multi-token steps on a non-empty cache -------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_chunks_give_identical_cache_and_logits(variant):
    if variant == "prefiller":
        pytest.skip("the prefiller reads the whole prompt in one forward (chunked prefill is refused)")
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((7, 19, 13)))
    reference = MaglevCache(model.config)
    whole = model(ids, attention_mask=mask, past_key_values=reference).logits
    for chunk in (1, 7, WINDOW):
        cache = MaglevCache(model.config)
        logits = torch.cat([model(ids[:, s:s + chunk], attention_mask=mask[:, :s + chunk], past_key_values=cache).logits
                            for s in range(0, ids.shape[1], chunk)], dim=1)
        real = mask.bool()
        assert torch.allclose(logits[real], whole[real], atol=1e-5), chunk
        assert_same_state(cache, reference)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["recurrent", "memory_off_ring"])
def test_generate_with_prefill_chunk_size_equals_plain(variant):
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((6, 17)))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    for chunk in (1, 7, WINDOW):
        chunked = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                 prefill_chunk_size=chunk)
        assert torch.equal(chunked, plain), chunk


@torch.no_grad()
def test_prefiller_refuses_chunked_prefill():
    model = tiny_model(**VARIANTS["prefiller"])
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        model.generate(random_ids(1, 10), max_new_tokens=2, prefill_chunk_size=4)


@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_continuation_after_generate_equals_one_call(variant):
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((5, 12)))
    kwargs = dict(do_sample=False, pad_token_id=PAD)
    once = model.generate(ids, attention_mask=mask, max_new_tokens=12, **kwargs)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, **kwargs)
    cache = getattr(first, CACHE_NAME)
    assert isinstance(cache, MaglevCache)
    grown_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
    resumed = model.generate(first.sequences, attention_mask=grown_mask, max_new_tokens=7,
                             **{GENERATE_CACHE_KWARG: cache}, **kwargs)
    assert torch.equal(resumed, once)


# ----- beams ------------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("do_sample", [False, True])
def test_beam_search_with_cache_equals_without(do_sample):
    model = tiny_model()
    ids, mask = left_padded(prompts((6, 11)))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=4, num_return_sequences=2, do_sample=do_sample,
                  pad_token_id=PAD)
    torch.manual_seed(3)
    cached = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (4, ids.shape[1] + 6)
    assert torch.equal(cached, uncached)


# ----- crop, assisted and prompt-lookup decoding ---------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", ["recurrent", "memory_off_ring", "nanochat_windows"])
def test_crop_rolls_back_exactly(variant):
    """Whole steps roll back bit for bit; a crop inside a multi-token step equals reading only its first
    tokens (to float rounding: parallel chunks of other sizes)."""
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((4, 10)))
    extra = random_ids(2, 9, seed=11)
    rolled = MaglevCache(model.config)
    rolled.activate_past_recording()
    assert rolled.is_croppable
    model(ids, attention_mask=mask, past_key_values=rolled)
    model(extra[:, :3], past_key_values=rolled)
    snapshot = [t.clone() for t in cache_state(rolled)]
    model(extra[:, 3:5], past_key_values=rolled)
    model(extra[:, 5:6], past_key_values=rolled)
    rolled.crop(-3)
    assert rolled.get_seq_length() == ids.shape[1] + 3
    assert all(torch.equal(a, b) for a, b in zip(cache_state(rolled), snapshot, strict=True))
    rolled.crop(ids.shape[1] + 3)  # absolute form: nothing to remove
    rolled.crop(0)
    assert all(torch.equal(a, b) for a, b in zip(cache_state(rolled), snapshot, strict=True))

    model(extra[:, 3:8], past_key_values=rolled)  # a multi-token step, partly undone
    rolled.crop(ids.shape[1] + 5)
    kept = MaglevCache(model.config)
    model(ids, attention_mask=mask, past_key_values=kept)
    model(extra[:, :3], past_key_values=kept)
    model(extra[:, 3:5], past_key_values=kept)
    assert_same_state(rolled, kept)
    # continuing from the rolled-back cache equals continuing from the live one
    a = model(extra[:, 5:], past_key_values=rolled).logits
    b = model(extra[:, 5:], past_key_values=kept).logits
    assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="cannot remove"):
        rolled.crop(-1000)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["recurrent", "memory_off_ring"])
def test_assisted_decoding_equals_greedy(variant):
    model = tiny_model(**VARIANTS[variant])
    small = tiny_model(seed=3, num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                       **VARIANTS[variant])
    prompt = random_ids(1, 11, seed=4)
    greedy = model.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=model), greedy)
    assert torch.equal(model.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=small), greedy)


@torch.no_grad()
def test_prompt_lookup_decoding_equals_greedy():
    model = tiny_model()
    prompt = random_ids(1, 6, seed=9).repeat(1, 3)  # repeats give lookup candidates
    greedy = model.generate(prompt, max_new_tokens=14, do_sample=False)
    looked_up = model.generate(prompt, max_new_tokens=14, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(looked_up, greedy)


# ----- saved caches -------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", ["recurrent", "nanochat_windows"])
def test_saved_cache_continues_like_the_live_one(tmp_path, variant):
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((6, 13)))
    live = MaglevCache(model.config)
    model(ids, attention_mask=mask, past_key_values=live)
    live.save(tmp_path / "doc")
    loaded = MaglevCache.load(tmp_path / "doc", model)
    assert_same_state(loaded, live, atol=0)
    assert loaded.nbytes() == live.nbytes()
    question = random_ids(2, 10, seed=12)
    assert torch.equal(model(question, past_key_values=loaded).logits, model(question, past_key_values=live).logits)
    assert sorted(p.name for p in (tmp_path / "doc").iterdir()) == ["maglev_cache.json", "maglev_cache.safetensors"]


@torch.no_grad()
def test_cache_for_another_config_is_refused(tmp_path):
    model = tiny_model()
    other = tiny_model(sliding_window=12)
    cache = MaglevCache(model.config)
    model(random_ids(1, 5), past_key_values=cache)
    cache.save(tmp_path / "c")
    with pytest.raises(ValueError, match="sliding_window"):
        MaglevCache.load(tmp_path / "c", other)
    with pytest.raises(ValueError, match="another Maglev config"):
        other(random_ids(1, 2), past_key_values=cache)
    with pytest.raises(ValueError, match="another Maglev config"):
        other.generate(random_ids(1, 6), max_new_tokens=1, **{GENERATE_CACHE_KWARG: cache})
    with pytest.raises(ValueError, match="not a saved MaglevCache"):
        MaglevCache.load(tmp_path / "missing", model)
    with pytest.raises(ValueError, match="empty"):
        MaglevCache(model.config).save(tmp_path / "empty")
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())


# ----- cache monitor ------------------------------------------------------------------------------------------
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
    assert sizes == {model.config.cache_bytes(20, batch_size=2, dtype=torch.float32)}  # flat
    assert monitor.trace[-1]["layer_lengths"] == [WINDOW - 1] * model.config.num_hidden_layers
    assert not model._forward_hooks  # removed on exit
    with pytest.raises(TypeError, match="nbytes"):
        describe_cache(object())


# ----- bad inputs ------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_bad_inputs_get_clear_errors():
    model = tiny_model()
    ids = random_ids(2, 6)
    with pytest.raises(ValueError, match="non-empty"):
        model(ids[:, :0])
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, VOCAB]]))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(TypeError, match="integer"):
        model(ids.float())
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(ids, attention_mask=torch.ones(3, 6))
    with pytest.raises(ValueError, match="not both"):
        model(ids, inputs_embeds=torch.zeros(2, 6, 64))
    with pytest.raises(ValueError, match="not supported"):
        model(inputs_embeds=torch.zeros(2, 6, 64))
    with pytest.raises(TypeError, match="MaglevCache"):
        model(ids, past_key_values=DynamicCache())
    cache = MaglevCache(model.config)
    model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match="2 rows but the inputs have 3"):
        model(random_ids(3, 1), past_key_values=cache)
    with pytest.raises(ValueError, match="cached \\+ new"):
        model(ids[:, :1], attention_mask=torch.ones(2, 3), past_key_values=cache)
    # No position limit to check: rotary is computed on the fly (test_maglev_model's invariant 3 decodes
    # past max_position_embeddings and matches the uncached forward).


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
