"""Write the flat copies of the shared modules (models/common) into the model folders that use them.

A Hub folder is one flat level of modules imported as `from .name import x`, so each model folder carries
its own copy of what the models share; the copy in `common/` is the one to edit. `--check` writes nothing
and exits 1 when a copy is missing or differs (CI runs it).

    python -m kvm_maglev.models.sync_shared [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
COMMON_DIR = MODELS_DIR / "common"
# shared module -> the model folders that carry a copy
SHARED_MODULES: dict[str, tuple[str, ...]] = {
    "config_fields.py": ("kvm", "maglev"),
    "onednn_linear.py": ("kvm", "maglev"),
    "runtime_switch.py": ("kvm", "maglev"),
    "saved_cache.py": ("kvm", "maglev"),
    "model_inputs.py": ("kvm", "maglev"),
    "generation_cache.py": ("kvm", "maglev"),
    "carried_card.py": ("kvm", "maglev"),
    "conventions.py": ("kvm", "maglev"),
    "tensor_parallel.py": ("kvm", "maglev"),
    "row_block_loss.py": ("kvm", "maglev"),
    "step_plan.py": ("kvm", "maglev"),
    "row_storage.py": ("kvm", "maglev"),
}
HEADER = "# Generated from kvm_maglev/models/common/{name} (python -m kvm_maglev.models.sync_shared); do not edit by hand.\n"


def expected_copies(models_dir: Path = MODELS_DIR) -> dict[Path, str]:
    """Each copy's path and the text it must have: the header line, then the shared module as it is."""
    copies = {}
    for name, folders in SHARED_MODULES.items():
        text = HEADER.format(name=name) + (models_dir / "common" / name).read_text()
        copies.update({models_dir / folder / name: text for folder in folders})
    return copies


def stale_copies(models_dir: Path = MODELS_DIR) -> list[Path]:
    """The copies that are missing or differ from their shared module."""
    return [path for path, text in expected_copies(models_dir).items()
            if not path.is_file() or path.read_text() != text]


def write_copies(models_dir: Path = MODELS_DIR) -> list[Path]:
    """Rewrite the stale copies; returns them."""
    stale = stale_copies(models_dir)
    expected = expected_copies(models_dir)
    for path in stale:
        path.write_text(expected[path])
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvm_maglev.models.sync_shared", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a copy differs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_copies()
        for path in stale:
            print(f"{path.relative_to(MODELS_DIR)} differs from common/{path.name}: "
                  "run `python -m kvm_maglev.models.sync_shared`", file=sys.stderr)
        return 1 if stale else 0
    for path in write_copies():
        print(f"wrote {path.relative_to(MODELS_DIR)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
