"""Activation checkpointing under the name the installed transformers gives it.

transformers 5.24 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable`, and from 5.25 the old
name warns that v6 removes it; 5.17, the oldest release the package supports (`transformers_versions`), has only the old name.
Code and tests that switch checkpointing on call `enable_activation_checkpointing`, so no call warns on a new release
and none fails on an old one.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def enable_activation_checkpointing(model: nn.Module, checkpoint_kwargs: dict[str, Any] | None = None) -> None:
    """Recompute `model`'s layer activations in the backward pass instead of keeping them.

    `checkpoint_kwargs` go to `torch.utils.checkpoint.checkpoint` (e.g. `{"use_reentrant": False}`); None keeps
    transformers' default. The current name is tried first; a model (or PEFT wrapper) without it gets the old one.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise TypeError(f"{type(model).__name__} has no activation checkpointing: expected a transformers "
                        "PreTrainedModel (or a wrapper of one) with `activation_checkpointing_enable` or "
                        "`gradient_checkpointing_enable`")
    enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
