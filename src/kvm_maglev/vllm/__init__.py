"""Serving on vLLM: the `vllm.general_plugins` entry point registers our architectures with vLLM's model registry.

Importing this package does not import vLLM; `register()` (which vLLM calls in every process it starts) does.
"""

from __future__ import annotations

# architectures this plugin serves, and where their vLLM model classes live (imported lazily by vLLM)
SERVED = {"MaglevForCausalLM": "kvm_maglev.vllm.maglev:VllmMaglevForCausalLM"}
# architectures of this package that vLLM does not serve yet, and why (said when a folder names one)
NOT_SERVED = {"KVMForCausalLM": "KVM's per-request state (block-window ring, merged state slots, token-shift carry) "
                                "is not wired to vLLM's cache manager yet; serve Maglev folders, or use generate()"}


def register() -> None:
    """Register the served architectures, their configs with transformers, and the config checks that turn off
    or refuse what cannot be exact (prefix caching, speculative decoding)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import kvm_maglev
    from kvm_maglev.vllm.serving_config import RecurrentStateServing, Unserved

    kvm_maglev.register_auto_classes()  # config.json's model_type resolves without remote code
    for architecture, target in SERVED.items():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, target)
        MODELS_CONFIG_MAP[architecture] = RecurrentStateServing
    for architecture in NOT_SERVED:
        # registered so that vLLM reaches the config check that names the reason, not its list of architectures
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, "kvm_maglev.vllm.unserved:VllmUnservedModel")
        MODELS_CONFIG_MAP[architecture] = Unserved
