"""state_kvm's pure functions against small re-implementations of the research code's state functions
(recursal/KVM-paper, model/kvm_mixer.py), on random tensors; rows folding together as each alone; and the fold
computed ahead (speedups/paced_fold_kvm) against the plain fold, bit for bit."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from kvm_maglev.models.kvm import KVMConfig, state_kvm
from kvm_maglev.models.kvm.cache_kvm import STATE, WINDOW, KVMCacheLayer
from kvm_maglev.models.kvm.modeling_kvm import KVMAttention
from kvm_maglev.models.kvm.state_kvm import Overflow
from kvm_maglev.models.speedups import paced_fold_kvm

B, H, D, DV = 2, 3, 16, 12


def random_layer_norm(seed: int = 0) -> torch.nn.LayerNorm:
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(D)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(D))
        norm.bias.add_(0.3 * torch.randn(D))
    return norm


def random_state(slots: int, norm, generator: torch.Generator, value_norms: bool = True):
    keys = norm(torch.randn(B, H, slots, D, generator=generator))
    values = torch.randn(B, H, slots, DV, generator=generator)
    norms = (values.norm(dim=-1, keepdim=True) if value_norms
             else torch.randint(1, 4, (B, H, slots, 1), generator=generator).float())
    return keys, values, norms


# ---- the research functions, re-implemented from reading them -------------------------------------------
def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Tokens `index` [B, H, N] of x [B, H, T, D]."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def research_prepare_k(k: torch.Tensor, rope_partial_dim: int, ln) -> torch.Tensor:
    """SequenceMixer._prepare_state_update_k: rotary part zeroed, then ln_s_k."""
    zeroed = k.clone()
    zeroed[..., :rope_partial_dim] = 0
    return ln(zeroed)


def research_split(k_block: torch.Tensor, n_append: int, k_ref: torch.Tensor):
    """_split_append_merge_idx_by_maxsim: the n_append tokens of lowest max similarity are appended."""
    tokens = k_block.shape[2]
    every = torch.arange(tokens).expand(k_block.shape[0], k_block.shape[1], tokens)
    if n_append == 0:
        return every[..., :0], every
    if n_append == tokens:
        return every, every[..., :0]
    max_similarity = (k_block @ k_ref.transpose(-1, -2)).float().max(dim=-1).values
    ranked = max_similarity.argsort(dim=-1)
    return ranked[..., :n_append].sort(dim=-1).values, ranked[..., n_append:].sort(dim=-1).values


def research_append(s_k, s_v, s_vlen, k_new, v_new, use_vlens: bool):
    """_append_to_state: new slots, their value norm recorded (or a count of one)."""
    vlen = v_new.float().norm(dim=-1, keepdim=True) if use_vlens else torch.ones_like(v_new[..., :1])
    return torch.cat([s_k, k_new], 2), torch.cat([s_v, v_new], 2), torch.cat([s_vlen, vlen], 2)


def research_merge(k_merge, v_merge, s_k, s_v, s_vlen, protected: int, ln, use_vlens: bool):
    """_merge_into_state: a one-hot matrix of each token's most similar unprotected slot, summed in."""
    logits = k_merge @ ln(s_k).transpose(-1, -2)
    logits[..., :protected] = float("-inf")
    one_hot = F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(k_merge.dtype)
    s_k = s_k + one_hot.transpose(-1, -2) @ k_merge
    s_v = s_v + one_hot.transpose(-1, -2) @ v_merge
    if not use_vlens:
        # the research code adds one_hot.sum(-1, keepdim=True), a column of ones over the merged tokens,
        # which broadcasts onto the slots as one more count for every slot
        s_vlen = s_vlen + one_hot.sum(-1, keepdim=True).amax(dim=2, keepdim=True)
    return s_k, s_v, s_vlen


def research_update(s, k_overflow, v_overflow, gate, n_append, sink, ln, gate_keys, gate_values, gate_appends,
                    use_vlens):
    """_update_state_from_overflow_tokens with the append count given (its budget is config arithmetic)."""
    s_k, s_v, s_vlen = s
    k_plain = k_overflow
    k_gated = k_plain * gate if gate_keys else k_plain
    v_gated = v_overflow * gate if gate_values else v_overflow
    k_append, v_append = (k_gated, v_gated) if gate_appends else (k_plain, v_overflow)
    k_merge, v_merge = k_gated, v_gated
    if n_append > 0:
        append_idx, merge_idx = research_split(k_plain, n_append, ln(s_k))
        take = gather_tokens
        s_k, s_v, s_vlen = research_append(s_k, s_v, s_vlen, take(k_append, append_idx), take(v_append, append_idx),
                                           use_vlens)
        k_merge, v_merge = take(k_gated, merge_idx), take(v_gated, merge_idx)
    if k_merge.shape[2] == 0:
        return s_k, s_v, s_vlen
    return research_merge(k_merge, v_merge, s_k, s_v, s_vlen, min(sink, s_k.shape[2]), ln, use_vlens)


def research_read(s_k, s_v, s_vlen, ln, temperature, use_vlens: bool):
    """The state half of _attend_with_state_and_bswa, without its bfloat16 rounding (the fp32rope fixtures)."""
    keys = ln(s_k) * temperature
    values = F.normalize(s_v.float(), dim=-1) * s_vlen if use_vlens else s_v / s_vlen
    return keys, values


# ---- state_kvm against them ------------------------------------------------------------------------------
def padded(state, capacity: int):
    """A state padded with zero slots to `capacity` (rows of a batch hold different numbers of slots)."""
    return tuple(F.pad(t, (0, 0, 0, capacity - t.shape[2])) for t in state)


def counts(value: int) -> torch.Tensor:
    return torch.full((B,), value, dtype=torch.long)


def fold_of(state, block: Overflow, n_append: int, sink: int, norm, value_norms: bool, capacity: int | None = None):
    """state_kvm's Fold of `block` into `state` for every row, the state padded to `capacity`."""
    slots = state[0].shape[2]
    capacity = capacity or slots + block.keys.shape[2]
    return state_kvm.Fold(padded(state, capacity), counts(slots), None, block, [n_append] * B, sink, norm,
                          value_norms)


@torch.no_grad()
def test_state_keys_zero_the_rotary_channels_then_norm():
    norm = random_layer_norm()
    k = torch.randn(B, H, 5, D)
    torch.testing.assert_close(state_kvm.state_keys(k, 6, norm), research_prepare_k(k, 6, norm), rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("n_append", [0, 1, 7, 16])
def test_appends_are_the_research_split(n_append):
    generator = torch.Generator().manual_seed(n_append)
    norm = random_layer_norm()
    state = random_state(11, norm, generator)
    keys = norm(torch.randn(B, H, 16, D, generator=generator))
    expected_append, _ = research_split(keys, n_append, norm(state[0]))
    fold = fold_of(state, Overflow(keys, keys, keys, keys, keys), n_append, 0, norm, True)
    for stage in state_kvm.fold_stages(fold):
        if stage.func in (state_kvm.score_overflow, state_kvm.choose_appends):
            stage()
    appended = fold.appended[..., 0]
    assert torch.equal(appended.sum(dim=-1), torch.full((B, H), n_append))
    assert torch.equal(appended.nonzero()[:, 2].view(B, H, -1), expected_append)


@torch.no_grad()
@pytest.mark.parametrize("value_norms", [True, False])
def test_append_stage_matches_the_research_append(value_norms):
    generator = torch.Generator().manual_seed(1)
    norm = random_layer_norm()
    state = random_state(6, norm, generator, value_norms)
    keys, values = norm(torch.randn(B, H, 4, D, generator=generator)), torch.randn(B, H, 4, DV, generator=generator)
    fold = fold_of(state, Overflow(keys, keys, values, keys, values), 4, 0, norm, value_norms)
    state_kvm.choose_appends(fold)
    state_kvm.append(fold)
    theirs = research_append(*state, keys, values, value_norms)
    assert all(torch.equal(a, b.float()) for a, b in zip(fold.state, theirs))


@torch.no_grad()
@pytest.mark.parametrize("value_norms,protected", [(True, 0), (True, 2), (False, 1)])
def test_merge_by_most_similar_slot_matches_the_research_merge(value_norms, protected):
    generator = torch.Generator().manual_seed(2)
    norm = random_layer_norm()
    slots = 9
    state = random_state(slots, norm, generator, value_norms)
    keys, values = norm(torch.randn(B, H, slots, D, generator=generator)), torch.randn(B, H, slots, DV, generator=generator)
    fold = fold_of(state, Overflow(keys, keys, values, keys, values), 0, protected, norm, value_norms, slots)
    state_kvm.run_fold(fold)
    assert bool((torch.cat(fold.routes, dim=2) >= protected).all())
    theirs = research_merge(keys, values, *state, protected, norm, value_norms)
    for a, b in zip(fold.state, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("n_append", [0, 5, 16])
@pytest.mark.parametrize("gates", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("value_norms,sink", [(True, 1), (False, 0)])
def test_fold_matches_the_research_update(n_append, gates, value_norms, sink):
    generator = torch.Generator().manual_seed(3)
    norm = random_layer_norm()
    slots = 10
    state = random_state(slots, norm, generator, value_norms)
    k = research_prepare_k(torch.randn(B, H, 16, D, generator=generator), 4, norm)
    v = torch.randn(B, H, 16, DV, generator=generator)
    gate = 1 + F.elu(torch.randn(B, H, 16, 1, generator=generator))
    gate_keys, gate_values, gate_appends = gates
    merge_k, merge_v = (k * gate if gate_keys else k), (v * gate if gate_values else v)
    block = Overflow(k, merge_k if gate_appends else k, merge_v if gate_appends else v, merge_k, merge_v)
    ours = state_kvm.run_fold(fold_of(state, block, n_append, sink, norm, value_norms))
    theirs = research_update(state, k, v, gate, n_append, sink, norm, gate_keys, gate_values, gate_appends,
                             value_norms)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a[:, :, :b.shape[2]], b.float(), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_rows_fold_together_as_each_folds_alone():
    """Rows at different slot counts and appends fold in one batch (states padded) exactly as each row alone."""
    generator = torch.Generator().manual_seed(9)
    norm = random_layer_norm()
    rows = [(6, 3), (10, 0), (4, 16), (8, 5)]  # (live slots, appends)
    capacity = max(slots + min(appends, 16) for slots, appends in rows)
    states = [random_state(slots, norm, generator) for slots, _ in rows]
    blocks = [(norm(torch.randn(B, H, 16, D, generator=generator)), torch.randn(B, H, 16, DV, generator=generator))
              for _ in rows]
    alone = []
    for state, (keys, values), (slots, appends) in zip(states, blocks, rows):
        block = Overflow(keys[:1], keys[:1], values[:1], keys[:1], values[:1])
        one = state_kvm.Fold(padded(tuple(t[:1] for t in state), capacity), torch.tensor([slots]), None, block,
                             [appends], 1, norm, True)
        alone.append(state_kvm.run_fold(one))
    batch_state = tuple(torch.cat([padded(tuple(t[:1] for t in state), capacity)[i] for state in states])
                        for i in range(3))
    keys = torch.cat([k[:1] for k, _ in blocks])
    values = torch.cat([v[:1] for _, v in blocks])
    together = state_kvm.run_fold(state_kvm.Fold(
        batch_state, torch.tensor([slots for slots, _ in rows]), None, Overflow(keys, keys, values, keys, values),
        [appends for _, appends in rows], 1, norm, True))
    for row, ((slots, appends), one) in enumerate(zip(rows, alone)):
        live = slots + min(appends, 16)
        for a, b in zip(together, one):
            torch.testing.assert_close(a[row:row + 1, :, :live], b[:, :, :live], rtol=1e-6, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("value_norms", [True, False])
def test_readable_state_matches_the_research_read(value_norms):
    """The read form without temperature (the model scales the queries by it, which gives the same logits)."""
    generator = torch.Generator().manual_seed(4)
    norm = random_layer_norm()
    state = random_state(7, norm, generator, value_norms)
    keys, values = state_kvm.readable_state(state, norm(state[0]), value_norms, torch.float32)
    expected_keys, expected_values = research_read(*state, norm, 1.0, value_norms)
    torch.testing.assert_close(keys, expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0)


def test_similarity_rows_cover_the_block_in_order():
    rows = state_kvm.similarity_rows(10, state_kvm.SIMILARITY_BLOCK // 3)
    assert [(r.start, r.stop) for r in rows] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert state_kvm.similarity_rows(64, 10**9) == [slice(i, i + 1) for i in range(64)]


# ---- the fold computed ahead equals the plain fold --------------------------------------------------------
def attention_and_cache(slots: int, budget: int, value_norms: bool, gated: bool, dtype=torch.float32):
    """A KVM attention layer (chunk 16, 3 heads) and a dense cache layer whose state has `slots` slots and whose
    window ring holds block 1 (positions 16-31), with random weights and tensors everywhere."""
    config = KVMConfig(vocab_size=32, hidden_size=48, num_hidden_layers=1, num_attention_heads=H, rotary_dim=4,
                       chunk_size=16, window_chunks=2, state_budget_mode="fixed", state_budget_min=budget,
                       state_max_chunks=100, sink_slots=1, state_value_norms=value_norms,
                       merge_gate_keys=gated, merge_gate_values=gated)
    torch.manual_seed(5)
    attention = KVMAttention(config, 0).eval()
    with torch.no_grad():
        for param in attention.parameters():
            param.add_(0.3 * torch.randn_like(param))
    generator = torch.Generator().manual_seed(6)
    layer = KVMCacheLayer(config, 0)
    head_dim, value_dim = attention.head_dim, attention.value_head_dim
    keys = attention.state_key_norm(torch.randn(B, H, slots, head_dim, generator=generator))
    values = torch.randn(B, H, slots, value_dim, generator=generator)
    norms = values.norm(dim=-1, keepdim=True) if value_norms else torch.ones(B, H, slots, 1)
    ring = [torch.randn(B, H, 32, head_dim, generator=generator).to(dtype),
            torch.randn(B, H, 32, value_dim, generator=generator).to(dtype)]
    if gated:
        ring.append((1 + F.elu(torch.randn(B, H, 32, 1, generator=generator))).to(dtype))
    layer.tensors = {**dict(zip(WINDOW, ring)), **dict(zip(STATE, (keys, values, norms)))}
    return attention, layer


@torch.no_grad()
@pytest.mark.parametrize("slots,budget,value_norms,gated", [
    (20, 20, True, True), (20, 27, True, True), (16, 32, True, True), (20, 27, True, False),  # appends none/some/all
    (16, 16, False, False), (12, 16, False, True),  # counts (the state stays within one chunk)
])
@pytest.mark.parametrize("block_size", [None, 50, 130])  # one product per stage, or uneven blocks of 1-6 rows
def test_fold_computed_ahead_equals_the_plain_fold_bit_for_bit(slots, budget, value_norms, gated, block_size,
                                                               monkeypatch):
    if block_size is not None:
        monkeypatch.setattr(state_kvm, "SIMILARITY_BLOCK", block_size)
    attention, layer = attention_and_cache(slots, budget, value_norms, gated)
    appends = min(max(min(budget, 32), slots) - slots, 16)
    capacity = slots + appends
    def ring_fold():  # block 1 of every row
        return layer.ring_fold(None, [1] * B, [slots] * B, [appends] * B, capacity, attention.state_key_norm)

    fold = paced_fold_kvm.PacedFold(ring_fold(), partial(layer.read_form, normalize=attention.state_key_norm,
                                                         dtype=torch.float32), 1, 16)
    assert fold.stride == max(1, 14 // (len(fold.stages) + 1))
    steps = 0
    while not fold.done:
        fold.run_next_stage()
        steps += 1
    assert steps == len(fold.stages)
    plain = state_kvm.run_fold(ring_fold())
    assert all(torch.equal(a, b) for a, b in zip(fold.state, plain))
    assert all(torch.equal(a, b) for a, b in zip(fold.read, attention.readable(plain, torch.float32)))
