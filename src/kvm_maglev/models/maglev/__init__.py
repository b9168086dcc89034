"""Maglev: a sliding-window nanochat transformer whose tokens carry a memory into the next token's keys and values."""

from .cache_maglev import MaglevCache
from .configuration_maglev import MaglevConfig
from .modeling_maglev import MaglevCausalLMOutput, MaglevForCausalLM, MaglevModel, MaglevPreTrainedModel

__all__ = ["MaglevCache", "MaglevCausalLMOutput", "MaglevConfig", "MaglevForCausalLM", "MaglevModel",
           "MaglevPreTrainedModel"]
