"""The served models' linear layers on vLLM's product for unquantized linears (kvm_maglev.vllm.engine_linears)
against nn.Linear: the same products up to float rounding, for decoding and prompt shapes, with and without bias;
inputs of any layout; the same parameters and state dict; the layers it must leave alone (another dtype, vLLM's own layers) left."""

import pytest
import torch
from torch import nn

from kvm_maglev.vllm.engine_linears import EngineLinear, use_engine_linears


def reference_and_engine(dtype: torch.dtype, bias: bool) -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(0)
    reference = nn.Linear(96, 160, bias=bias, dtype=dtype)
    model = nn.Sequential(nn.Linear(96, 160, bias=bias, dtype=dtype))
    model.load_state_dict({f"0.{name}": tensor for name, tensor in reference.state_dict().items()})
    return reference, model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "columns strided", "transposed"])
@pytest.mark.parametrize("shape", [(1, 96), (8, 96), (3, 5, 96)])
def test_engine_linears_compute_what_nn_linear_computes(shape, layout, bias):
    reference, model = reference_and_engine(torch.float32, bias)
    assert use_engine_linears(model, torch.float32) == 1
    assert type(model[0]) is EngineLinear
    x = torch.randn(shape)
    if layout == "columns strided":  # rows of a wider tensor
        x = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    elif layout == "transposed":  # the last dimension not of unit stride
        x = torch.randn(*reversed(shape)).permute(*reversed(range(len(shape))))
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    assert model(x).shape == reference(x).shape
    assert set(model.state_dict()) == {f"0.{name}" for name in reference.state_dict()}
    torch.testing.assert_close(model[0].weight, reference.weight, rtol=0, atol=0)


def test_layers_of_another_dtype_are_left_alone():
    _, model = reference_and_engine(torch.float32, False)
    assert use_engine_linears(model, torch.bfloat16) == 0  # a full-precision gate under a half-precision model
    assert type(model[0]) is nn.Linear


def test_a_second_load_prepacks_the_new_weight():
    reference, model = reference_and_engine(torch.float32, True)
    use_engine_linears(model, torch.float32)
    with torch.no_grad():
        reference.weight.mul_(-2.0)
        model[0].weight.copy_(reference.weight)  # a reload writes the weight in place
    use_engine_linears(model, torch.float32)
    x = torch.randn(4, 96)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
