"""RULER (lm-evaluation-harness 0.4.13's long-context tasks) on a model folder, scores written to a JSON file.

    python examples/ruler.py --model out/kvm --tasks niah_single_1,niah_multikey_2 \
        --lengths 1024,2048,4096 --samples-per-length 20 --output results/ruler/kvm.json

RULER generates its documents from the model's own tokenizer: `--lengths` are the task metadata's
`max_seq_lengths` (prompt plus the answer's reserved tokens, counted in the model's tokens; 500
documents a length). `--max-length` (lm-eval's `max_length`; default: the longest length plus 256,
room for the answer prefix lm-eval appends) bounds prompt plus answer, so nothing is cut from the
left of a prompt. `--samples-per-length N` scores the first N documents of each length (the
protocol: all 500). niah_single_1, niah_multikey_2, niah_multikey_3, ruler_vt, ruler_cwe and
ruler_fwe need no download; the essay and QA tasks download their text at run time. Needs
`pip install "lm-eval[ruler]==0.4.13"` (nltk, wonderwords, scipy). docs/evaluation.md has the
KVM paper's protocol and the same run with lm-eval's own CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

# lm-eval's defaults (lm_eval.evaluator): its CLI seeds with these before it builds the documents
PYTHON_SEED, NUMPY_SEED, TORCH_SEED = 0, 1234, 1234
ANSWER_ROOM = 256  # default --max-length minus the longest length


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (or Hub id), loaded with trust_remote_code")
    parser.add_argument("--tasks", default="niah_single_1", help="comma-separated RULER task names")
    parser.add_argument("--lengths", default="4096", help="comma-separated max_seq_lengths, in the model's tokens")
    parser.add_argument("--max-length", type=int, default=None,
                        help=f"lm-eval's max_length (default: the longest length + {ANSWER_ROOM})")
    parser.add_argument("--samples-per-length", type=int, default=None,
                        help="score only the first N documents of each length (default: all 500)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer that sizes the documents (default: --model's)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="auto", help="auto: the folder's dtype")
    parser.add_argument("--output", required=True, help="JSON file the scores are written to")
    parser.add_argument("--log-samples", action="store_true",
                        help="also write each scored document's prompt, target, response and score (large at long lengths)")
    args = parser.parse_args(argv)
    args.task_names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    args.max_seq_lengths = sorted({int(length) for length in args.lengths.split(",") if length.strip()})
    if not args.task_names or not args.max_seq_lengths:
        parser.error("--tasks and --lengths must name at least one task and one length")
    if args.max_length is None:
        args.max_length = max(args.max_seq_lengths) + ANSWER_ROOM
    if args.max_length < max(args.max_seq_lengths):
        parser.error(f"--max-length {args.max_length} is below the longest length {max(args.max_seq_lengths)}")
    return args


def ruler_task_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "ruler"


def load_tasks(args: argparse.Namespace):
    """The RULER tasks with their documents, as lm-eval's CLI builds them (same metadata, same seeds);
    only lm-eval's ruler folder is indexed, not its thousands of other task files."""
    import random

    import numpy as np
    import torch
    from lm_eval.tasks import TaskManager

    random.seed(PYTHON_SEED)
    np.random.seed(NUMPY_SEED)
    torch.manual_seed(TORCH_SEED)
    metadata = {"pretrained": args.model, "max_seq_lengths": args.max_seq_lengths}
    if args.tokenizer:
        metadata["tokenizer"] = args.tokenizer
    manager = TaskManager(include_path=str(ruler_task_dir()), include_defaults=False, metadata=metadata)
    unknown = sorted(set(args.task_names) - set(manager.all_tasks))
    if unknown:
        raise ValueError(f"not RULER tasks of lm-eval: {', '.join(unknown)}; known: {', '.join(manager.all_tasks)}")
    return manager, manager.load(args.task_names)["tasks"]


def documents_by_length(task, per_length: int | None) -> dict[int, list[int]]:
    """Doc indices of each max_seq_length (the first `per_length` of each, or all)."""
    chosen: dict[int, list[int]] = defaultdict(list)
    for index, doc in enumerate(task.test_docs()):
        if per_length is None or len(chosen[doc["max_length"]]) < per_length:
            chosen[doc["max_length"]].append(index)
    return dict(chosen)


def load_model(args: argparse.Namespace):
    """lm-eval's HFLM on the folder, with the max_length the longest prompt needs."""
    import torch
    from lm_eval.models.huggingface import HFLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return HFLM(pretrained=args.model, trust_remote_code=True, max_length=args.max_length,
                batch_size=args.batch_size, device=device, dtype=args.dtype)


def score_table(results: dict, tasks: list[str], lengths: list[int]) -> dict[str, dict[str, float]]:
    """{task: {length: score}}: the share of needles found, from 0 to 1, per length."""
    return {task: {str(length): results["results"][task][f"{length},none"] for length in lengths} for task in tasks}


def evaluate(args: argparse.Namespace, model=None) -> dict:
    """Build the documents, score the chosen ones and return what `main` writes."""
    import lm_eval

    manager, tasks = load_tasks(args)
    chosen = {name: documents_by_length(task, args.samples_per_length) for name, task in tasks.items()}
    for name, by_length in chosen.items():
        missing = [length for length in args.max_seq_lengths if length not in by_length]
        if missing:
            raise ValueError(f"{name} made no document of length {missing}")
    indices = {name: sorted(i for ids in by_length.values() for i in ids) for name, by_length in chosen.items()}
    model = load_model(args) if model is None else model
    results = lm_eval.simple_evaluate(
        model=model, tasks=list(tasks.values()), task_manager=manager,
        samples=None if args.samples_per_length is None else indices,
        log_samples=args.log_samples, random_seed=PYTHON_SEED, numpy_random_seed=NUMPY_SEED,
        torch_random_seed=TORCH_SEED,
    )
    report = {
        "model": args.model,
        "tasks": list(tasks),
        "max_seq_lengths": args.max_seq_lengths,
        "max_length": model.max_length,
        "samples_per_length": {name: {str(length): len(ids) for length, ids in sorted(by_length.items())}
                               for name, by_length in chosen.items()},
        "scores": score_table(results, list(tasks), args.max_seq_lengths),
        "lm_eval": {key: results[key] for key in ("results", "versions", "n-samples", "higher_is_better")
                    if key in results},
    }
    if args.log_samples:
        report["samples"] = {
            name: [{"doc_id": sample["doc_id"], "max_seq_length": sample["doc"]["max_length"],
                    "length": sample["doc"]["length"], "prompt": sample["arguments"][0][0],
                    "target": sample["doc"]["outputs"], "response": sample["resps"][0][0],
                    "score": sample[str(sample["doc"]["max_length"])]}
                   for sample in samples]
            for name, samples in results["samples"].items()
        }
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = evaluate(args)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    width = max(len(name) for name in report["scores"])
    print(f"{'task':<{width}}  " + "  ".join(f"{length:>7}" for length in report["max_seq_lengths"]))
    for name, by_length in report["scores"].items():
        print(f"{name:<{width}}  " + "  ".join(f"{by_length[str(length)]:>7.3f}" for length in report["max_seq_lengths"]))
    print(f"scores written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
