"""Training conventions: shifted labels with -100 and num_items_in_batch, gradients through
merges, gradient checkpointing, and reduced-precision forwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM, modeling_kvm
from tests.returned_cache import returned_cache

CONFIG = dict(
    vocab_size=53, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8, chunk_size=4,
    window_chunks=2, state_budget_mode="power_law", state_budget_factor=1.5, state_budget_min=4, state_max_chunks=100,
)



def random_model(**overrides) -> KVMForCausalLM:
    torch.manual_seed(0)
    model = KVMForCausalLM(KVMConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def tokens(batch=2, length=40, seed=1):
    return torch.randint(0, 53, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_labels_are_shifted_inside_and_minus_100_ignored():
    model = random_model().eval()
    ids = tokens()
    labels = ids.clone()
    labels[0, :10] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 53).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, expected, atol=1e-5)
    # num_items_in_batch (Trainer's gradient accumulation) turns the mean into sum / n
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(1000)).loss
    count = (labels[:, 1:] != -100).sum()
    assert torch.allclose(summed, expected * count / 1000, atol=1e-5)


def test_gradients_flow_through_merges_and_state():
    model = random_model().train()
    ids = tokens(length=48)
    loss = model(ids, labels=ids).loss
    loss.backward()
    for layer in model.model.layers:
        attention = layer.self_attn
        for param in (attention.merge_gate_proj.weight, attention.state_key_norm.weight, attention.state_temperature):
            assert param.grad is not None and param.grad.abs().sum() > 0
    # a prompt inside the front window never reads the state, so the state has no gradient
    model.zero_grad()
    short = tokens(length=8)
    model(short, labels=short).loss.backward()
    grad = model.model.layers[0].self_attn.state_temperature.grad
    assert grad is None or grad.abs().sum() == 0


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = tokens(length=36)
    grads = []
    for checkpointing in (False, True):
        model = random_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5), name


def test_training_forward_with_cache_enabled_is_differentiable():
    model = random_model().train()
    ids = tokens(length=30)
    out = model(ids, labels=ids, use_cache=True)
    out.loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_cached_decoding_matches_its_forward(dtype):
    reference = random_model().eval()
    model = random_model().eval().to(dtype)
    ids = tokens(length=40)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6])
        cache = returned_cache(out)
        steps = torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(6, 40)], dim=1)
        assert full.dtype == dtype and torch.isfinite(full).all()
        # a few units in the last place of the 16-bit logits; which way they round depends on the CPU's kernels
        torch.testing.assert_close(steps.float(), full[:, 6:].float(), atol=0.05, rtol=4 * torch.finfo(dtype).eps)
        # state sums accumulate in float32 for both 16-bit dtypes
        state_dtype = torch.float32
        assert cache.groups[0].layers[0].state_keys.dtype == state_dtype
        # the front window (no state yet) follows float32 closely
        assert (full[:, :8].float() - reference(ids[:, :8]).logits).abs().max() < 0.1


BUDGETS = {
    "fixed": dict(state_budget_mode="fixed", state_budget_min=4, state_max_chunks=1),
    "power_law": dict(state_budget_mode="power_law", state_budget_factor=1.5, state_budget_min=4, state_max_chunks=100),
}


def logits_and_gradients(model: KVMForCausalLM, ids, mask, at_once: bool, monkeypatch) -> tuple:
    monkeypatch.setattr(modeling_kvm.KVMAttention, "chunks_at_once", at_once)
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("length", [9, 22, 40])
@pytest.mark.parametrize("padded", [False, True])
def test_training_attention_of_all_chunks_at_once_equals_the_chunk_loop(budget, length, padded, monkeypatch):
    """A training forward computes every chunk's state first, then one attention call over all chunks (chunk
    size 4, window 2 chunks: 9 and 22 tokens end in a partial chunk); logits and gradients equal the loop's."""
    model = random_model(**BUDGETS[budget]).train()
    ids = tokens(length=length, seed=length)
    mask = None
    if padded:  # left padding: the second row's chunks follow its own 5 fewer tokens
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
    calls = []
    batched = modeling_kvm.KVMAttention.attend_chunks_at_once
    monkeypatch.setattr(modeling_kvm.KVMAttention, "attend_chunks_at_once",
                        lambda *args: calls.append(1) or batched(*args))
    loop_logits, loop_grads = logits_and_gradients(model, ids, mask, False, monkeypatch)
    assert not calls
    logits, grads = logits_and_gradients(model, ids, mask, True, monkeypatch)
    rows = [length, length - 5] if padded else [length]
    assert len(calls) == 2 * sum(n > 8 for n in rows)  # per layer, each row group past the front window
    torch.testing.assert_close(logits, loop_logits, rtol=0, atol=2e-5)
    assert grads.keys() == loop_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], loop_grads[name], rtol=1e-4, atol=1e-5, msg=name)
