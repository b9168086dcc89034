# Generated from kvm_maglev/models/common/runtime_switch.py (python -m kvm_maglev.models.sync_shared); do not edit by hand.
"""The switch that turns a model's inference speed-ups on for a block and leaves the model plain after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .onednn_linear import onednn_linears

FAST_CLASSES: dict[tuple[type, type], type] = {}


def fast_class(cls: type, fast_methods: type) -> type:
    """`cls` with the methods of `fast_methods` in front (they call the plain ones through super), made once."""
    if (cls, fast_methods) not in FAST_CLASSES:
        FAST_CLASSES[cls, fast_methods] = type(f"Fast{cls.__name__}", (fast_methods, cls), {})
    return FAST_CLASSES[cls, fast_methods]


@contextlib.contextmanager
def speedups_switched_on(model: nn.Module, attention_class: type, fast_methods: type) -> Iterator[nn.Module]:
    """A block in which `model`'s `attention_class` modules take `fast_methods`' methods and its linear layers
    compute on oneDNN; on leaving it the model is plain again. Nested blocks are free."""
    attentions = [module for module in model.modules() if type(module) is attention_class]
    for attention in attentions:
        attention.__class__ = fast_class(attention_class, fast_methods)
    try:
        with onednn_linears(model):
            yield model
    finally:
        for attention in attentions:
            attention.__class__ = attention_class
