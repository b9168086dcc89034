"""The models' linear layers (oneDNN for float32 CPU inference) compute what nn.Linear computes."""

import pytest
import torch

from kvm_maglev.models.kvm import modeling_kvm
from kvm_maglev.models.kvm.modeling_kvm import KVMLinear
from kvm_maglev.models.maglev import modeling_maglev
from kvm_maglev.models.maglev.modeling_maglev import MaglevLinear

SHAPES = [(1, 1), (2, 1), (8, 1), (1, 7), (3, 20), (70, 1), (0, 3)]


@pytest.mark.parametrize("linear_class", [KVMLinear, MaglevLinear])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_inference_matches_linear(linear_class, shape, bias):
    torch.manual_seed(0)
    layer = linear_class(512, 601, bias=bias)  # above ONEDNN_MIN_WEIGHTS: the oneDNN path
    x = torch.randn(*shape, 512)
    with torch.no_grad():
        out = layer(x)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("linear_class", [KVMLinear, MaglevLinear])
def test_non_contiguous_input(linear_class):
    layer = linear_class(512, 601, bias=False)
    x = torch.randn(4, 1024)[:, ::2]
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("linear_class", [KVMLinear, MaglevLinear])
def test_training_bfloat16_small_layers_and_no_onednn_take_nn_linear(linear_class, monkeypatch):
    torch.manual_seed(0)
    layer = linear_class(512, 601, bias=False)
    x = torch.randn(3, 512, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight))
    grads = torch.autograd.grad(out.sum(), (x, layer.weight))
    assert all(g is not None for g in grads)
    half = linear_class(512, 601, bias=False).to(torch.bfloat16)
    xb = torch.randn(4, 512, dtype=torch.bfloat16)
    small = linear_class(16, 40, bias=False)
    xs = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(half(xb), torch.nn.functional.linear(xb, half.weight))
        assert torch.equal(small(xs), torch.nn.functional.linear(xs, small.weight))
    module = modeling_kvm if linear_class is KVMLinear else modeling_maglev
    monkeypatch.setattr(module, "ONEDNN_LINEAR", None)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


def test_onednn_is_used_on_this_machine():
    """Guards the speed path itself: on an x86 torch build the oneDNN op is there and differs from MKL's
    summation order only at float rounding."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert modeling_kvm.ONEDNN_LINEAR is not None and modeling_maglev.ONEDNN_LINEAR is not None
