"""Maglev's runtime speed-ups (runtime_maglev) compute what the plain path computes."""

import pytest
import torch

from kvm_maglev.models.maglev import MaglevConfig, MaglevForCausalLM
from kvm_maglev.models.maglev.model_inputs import CACHE_NAME
from kvm_maglev.models.maglev.modeling_maglev import MaglevAttention
from kvm_maglev.models.maglev.onednn_linear import OneDNNLinear


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
        return torch.cat(logits, dim=1), [t for store in cache.layer_stores for t in store.state().values()]

    plain_logits, plain_state = run()
    with model.runtime_speedups():
        assert all(type(m).__name__ == "FastMaglevAttention" for m in model.modules()
                   if isinstance(m, MaglevAttention))
        fast_logits, fast_state = run()
    real = mask.bool()
    torch.testing.assert_close(fast_logits[real], plain_logits[real], rtol=1e-5, atol=1e-5)
    for fast, plain in zip(fast_state, plain_state, strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_speedups_leave_the_model_plain():
    model = tiny()
    with model.runtime_speedups():
        with model.runtime_speedups():
            assert isinstance(model.lm_head, OneDNNLinear)
        assert isinstance(model.lm_head, OneDNNLinear)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.init_kind == "normal"
    assert all(type(m) is MaglevAttention for m in model.modules() if isinstance(m, MaglevAttention))
