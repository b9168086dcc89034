"""KVM (Key-Value Means): configuration, cache and models for transformers.

Importing it registers nothing with transformers' Auto classes (a registered class wins over a folder's own code):
`kvm_maglev.register_auto_classes()` registers both architectures when asked."""

from .cache_kvm import KVMCache
from .configuration_kvm import KVMConfig
from .modeling_kvm import KVMForCausalLM, KVMModel, KVMPreTrainedModel

__all__ = ["KVMCache", "KVMConfig", "KVMForCausalLM", "KVMModel", "KVMPreTrainedModel"]
