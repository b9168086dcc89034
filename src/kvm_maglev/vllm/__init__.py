"""Serving on vLLM: the `vllm.general_plugins` entry point registers our architectures with vLLM's model registry.

Importing this package does not import vLLM; `register()` (which vLLM calls in every process it starts) does.
"""

from __future__ import annotations

# architectures this plugin serves, and where their vLLM model classes live (imported lazily by vLLM)
SERVED = {"KVMForCausalLM": "kvm_maglev.vllm.kvm:VllmKVMForCausalLM",
          "MaglevForCausalLM": "kvm_maglev.vllm.maglev:VllmMaglevForCausalLM"}


def register() -> None:
    """Register the served architectures, their configs with transformers, and the config checks that turn off
    or refuse what cannot be exact (speculative decoding, quantization; prefix caching where it cannot be, on by
    default elsewhere), which need to know the engine arguments the user set (`record_user_flags`)."""
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import kvm_maglev
    from kvm_maglev.vllm.serving_config import RecurrentStateServing, default_prefix_caching_on, record_user_flags

    kvm_maglev.register_auto_classes()  # config.json's model_type resolves without remote code
    record_user_flags(EngineArgs)
    for architecture, target in SERVED.items():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, target)
        MODELS_CONFIG_MAP[architecture] = RecurrentStateServing
    default_prefix_caching_on(SERVED)
