"""A registered stand-in for the architectures the plugin does not serve yet: vLLM then reaches our config check
(`serving_config.Unserved`), which says why, instead of listing every architecture it supports."""

from __future__ import annotations

import torch
from torch import nn


class VllmUnservedModel(nn.Module):
    """Never built: `Unserved.verify_and_update_config` refuses the folder first; building it refuses too."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from kvm_maglev.vllm import NOT_SERVED

        architecture = vllm_config.model_config.architecture
        raise ValueError(f"{architecture} is not served on vLLM by kvm_maglev yet: {NOT_SERVED.get(architecture)}")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
