"""KVM (Key-Value Means) and Maglev (Sliding Recurrent Memory) models for transformers.

Names are imported lazily so that the command line starts fast and importing the package
does not pull in torch until a model class is actually used.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

# the configs and models are the package's classes (the models' own with saving, the carried card and the row-block
# loss added); the caches are the models' own
_EXPORTS = {
    "KVMConfig": "kvm_maglev.package_only.classes",
    "KVMCache": "kvm_maglev.models.kvm.cache_kvm",
    "KVMModel": "kvm_maglev.package_only.classes",
    "KVMForCausalLM": "kvm_maglev.package_only.classes",
    "MaglevConfig": "kvm_maglev.package_only.classes",
    "MaglevCache": "kvm_maglev.models.maglev.cache_maglev",
    "MaglevModel": "kvm_maglev.package_only.classes",
    "MaglevForCausalLM": "kvm_maglev.package_only.classes",
}

__all__ = sorted(_EXPORTS) + ["register_auto_classes"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvm_maglev' has no attribute {name!r}")


def register_auto_classes() -> None:
    """Register both architectures, and Maglev's nanochat tokenizer, with the transformers Auto classes
    (no remote code needed). KVM's GPT-2 tokenizer is a plain PreTrainedTokenizerFast.

    This is the only place the package registers them; importing it (or a model's subpackage) does not, because a
    registered class is used even for a folder loaded with trust_remote_code=True. A second call changes nothing."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from kvm_maglev.tokenization.tokenization_nanochat import NanochatTokenizerFast

    for prefix, model_type in (("KVM", "kvm"), ("Maglev", "maglev")):
        config_cls = __getattr__(f"{prefix}Config")
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, __getattr__(f"{prefix}Model"), exist_ok=True)
        AutoModelForCausalLM.register(config_cls, __getattr__(f"{prefix}ForCausalLM"), exist_ok=True)
    AutoTokenizer.register(__getattr__("MaglevConfig"), tokenizer_class=NanochatTokenizerFast, exist_ok=True)
