"""runtime_kvm's speed-ups against the plain path they replace, and the switch that turns them on.
(The oneDNN linears' own equality tests are in test_linear.py; the fold computed ahead in test_kvm_state.py
and test_kvm_cache.py.)"""

from __future__ import annotations

import ast
import inspect
import math

import pytest
import torch

from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM, modeling_kvm, onednn_linear, runtime_kvm, state_kvm
from kvm_maglev.models.kvm.modeling_kvm import KVMAttention


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


@torch.no_grad()
@pytest.mark.parametrize("batch,slots,window", [(1, 5, 7), (3, 40, 16), (2, 1, 1)])
@pytest.mark.parametrize("temperatures", [True, False])
def test_one_query_attention_matches_the_plain_joint_softmax(batch, slots, window, temperatures):
    model = random_model(head_temperatures=temperatures)
    attention = model.model.layers[0].self_attn
    if temperatures:
        attention.window_temperature.copy_(0.5 + torch.rand(4))
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(batch, 4, 1, 16, generator=generator)
    keys, values = torch.randn(batch, 4, window, 16, generator=generator), torch.randn(batch, 4, window, 16,
                                                                                       generator=generator)
    state_keys = torch.randn(batch, 4, slots, 16, generator=generator)
    columns = torch.randn(batch, 4, 16, slots, generator=generator)
    plain = attention.attend_state_and_window(q, keys, values, state_keys, columns)
    window_q = q * attention.temperature("window_temperature")
    fast = runtime_kvm.one_query_attention(q, window_q, keys, values, state_keys, columns, 1 / math.sqrt(16))
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_stepping_inside_runtime_speedups_matches_the_plain_model():
    """A loop that steps the model itself may open the block: the same logits up to float rounding, the
    same state (folds are computed ahead either way), and the model plain again after it."""
    model = random_model(hidden_size=512, num_attention_heads=4)  # above the oneDNN threshold: linears switch too
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))

    def decode():
        cache = KVMCache(model.config)
        logits = [model(ids[:, :5], cache=cache).logits]
        logits += [model(ids[:, pos : pos + 1], cache=cache).logits for pos in range(5, 40)]
        return torch.cat(logits, dim=1), cache

    plain, plain_cache = decode()
    with model.runtime_speedups():
        assert all(m.onednn for m in model.modules() if isinstance(m, torch.nn.Linear))
        fast, fast_cache = decode()
        assert any(layer.pending_fold is not None for layer in fast_cache.groups[0].layers)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    for a, b in zip(fast_cache.groups[0].layers, plain_cache.groups[0].layers):
        for x, y in zip(a.state(), b.state()):
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)  # sums of many tokens
    assert all(not m.onednn for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(type(m) is KVMAttention and not m.one_query_kernel
               for m in model.modules() if isinstance(m, KVMAttention))
    assert plain_cache.groups[0].layers[0].pending_fold is not None  # outside the block folds are paced too


@torch.no_grad()
def test_generate_runs_inside_runtime_speedups_and_agrees_with_stepping():
    model = random_model()
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda module, *_: seen.append(module.one_query_kernel))
    out = model.generate(ids, max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    hook.remove()
    assert seen and all(seen)
    assert type(model.model.layers[0].self_attn) is KVMAttention and not model.model.layers[0].self_attn.one_query_kernel
    cache = KVMCache(model.config)
    scores = [model(ids, cache=cache).logits[:, -1]]
    for step in range(19):
        scores.append(model(out.sequences[:, 6 + step : 7 + step], cache=cache).logits[:, -1])
    assert torch.equal(torch.stack(scores).argmax(-1), out.sequences[:, 6:].T)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(scores), rtol=1e-5, atol=1e-5)


def test_nested_blocks_leave_the_switch_to_the_outermost():
    model = random_model()
    attention = model.model.layers[0].self_attn
    with model.runtime_speedups():
        assert attention.one_query_kernel
        with model.runtime_speedups():
            assert attention.one_query_kernel
        assert attention.one_query_kernel
    assert not attention.one_query_kernel and type(attention) is KVMAttention


@torch.no_grad()
def test_the_one_query_kernel_is_chosen_at_its_call_site_and_equals_the_plain_products(monkeypatch):
    """With the flag on, a one-query float32 CPU step takes `one_query_attention` (and nothing else does);
    its output equals the plain products'."""
    model = random_model()
    attention = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 4, 6, 16, generator=generator), torch.randn(2, 4, 6, 16, generator=generator)
    state_keys, columns = torch.randn(2, 4, 3, 16, generator=generator), torch.randn(2, 4, 16, 3, generator=generator)
    calls, kernel = [], modeling_kvm.one_query_attention
    monkeypatch.setattr(modeling_kvm, "one_query_attention", lambda *args: calls.append(args[0].shape[2]) or kernel(*args))
    for queries in (1, 6):
        q = torch.randn(2, 4, queries, 16, generator=generator)
        attention.one_query_kernel = False
        plain = attention.attend_state_and_window(q, keys, values, state_keys, columns)
        attention.one_query_kernel = True
        fast = attention.attend_state_and_window(q, keys, values, state_keys, columns)
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
    assert calls == [1]


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
