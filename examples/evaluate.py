"""Evaluate a KVM or Maglev model (any causal-LM folder) with lm-evaluation-harness.

    python examples/evaluate.py --model MODEL_DIR --tasks lighthouse_choice,lighthouse_answer

The tasks in examples/lm_eval_tasks/ read local data only; any installed lm-eval task works too
(e.g. --tasks hellaswag, which downloads its data set). Add --adapter DIR to evaluate a LoRA
adapter saved by examples/finetune.py --lora.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (or Hub id), loaded with trust_remote_code")
    parser.add_argument("--tasks", default="lighthouse_choice,lighthouse_answer", help="comma-separated task names")
    parser.add_argument("--include-path", default=str(TASKS_DIR), help="folder with extra task YAML files")
    parser.add_argument("--adapter", default=None, help="PEFT adapter folder to apply on top of --model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N documents per task")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default=None, help="write the results (and per-sample outputs) as JSON here")
    return parser.parse_args(argv)


def load_model(args: argparse.Namespace):
    """lm-eval's HFLM on the model folder; its max_length comes from `max_position_embeddings`."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=args.model,
        trust_remote_code=True,
        peft=args.adapter,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
    )


def evaluate(args: argparse.Namespace, model=None) -> dict:
    """Run the tasks through lm-eval (`model`: an HFLM, default load_model(args)) and return
    simple_evaluate's result dictionary."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = load_model(args) if model is None else model
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise ValueError("--tasks names no task")
    # indexing lm-eval's own thousands of task files takes a while: skip it when the local ones suffice
    task_manager = TaskManager(include_path=args.include_path, include_defaults=False)
    if not set(tasks) <= set(task_manager.all_tasks):
        task_manager = TaskManager(include_path=args.include_path)
    return lm_eval.simple_evaluate(
        model=model,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        task_manager=task_manager,
        log_samples=args.output is not None,
    )


def main(argv: list[str] | None = None) -> int:
    from lm_eval.utils import make_table

    args = parse_args(argv)
    results = evaluate(args)
    print(make_table(results))
    if args.output:
        keep = {key: results[key] for key in ("results", "configs", "versions", "n-shot", "samples") if key in results}
        Path(args.output).write_text(json.dumps(keep, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
