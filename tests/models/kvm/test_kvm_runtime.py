"""KVM's speed-ups inside `runtime_speedups()` against the plain path they replace, and the switch that turns them
on. (The oneDNN linears' own equality tests are in test_linear.py; the fold computed ahead, speedups/paced_fold_kvm,
in test_kvm_state.py and test_kvm_cache.py.)"""

from __future__ import annotations

import ast
import inspect
import math

import pytest
import torch

from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM, modeling_kvm, state_kvm
from kvm_maglev.models.speedups import merged_attention_kvm, onednn_linear
from tests.generation.testers import kvm_row_tensors


def random_model(**overrides) -> KVMForCausalLM:
    torch.manual_seed(0)
    config = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, rotary_dim=8,
                  chunk_size=4, window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0,
                  state_budget_min=4, state_max_chunks=100)
    model = KVMForCausalLM(KVMConfig(**{**config, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def random_key_sets(pieces: int, slots: int, window: int, generator) -> list:
    """A state key set and a window key set as KVMAttention.attend hands them over (2 key/value heads, 16
    channels, per-query-head temperatures), some keys hidden."""
    key_sets = []
    for size in (slots, window):
        keys = torch.randn(pieces, 2, size, 16, generator=generator)
        values = torch.randn(pieces, 2, size, 16, generator=generator)
        visible = torch.rand(pieces, 1, size, generator=generator) < 0.7
        visible[..., -1] = True
        key_sets.append(modeling_kvm.KeySet(keys, values, visible, 0.5 + torch.rand(4, generator=generator)))
    return key_sets


@torch.no_grad()
@pytest.mark.parametrize("pieces,slots,window", [(1, 5, 7), (3, 40, 16), (2, 1, 1)])
@pytest.mark.parametrize("queries", [1, 3])
def test_fused_kernel_equals_the_explicit_joint_softmax(pieces, slots, window, queries):
    """The fused path (torch's kernel over the key sets concatenated, temperatures on the keys per query head)
    and the explicit products (temperatures on the queries) give one softmax over the same logits."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(pieces, queries, 4, 16, generator=generator)
    key_sets = random_key_sets(pieces, slots, window, generator)
    plain = modeling_kvm.joint_attention(q, key_sets, 2, 1 / math.sqrt(16))
    fused = modeling_kvm.fused_attention(q, key_sets, 2)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("per_query", [False, True], ids=["piece_masks", "query_masks"])
def test_merged_key_sets_equal_the_fused_call(per_query, groups, dtype):
    """A flash call per key set merged by log-sum-exp (speedups/merged_attention_kvm) against the key sets joined in
    one fused call: masks of one row a piece (a KVM layer's state, ring and earlier tokens) or of one row a query (a
    sliding-window layer's), a piece that sees none of a set, a set no piece sees, the pieces' own tokens causal,
    temperatures."""
    generator = torch.Generator().manual_seed(groups)
    pieces, width, kv_heads, dim = 5, 7, 2, 16
    heads = kv_heads * groups

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)
    key_sets = []
    for size, rows in ((9, 1), (6, width if per_query else 1), (3, 1)):
        visible = torch.rand(pieces, rows, size, generator=generator) < 0.5
        visible[0] = False
        visible &= size != 3  # a set no piece sees a key of (a ring no piece's row has written)
        key_sets.append(modeling_kvm.KeySet(tensor(pieces, kv_heads, size, dim), tensor(pieces, kv_heads, size, dim),
                                            visible, 0.5 + torch.rand(heads, generator=generator)))
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand(pieces, -1, -1)
    key_sets.append(modeling_kvm.KeySet(tensor(pieces, kv_heads, width, dim), tensor(pieces, kv_heads, width, dim),
                                        causal, None, causal=True))
    q = tensor(pieces, width, heads, dim)
    assert merged_attention_kvm.applies(q, key_sets) and not merged_attention_kvm.applies(q, key_sets[:3])
    merged = merged_attention_kvm.attend_key_sets(q, key_sets, groups)
    assert merged.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(merged, modeling_kvm.fused_attention(q, key_sets, groups), **tolerance)


@torch.no_grad()
@pytest.mark.parametrize("layers", [dict(sliding_window_every=2, sliding_window=6), dict(num_key_value_heads=2)],
                         ids=["sliding_layers", "grouped_queries"])
def test_prompt_pieces_merged_equal_the_joined_key_sets(layers, monkeypatch):
    """A model's prompts read in uneven forwards over a cache (pieces that read the ring, the state, earlier tokens
    of the forward and their own; KVM and sliding-window layers) with the key sets merged, as the vLLM plugin reads
    them, and joined: the same logits up to float rounding."""
    model = random_model(**layers)
    ids = torch.randint(0, 97, (2, 31), generator=torch.Generator().manual_seed(3))

    def prompt() -> torch.Tensor:
        cache = KVMCache(model.config)
        return torch.cat([model(ids[:, begin:end], cache=cache).logits
                          for begin, end in ((0, 6), (6, 7), (7, 19), (19, 31))], dim=1)
    joined = prompt()
    monkeypatch.setattr(modeling_kvm.KVMAttentionBase, "merged_key_sets", True)
    calls = []
    attend = merged_attention_kvm.attend_key_sets
    monkeypatch.setattr(merged_attention_kvm, "attend_key_sets", lambda *args: calls.append(1) or attend(*args))
    merged = prompt()
    assert calls
    torch.testing.assert_close(merged, joined, rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("merged", [False, True], ids=["joined", "merged"])
def test_pieces_in_blocks_equal_one_call(merged, monkeypatch):
    """Long prompts attend in blocks of pieces (`ATTENTION_BLOCK`): every key set, the causal own tokens included,
    cut to each block's pieces, gives the one call's result."""
    generator = torch.Generator().manual_seed(5)
    key_sets = random_key_sets(3, 5, 6, generator)
    causal = torch.ones(4, 4, dtype=torch.bool).tril().expand(3, -1, -1)
    key_sets.append(modeling_kvm.KeySet(torch.randn(3, 2, 4, 16, generator=generator),
                                        torch.randn(3, 2, 4, 16, generator=generator), causal, None, causal=True))
    q = torch.randn(3, 4, 4, 16, generator=generator)
    whole = modeling_kvm.attend_pieces(q, key_sets, 2, False, merged)
    monkeypatch.setattr(modeling_kvm, "ATTENTION_BLOCK", 1)  # a block of one piece
    torch.testing.assert_close(modeling_kvm.attend_pieces(q, key_sets, 2, False, merged), whole, rtol=0, atol=0)


@torch.no_grad()
def test_stepping_inside_runtime_speedups_matches_the_plain_model():
    """A loop that steps the model itself may open the block: the same logits up to float rounding, the
    same state (folds are computed ahead either way), and the model plain again after it."""
    model = random_model(hidden_size=768, num_attention_heads=4)  # above the oneDNN threshold: linears switch too
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))

    def decode():
        cache = KVMCache(model.config)
        logits = [model(ids[:, :5], cache=cache).logits]
        logits += [model(ids[:, pos : pos + 1], cache=cache).logits for pos in range(5, 40)]
        return torch.cat(logits, dim=1), cache

    plain, plain_cache = decode()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]  # the gates keep their own class
    with model.runtime_speedups():
        assert linears and all(type(m) is onednn_linear.OneDNNLinear and m.onednn for m in linears)
        fast, fast_cache = decode()
        assert any(layer.pending is not None for layer in fast_cache.layers)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    for row in range(2):
        for x, y in zip(kvm_row_tensors(fast_cache, row), kvm_row_tensors(plain_cache, row)):
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)  # sums of many tokens
    assert all(type(m) is torch.nn.Linear and "onednn" not in vars(m) for m in linears)
    assert plain_cache.layers[0].pending is not None  # outside the block folds are paced too


@torch.no_grad()
def test_generate_runs_inside_runtime_speedups_and_agrees_with_stepping():
    model = random_model()
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, *_: seen.append(module.onednn))
    out = model.generate(ids, max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    hook.remove()
    assert seen and all(seen) and type(model.lm_head) is torch.nn.Linear
    cache = KVMCache(model.config)
    scores = [model(ids, cache=cache).logits[:, -1]]
    for step in range(19):
        scores.append(model(out.sequences[:, 6 + step : 7 + step], cache=cache).logits[:, -1])
    assert torch.equal(torch.stack(scores).argmax(-1), out.sequences[:, 6:].T)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(scores), rtol=1e-5, atol=1e-5)


def test_nested_blocks_leave_the_switch_to_the_outermost():
    model = random_model()
    with model.runtime_speedups():
        assert model.lm_head.onednn
        with model.runtime_speedups():
            assert model.lm_head.onednn
        assert model.lm_head.onednn
    assert type(model.lm_head) is torch.nn.Linear and "onednn" not in vars(model.lm_head)


def test_training_inside_the_block_takes_the_plain_path():
    """With autograd on, no fold is computed ahead and linears are nn.Linear's: gradients as outside."""
    model = random_model()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(4))
    model.train()
    plain = torch.autograd.grad(model(ids, labels=ids).loss, model.lm_head.weight)[0]
    with model.runtime_speedups():
        fast = torch.autograd.grad(model(ids, labels=ids).loss, model.lm_head.weight)[0]
    assert torch.equal(plain, fast)


def imported_modules(module) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_the_math_files_hold_no_runtime_tuning():
    """modeling_kvm names no mkldnn; state_kvm and onednn_linear import only torch (onednn_linear can serve
    any model folder)."""
    assert "mkldnn" not in inspect.getsource(modeling_kvm)
    assert imported_modules(state_kvm) <= {"__future__", "collections.abc", "dataclasses", "functools", "math",
                                           "torch", "torch.nn.functional"}
    assert imported_modules(onednn_linear) <= {"__future__", "collections.abc", "contextlib", "torch", "torch.nn.functional"}
