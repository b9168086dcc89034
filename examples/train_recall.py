"""Train tiny KVM, Maglev and sliding-window models on long-range recall, then measure it.

Every model has the same width, depth and attention window and trains for the same number
of steps with the same data and seed; only the memory differs. Recall is then measured per
query distance with cached ``generate()`` (Maglev: from P's own recurrent memory, and fed by
its prefiller), and written to JSON and a PNG plot, with the drift between P's own memories
and the prefiller's by position. Maglev training recipes are named presets (``maglev_<preset>``).
With ``--save-models DIR`` the trained models are written as folders that ``kvm-maglev demo`` loads.

    python examples/train_recall.py --facts 2 --seed 0 --models swa_baseline maglev_paper maglev_self_feed2 \
        --out results/recall_f2_s0
"""

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

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
    memory_drift,
    plot_recall,
)
from kvm_maglev.training import MAGLEV_RECIPE, MAGLEV_RECIPES, MaglevStepCallback

WIDTH, LAYERS, HEADS, WINDOW, CHUNK = 64, 2, 2, 16, 8
SEQ_LEN = 144  # queries reach 8 windows past their fact: 1 + 2 * facts + 8 * WINDOW + room for the query
# evaluation prompts come from a generator of their own, never from a training seed's stream
EVAL_SEED_OFFSET = 10_000


def recall_task(facts: int) -> RecallTask:
    return RecallTask(num_keys=32, num_values=32, num_filler=32, num_facts=facts, seq_len=SEQ_LEN)


def _kvm(**budget) -> torch.nn.Module:
    config = KVMConfig(
        vocab_size=recall_task(1).vocab_size,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        chunk_size=CHUNK,
        window_chunks=WINDOW // CHUNK,
        sink_slots=1,
        **budget,
    )
    return KVMForCausalLM(config)


def _maglev(use_memory: bool, **recipe) -> torch.nn.Module:
    recipe = {"consistency_weight": 0.1, **recipe}  # a recipe may name its own weight
    config = MaglevConfig(
        vocab_size=recall_task(1).vocab_size,
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
        prefiller_shares_blocks=False,
        **recipe,
    )
    return MaglevForCausalLM(config)


MODELS: Dict[str, Callable[[argparse.Namespace], torch.nn.Module]] = {
    "kvm_fixed": lambda args: _kvm(state_budget_mode="fixed", state_budget_min=2 * CHUNK, state_max_chunks=2),
    "kvm_sqrt": lambda args: _kvm(
        state_budget_mode="power_law", state_budget_factor=4.0, state_budget_exponent=0.5,
        state_budget_min=CHUNK, state_max_chunks=1000,
    ),
    "maglev": lambda args: _maglev(True, weight_init=args.weight_init, **MAGLEV_RECIPES[MAGLEV_RECIPE]),
    "swa_baseline": lambda args: _maglev(False, weight_init=args.weight_init),
    **{f"maglev_{name}": (lambda args, recipe=recipe: _maglev(True, weight_init=args.weight_init, **recipe))
       for name, recipe in MAGLEV_RECIPES.items()},
}
DEMO_MODELS = ["kvm_fixed", "kvm_sqrt", "maglev", "swa_baseline"]


def distance_weights(distances: List[int], in_window_share: Optional[float]) -> Optional[List[float]]:
    """Sampling weights giving queries inside the window (distance <= WINDOW) `in_window_share` of the draws,
    uniform within each side; None (uniform over all) when no share is given. Every model of one run sees
    the same data."""
    if in_window_share is None:
        return None
    if not 0 < in_window_share < 1:
        raise ValueError(f"--in-window-share must be in (0, 1), got {in_window_share}")
    inside = sum(d <= WINDOW for d in distances)
    if inside in (0, len(distances)):
        raise ValueError("--in-window-share needs training distances both inside and outside the window")
    return [in_window_share / inside if d <= WINDOW else (1 - in_window_share) / (len(distances) - inside)
            for d in distances]


def train_one(name: str, args: argparse.Namespace, train_data) -> torch.nn.Module:
    set_seed(args.seed)
    model = MODELS[name](args)
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
        disable_tqdm=not args.progress,
    )
    callbacks = [MaglevStepCallback()] if isinstance(model, MaglevForCausalLM) else []
    Trainer(model=model, args=training_args, train_dataset=train_data, data_collator=collate,
            callbacks=callbacks).train()
    return model.eval()


def save_recall_model(model, target: Path, name: str, distances: List[int], args: argparse.Namespace) -> None:
    """Keep config, weights and the task it learned; ``kvm-maglev demo`` adds the package's code and a card."""
    task_spec = {"task": args.task.__dict__, "window": WINDOW, "distances": distances, "steps": args.steps, "seed": args.seed}
    if args.in_window_share is not None:
        task_spec["in_window_share"] = args.in_window_share
    save_demo_model(model, target, task_spec)


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=DEMO_MODELS,
                        help="models to train; maglev_<preset> names a Maglev training recipe, maglev the best one")
    parser.add_argument("--facts", type=int, default=4, help="key-value facts per sequence")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--seed", type=int, default=0, help="training seed (weights, data order, training data)")
    parser.add_argument("--weight-init", choices=("nanochat", "torch"), default="torch",
                        help="Maglev / sliding-window init: nanochat's documented one or PyTorch's layer defaults")
    parser.add_argument("--in-window-share", type=float, default=None,
                        help="share of training queries drawn from distances inside the window (default: "
                             "uniform over all distances, about 10%% inside)")
    parser.add_argument("--eval-examples", type=int, default=200, help="queries per distance")
    parser.add_argument("--out", type=Path, default=Path("results/recall"))
    parser.add_argument("--save-models", type=Path, default=None)
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    args = parser.parse_args(argv)
    args.task = recall_task(args.facts)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    train_distances = list(range(4, 8 * WINDOW + 1))
    train_data = build_dataset(args.task, args.steps * args.batch_size, train_distances, queries_per_example=12,
                               seed=args.seed, weights=distance_weights(train_distances, args.in_window_share))
    eval_distances = default_distances(WINDOW)
    eval_seed = EVAL_SEED_OFFSET + args.seed
    results, timings = {}, {}
    for name in args.models:
        start = time.time()
        model = train_one(name, args, train_data)
        timings[name] = time.time() - start
        results[name] = measure(model, name, args.task, eval_distances, args.eval_examples, eval_seed)
        for mode, recall in results[name].items():
            if isinstance(recall, dict) and mode != "drift":
                print(name, mode, f"{timings[name]:.0f}s", {d: round(100 * r, 1) for d, r in recall.items()},
                      flush=True)
        if args.save_models is not None:
            args.save_models.mkdir(parents=True, exist_ok=True)
            save_recall_model(model, args.save_models / name, name, eval_distances, args)
        write_results(results, timings, args)  # after every model, so a long run can be read as it goes


def measure(model, name: str, task: RecallTask, distances: List[int], examples: int, seed: int) -> Dict:
    """Recall per distance: "recurrent" is the model's own inference (Maglev: P alone on its own memory; other
    models: their cache), "prefiller" a Maglev prompt fed by its prefiller; plus Maglev's memory drift."""
    per_mode = evaluate_recall_per_mode(model, name, task, distances, examples, seed=seed)
    row = {"recurrent": {str(d): r for d, r in per_mode[name].items()}}
    fed = per_mode.get(f"{name}_prefiller_fed")
    if fed is not None:
        row["prefiller"] = {str(d): r for d, r in fed.items()}
        row["drift"] = memory_drift(model, task, num_examples=64, seed=seed, bucket=WINDOW)
    row.update(window=WINDOW, chance=chance_level(task))
    return row


def write_results(results: Dict[str, Dict], timings: Dict[str, float], args: argparse.Namespace) -> None:
    summary = {
        "command": "python examples/train_recall.py " + " ".join(_argv_of(args)),
        "task": args.task.__dict__,
        "settings": {k: str(v) for k, v in vars(args).items() if k != "task"},
        "train_seconds": timings,
        "models": results,
    }
    (args.out / "recall.json").write_text(json.dumps(summary, indent=1))
    curves = {}
    for name, row in results.items():
        curves[name] = {int(d): r for d, r in row["recurrent"].items()}
        if "prefiller" in row:
            curves[f"{name} (prefiller-fed)"] = {int(d): r for d, r in row["prefiller"].items()}
    plot_recall(curves, chance_level(args.task), WINDOW, args.out / "recall.png")
    print(f"wrote {args.out / 'recall.json'} and {args.out / 'recall.png'}", flush=True)


def _argv_of(args: argparse.Namespace) -> List[str]:
    words = ["--models", *args.models, "--facts", str(args.facts), "--steps", str(args.steps), "--seed",
             str(args.seed), "--weight-init", args.weight_init, "--eval-examples", str(args.eval_examples),
             "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--out", str(args.out)]
    if args.in_window_share is not None:
        words += ["--in-window-share", str(args.in_window_share)]
    return words


if __name__ == "__main__":
    main()
