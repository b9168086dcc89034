"""The served models' linear layers on vLLM's own product for unquantized linears, as vLLM's Llama computes its
projections: on CPU vLLM picks, per layer, a kernel over a weight it prepacks once (oneDNN's matmul on x86, others
where they apply: `dispatch_cpu_unquantized_gemm`), callable inside the compiled forward as one opaque operator.
Inside vLLM's compiled forward our plain nn.Linear layers lower to aten's `mm`, which read the weights at decoding
batch sizes far slower (docs/serving.md, the 120M profile).

Same products as nn.Linear up to float rounding (tests/vllm/test_engine_decode.py compares them); one rank and
unquantized weights only: quantized folders and tensor-parallel shares already run vLLM's layers. The layers keep
their weights (the prepacked copy is beside them), so that anything reading a weight still finds it.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.platforms import current_platform

from kvm_maglev.models.speedups.onednn_linear import OneDNNLinear, plain_weight

SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class EngineLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose product is `cpu_linear`, the kernel vLLM picked for its
    weight when it was loaded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:  # vLLM's kernels read rows of unit stride (nn.Linear takes any layout)
            x = x.contiguous()
        return self.cpu_linear(x, self.weight, self.bias)


def takes_engine_product(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether `module` is one of the model's plain float linear layers in the served dtype (not a full-precision
    gate kept in float32 under half precision, not a quantized or tensor-parallel layer of vLLM's)."""
    return type(module) in (nn.Linear, OneDNNLinear, EngineLinear) and plain_weight(module.weight) \
        and module.weight.dtype == dtype and module.weight.ndim == 2


def use_engine_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Make each linear layer of `model` that `takes_engine_product` an EngineLinear over the kernel vLLM picks
    for its weight as now loaded (again after each load: the prepacked copy is of the weight it saw). CPU only:
    elsewhere vLLM's unquantized product is torch's own. Returns how many layers it changed."""
    if not current_platform.is_cpu() or dtype not in SERVED_DTYPES:
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    changed = 0
    for module in model.modules():
        if takes_engine_product(module, dtype):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            module.__class__ = EngineLinear  # no state of its own beyond `cpu_linear`: the same module
            changed += 1
    return changed
