"""Tiny KVM and Maglev model folders for the ecosystem tests (Trainer, PEFT, accelerate, lm-eval, pipeline).

Everything is built offline from the project's own files: the research KVM fixture converted as a
user would, and a random tiny Maglev with the nanochat test tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS = REPO_ROOT / "examples" / "data" / "tiny_corpus.txt"



def corpus_lines() -> list[str]:
    return [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Move every parameter off its initial value (zero output projections, zero gates), so that
    gradients, merges and memories are non-trivial, as in a trained checkpoint."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def save_tiny_maglev(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Maglev (hidden 64, window 16) with memory and a separate prefiller Q, saved with
    its remote code and the nanochat test tokenizer (with the chat template)."""
    from kvm_maglev import MaglevConfig, MaglevForCausalLM
    from kvm_maglev.tokenization.nanochat import load_nanochat_tokenizer, nanochat_generation_token_fields

    tokenizer = load_nanochat_tokenizer(REPO_ROOT / "tests" / "data" / "nanochat" / "tiny_sl" / "tokenizer")
    config = MaglevConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, window_pattern="SL", sliding_window=16,
        has_prefiller=True, prefiller_shares_blocks=False, prefiller_window_pattern="SL",
        consistency_weight=0.5, **nanochat_generation_token_fields(tokenizer),
    )
    torch.manual_seed(seed)
    model = MaglevForCausalLM(config)
    perturb_(model, seed)
    model.generation_config.update(**nanochat_generation_token_fields(tokenizer))
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_kvm(folder: Path) -> Path:
    """The research KVM fixture with alternating KVM / sliding-window layers and the saturating
    state budget, converted as a user would (`kvm-maglev convert kvm`), with its GPT-2 tokenizer."""
    from kvm_maglev.convert.kvm import convert

    return convert(REPO_ROOT / "tests" / "data" / "kvm" / "kvm_saturate_swa" / "research_final", folder)


# model kinds the ecosystem tests run on; each maps to a builder of a saved model folder
MODEL_BUILDERS = {"kvm": save_tiny_kvm, "maglev": save_tiny_maglev}


def training_block_size(folder: Path) -> int:
    """Training block length for the tests: long enough that every parameter takes part (a KVM
    layer's state and merge gate act only once a chunk has left the attention window)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if config["model_type"] == "kvm":
        return config["chunk_size"] * (config["window_chunks"] + 2)
    return 32


_FOLDERS: dict[str, Path] = {}


def model_folder(kind: str, base: Path) -> Path:
    """The saved folder of a tiny model of `kind`, built once per test session under `base`."""
    if kind not in _FOLDERS:
        _FOLDERS[kind] = MODEL_BUILDERS[kind](base / f"model_{kind}")
    return _FOLDERS[kind]


def load_example(name: str):
    """Import examples/<name>.py as a module (the examples are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO_ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

