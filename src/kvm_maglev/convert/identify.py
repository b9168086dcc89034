"""Say what a converter's SOURCE is before reading it, so a folder of the wrong kind gets the right error.

`identify_source` looks only at file names (and config.json's `model_type`): it never loads a
checkpoint. `check_source_kind` turns a kind the converter cannot read into one line naming what
SOURCE is, what the converter expects, and where to go instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

KVM_PT = re.compile(r"model_step_?\d+\.pt")
NANOCHAT_PT = re.compile(r"model_(\d+)\.pt")
NANOCHAT_META = re.compile(r"meta_(\d+)\.json")
CONVERTED_TYPES = ("kvm", "maglev")

# kind -> what SOURCE is, in words
DESCRIPTIONS = {
    "kvm_final": "a KVM research save_pretrained folder (config.json with model_type rwkv7backbone)",
    "kvm_checkpoint": "a KVM research trainer checkpoint (a .pt file)",
    "kvm_run": "a KVM research run folder (model_stepNNNNNN.pt files)",
    "nanochat_checkpoint": "a nanochat checkpoint folder (model_<step>.pt, meta_<step>.json)",
    "nanochat_file": "a nanochat checkpoint file (model_<step>.pt)",
    "nanochat_base": "nanochat's base folder (base_checkpoints/, tokenizer/)",
    "nanochat_checkpoints": "a folder of nanochat checkpoint folders",
    "converted": "a folder already converted by kvm-maglev",
    "transformers": "a transformers model folder",
    "other_file": "a file that is not a checkpoint",
    "other_folder": "a folder with no checkpoint in it",
}
# converter -> (kinds it reads, what it expects in words)
EXPECTED = {
    "kvm": (("kvm_final", "kvm_checkpoint"),
            "a KVM research checkpoint: model_stepNNNNNN.pt (with --config) or the research save_pretrained "
            "folder (config.json with model_type rwkv7backbone)"),
    "maglev": (("nanochat_checkpoint",),
               "a nanochat checkpoint folder holding model_<step>.pt and meta_<step>.json "
               "(e.g. <base>/base_checkpoints/d<N>)"),
}


@dataclass(frozen=True)
class SourceKind:
    """What a SOURCE path is: a kind from DESCRIPTIONS, plus details for the message (model type, subfolders)."""

    kind: str
    model_type: str | None = None
    checkpoints: tuple[str, ...] = ()

    def describe(self) -> str:
        text = DESCRIPTIONS[self.kind]
        if self.model_type and self.kind in ("converted", "transformers"):
            text += f" (model_type {self.model_type})"
        return text


def identify_source(source: str | Path) -> SourceKind:
    """Classify SOURCE from its file names and config.json alone (no checkpoint is loaded)."""
    source = Path(source)
    if source.is_file():
        return _identify_file(source)
    config = _model_type(source / "config.json")
    if config is not None:
        if config == "rwkv7backbone":
            return SourceKind("kvm_final", config)
        return SourceKind("converted" if config in CONVERTED_TYPES else "transformers", config)
    names = [path.name for path in source.iterdir()]
    if any(NANOCHAT_PT.fullmatch(n) or NANOCHAT_META.fullmatch(n) for n in names):
        return SourceKind("nanochat_checkpoint")
    if any(KVM_PT.fullmatch(n) for n in names):
        return SourceKind("kvm_run")
    nested = nanochat_checkpoint_folders(source)
    if nested:
        base = any(n.endswith("_checkpoints") for n in names)
        return SourceKind("nanochat_base" if base else "nanochat_checkpoints", checkpoints=nested)
    return SourceKind("other_folder")


def _identify_file(source: Path) -> SourceKind:
    if NANOCHAT_PT.fullmatch(source.name):
        return SourceKind("nanochat_file")
    if source.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return SourceKind("kvm_checkpoint")
    return SourceKind("other_file")


def _model_type(config_file: Path) -> str | None:
    """config.json's model_type ('' when the file exists without one), None without a config.json."""
    if not config_file.is_file():
        return None
    try:
        document = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    value = document.get("model_type") if isinstance(document, dict) else None
    return value if isinstance(value, str) else ""


def nanochat_checkpoint_folders(folder: Path) -> tuple[str, ...]:
    """Checkpoint folders one or two levels below `folder` (`d20`, `base_checkpoints/d20`), relative to it."""
    found = []
    for pattern in ("*/model_*.pt", "*/*/model_*.pt", "*/meta_*.json", "*/*/meta_*.json"):
        found += [path.parent.relative_to(folder).as_posix() for path in folder.glob(pattern)]
    return tuple(sorted(set(found)))


def check_source_kind(source: str | Path, converter: str, shown: str | None = None) -> SourceKind:
    """Return SOURCE's kind when `converter` reads it; else raise one ValueError saying what it is and what was expected."""
    kind = identify_source(source)
    readable, expected = EXPECTED[converter]
    if kind.kind in readable:
        return kind
    shown = shown or str(source)
    message = f"{shown} is {kind.describe()}; `kvm-maglev convert {converter}` expects {expected}"
    hint = _hint(kind, converter, Path(source), shown)
    raise ValueError(message + (f"; {hint}" if hint else ""))


def _hint(kind: SourceKind, converter: str, source: Path, shown: str) -> str:
    """Where to go instead, when the kind says it."""
    if converter == "maglev" and kind.kind in ("nanochat_base", "nanochat_checkpoints"):
        choices = ", ".join(f"{shown.rstrip('/')}/{name}" for name in kind.checkpoints[:5])
        return f"point at one of its checkpoint folders: {choices}"
    if converter == "maglev" and kind.kind == "nanochat_file":
        step = int(NANOCHAT_PT.fullmatch(source.name).group(1))
        return f"pass its folder {source.parent} (with --step {step})"
    if converter == "kvm" and kind.kind == "kvm_run":
        newest = sorted(name.name for name in source.iterdir() if KVM_PT.fullmatch(name.name))[-1]
        yaml_file = source / "config.yaml" if (source / "config.yaml").is_file() else "<the run's YAML>"
        return f"pass one trainer checkpoint file with its YAML, e.g. {source / newest} --config {yaml_file}"
    if kind.kind == "converted":
        return "it needs no conversion: load it with from_pretrained or publish it with `kvm-maglev push`"
    if converter == "kvm" and kind.kind.startswith("nanochat"):
        return "nanochat and Maglev checkpoints convert with `kvm-maglev convert maglev`"
    if converter == "maglev" and kind.kind.startswith("kvm"):
        return "KVM research checkpoints convert with `kvm-maglev convert kvm`"
    return ""
