"""A fresh model's every parameter group has its documented init, whichever modules transformers chooses to
visit: built from the package class, through trust_remote_code from a saved folder, and for keys a checkpoint
lacks in from_pretrained (the suite runs on the newest transformers and on 5.17)."""

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from kvm_maglev import MaglevConfig, MaglevForCausalLM  # the package's classes: saved with the generated code

HIDDEN = 64


def maglev_config(**overrides) -> MaglevConfig:
    fields = dict(vocab_size=300, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64, sliding_window=16, has_prefiller=True,
                  prefiller_shares_blocks=False, memory_projection=True, memory_residual_injection=True)
    fields.update(overrides)
    return MaglevConfig(**fields)


def maglev_expectations(name: str, weight_init: str):
    """(kind, value) of the documented init of a Maglev parameter, by its name."""
    scalars = {"residual_lambdas": ("constant", 1.0), "x0_lambdas": ("constant", 0.1), "smear_lambda": ("constant", 0.0),
               "backout_lambda": ("constant", 0.2), "memory_init": ("constant", 0.0)}
    for key, rule in scalars.items():
        if name.endswith(key):
            return rule
    if weight_init == "torch":
        return ("normal", 1.0) if "embed" in name else ("torch_uniform", None)
    zeros = ("o_proj", "down_proj", "value_gate", "memory_gate", "smear_gate", "memory_residual_proj")
    if any(f"{key}." in name for key in zeros):
        return ("constant", 0.0)
    if name == "lm_head.weight":
        return ("normal", 0.001)
    if name.endswith("embed_tokens.weight"):
        return ("normal", 1.0)
    if "memory_k_proj" in name or "memory_v_proj" in name:
        return ("normal", 0.02)
    return ("uniform", math.sqrt(3.0 / HIDDEN))


def check_param(name: str, param: torch.Tensor, kind: str, value) -> None:
    data = param.detach().float()
    reach = 0.5 if data.numel() < 256 else 0.9  # how close a uniform sample's largest value must come to its bound
    if kind == "constant":
        assert torch.all(data == value), f"{name}: expected all {value}, got max |w| {data.abs().max():.3g}"
    elif kind == "normal":
        assert abs(data.std().item() - value) < 0.15 * value, f"{name}: std {data.std():.4g}, expected {value}"
    elif kind == "uniform":
        assert reach * value < data.abs().max() <= value, f"{name}: not U(-{value:.3g}, {value:.3g})"
    else:  # PyTorch's nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = param.shape[1] ** -0.5
        assert reach * bound < data.abs().max() <= bound, f"{name}: not PyTorch's default"


def check_init(model: torch.nn.Module, expectation) -> None:
    for name, param in model.named_parameters():
        check_param(name, param, *expectation(name))


@pytest.mark.parametrize("weight_init", ["nanochat", "torch"])
def test_maglev_fresh_package_model_has_the_documented_init(weight_init):
    torch.manual_seed(0)
    model = MaglevForCausalLM(maglev_config(weight_init=weight_init))
    check_init(model, lambda name: maglev_expectations(name, weight_init))


def saved_with_code(model, folder):
    type(model).register_for_auto_class("AutoModelForCausalLM")
    model.config.register_for_auto_class()
    model.save_pretrained(folder)
    return folder


def fresh_remote_model(folder, seed: int = 0):
    """A new model built by the folder's remote code (its own classes, not the package's, even where the
    package registered its model type with the Auto classes)."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    reference = config.auto_map["AutoModelForCausalLM"]
    model_class = get_class_from_dynamic_module(reference, str(folder))
    torch.manual_seed(seed)
    model = model_class(model_class.config_class.from_pretrained(folder))
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    return model


def test_maglev_fresh_remote_code_model_has_the_documented_init(tmp_path):
    folder = saved_with_code(MaglevForCausalLM(maglev_config()), tmp_path / "maglev")
    model = fresh_remote_model(folder)
    check_init(model, lambda name: maglev_expectations(name, "nanochat"))


@pytest.mark.parametrize("remote", [False, True])
def test_maglev_keys_a_checkpoint_lacks_get_the_documented_init(tmp_path, remote):
    """Loaded keys are kept; missing ones (here every memory tensor, as from a plain nanochat checkpoint
    extended with memory) are initialised as documented."""
    torch.manual_seed(0)
    source = MaglevForCausalLM(maglev_config())
    with torch.no_grad():
        for param in source.parameters():
            param.add_(0.5)
    folder = saved_with_code(source, tmp_path / "maglev")
    weights = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in weights.items() if "memory" not in k}
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    loader = AutoModelForCausalLM if remote else MaglevForCausalLM
    model = loader.from_pretrained(folder, trust_remote_code=True) if remote else loader.from_pretrained(folder)
    missing = [name for name, _ in model.named_parameters() if name not in kept]
    assert any("memory_k_proj" in name for name in missing), "the test must leave keys missing"
    for name, param in model.named_parameters():
        if name in kept:
            assert torch.equal(param, kept[name]), name
        else:
            check_param(name, param, *maglev_expectations(name, "nanochat"))


# ----- KVM ------------------------------------------------------------------------------------------------
def kvm_model(seed: int, **overrides):
    from kvm_maglev import KVMConfig, KVMForCausalLM

    fields = dict(vocab_size=300, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=2, chunk_size=8)
    fields.update(overrides)
    torch.manual_seed(seed)
    return KVMForCausalLM(KVMConfig(**fields))


def every_module_initialised(model):
    """The same model after `_init_weights` on every module, containers included (the documented init)."""
    with torch.no_grad():
        model.apply(model._init_weights)
    return model


def check_kvm_init(model, reference) -> None:
    """Deterministic parameters equal the documented ones exactly; random ones follow their distribution."""
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            assert param.abs().max() <= 1e-4, name
        elif param.ndim == 2 and not torch.all(expected[name] == 0):
            std = param.shape[1] ** -0.5
            assert abs(param.std().item() - std) < 0.2 * std, f"{name}: std {param.std():.4g}, expected {std:.4g}"
        else:  # zeroed projections, norms, shift ramps, gate biases, lambdas, temperatures
            assert torch.equal(param, expected[name]), f"{name} differs from its documented init"


@pytest.mark.parametrize("ffn_token_shift", [True, False])
def test_kvm_fresh_model_has_the_documented_init(ffn_token_shift):
    model = kvm_model(0, ffn_token_shift=ffn_token_shift)
    assert all(layer.mlp.down_proj.weight.abs().max() == 0 for layer in model.model.layers)
    check_kvm_init(model, every_module_initialised(kvm_model(1, ffn_token_shift=ffn_token_shift)))


def test_kvm_fresh_remote_code_model_has_the_documented_init(tmp_path):
    folder = saved_with_code(kvm_model(0, ffn_token_shift=False), tmp_path / "kvm")
    model = fresh_remote_model(folder)
    check_kvm_init(model, every_module_initialised(kvm_model(1, ffn_token_shift=False)))
