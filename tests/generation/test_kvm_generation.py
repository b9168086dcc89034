"""KVM under every generate() strategy: padded batches (left with a mask, right without), chunked prefill,
continuation, beams, assisted and prompt-lookup decoding (exact crop), saved caches, the cache monitor and
bad inputs. Each test compares against a simpler path that must agree."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvm_maglev.cache_monitor import CacheMonitor, describe_cache
from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.modeling_kvm import CACHE_FIELD

PAD = 0
VOCAB = 61
CHUNK = 4
BASE = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8, chunk_size=CHUNK,
    window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0, state_budget_min=4, state_max_chunks=100,
)
VARIANTS = {
    # state grows with the context (appends of the most novel tokens and merges)
    "power_law": {},
    # sliding-window layers in between, post-token-shift value gate, gated first chunk
    "saturation_swa": dict(
        num_hidden_layers=4, sliding_window_every=2, sliding_window=5, sliding_window_rotary_dim=16,
        kvm_value_residual_mode="rwkv_post_tokenshift", merge_gate_initial_state=True, state_budget_mode="kvm_saturation",
        state_budget_saturation=16, state_budget_min=1,
    ),
    # a one-chunk state merged into by every block, counts instead of value norms
    "fixed_counts": dict(state_value_norms=False, state_budget_mode="fixed", state_budget_min=4, state_max_chunks=1),
}



_MODELS: dict = {}


def tiny_model(seed: int = 0, **overrides) -> KVMForCausalLM:
    """Tiny model whose every parameter matters (the default init zeroes some paths); built once per config."""
    key = (seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        model = KVMForCausalLM(KVMConfig(**{**BASE, **overrides})).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.3 * torch.randn_like(param))
        _MODELS[key] = model
    return _MODELS[key]


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Ids without the pad id (generate would mask it)."""
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def prompts(lengths=(3, 9, 14, 6), seed=7) -> list[torch.Tensor]:
    """Rows whose lengths put their chunk boundaries (chunk 4) at different columns of a padded batch."""
    return [random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]


def left_padded(rows: list[torch.Tensor], pad: int = PAD):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


def cache_of(output) -> KVMCache:
    return getattr(output, CACHE_FIELD)


def row_state(cache: KVMCache, row: int) -> list[torch.Tensor]:
    """Everything the cache holds for one row: per layer state, window and token-shift carries."""
    for group in cache.groups:
        if row in group.rows:
            local = group.rows.index(row)
            tensors = []
            for layer in group.layers:
                named = layer.tensors()
                tensors += [named[name][local:local + 1] for name in sorted(named)]
                tensors.append(torch.tensor([layer.seen, layer.merged_blocks, layer.window.begin]))
            for carries in cache.carries:
                tensors += [carries.values[name][row:row + 1] for name in sorted(carries.values)]
            return tensors
    raise AssertionError(f"row {row} not in the cache")


def assert_same_rows(a: KVMCache, b: KVMCache, rows_a=None, rows_b=None, atol=5e-5):
    # oneDNN's linears block by row count, so states built from different chunkings differ by rounding
    rows_a = range(a.rows) if rows_a is None else rows_a
    rows_b = range(b.rows) if rows_b is None else rows_b
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for x, y in zip(row_state(a, ra), row_state(b, rb), strict=True):
            assert x.shape == y.shape, (ra, rb, x.shape, y.shape)
            assert torch.allclose(x.to(y.dtype), y, atol=atol), (ra, rb, (x - y).abs().max())


# ----- padded batches -----------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_greedy_batch_equals_each_row_alone(variant):
    model = tiny_model(**VARIANTS[variant])
    rows = prompts()
    ids, mask = left_padded(rows)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=PAD,
                         return_dict_in_generate=True)
    width = ids.shape[1]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=14, do_sample=False, pad_token_id=PAD,
                               return_dict_in_generate=True)
        assert torch.equal(out.sequences[i, width:], alone.sequences[0, len(row):]), i
        # the row's state, window and carries are those of the row read alone: same chunk boundaries and merges
        assert_same_rows(cache_of(out), cache_of(alone), [i], [0])
    assert cache_of(out).row_lengths() == [len(r) + 13 for r in rows]


@torch.no_grad()
def test_left_padded_sampling_scores_equal_each_row_rescored_alone():
    """Seeded sampling in a padded batch: each step's logits equal the row's own unpadded uncached forward,
    and what fills the padding does not change a single sampled token."""
    model = tiny_model(**VARIANTS["saturation_swa"])
    rows = prompts((5, 11))
    ids, mask = left_padded(rows)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=0, return_dict_in_generate=True,
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
    ids = torch.full((3, 20), PAD, dtype=torch.long)
    mask = torch.zeros(3, 20, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    no_mask = model(ids, use_cache=False).logits
    with_mask = model(ids, attention_mask=mask).logits
    for i, row in enumerate(rows):
        alone = model(row[None], use_cache=False).logits[0]
        assert torch.allclose(no_mask[i, :len(row)], alone, atol=1e-5)
        assert torch.allclose(with_mask[i, :len(row)], alone, atol=1e-5)


@torch.no_grad()
def test_padding_inside_decoding_steps_is_skipped():
    """A row may skip steps (mask 0) while others decode: its state is untouched, it stays in the batch."""
    model = tiny_model(**VARIANTS["saturation_swa"])
    ids = random_ids(2, 16)
    cache = KVMCache(model.config)
    model(ids[:, :6], cache=cache)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 6:9] = 0  # row 1 pauses for three columns
    for t in range(6, 16):
        step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits
    reference = model(torch.cat([ids[1:, :6], ids[1:, 9:]], dim=1), use_cache=False).logits[:, -1]
    assert torch.allclose(step[1], reference[0], atol=1e-5)
    assert torch.allclose(step[0], model(ids[:1], use_cache=False).logits[0, -1], atol=1e-5)
    assert cache.row_lengths() == [16, 13] and cache.get_seq_length() == 16


@torch.no_grad()
def test_padded_batch_in_a_training_forward_without_cache():
    """A padded batch without a cache (evaluation, training with padding) equals each row alone."""
    model = tiny_model()
    rows = prompts((7, 12))
    ids, mask = left_padded(rows)
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    for i, row in enumerate(rows):
        alone = model(row[None], use_cache=False).logits[0]
        assert torch.allclose(logits[i, -len(row):], alone, atol=1e-5)
        assert torch.isfinite(logits[i]).all()


# ----- multi-token steps on a non-empty cache -------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_chunks_give_identical_cache_and_logits(variant):
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((7, 19, 13)))
    reference = KVMCache(model.config)
    whole = model(ids, attention_mask=mask, cache=reference).logits
    for chunk in (1, 7, CHUNK):
        cache = KVMCache(model.config)
        logits = torch.cat([model(ids[:, s:s + chunk], attention_mask=mask[:, :s + chunk], cache=cache).logits
                            for s in range(0, ids.shape[1], chunk)], dim=1)
        real = mask.bool()
        assert torch.allclose(logits[real], whole[real], atol=1e-5), chunk
        assert_same_rows(cache, reference)
        assert cache.state_lengths() == reference.state_lengths()


@torch.no_grad()
def test_generate_with_prefill_chunk_size_equals_plain():
    model = tiny_model(**VARIANTS["saturation_swa"])
    ids, mask = left_padded(prompts((6, 17)))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    for chunk in (1, 7, CHUNK):
        chunked = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                 prefill_chunk_size=chunk)
        assert torch.equal(chunked, plain), chunk


@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_continuation_after_generate_equals_one_call(variant):
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((5, 12)))
    kwargs = dict(do_sample=False, pad_token_id=PAD)
    once = model.generate(ids, attention_mask=mask, max_new_tokens=12, **kwargs)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, **kwargs)
    cache = cache_of(first)
    assert isinstance(cache, KVMCache)
    grown_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
    resumed = model.generate(first.sequences, attention_mask=grown_mask, max_new_tokens=7, **{CACHE_FIELD: cache},
                             **kwargs)
    assert torch.equal(resumed, once)


# ----- beams ------------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("do_sample", [False, True])
def test_beam_search_with_cache_equals_without(do_sample):
    model = tiny_model(**VARIANTS["saturation_swa"])
    ids, mask = left_padded(prompts((6, 11)))
    kwargs = dict(attention_mask=mask, max_new_tokens=8, num_beams=4, num_return_sequences=2, do_sample=do_sample,
                  pad_token_id=PAD)
    torch.manual_seed(3)
    cached = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (4, ids.shape[1] + 8)
    assert torch.equal(cached, uncached)


@torch.no_grad()
def test_sampling_num_return_sequences_with_padding_equals_uncached():
    model = tiny_model()
    ids, mask = left_padded(prompts((3, 10)))
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, num_return_sequences=3, pad_token_id=PAD)
    torch.manual_seed(11)
    cached = model.generate(ids, **kwargs)
    torch.manual_seed(11)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (6, ids.shape[1] + 9) and torch.equal(cached, uncached)


# ----- crop, assisted and prompt-lookup decoding ---------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_crop_rolls_back_exactly(variant):
    """Multi-token steps that cross chunk boundaries (folds, appends, merges) are partly undone: the cache
    equals one that never read the removed tokens, and continues like it (to float rounding: the two read
    their tokens in steps of other sizes)."""
    model = tiny_model(**VARIANTS[variant])
    ids = random_ids(2, 40, seed=3)
    kept = KVMCache(model.config)
    model(ids[:, :13], cache=kept)
    rolled = KVMCache(model.config)
    rolled.activate_past_recording()
    assert rolled.is_croppable
    model(ids[:, :10], cache=rolled)
    model(ids[:, 10:16], cache=rolled)  # crosses the boundaries at 12 (a block folds) ...
    model(ids[:, 16:26], cache=rolled)
    rolled.crop(-13)  # ... undone to the middle of the step, with the step after it
    assert rolled.get_seq_length() == 13
    assert_same_rows(rolled, kept)
    rolled.crop(13)  # absolute form: nothing to remove
    rolled.crop(0)
    assert_same_rows(rolled, kept)
    a = model(ids[:, 13:30], cache=rolled).logits
    b = model(ids[:, 13:30], cache=kept).logits
    assert torch.allclose(a, b, atol=1e-5)
    rolled.crop(20)  # absolute form, into the forward just read
    model(ids[:, 20:30], cache=rolled)
    assert_same_rows(rolled, kept, atol=1e-5)
    with pytest.raises(ValueError, match="cannot remove"):
        rolled.crop(-1000)


@torch.no_grad()
def test_crop_with_padding_in_the_step():
    """A step whose mask has zeros (transformers' assistant masks do) is rolled back by its real tokens."""
    model = tiny_model()
    ids = random_ids(1, 20, seed=4)
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
    assert_same_rows(cache, kept)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["power_law", "saturation_swa"])
def test_assisted_decoding_equals_greedy(variant):
    model = tiny_model(**VARIANTS[variant])
    small = tiny_model(seed=3, **{**VARIANTS[variant], "num_hidden_layers": 2, "hidden_size": 16, "rotary_dim": 4,
                                  "sliding_window_rotary_dim": 8})
    prompt = random_ids(1, 11, seed=4)
    greedy = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    assert torch.equal(model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                                      assistant_model=model), greedy)
    assert torch.equal(model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                                      assistant_model=small), greedy)


@torch.no_grad()
def test_prompt_lookup_decoding_equals_greedy():
    model = tiny_model()
    prompt = random_ids(1, 6, seed=9).repeat(1, 3)  # repeats give lookup candidates
    greedy = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    looked_up = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=PAD,
                               prompt_lookup_num_tokens=3)
    assert torch.equal(looked_up, greedy)


# ----- saved caches -------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("variant", ["power_law", "saturation_swa"])
def test_saved_cache_continues_like_the_live_one(tmp_path, variant):
    model = tiny_model(**VARIANTS[variant])
    ids, mask = left_padded(prompts((6, 17)))
    live = KVMCache(model.config)
    model(ids, attention_mask=mask, cache=live)
    live.save(tmp_path / "doc")
    loaded = KVMCache.load(tmp_path / "doc", model)
    assert_same_rows(loaded, live, atol=0)
    assert loaded.nbytes() == live.nbytes() and loaded.get_seq_length() == live.get_seq_length()
    question = random_ids(2, 10, seed=12)
    assert torch.equal(model(question, cache=loaded).logits, model(question, cache=live).logits)
    assert sorted(p.name for p in (tmp_path / "doc").iterdir()) == ["kvm_cache.json", "kvm_cache.safetensors"]


@torch.no_grad()
def test_cache_for_another_config_is_refused(tmp_path):
    model = tiny_model()
    other = tiny_model(chunk_size=8)
    cache = KVMCache(model.config)
    model(random_ids(1, 5), cache=cache)
    cache.save(tmp_path / "c")
    with pytest.raises(ValueError, match="chunk_size"):
        KVMCache.load(tmp_path / "c", other)
    with pytest.raises(ValueError, match="another KVM config"):
        other(random_ids(1, 2), cache=cache)
    with pytest.raises(ValueError, match="another KVM config"):
        other.generate(random_ids(1, 6), max_new_tokens=1, pad_token_id=PAD, **{CACHE_FIELD: cache})
    with pytest.raises(ValueError, match="not a saved KVMCache"):
        KVMCache.load(tmp_path / "missing", model)
    with pytest.raises(ValueError, match="empty"):
        KVMCache(model.config).save(tmp_path / "empty")
    assert not (tmp_path / "empty").exists()


# ----- cache monitor ------------------------------------------------------------------------------------------
@torch.no_grad()
def test_cache_monitor_traces_state_lengths_and_bytes():
    model = tiny_model()
    prompt = random_ids(2, 5)
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
        model(ids, inputs_embeds=torch.zeros(2, 6, 32))
    with pytest.raises(TypeError, match="KVMCache"):
        model(ids, past_key_values=DynamicCache())
    cache = KVMCache(model.config)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="2 rows but the inputs have 3"):
        model(random_ids(3, 1), cache=cache)
    with pytest.raises(ValueError, match="cached \\+ new"):
        model(ids[:, :1], attention_mask=torch.ones(2, 3), cache=cache)
    # inputs_embeds alone work and equal the ids' forward
    embeds = model.get_input_embeddings()(ids)
    assert torch.allclose(model(inputs_embeds=embeds, use_cache=False).logits, model(ids, use_cache=False).logits)
