"""Show the memory at work: long-range recall of the tiny trained models shipped with the package."""

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List

import torch

from .compat import CACHE_KEYWORD, returned_cache
from .recall import RecallTask, chance_level, evaluate_recall_per_mode, make_example, plot_recall

RECALL_MODELS_DIR = Path(__file__).parent / "assets" / "recall_models"
TASK_FILE = "recall_task.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", type=Path, default=RECALL_MODELS_DIR, help="folders saved by examples/train_recall.py")
    parser.add_argument("--examples", type=int, default=32, help="queries per distance")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated to time decoding")
    parser.add_argument("--out", type=Path, default=Path("results/demo"))
    parser.add_argument("--seed", type=int, default=1234)


def find_model_folders(models_dir: Path) -> List[Path]:
    """Model folders under ``models_dir`` (each has a config.json and the recall task it learned)."""
    folders = sorted(p.parent for p in models_dir.glob(f"*/{TASK_FILE}"))
    if not folders:
        raise FileNotFoundError(
            f"no trained recall models in {models_dir}; make them with "
            f"`python examples/train_recall.py --save-models {models_dir}`"
        )
    return folders


def load_task(folder: Path) -> Dict:
    return json.loads((folder / TASK_FILE).read_text())


@torch.no_grad()
def decode_cost(model, task: RecallTask, decode_tokens: int, seed: int) -> Dict[str, float]:
    """Cache bytes after a full-length prompt, and greedy decode ms/token after it (each step timed
    on the model's own cache, as generate() runs it)."""
    example = make_example(task, torch.Generator().manual_seed(seed), [])
    out = model(torch.tensor([example.input_ids]), use_cache=True)
    cache = returned_cache(out)
    token = out.logits[:, -1:].argmax(-1)
    elapsed = 0.0
    for _ in range(decode_tokens):
        start = time.perf_counter()
        out = model(token, use_cache=True, **{CACHE_KEYWORD: cache})
        elapsed += time.perf_counter() - start
        cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
    return {"cache_bytes": float(cache.nbytes()), "ms_per_token": 1e3 * elapsed / max(decode_tokens, 1)}


def _table(rows: Dict[str, Dict], distances: List[int]) -> str:
    header = f"{'model':<24}" + "".join(f"{'d=' + str(d):>8}" for d in distances) + f"{'cache KiB':>11}{'ms/token':>10}"
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        cells = "".join(f"{100 * row['recall'][d]:>7.0f}%" for d in distances)
        lines.append(f"{name:<24}{cells}{row['cache_bytes'] / 1024:>11.1f}{row['ms_per_token']:>10.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    rows: Dict[str, Dict] = {}
    for folder in find_model_folders(args.models_dir):
        spec = load_task(folder)
        task = RecallTask(**spec["task"])
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
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
