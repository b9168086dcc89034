"""Grouped-query attention in KVM: query head h reads key/value head h // group, whose window and state are
kept once for the group. Checked against a model without GQA whose key/value weights are repeated per query
head (the same logits), and cached decoding against the full forward, batched against unbatched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.models.common.transformers_versions import returned_cache
from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.modeling_kvm import check_tensor_parallel_size
from kvm_maglev.package_only.saved_cache import load_cache, save_cache

BASE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, rotary_dim=4, chunk_size=4,
            window_chunks=2, state_max_chunks=100, state_budget_min=4)
BUDGETS = {
    "fixed": dict(state_budget_mode="fixed", state_budget_min=6, state_max_chunks=2),
    "power_law": dict(state_budget_mode="power_law", state_budget_factor=2.0),
}
KV_HEADS = (2, 1)  # grouped, multi-query
# per key/value head: repeated rows (or entries) of these, in `(name, dim, width)` form
PER_KV_HEAD = (("k_proj.weight", 0, "qk"), ("v_proj.weight", 0, "v"), ("k_shift", 0, "qk"), ("v_shift", 0, "v"),
               ("value_gate_bias", 2, "v"), ("value_gate_up.weight", 0, "v"), ("merge_gate_proj.weight", 0, 1))


def random_model(seed: int = 0, **overrides) -> KVMForCausalLM:
    torch.manual_seed(seed)
    model = KVMForCausalLM(KVMConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def expanded(gqa: KVMForCausalLM) -> KVMForCausalLM:
    """The model without GQA that computes the same: each key/value head's weights copied to its query heads."""
    config = gqa.config
    plain = KVMForCausalLM(KVMConfig(**{**config.to_diff_dict(), "num_key_value_heads": None})).eval()
    widths = {"qk": config.qk_head_dim, "v": config.v_head_dim, 1: 1}
    state = {}
    for key, value in gqa.state_dict().items():
        for name, dim, width in PER_KV_HEAD:
            if key.endswith("self_attn." + name):
                heads = value.unflatten(dim, (config.kv_heads, widths[width]))
                value = heads.repeat_interleave(config.kv_group_size, dim=dim).flatten(dim, dim + 1)
        state[key] = value
    plain.load_state_dict(state, strict=True)
    return plain


def decode(model: KVMForCausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        cache = returned_cache(out)
        steps = [out.logits] + [model(ids[:, i : i + 1], cache=cache).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_gqa_equals_repeated_key_value_weights(budget, kv_heads):
    gqa = random_model(num_key_value_heads=kv_heads, **BUDGETS[budget])
    plain = expanded(gqa)
    ids = torch.randint(0, 61, (2, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(gqa(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)
    assert torch.allclose(decode(gqa, ids, 9), decode(plain, ids, 9), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("budget", sorted(BUDGETS))
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_gqa_cached_decode_equals_full_forward(budget, kv_heads, data):
    length = data.draw(st.integers(1, 45), label="length")
    prefill = data.draw(st.integers(1, length), label="prefill")
    model = random_model(num_key_value_heads=kv_heads, **BUDGETS[budget])
    ids = torch.randint(0, 61, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        alone = torch.cat([model(ids[row : row + 1], use_cache=False).logits for row in range(2)])
        with model.runtime_speedups():
            fast = decode(model, ids, prefill)
    assert torch.allclose(decode(model, ids, prefill), full, atol=1e-5, rtol=0)
    assert torch.allclose(fast, full, atol=1e-5, rtol=0)
    assert torch.allclose(alone, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_gqa_cache_holds_key_value_heads(kv_heads):
    model = random_model(num_key_value_heads=kv_heads, **BUDGETS["power_law"])
    with torch.no_grad():
        cache = returned_cache(model(torch.randint(0, 61, (3, 41)), use_cache=True))
    layer = cache.layers[1]
    assert layer.tensors["state_keys"].shape[1] == kv_heads and layer.tensors["window_keys"].shape[1] == kv_heads
    assert cache.nbytes() == cache_bytes(model.config, 41, batch_size=3, dtype=torch.float32)
    plain = random_model(**BUDGETS["power_law"]).config
    assert cache_bytes(model.config, 41) < cache_bytes(plain, 41)


def test_gqa_trains():
    model = random_model(num_key_value_heads=2, **BUDGETS["power_law"]).train()
    ids = torch.randint(0, 61, (2, 30))
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.merge_gate_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("overrides, allowed", [
    (dict(num_key_value_heads=3), "divisor of num_attention_heads=4"),
    (dict(num_key_value_heads=0), "divisor"),
    (dict(num_key_value_heads=2, num_hidden_layers=4, sliding_window_every=2), "sliding-window layers"),
    (dict(num_key_value_heads=2, kvm_value_residual_mode="rwkv_post_tokenshift"), "rwkv_post_tokenshift"),
])
def test_invalid_key_value_heads(overrides, allowed):
    with pytest.raises(ValueError, match=f"num_key_value_heads.*{allowed}"):
        KVMConfig(**{**BASE, **overrides})


def test_tensor_parallel_size_must_keep_key_value_heads_whole():
    config = KVMConfig(**BASE, num_key_value_heads=2)
    check_tensor_parallel_size(config, 2)
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide num_key_value_heads=2"):
        check_tensor_parallel_size(config, 4)
    check_tensor_parallel_size(KVMConfig(**BASE), 4)


def test_no_gqa_is_one_key_value_head_per_query_head():
    config = KVMConfig(**BASE)
    assert config.num_key_value_heads == 4 and config.kv_heads == 4 and config.kv_group_size == 1  # None written out
    same = random_model(num_key_value_heads=4)
    plain = random_model()
    assert same.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 61, (1, 30))
    with torch.no_grad():
        assert torch.equal(same(ids).logits, plain(ids).logits)


def test_saved_gqa_cache_continues_and_is_refused_by_another_head_count(tmp_path):
    from kvm_maglev.models.kvm import KVMCache

    model = random_model(num_key_value_heads=2, **BUDGETS["power_law"])
    ids = torch.randint(0, 61, (1, 40))
    with torch.no_grad():
        live = returned_cache(model(ids, use_cache=True))
        save_cache(live, tmp_path / "c")
        loaded = load_cache(tmp_path / "c", model, KVMCache)
        step = ids[:, -1:]
        assert torch.equal(model(step, cache=loaded).logits, model(step, cache=live).logits)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        load_cache(tmp_path / "c", random_model(num_key_value_heads=1, **BUDGETS["power_law"]), KVMCache)


def test_model_card_names_query_and_key_value_heads():
    from kvm_maglev.convert.cards import _kvm_architecture

    paragraph, rows = _kvm_architecture(KVMConfig(**BASE, num_key_value_heads=2))
    assert "4 query heads sharing 2 key-value heads" in paragraph
    assert ("attention heads (query / key-value)", "4 / 2") in rows
    paragraph, rows = _kvm_architecture(KVMConfig(**BASE))
    assert "with 4 heads." in paragraph and ("attention heads", 4) in rows
