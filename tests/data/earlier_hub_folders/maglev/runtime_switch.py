# Generated from kvm_maglev/models/common/runtime_switch.py (python -m kvm_maglev.models.sync_shared); do not edit by hand.
"""The switch that turns a model's inference speed-ups on for a block and leaves the model plain after it.

Each speed-up is chosen at one call site by a flag the block sets: an attention module's `one_query_kernel`
(read where it attends) and each OneDNNLinear's `onednn` (read in its forward); outside the block both are
the class defaults and the plain path runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .onednn_linear import onednn_linears


@contextlib.contextmanager
def runtime_speedups(model: nn.Module, attention_class: type) -> Iterator[nn.Module]:
    """A block in which `model`'s `attention_class` modules have their `one_query_kernel` flag on and its
    linear layers compute on oneDNN; on leaving it the model is plain again. Nested blocks leave the switch
    to the outermost one."""
    switched = [module for module in model.modules()
                if isinstance(module, attention_class) and not module.one_query_kernel]
    for attention in switched:
        attention.one_query_kernel = True
    try:
        with onednn_linears(model):
            yield model
    finally:
        for attention in switched:
            del attention.one_query_kernel  # the class's default again
