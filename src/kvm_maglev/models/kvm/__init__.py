"""KVM (Key-Value Means): configuration, cache and models for transformers."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_kvm import KVMCache
from .configuration_kvm import KVMConfig
from .modeling_kvm import KVMForCausalLM, KVMModel, KVMPreTrainedModel

# Lets `AutoModelForCausalLM.from_pretrained` load converted folders without remote code
# when kvm_maglev is installed; exist_ok keeps re-imports harmless.
AutoConfig.register(KVMConfig.model_type, KVMConfig, exist_ok=True)
AutoModel.register(KVMConfig, KVMModel, exist_ok=True)
AutoModelForCausalLM.register(KVMConfig, KVMForCausalLM, exist_ok=True)

__all__ = ["KVMCache", "KVMConfig", "KVMForCausalLM", "KVMModel", "KVMPreTrainedModel"]
