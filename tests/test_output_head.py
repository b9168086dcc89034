"""The output heads' few-row CPU product (W @ x^T) computes what nn.Linear computes, values and gradients."""

import pytest
import torch

from kvm_maglev.models.kvm.modeling_kvm import KVMOutputHead
from kvm_maglev.models.maglev.modeling_maglev import MaglevOutputHead


@pytest.mark.parametrize("head_class", [KVMOutputHead, MaglevOutputHead])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (8, 1), (1, 7), (3, 20), (70, 1)])
def test_head_matches_linear(head_class, shape):
    torch.manual_seed(0)
    head = head_class(24, 301, bias=False)
    x = torch.randn(*shape, 24, requires_grad=True)
    out = head(x)
    expected = torch.nn.functional.linear(x, head.weight)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, head.weight), grad)
    want = torch.autograd.grad(expected, (x, head.weight), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_head_in_bfloat16_takes_the_plain_path():
    head = KVMOutputHead(16, 40, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))
