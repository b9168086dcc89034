"""Packed rows (several documents in one row): logits, loss and every parameter's gradient equal those of each
document run alone, in both models and their training modes; document boundaries from position_ids,
cu_seq_lens_q and seq_idx; a packed row with a cache is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvm_maglev.models.common.step_plan import Document, length_buckets, packed_documents
from tests.models.kvm.test_kvm_training import random_model as kvm_model
from tests.models.maglev.test_maglev_model import VOCAB
from tests.models.maglev.test_maglev_model import tiny_model as maglev_model
from tests.models.packing.helpers import check_packed_equals_alone, documents, packed_batch

KVM_VOCAB = 53
LENGTHS = [13, 1, 20, 7, 4]  # chunk_size 4: a length 1, multiples and non-multiples of the chunk


@pytest.mark.parametrize("switches", [
    dict(state_budget_mode="fixed", state_budget_min=4, state_max_chunks=2),
    dict(state_budget_mode="power_law", state_budget_factor=1.5, state_budget_min=4),
    dict(state_budget_mode="kvm_saturation", state_budget_saturation=12),
    dict(sliding_window_every=2),
])
def test_kvm_packed_equals_alone(switches):
    model = kvm_model(**switches).train()
    check_packed_equals_alone(model, documents(LENGTHS, KVM_VOCAB))


def test_kvm_packed_rows_and_embeddings_equal_alone():
    model = kvm_model().eval()
    docs = documents([9, 6, 3, 6], KVM_VOCAB, seed=3)
    batch = packed_batch(docs, rows=2)
    embeds = model.get_input_embeddings()(batch["input_ids"])
    packed = model(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits
    for row, order in enumerate([docs[0::2], docs[1::2]]):
        column = 0
        for doc in order:
            alone = model(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(packed[row, column:column + len(doc)], alone, atol=1e-5, rtol=1e-5)
            column += len(doc)


@pytest.mark.parametrize("switches", [
    dict(consistency_weight=0.0),
    dict(consistency_weight=0.0, prefiller_shares_blocks=False),
    dict(consistency_weight=0.0, memory_self_feed_steps=2, memory_self_feed_mix=1.0),
    dict(use_memory=False),
])
def test_maglev_packed_equals_alone(switches):
    model = maglev_model(**switches).train()
    check_packed_equals_alone(model, documents(LENGTHS, VOCAB))


def test_maglev_consistency_is_the_mean_over_all_documents_tokens():
    model = maglev_model(consistency_weight=0.5).train()
    docs = documents(LENGTHS, VOCAB)
    batch = packed_batch(docs)
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    alone = [model(input_ids=d[None], labels=d[None]).consistency_loss for d in docs]
    expected = sum(c * len(d) for c, d in zip(alone, docs)) / sum(len(d) for d in docs)
    torch.testing.assert_close(packed.consistency_loss, expected, atol=1e-5, rtol=1e-5)


def test_maglev_inference_prefill_packed_equals_alone():
    model = maglev_model(memory_prefill="prefiller").eval()
    docs = documents([11, 1, 6], VOCAB, seed=2)
    batch = packed_batch(docs)
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 19), min_size=2, max_size=4).filter(lambda lengths: max(lengths) > 1))
def test_random_lengths_kvm_and_maglev(lengths):
    check_packed_equals_alone(kvm_model().train(), documents(lengths, KVM_VOCAB))
    check_packed_equals_alone(maglev_model(consistency_weight=0.0).train(), documents(lengths, VOCAB))


def test_boundaries_from_every_source_agree_or_are_refused():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    expected = [Document(0, 0, 3), Document(0, 3, 5), Document(0, 5, 6)]
    cu = torch.tensor([0, 3, 5, 6])
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert packed_documents(positions, None, {}, 1, 6, "M") == expected
    assert packed_documents(None, None, {"cu_seq_lens_q": cu}, 1, 6, "M") == expected
    assert packed_documents(positions, None, {"cu_seq_lens_q": cu, "seq_idx": seq_idx}, 1, 6, "M") == expected
    assert packed_documents(torch.arange(6)[None], None, {}, 1, 6, "M") is None  # one document: not packed
    with pytest.raises(ValueError, match="different places"):
        packed_documents(positions, None, {"cu_seq_lens_q": torch.tensor([0, 2, 6])}, 1, 6, "M")
    with pytest.raises(ValueError, match="count 0, 1, 2"):
        packed_documents(torch.tensor([[0, 1, 3, 0, 1, 2]]), None, {}, 1, 6, "M")
    with pytest.raises(ValueError, match="across rows"):
        packed_documents(None, None, {"cu_seq_lens_q": torch.tensor([0, 2, 6])}, 2, 3, "M")
    with pytest.raises(ValueError, match="padding"):
        packed_documents(None, torch.tensor([[1, 1, 1, 1, 1, 0]]), {"cu_seq_lens_q": cu}, 1, 6, "M")
    left_padded = torch.tensor([[1, 1, 0, 1, 2, 3]])  # generate()'s positions for a left-padded row
    assert packed_documents(left_padded, torch.tensor([[0, 0, 1, 1, 1, 1]]), {}, 1, 6, "M") is None


@pytest.mark.parametrize("make", [kvm_model, maglev_model])
def test_cu_seq_lens_alone_delimit_documents_and_a_cache_is_refused(make):
    model = make().eval()
    vocab = model.config.vocab_size
    docs = documents([5, 8], vocab)
    batch = packed_batch(docs)
    by_positions = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    by_cu = model(input_ids=batch["input_ids"], cu_seq_lens_q=torch.tensor([0, 5, 13]), use_cache=False).logits
    torch.testing.assert_close(by_cu, by_positions)
    with pytest.raises(ValueError, match="cannot be run with a cache"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)


def test_buckets_are_chunk_aligned_and_waste_under_half():
    docs = [Document(0, 0, 2000), Document(0, 2000, 2100), Document(0, 2100, 2900), Document(1, 0, 64)]
    buckets = length_buckets(docs, 256)
    assert [[d.length for d in b] for b in buckets] == [[2000, 800], [100, 64]]
