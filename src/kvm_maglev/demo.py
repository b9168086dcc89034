"""Show the memory at work: long-range recall of the tiny trained models shipped with the package.

The package keeps each model as weights, config and task only. The demo builds its Hub folder
(the package's current code and a card) into a cache folder keyed by the code and weights, and
loads that with trust_remote_code, so it always runs the code as it is now.
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from .models.common.transformers_versions import CACHE_NAME, returned_cache
from .recall import RecallTask, chance_level, evaluate_recall_per_mode, make_example, plot_recall

RECALL_MODELS_DIR = Path(__file__).parent / "assets" / "recall_models"
TASK_FILE = "recall_task.json"
KEPT_FILES = ("config.json", "model.safetensors", TASK_FILE)  # all a kept model holds
_CONFIG_CLASSES = {"kvm": "KVMConfig", "maglev": "MaglevConfig"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", type=Path, default=RECALL_MODELS_DIR, help="folders saved by examples/train_recall.py")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the models' Hub folders are built (default: $XDG_CACHE_HOME/kvm_maglev/demo)")
    parser.add_argument("--examples", type=int, default=32, help="queries per distance")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated to time decoding")
    parser.add_argument("--out", type=Path, default=Path("results/demo"))
    parser.add_argument("--seed", type=int, default=1234)


def find_model_folders(models_dir: Path) -> list[Path]:
    """Model folders under ``models_dir`` (each has a config.json and the recall task it learned)."""
    folders = sorted(p.parent for p in models_dir.glob(f"*/{TASK_FILE}"))
    if not folders:
        raise FileNotFoundError(
            f"no trained recall models in {models_dir}; make them with "
            f"`python examples/train_recall.py --save-models {models_dir}`"
        )
    return folders


def load_task(folder: Path) -> dict:
    return json.loads((folder / TASK_FILE).read_text())


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/kvm_maglev/demo, else ~/.cache/kvm_maglev/demo."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvm_maglev" / "demo"


def save_demo_model(model, folder: Path, task_spec: Mapping) -> Path:
    """Keep a trained demo model as config, weights and its task; code and card are added when built."""
    from .convert.export import move_into_place

    folder = Path(folder)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        for path in staging.iterdir():
            if path.name not in KEPT_FILES:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        (staging / TASK_FILE).write_text(json.dumps(task_spec, indent=1))
        move_into_place(staging, folder, overwrite=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def build_demo_folder(folder: Path, cache_dir: Path) -> Path:
    """The Hub folder of a kept model, built once per (package code, kept files) under `cache_dir`."""
    from .convert.export import build_hub_folder

    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    out = Path(cache_dir) / f"{folder.name}-{_build_key(folder, model_type)}"
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        build_hub_folder(folder, out, card_text=_demo_card(folder, model_type), progress=False)
    except ValueError:
        if out.is_dir():  # another process built the same folder first
            return out
        raise
    return out


def load_demo_model(folder: Path, cache_dir: Path):
    """Build (or reuse) the kept model's Hub folder and load it as a user would, through remote code."""
    from transformers import AutoModelForCausalLM

    built = build_demo_folder(folder, cache_dir)
    return AutoModelForCausalLM.from_pretrained(built, trust_remote_code=True).eval()


def _build_key(folder: Path, model_type: str) -> str:
    """Hash of the package's code files and the kept files: any change to either builds a new folder."""
    from .convert.export import package_code_files

    digest = hashlib.sha256()
    for name, text in package_code_files(model_type).items():
        digest.update(name.encode() + b"\0" + text.encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _demo_card(folder: Path, model_type: str) -> str:
    """The model card, rendered from the kept config and the weights' parameter count."""
    from safetensors import safe_open

    import kvm_maglev

    from .convert.cards import render_model_card

    config = getattr(kvm_maglev, _CONFIG_CLASSES[model_type]).from_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        num_parameters = sum(_numel(weights.get_slice(name).get_shape()) for name in weights.keys())
    title = f"Tiny {folder.name} trained on synthetic long-range recall"
    return render_model_card(config, num_parameters=num_parameters, license="apache-2.0", title=title,
                             recipe=load_task(folder).get("recipe"))


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@torch.no_grad()
def decode_cost(model, task: RecallTask, decode_tokens: int, seed: int) -> dict[str, float]:
    """Cache bytes after a full-length prompt, and greedy decode ms/token after it (each step timed
    on the model's own cache, as generate() runs it)."""
    example = make_example(task, torch.Generator().manual_seed(seed), [])
    out = model(torch.tensor([example.input_ids]), use_cache=True)
    cache = returned_cache(out)
    token = out.logits[:, -1:].argmax(-1)
    elapsed = 0.0
    for _ in range(decode_tokens):
        start = time.perf_counter()
        out = model(token, use_cache=True, **{CACHE_NAME: cache})
        elapsed += time.perf_counter() - start
        cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
    return {"cache_bytes": float(cache.nbytes()), "ms_per_token": 1e3 * elapsed / max(decode_tokens, 1)}


def _table(rows: dict[str, dict], distances: list[int]) -> str:
    header = f"{'model':<24}" + "".join(f"{'d=' + str(d):>8}" for d in distances) + f"{'cache KiB':>11}{'ms/token':>10}"
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        cells = "".join(f"{100 * row['recall'][d]:>7.0f}%" for d in distances)
        lines.append(f"{name:<24}{cells}{row['cache_bytes'] / 1024:>11.1f}{row['ms_per_token']:>10.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    cache_dir = args.cache_dir or default_cache_dir()
    rows: dict[str, dict] = {}
    for folder in find_model_folders(args.models_dir):
        spec = load_task(folder)
        task = RecallTask(**spec["task"])
        model = load_demo_model(folder, cache_dir)
        cost = decode_cost(model, task, args.decode_tokens, args.seed)
        per_mode = evaluate_recall_per_mode(model, folder.name, task, spec["distances"], args.examples, args.seed)
        rows.update({label: {"recall": recall, **cost} for label, recall in per_mode.items()})
        print(f"{folder.name}: done", flush=True)
    distances = spec["distances"]
    print(f"\nRecall of a value stated d tokens earlier (attention window {spec['window']}, chance {100 * chance_level(task):.1f}%)")
    print(_table(rows, distances))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(rows, indent=1))
    recall = {name: row["recall"] for name, row in rows.items()}
    plot_recall(recall, chance_level(task), spec["window"], args.out / "recall.png")
    print(f"\nwrote {args.out / 'demo.json'} and {args.out / 'recall.png'}")
    return 0
