"""Maglev's runtime speed-ups (speedups/runtime_maglev) compute what the plain path computes."""

import pytest
import torch

from kvm_maglev.models.common.transformers_versions import CACHE_NAME
from kvm_maglev.models.maglev import MaglevConfig, MaglevForCausalLM
from kvm_maglev.models.maglev.modeling_maglev import MaglevAttention
from kvm_maglev.models.speedups.onednn_linear import OneDNNLinear


def tiny(**overrides) -> MaglevForCausalLM:
    torch.manual_seed(0)
    fields = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  sliding_window=8, window_pattern="SL", prefiller_window_pattern="SL")
    model = MaglevForCausalLM(MaglevConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model.eval()


@torch.no_grad()
@pytest.mark.parametrize("overrides", [{}, {"use_memory": False}], ids=["memory", "memory_off_ring"])
def test_speedups_equal_the_plain_path(overrides):
    """A padded batch read token by token and in chunks (one-query ring attention, oneDNN linears) gives the
    plain path's logits and cache."""
    model = tiny(**overrides)
    ids = torch.randint(1, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5], mask[2, 9:12] = 0, 0

    def run():
        out = model(ids[:, :13], attention_mask=mask[:, :13], use_cache=True)
        cache, logits = getattr(out, CACHE_NAME), [out.logits]
        for t in range(13, 21):
            logits.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits)
        return torch.cat(logits, dim=1), [t for store in cache.layers for t in store.tensors.values()]

    plain_logits, plain_state = run()
    with model.runtime_speedups():
        assert all(m.one_query_kernel for m in model.modules() if isinstance(m, MaglevAttention))
        fast_logits, fast_state = run()
    real = mask.bool()
    torch.testing.assert_close(fast_logits[real], plain_logits[real], rtol=1e-5, atol=1e-5)
    for fast, plain in zip(fast_state, plain_state, strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_speedups_leave_the_model_plain():
    """The block sets the flags that choose the fast paths (its linears are OneDNNLinear inside it) and leaves them
    to the outermost block; after it every module is of its own class again, its attributes kept."""
    model = tiny()
    attentions = [m for m in model.modules() if isinstance(m, MaglevAttention)]
    with model.runtime_speedups():
        with model.runtime_speedups():
            assert type(model.lm_head) is OneDNNLinear and model.lm_head.onednn
            assert all(m.one_query_kernel for m in attentions)
        assert type(model.lm_head) is OneDNNLinear and model.lm_head.onednn
        assert all(m.one_query_kernel for m in attentions)
    assert type(model.lm_head) is torch.nn.Linear and "onednn" not in vars(model.lm_head)
    assert model.lm_head.init_kind == "normal"
    assert all(type(m) is MaglevAttention and not m.one_query_kernel for m in attentions)


@torch.no_grad()
def test_the_one_query_kernel_is_chosen_at_its_call_site(monkeypatch):
    """With the flag on, a one-token step over the ring takes `one_query_attention` (a longer chunk does not)
    and equals the plain attention."""
    from kvm_maglev.models.maglev import modeling_maglev

    model = tiny(use_memory=False)
    ids = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(3))
    calls, kernel = [], modeling_maglev.runtime_maglev.one_query_attention
    monkeypatch.setattr(modeling_maglev.runtime_maglev, "one_query_attention",
                        lambda *args: calls.append(args[0].shape[2]) or kernel(*args))

    def run(flag: bool):
        for attention in (m for m in model.modules() if isinstance(m, MaglevAttention)):
            attention.one_query_kernel = flag
        out = model(ids[:, :10], use_cache=True)
        cache = getattr(out, CACHE_NAME)
        logits = [model(ids[:, 10:12], past_key_values=cache).logits]
        logits += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(12, 14)]
        return torch.cat(logits, dim=1)

    plain = run(False)
    assert not calls
    fast = run(True)
    assert calls and set(calls) == {1}
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
