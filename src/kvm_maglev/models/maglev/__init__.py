"""Maglev: a sliding-window nanochat transformer whose tokens carry a memory into the next token's keys and values.

Importing it registers nothing with transformers' Auto classes (a registered class wins over a folder's own code):
`kvm_maglev.register_auto_classes()` registers both architectures when asked."""

from .cache_maglev import MaglevCache
from .configuration_maglev import MaglevConfig
from .modeling_maglev import MaglevCausalLMOutput, MaglevForCausalLM, MaglevModel, MaglevPreTrainedModel

__all__ = ["MaglevCache", "MaglevCausalLMOutput", "MaglevConfig", "MaglevForCausalLM", "MaglevModel",
           "MaglevPreTrainedModel"]
