"""The switch that turns a model's inference speed-ups on for a block and leaves the model plain after it.

Inside the block a speed-up runs where a flag it sets is read: an attention module's `one_query_kernel` (read where
it attends) and the `onednn` of the linear layers, which are OneDNNLinear there (`onednn_linears`: plain-weight
nn.Linear only, quantized ones keep their own kernels); outside it the flags are the class defaults, the linears
nn.Linear, and the plain path runs. The models open it through their seam (common/seams `speedups_block`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .onednn_linear import onednn_linears


@contextlib.contextmanager
def runtime_speedups(model: nn.Module, attention_class: type | None) -> Iterator[nn.Module]:
    """A block in which `model`'s `attention_class` modules (None: none) have their `one_query_kernel` flag on
    and its plain-weight linear layers compute on oneDNN; on leaving it the model is plain again. Nested blocks
    leave the switch to the outermost one."""
    switched = [module for module in model.modules() if attention_class is not None
                and isinstance(module, attention_class) and not module.one_query_kernel]
    for attention in switched:
        attention.one_query_kernel = True
    try:
        with onednn_linears(model):
            yield model
    finally:
        for attention in switched:
            del attention.one_query_kernel  # the class's default again
