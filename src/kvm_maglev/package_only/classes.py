"""The package's configuration and model classes: each model's own class (`kvm_maglev.models`, what a Hub folder's
generated code runs) with what the package adds on top: saving the generated code files, carrying the model card,
the row-block loss.

They keep the models' class names, so that a saved config.json names the same architecture either way, and their
configs are this module's, so that `from_pretrained` of a package model gives a package config.
"""

from __future__ import annotations

from ..models.kvm import configuration_kvm, modeling_kvm
from ..models.maglev import configuration_maglev, modeling_maglev
from .carried_card import CarriedCardMixin
from .hub_save import HubCodeSaveMixin
from .row_block_loss import RowBlockLossMixin


class PackageModelMixin(HubCodeSaveMixin, CarriedCardMixin, RowBlockLossMixin):
    """Put before a model class: saving writes the generated code files and the carried card, training takes the
    row-block loss."""


class KVMConfig(HubCodeSaveMixin, configuration_kvm.KVMConfig):
    __doc__ = configuration_kvm.KVMConfig.__doc__
    # its own: transformers makes each config subclass a dataclass again, which would write another __init__
    __init__ = configuration_kvm.KVMConfig.__init__


class MaglevConfig(HubCodeSaveMixin, configuration_maglev.MaglevConfig):
    __doc__ = configuration_maglev.MaglevConfig.__doc__
    # its own: transformers makes each config subclass a dataclass again, which would write another __init__
    __init__ = configuration_maglev.MaglevConfig.__init__


class KVMModel(PackageModelMixin, modeling_kvm.KVMModel):
    __doc__ = modeling_kvm.KVMModel.__doc__
    config_class = KVMConfig


class KVMForCausalLM(PackageModelMixin, modeling_kvm.KVMForCausalLM):
    __doc__ = modeling_kvm.KVMForCausalLM.__doc__
    config_class = KVMConfig


class MaglevModel(PackageModelMixin, modeling_maglev.MaglevModel):
    __doc__ = modeling_maglev.MaglevModel.__doc__
    config_class = MaglevConfig


class MaglevForCausalLM(PackageModelMixin, modeling_maglev.MaglevForCausalLM):
    __doc__ = modeling_maglev.MaglevForCausalLM.__doc__
    config_class = MaglevConfig
