"""oneDNN's product for the models' linear layers during float32 CPU inference, inside `onednn_linears()`.

The models build plain nn.Linear layers: transformers' quantizers convert only modules of exactly that type, and
PEFT, bitsandbytes and torchao expect it. Inside the block each nn.Linear whose weight is an ordinary float tensor
becomes a OneDNNLinear (its class swapped, parameters untouched) and is nn.Linear again after it; quantized weights
(tensor subclasses such as torchao's, bitsandbytes' packed parameters and their own Linear classes) are left to their
own kernels.

Decoding reads every weight once per step, and oneDNN reads them at about twice the memory bandwidth of
MKL's one-row product; batched steps (2-64 rows) read a copy of each weight in oneDNN's blocked layout.
Same products as nn.Linear up to float rounding. Imports only torch. Switched on by runtime_switch (opened by the
models' generate()); measurements: docs/kvm_runtime_notes.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# torch's oneDNN linear (what torch.compile emits for CPU linears); None where torch is built without oneDNN
ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
# torch's reordering of a linear weight into oneDNN's blocked layout for a given row count
ONEDNN_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if ONEDNN_LINEAR is not None else None
# below 2^19 float32 weights oneDNN's fixed cost per call outweighs what it saves (docs/kvm_runtime_notes.md)
ONEDNN_MIN_WEIGHTS = 1 << 19
# rows per product up to which the blocked copy pays (a decoding batch); prefill sizes gain little
PACKED_MAX_ROWS = 64


def plain_weight(weight: torch.Tensor) -> bool:
    """Whether `weight` is an ordinary dense tensor: not a tensor subclass (torchao's quantized tensors report
    their float dtype, DTensors a shard), not bitsandbytes' packed parameters."""
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.layout == torch.strided


def onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether oneDNN computes `x @ weight^T`: float32 on CPU, no autograd, not compiling (inductor picks the
    kernel: it cannot lower a oneDNN call on a weight it does not own), a large contiguous plain weight."""
    return (ONEDNN_LINEAR is not None and weight.numel() >= ONEDNN_MIN_WEIGHTS and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and plain_weight(weight) and weight.is_contiguous())


class OneDNNLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward chooses the product: oneDNN's when its
    `onednn` flag is on (`onednn_linears()` sets it) and `onednn_applies`, nn.Linear's otherwise. Products
    of 2-64 rows read a blocked copy of the weight, made on first use and remade if the weight changes. The models'
    nn.Linear layers are this class only inside the block; the vLLM plugin builds it directly."""

    onednn = False  # the class default: nn.Linear's product
    packed: tuple | None = None  # (weight's identity, its blocked copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn and onednn_applies(x, self.weight):
            return self.onednn_product(x)
        return F.linear(x, self.weight, self.bias)

    def onednn_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight^T + bias` on oneDNN, 2-64 rows against the blocked copy."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        weight = self.weight
        if ONEDNN_PACK is not None and 1 < rows.shape[0] <= PACKED_MAX_ROWS:
            weight = self.blocked_weight(rows.shape[0])
        return ONEDNN_LINEAR(rows, weight, self.bias, "none", [], "").view(*x.shape[:-1], self.out_features)

    def blocked_weight(self, rows: int) -> torch.Tensor:
        """The weight in oneDNN's blocked layout for `rows`-row products (again if it was replaced or written)."""
        identity = (self.weight.data_ptr(), self.weight._version)
        if self.packed is None or self.packed[0] != identity:
            self.packed = (identity, ONEDNN_PACK(self.weight, rows))
        return self.packed[1]


def switchable(module: nn.Module) -> bool:
    """Whether `onednn_linears()` makes `module` a OneDNNLinear: an nn.Linear itself (not a subclass with a forward
    of its own, such as bitsandbytes' and quanto's quantized layers) holding a plain weight; not a compressed-tensors
    layer (`quantization_scheme`: its forward quantizes, and a packed one has no `weight` until decompressed)."""
    return (type(module) is nn.Linear and getattr(module, "quantization_scheme", None) is None
            and plain_weight(module.weight))


@contextlib.contextmanager
def onednn_linears(model: nn.Module) -> Iterator[None]:
    """A block in which `model`'s plain nn.Linear layers (`switchable`) are OneDNNLinear and every OneDNNLinear has
    its `onednn` flag on; on leaving it they are nn.Linear again, their blocked copies freed. Nested blocks leave
    the layers to the outermost one. Weights written through `.data` inside the block go unseen by the copies."""
    swapped = [module for module in model.modules() if switchable(module)]
    linears = swapped + [module for module in model.modules() if isinstance(module, OneDNNLinear) and not module.onednn]
    for linear in swapped:
        linear.__class__ = OneDNNLinear  # no state of its own: the same module, another forward
    for linear in linears:
        linear.onednn = True
    try:
        yield
    finally:
        for linear in linears:
            del linear.onednn  # the class's default again
            linear.__dict__.pop("packed", None)
        for linear in swapped:
            linear.__class__ = nn.Linear
