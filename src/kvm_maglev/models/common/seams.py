"""Where the models pick their optional speed-ups (`kvm_maglev.models.speedups`), one seam each: the speed-up
module or None, and the model takes it or its plain torch path, the reference it is tested against.

In the package the speed-ups are on by default. A generated file is the plain model unless its user sets
`KVM_MAGLEV_SPEEDUPS=1` before importing it (as `use_kernels=True` asks transformers for kernels), and then takes an
installed kvm_maglev's speed-ups only at the version it was written with (`CODE_VERSION`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from functools import cache
from types import ModuleType

from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# None in the package (its speed-ups are its own); a generated file holds the `speedups.VERSION` that wrote it
CODE_VERSION: str | None = None
# the environment variable by which the user of a generated file asks for an installed kvm_maglev's speed-ups ("1")
SPEEDUPS_SWITCH = "KVM_MAGLEV_SPEEDUPS"


@cache
def installed_speedups() -> ModuleType | None:
    """kvm_maglev's speed-ups package: in the package its own; in a generated file an installed one, where the user
    asked for it (`SPEEDUPS_SWITCH`) and it is the version this code recorded; else None (the plain torch path)."""
    if CODE_VERSION is not None and os.environ.get(SPEEDUPS_SWITCH) != "1":
        return None
    try:
        speedups = importlib.import_module("kvm_maglev.models.speedups")
    except ImportError:
        logger.warning(f"{SPEEDUPS_SWITCH}=1 asks for kvm_maglev's speed-ups, which do not import here: the model "
                       "runs its plain torch path")
        return None
    if CODE_VERSION is not None and getattr(speedups, "VERSION", None) != CODE_VERSION:
        logger.warning(f"kvm_maglev's speed-ups {getattr(speedups, 'VERSION', None)} are not the {CODE_VERSION} this "
                       "model's code was written with: the model runs its plain torch path")
        return None
    return speedups


def package_speedups(name: str) -> ModuleType | None:
    """Speed-up module `name` of `installed_speedups()`; None without them or where it does not import (the Triton
    kernel without Triton)."""
    speedups = installed_speedups()
    if speedups is None:
        return None
    try:
        return importlib.import_module(f"{speedups.__name__}.{name}")
    except ImportError:
        return None


# the seam of the block that turns speed-ups on (speedups/runtime_switch), which generate() opens: the models' linears
# are plain nn.Linear (what quantizers and PEFT convert), made oneDNN linears only inside it (speedups/onednn_linear)
runtime_switch = package_speedups("runtime_switch")


def speedups_block(model: nn.Module, attention_class: type | None) -> contextlib.AbstractContextManager:
    """runtime_switch's `runtime_speedups(model, attention_class)`; without the speed-ups a block that changes
    nothing."""
    if runtime_switch is None:
        return contextlib.nullcontext(model)
    return runtime_switch.runtime_speedups(model, attention_class)
