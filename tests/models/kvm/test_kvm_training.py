"""Training conventions: shifted labels with -100 and num_items_in_batch, gradients through
merges, gradient checkpointing, and reduced-precision forwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvm_maglev.models.common.activation_checkpointing import enable_activation_checkpointing
from kvm_maglev.models.common.transformers_versions import returned_cache
from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM

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
            enable_activation_checkpointing(model, {"use_reentrant": True})
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5), name


def test_activation_checkpointing_refuses_a_module_without_it():
    with pytest.raises(TypeError, match="Linear has no activation checkpointing"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_activation_checkpointing_takes_the_old_name_where_only_it_exists():
    class Transformers517Model(torch.nn.Module):  # transformers 5.17 has only `gradient_checkpointing_enable`
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    calls = []
    enable_activation_checkpointing(Transformers517Model(), {"use_reentrant": False})
    assert calls == [{"use_reentrant": False}]


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
        assert cache.layers[0].tensors["state_keys"].dtype == state_dtype
        # the front window (no state yet) follows float32 closely
        assert (full[:, :8].float() - reference(ids[:, :8]).logits).abs().max() < 0.1
