"""Every method transformers' generic code may call on a `Cache` either works on a MaglevCache or refuses with an
error that says why (transformers 5.25's `cache_utils.Cache`; members older releases lack are checked where they
exist)."""

import pytest
import torch
from transformers.cache_utils import Cache

from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from tests.models.maglev.test_maglev_model import random_ids, tiny_model


def filled_cache() -> MaglevCache:
    """A cache of two rows that read five tokens."""
    model = tiny_model()
    cache = MaglevCache(model.config)
    with torch.no_grad():
        model(random_ids(2, 5), past_key_values=cache, use_cache=True)
    return cache


def test_queries_answer_before_and_after_the_first_forward():
    model = tiny_model()
    empty = MaglevCache(model.config)
    assert (empty.is_initialized, empty.has_previous_state(), empty.batch_size, empty.max_batch_size) == (
        False, False, -1, -1)
    cache = filled_cache()
    assert (cache.is_initialized, cache.has_previous_state(), cache.batch_size, cache.max_batch_size) == (
        True, True, 2, 2)
    assert cache.get_seq_length() == cache.get_query_offset() == 5
    assert cache.get_max_length() == cache.max_cache_len == -1
    assert not cache.is_compileable and not cache.is_croppable
    assert cache.is_sliding == [True] * 3 and cache.is_linear == cache.is_dummy == [False] * 3
    if hasattr(Cache, "is_recording_past"):  # transformers >= 5.25
        assert not cache.is_recording_past(0) and cache.get_recurrent_states_to_keep() == 0


def test_row_changes_work():
    cache = filled_cache()
    memory = cache.last_memory.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.last_memory, memory.flip(0))
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert torch.equal(cache.last_memory, memory.flip(0))
    cache.crop(0)
    assert cache.get_seq_length() == 5


@pytest.mark.parametrize("call, reason", [
    (lambda cache: cache.get_mask_sizes(1, 0), "builds its own masks"),
    (lambda cache: cache.early_initialization(2, 2, 16, torch.float32, "cpu"), "memory_init"),
    (lambda cache: cache.update(torch.zeros(1), torch.zeros(1), 0), "filled by the Maglev model"),
    (lambda cache: cache.offload(0), "offloading"),
    (lambda cache: cache.prefetch(0), "offloading"),
    (lambda cache: cache.increase_count(0, 0), "no convolution states"),
    (lambda cache: cache.update_conv_state(torch.zeros(1), 0), "no convolution states"),
    (lambda cache: cache.update_recurrent_state(torch.zeros(1), 0), "no linear-attention recurrent states"),
], ids=["get_mask_sizes", "early_initialization", "update", "offload", "prefetch", "increase_count",
        "update_conv_state", "update_recurrent_state"])
def test_what_does_not_apply_is_refused_with_its_reason(call, reason):
    with pytest.raises(NotImplementedError, match=reason):
        call(filled_cache())


@pytest.mark.parametrize("name, call", [
    ("get_conv_state", lambda cache: cache.get_conv_state(0)),
    ("get_recurrent_state", lambda cache: cache.get_recurrent_state(0)),
    ("update_indexer", lambda cache: cache.update_indexer(torch.zeros(1), 0)),
], ids=["get_conv_state", "get_recurrent_state", "update_indexer"])
def test_linear_attention_accessors_name_the_layer_kind(name, call):
    if not hasattr(Cache, name):
        pytest.skip(f"this transformers' Cache has no {name}")
    with pytest.raises(ValueError, match="MaglevCacheLayer"):
        call(filled_cache())
