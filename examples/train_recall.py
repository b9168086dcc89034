"""Train tiny KVM, Maglev and sliding-window models on long-range recall, then measure it.

Every model has the same width, depth and attention window and trains for the same number
of steps with the same data and seed; only the memory differs. Recall is then measured per
query distance with cached ``generate()``, and written to JSON and a PNG plot. With
``--save-models DIR`` the trained models are written as Hub-ready folders (what
``kvm-maglev demo`` loads).

    python examples/train_recall.py --out results/recall --save-models src/kvm_maglev/assets/recall_models
"""

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from transformers import Trainer, TrainingArguments, set_seed

from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM
from kvm_maglev.demo import save_demo_model
from kvm_maglev.recall import (
    RecallTask,
    build_dataset,
    chance_level,
    collate,
    default_distances,
    evaluate_recall_per_mode,
    plot_recall,
)

WIDTH, LAYERS, HEADS, WINDOW, CHUNK = 64, 2, 2, 16, 8
# queries reach 8 windows past their fact: 1 + 2 * facts + 8 * WINDOW + room for the query
TASK = RecallTask(num_keys=32, num_values=32, num_filler=32, num_facts=4, seq_len=144)


def _kvm(**budget) -> torch.nn.Module:
    config = KVMConfig(
        vocab_size=TASK.vocab_size,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        chunk_size=CHUNK,
        window_chunks=WINDOW // CHUNK,
        sink_slots=1,
        **budget,
    )
    return KVMForCausalLM(config)


def _maglev(use_memory: bool, consistency_weight: float = 0.1, shares_blocks: bool = False) -> torch.nn.Module:
    config = MaglevConfig(
        vocab_size=TASK.vocab_size,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=4096,  # nanochat's L window: the prefiller sees the whole sequence
        window_pattern="L",
        sliding_window=WINDOW,
        use_memory=use_memory,
        has_prefiller=use_memory,
        prefiller_window_pattern="L",
        prefiller_shares_blocks=shares_blocks,
        consistency_weight=consistency_weight,
    )
    return MaglevForCausalLM(config)


MODELS: Dict[str, Callable[[], torch.nn.Module]] = {
    "kvm_fixed": lambda: _kvm(state_budget_mode="fixed", state_budget_min=2 * CHUNK, state_max_chunks=2),
    "kvm_sqrt": lambda: _kvm(
        state_budget_mode="power_law", state_budget_factor=4.0, state_budget_exponent=0.5,
        state_budget_min=CHUNK, state_max_chunks=1000,
    ),
    "maglev": lambda: _maglev(use_memory=True),
    "swa_baseline": lambda: _maglev(use_memory=False),
}
# Maglev settings tried beside the default (not run unless named with --models)
VARIANTS: Dict[str, Callable[[], torch.nn.Module]] = {
    "maglev_consistency1": lambda: _maglev(use_memory=True, consistency_weight=1.0),
    "maglev_consistency0.3": lambda: _maglev(use_memory=True, consistency_weight=0.3),
    "maglev_shared_blocks": lambda: _maglev(use_memory=True, shares_blocks=True),
}


def train_one(name: str, args: argparse.Namespace, train_data) -> torch.nn.Module:
    set_seed(args.seed)
    model = {**MODELS, **VARIANTS}[name]()
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer" / name),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 20),
        weight_decay=0.0,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    Trainer(model=model, args=training_args, train_dataset=train_data, data_collator=collate).train()
    return model.eval()


def save_recall_model(model, target: Path, name: str, distances: List[int], args: argparse.Namespace) -> None:
    """Keep config, weights and the task it learned; ``kvm-maglev demo`` adds the package's code and a card."""
    task_spec = {"task": TASK.__dict__, "window": WINDOW, "distances": distances, "steps": args.steps, "seed": args.seed}
    save_demo_model(model, target, task_spec)


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted({**MODELS, **VARIANTS}), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-examples", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("results/recall"))
    parser.add_argument("--save-models", type=Path, default=None)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    train_distances = list(range(4, 8 * WINDOW + 1))
    train_data = build_dataset(TASK, args.steps * args.batch_size, train_distances, queries_per_example=12, seed=args.seed)
    eval_distances = default_distances(WINDOW)
    results, timings = {}, {}
    for name in args.models:
        start = time.time()
        model = train_one(name, args, train_data)
        timings[name] = time.time() - start
        per_mode = evaluate_recall_per_mode(model, name, TASK, eval_distances, args.eval_examples, seed=args.seed + 1)
        for label, recall in per_mode.items():
            print(label, f"{timings[name]:.0f}s", {d: round(100 * r, 1) for d, r in recall.items()}, flush=True)
        results.update(per_mode)
        if args.save_models is not None:
            args.save_models.mkdir(parents=True, exist_ok=True)
            save_recall_model(model, args.save_models / name, name, eval_distances, args)
        write_results(results, timings, args)  # after every model, so a long run can be read as it goes


def write_results(results: Dict[str, Dict[int, float]], timings: Dict[str, float], args: argparse.Namespace) -> None:
    summary = {
        "task": TASK.__dict__,
        "window": WINDOW,
        "chance": chance_level(TASK),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "train_seconds": timings,
        "recall": {name: {str(d): r for d, r in per.items()} for name, per in results.items()},
    }
    (args.out / "recall.json").write_text(json.dumps(summary, indent=1))
    plot_recall(results, chance_level(TASK), WINDOW, args.out / "recall.png")
    print(f"wrote {args.out / 'recall.json'} and {args.out / 'recall.png'}", flush=True)


if __name__ == "__main__":
    main()
