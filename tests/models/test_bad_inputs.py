"""Bad inputs at the model API of both models, as one matrix: each gets a ValueError/TypeError whose message
names the problem (never an index error deep inside, never silent garbage). The model tests check the
messages of each model's own checks; this file checks that both models answer every case, including the
cases that involve both (a cache of the other model, its saved folder) and the generate() entry point.

No position limit exists to test: both models compute rotary tables from each row's position on the fly
(test_maglev_model decodes past max_position_embeddings; KVM's field is informational, 2**30 by default)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvm_maglev.models.common.transformers_versions import GENERATE_CACHE_KWARG
from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM
from kvm_maglev.package_only.saved_cache import load_cache, save_cache
from tests.generation.test_determinism import MODELS, PAD, VOCAB, build

CACHE_CLASSES = {"kvm": KVMCache, "maglev": MaglevCache}


@pytest.fixture(scope="module")
def models() -> dict:
    return {name: build(name) for name in MODELS}


def other(name: str) -> str:
    return MODELS[1 - MODELS.index(name)]


def filled_cache(model, batch: int = 2):
    """A cache of `model` that has read 4 columns of `batch` rows."""
    cache = CACHE_CLASSES["kvm" if isinstance(model, KVMForCausalLM) else "maglev"](model.config)
    model(torch.ones(batch, 4, dtype=torch.long), past_key_values=cache)
    return cache


def other_config_model(name: str):
    """The same kind of model with one architecture field changed (a cache must not pass between them)."""
    config = build(name).config.to_dict()
    if name == "kvm":
        config["chunk_size"] = 8
        return KVMForCausalLM(KVMConfig(**config)).eval(), "chunk_size"
    config["sliding_window"] = 9
    return MaglevForCausalLM(MaglevConfig(**config)).eval(), "sliding_window"


IDS = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))

# name -> (call(model, name, models), exception type, regex the message must match)
CASES = {
    "empty_input_ids": (lambda m, n, ms: m(IDS[:, :0]), ValueError, r"non-empty \[batch, length\].*\(2, 0\)"),
    "empty_batch": (lambda m, n, ms: m(IDS[:0]), ValueError, r"non-empty \[batch, length\].*\(0, 6\)"),
    "one_dimensional_ids": (lambda m, n, ms: m(IDS[0]), ValueError, r"\[batch, length\].*\(6,\)"),
    "ids_at_vocab_size": (lambda m, n, ms: m(torch.tensor([[1, VOCAB]])), ValueError,
                          rf"vocab_size={VOCAB}.*\[1, {VOCAB}\]"),
    "negative_ids": (lambda m, n, ms: m(torch.tensor([[-3, 2]])), ValueError, rf"vocab_size={VOCAB}.*\[-3, 2\]"),
    "float_ids": (lambda m, n, ms: m(IDS.float()), TypeError, r"integer tensor.*float32"),
    "bool_ids": (lambda m, n, ms: m(IDS.bool()), TypeError, r"integer tensor.*bool"),
    "ids_as_list": (lambda m, n, ms: m(IDS.tolist()), TypeError, r"integer tensor.*list"),
    "no_inputs": (lambda m, n, ms: m(), ValueError, r"input_ids"),
    "inputs_embeds_with_input_ids": (lambda m, n, ms: m(IDS, inputs_embeds=torch.zeros(2, 6, 32)), ValueError,
                                     r"(?i)either input_ids or inputs_embeds, not both"),
    "mask_too_short": (lambda m, n, ms: m(IDS, attention_mask=torch.ones(2, 5)), ValueError,
                       r"attention_mask must have shape \[2, 6\].*\(2, 5\)"),
    "mask_wrong_batch": (lambda m, n, ms: m(IDS, attention_mask=torch.ones(3, 6)), ValueError,
                         r"attention_mask must have shape \[2, 6\].*\(3, 6\)"),
    "mask_one_dimensional": (lambda m, n, ms: m(IDS, attention_mask=torch.ones(6)), ValueError,
                             r"attention_mask must have shape \[2, 6\].*\(6,\)"),
    "mask_as_list": (lambda m, n, ms: m(IDS, attention_mask=[[1] * 6] * 2), TypeError,
                     r"attention_mask must be a tensor.*list"),
    "mask_wrong_for_cached_columns": (
        lambda m, n, ms: m(IDS[:, :1], attention_mask=torch.ones(2, 3), past_key_values=filled_cache(m)),
        ValueError, r"\[2, 1\] or \[2, 5\].*cached \+ new.*\(2, 3\)"),
    "cache_of_the_other_model": (
        lambda m, n, ms: m(IDS, past_key_values=CACHE_CLASSES[other(n)](ms[other(n)].config)), TypeError,
        r"KVMCache.*MaglevCache|MaglevCache.*KVMCache"),
    "dynamic_cache": (lambda m, n, ms: m(IDS, past_key_values=DynamicCache()), TypeError, r"Cache, got DynamicCache"),
    "cache_of_another_config": (
        lambda m, n, ms: other_config_model(n)[0](IDS, past_key_values=filled_cache(m)), ValueError,
        r"another (KVM|Maglev) config.*(chunk_size|sliding_window)"),
    "cache_batch_size_changed": (lambda m, n, ms: m(IDS[:1, :1], past_key_values=filled_cache(m, batch=2)),
                                 ValueError, r"2 rows but the inputs have 1"),
    "two_different_caches": (
        lambda m, n, ms: m(IDS, past_key_values=filled_cache(m), cache=CACHE_CLASSES[n](m.config)), ValueError,
        r"(?i)cache once.*not both"),
    "generate_ids_at_vocab_size": (
        lambda m, n, ms: m.generate(torch.tensor([[1, VOCAB + 5]]), max_new_tokens=2, pad_token_id=PAD),
        ValueError, rf"vocab_size={VOCAB}"),
    "generate_empty_prompt": (
        lambda m, n, ms: m.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2, pad_token_id=PAD),
        ValueError, r"non-empty"),
    # with padding in it: transformers 5.24's generate drops a mask of all ones before the model sees it
    "generate_mask_wrong_shape": (
        lambda m, n, ms: m.generate(IDS, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), max_new_tokens=2,
                                    pad_token_id=PAD),
        ValueError, r"attention_mask must have shape"),
    "generate_cache_of_the_other_model": (
        lambda m, n, ms: m.generate(IDS, max_new_tokens=2, pad_token_id=PAD,
                                    **{GENERATE_CACHE_KWARG: CACHE_CLASSES[other(n)](ms[other(n)].config)}),
        TypeError, r"KVMCache.*MaglevCache|MaglevCache.*KVMCache"),
}


@torch.no_grad()
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_bad_input_gets_a_clear_error(models, name, case):
    call, error, message = CASES[case]
    with pytest.raises(error, match=message):
        call(models[name], name, models)


@torch.no_grad()
@pytest.mark.parametrize("name", MODELS)
def test_saved_cache_of_the_other_model_is_refused(models, name, tmp_path):
    saved = filled_cache(models[other(name)])
    save_cache(saved, tmp_path / "saved")
    with pytest.raises(ValueError, match=f"not a saved {CACHE_CLASSES[name].__name__}"):
        load_cache(tmp_path / "saved", models[name], CACHE_CLASSES[name])


@torch.no_grad()
@pytest.mark.parametrize("name", MODELS)
def test_refused_inputs_leave_the_cache_untouched(models, name):
    """A refused forward must not half-update the cache: the next good step equals one on a fresh copy."""
    model = models[name]
    cache, reference = filled_cache(model), filled_cache(model)
    refused = (dict(input_ids=torch.tensor([[1], [VOCAB]])),
               dict(input_ids=IDS[:, :1], attention_mask=torch.ones(2, 3)))
    for bad in refused:
        with pytest.raises(ValueError):
            model(**bad, past_key_values=cache)
    assert cache.get_seq_length() == reference.get_seq_length() == 4
    step = IDS[:, :2]
    assert torch.equal(model(step, past_key_values=cache).logits, model(step, past_key_values=reference).logits)
