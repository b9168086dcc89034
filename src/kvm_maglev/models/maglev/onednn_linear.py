# Generated from kvm_maglev/models/common/onednn_linear.py (python -m kvm_maglev.models.sync_shared); do not edit by hand.
"""oneDNN products for the nn.Linear layers of a model during float32 CPU inference.

Decoding reads every weight once per step, and oneDNN reads them at about twice the memory bandwidth of
MKL's one-row product; batched steps (2-64 rows) read a copy of each weight in oneDNN's blocked layout.
Same products as nn.Linear up to float rounding. Imports only torch: any model folder can carry it.
Measurements: docs/kvm_runtime_notes.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# torch's oneDNN linear (what torch.compile emits for CPU linears); None where torch is built without oneDNN
ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
# torch's reordering of a linear weight into oneDNN's blocked layout for a given row count
ONEDNN_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if ONEDNN_LINEAR is not None else None
# below 2^18 float32 weights oneDNN's fixed cost per call outweighs what it saves
ONEDNN_MIN_WEIGHTS = 1 << 18
# rows per product up to which the blocked copy pays (a decoding batch); prefill sizes gain little
PACKED_MAX_ROWS = 64


class OneDNNLinear(nn.Linear):
    """nn.Linear computing on oneDNN when it can: float32 on CPU, no autograd, not compiling, a large weight.

    A layer is one only inside `onednn_linears()`; everything else takes nn.Linear's path. Products of
    2-64 rows read a blocked copy of the weight, made on first use and remade if the weight changes.
    """

    packed: tuple | None = None  # (weight's identity, its blocked copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # under torch.compile inductor picks the kernel (it cannot lower a oneDNN call on a weight it does not own)
        if (ONEDNN_LINEAR is None or weight.numel() < ONEDNN_MIN_WEIGHTS or torch.is_grad_enabled()
                or torch.compiler.is_compiling()
                or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
                or not weight.is_contiguous()):
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if ONEDNN_PACK is not None and 1 < rows.shape[0] <= PACKED_MAX_ROWS:
            weight = self.blocked_weight(rows.shape[0])
        return ONEDNN_LINEAR(rows, weight, self.bias, "none", [], "").view(*x.shape[:-1], self.out_features)

    def blocked_weight(self, rows: int) -> torch.Tensor:
        """The weight in oneDNN's blocked layout for `rows`-row products (again if it was replaced or written)."""
        identity = (self.weight.data_ptr(), self.weight._version)
        if self.packed is None or self.packed[0] != identity:
            self.packed = (identity, ONEDNN_PACK(self.weight, rows))
        return self.packed[1]


@contextlib.contextmanager
def onednn_linears(model: nn.Module) -> Iterator[None]:
    """A block in which the plain nn.Linear layers of `model` are OneDNNLinear; blocked copies are freed at
    its end. Nested blocks leave the layers to the outermost one. Weights written through `.data` inside
    the block go unseen by the copies."""
    linears = [module for module in model.modules() if type(module) is nn.Linear]
    for linear in linears:
        linear.__class__ = OneDNNLinear
    try:
        yield
    finally:
        for linear in linears:
            linear.__class__ = nn.Linear
            linear.__dict__.pop("packed", None)
