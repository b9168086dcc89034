"""Train tiny KVM, Maglev and sliding-window models on long-range recall, then measure it.

Every model has the same width, depth and attention window and trains for the same number
of steps with the same data and seed; only the memory differs. Recall is then measured per
query distance with cached ``generate()`` (Maglev: from P's own recurrent memory, and fed by
its prefiller), and written to JSON and a PNG plot, with the drift between P's own memories
and the prefiller's by position. Maglev training recipes are named presets (``maglev_<preset>``).
With ``--save-models DIR`` the trained models are written as folders that ``kvm-maglev demo`` loads.

``--task capacity`` is the capacity-bound multi-key recall of `kvm_maglev.capacity`: 8 to 64 facts spread through
filler, queries after all of them, trained at ``--train-length`` tokens and measured at multiples of it
(``--eval-multiples``) through ``generate()`` on each model's cache. KVM's fixed state gets the power-law
state's slots at the training length (equal state bytes there); full attention is the ceiling.

    python examples/train_recall.py --facts 2 --seed 0 --models swa_baseline maglev_paper maglev_self_feed2 \
        --out results/recall_f2_s0
    python examples/train_recall.py --task capacity --models kvm_fixed kvm_sqrt swa_baseline full_attention \
        --facts 8 16 32 64 --seed 0 --threads 1 --out results/capacity_s0
"""

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments, set_seed

from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM
from kvm_maglev.capacity import CapacityTask, build_capacity_dataset, evaluate_capacity, plot_capacity, recall_by_length
from kvm_maglev.demo import save_demo_model
from kvm_maglev.models.kvm.state_kvm import state_slots_after
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
from kvm_maglev.training import MAGLEV_RECIPE, MAGLEV_RECIPES, maglev_recipe_callbacks

WIDTH, LAYERS, HEADS, WINDOW, CHUNK = 64, 2, 2, 16, 8
SEQ_LEN = 144  # queries reach 8 windows past their fact: 1 + 2 * facts + 8 * WINDOW + room for the query
# evaluation prompts come from a generator of their own, never from a training seed's stream
EVAL_SEED_OFFSET = 10_000
# the capacity task's defaults: facts per sequence, evaluation lengths as multiples of the training length
CAPACITY_FACTS = [8, 16, 32, 64]
CAPACITY_MULTIPLES = [1, 4, 16, 32]


def recall_task(facts: int) -> RecallTask:
    return RecallTask(num_keys=32, num_values=32, num_filler=32, num_facts=facts, seq_len=SEQ_LEN)


def capacity_task(train_length: int) -> CapacityTask:
    return CapacityTask(seq_len=train_length)


def longest_context(args: argparse.Namespace) -> int:
    """The longest sequence a model of this run reads (capacity: the longest evaluation length)."""
    if isinstance(args.task, CapacityTask):
        return max(4096, args.task.seq_len * max(args.eval_multiples))
    return 4096


def _kvm(args: argparse.Namespace, **budget) -> torch.nn.Module:
    config = KVMConfig(
        vocab_size=args.task.vocab_size,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        chunk_size=CHUNK,
        window_chunks=WINDOW // CHUNK,
        sink_slots=1,
        **budget,
    )
    return KVMForCausalLM(config)


def _maglev(args: argparse.Namespace, use_memory: bool, sliding_window: int | None = WINDOW,
            **recipe) -> torch.nn.Module:
    recipe = {"consistency_weight": 0.1, **recipe}  # a recipe may name its own weight
    config = MaglevConfig(
        vocab_size=args.task.vocab_size,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        # nanochat's L window: the prefiller (full attention: every layer) sees the whole sequence
        max_position_embeddings=longest_context(args),
        window_pattern="L",
        sliding_window=sliding_window,
        use_memory=use_memory,
        has_prefiller=use_memory,
        prefiller_window_pattern="L",
        prefiller_shares_blocks=False,
        **recipe,
    )
    return MaglevForCausalLM(config)


SQRT_BUDGET = dict(state_budget_mode="power_law", state_budget_exponent=0.5, state_budget_min=CHUNK,
                   state_max_chunks=1000)


def capacity_state_slots(args: argparse.Namespace) -> int:
    """State slots of the power-law KVM after the capacity task's training length: the fixed state's budget, so
    both hold the same state bytes there."""
    sqrt = KVMConfig(chunk_size=CHUNK, window_chunks=WINDOW // CHUNK, state_budget_factor=args.state_factor,
                     **SQRT_BUDGET)
    return state_slots_after(sqrt, args.task.seq_len)


def _kvm_fixed(args: argparse.Namespace) -> torch.nn.Module:
    if isinstance(args.task, CapacityTask):
        slots = capacity_state_slots(args)
        return _kvm(args, state_budget_mode="fixed", state_budget_min=slots, state_max_chunks=-(-slots // CHUNK))
    return _kvm(args, state_budget_mode="fixed", state_budget_min=2 * CHUNK, state_max_chunks=2)


MODELS: dict[str, Callable[[argparse.Namespace], torch.nn.Module]] = {
    "kvm_fixed": _kvm_fixed,
    "kvm_sqrt": lambda args: _kvm(args, state_budget_factor=args.state_factor, **SQRT_BUDGET),
    "maglev": lambda args: _maglev(args, True, weight_init=args.weight_init, **MAGLEV_RECIPES[MAGLEV_RECIPE]),
    "swa_baseline": lambda args: _maglev(args, False, weight_init=args.weight_init),
    # nanochat's GPT with every layer's window over the longest sequence of the run: full attention
    "full_attention": lambda args: _maglev(args, False, sliding_window=None, weight_init=args.weight_init),
    **{f"maglev_{name}": (lambda args, recipe=recipe: _maglev(args, True, weight_init=args.weight_init, **recipe))
       for name, recipe in MAGLEV_RECIPES.items()},
}
DEMO_MODELS = ["kvm_fixed", "kvm_sqrt", "maglev", "swa_baseline"]
CAPACITY_MODELS = ["kvm_fixed", "kvm_sqrt", "swa_baseline", "full_attention"]


def model_recipe(name: str) -> str | None:
    """The MAGLEV_RECIPES entry a Maglev model trains with (`maglev`: the shipped one), None for other models."""
    if name == "maglev":
        return MAGLEV_RECIPE
    recipe = name[len("maglev_"):] if name.startswith("maglev_") else None
    return recipe if recipe in MAGLEV_RECIPES else None


def distance_weights(distances: list[int], in_window_share: float | None) -> list[float] | None:
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
    # a Maglev model trains with its recipe's callbacks (the step callback; the recipe's schedule, if any)
    recipe = model_recipe(name) or "paper"
    callbacks = maglev_recipe_callbacks(recipe) if isinstance(model, MaglevForCausalLM) else []
    Trainer(model=model, args=training_args, train_dataset=train_data, data_collator=collate,
            callbacks=callbacks).train()
    return model.eval()


def save_recall_model(model, target: Path, name: str, distances: list[int], args: argparse.Namespace) -> None:
    """Keep config, weights and the task it learned; ``kvm-maglev demo`` adds the package's code and a card."""
    task_spec = {"task": args.task.__dict__, "window": WINDOW, "distances": distances, "steps": args.steps, "seed": args.seed}
    if args.in_window_share is not None:
        task_spec["in_window_share"] = args.in_window_share
    if model_recipe(name) is not None:  # the card names it: a recipe's schedule is not in the config
        task_spec["recipe"] = model_recipe(name)
    save_demo_model(model, target, task_spec)


def parse_args(argv: list[str] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--task", choices=("recall", "capacity"), default="recall",
                        help="recall: facts at the start, queries at set distances (the demo's task); capacity: "
                             "many facts spread through filler, queries after all of them, longer sequences at "
                             "evaluation (kvm_maglev.capacity)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                        help="models to train; maglev_<preset> names a Maglev training recipe, maglev the shipped one "
                             f"(default: {' '.join(DEMO_MODELS)}; capacity: {' '.join(CAPACITY_MODELS)})")
    parser.add_argument("--facts", type=int, nargs="+", default=None,
                        help="key-value facts per sequence (recall: one count, default 4; capacity: the counts "
                             f"trained on, each equally often, and measured one by one, default {CAPACITY_FACTS})")
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
    parser.add_argument("--train-length", type=int, default=256, help="capacity: tokens per training sequence")
    parser.add_argument("--eval-multiples", type=int, nargs="+", default=CAPACITY_MULTIPLES,
                        help="capacity: evaluation lengths as multiples of --train-length")
    parser.add_argument("--eval-sequences", type=int, default=16,
                        help="capacity: sequences per (length, facts) cell, each with the task's 8 queries")
    parser.add_argument("--state-factor", type=float, default=4.0,
                        help="kvm_sqrt's budget factor (slots = factor * sqrt(tokens)); capacity: kvm_fixed keeps "
                             "kvm_sqrt's slots at the training length")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("results/recall"))
    parser.add_argument("--save-models", type=Path, default=None)
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    args = parser.parse_args(argv)
    capacity = args.task == "capacity"
    if args.models is None:
        args.models = CAPACITY_MODELS if capacity else DEMO_MODELS
    if args.facts is None:
        args.facts = CAPACITY_FACTS if capacity else [4]
    if capacity:
        if args.in_window_share is not None or args.save_models is not None:
            parser.error("--in-window-share and --save-models belong to the recall task")
        args.task = capacity_task(args.train_length)
        for facts in args.facts:
            for multiple in args.eval_multiples:  # every cell fits: the shortest is the training length
                args.task.cell(args.task.seq_len * multiple, facts).validate()
    else:
        if len(args.facts) != 1:
            parser.error("the recall task takes one --facts count")
        args.task = recall_task(args.facts[0])
    return args


def main(argv: list[str] = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    capacity = isinstance(args.task, CapacityTask)
    eval_seed = EVAL_SEED_OFFSET + args.seed
    if capacity:
        train_data = build_capacity_dataset(args.task, args.steps * args.batch_size, args.facts, seed=args.seed)
    else:
        train_distances = list(range(4, 8 * WINDOW + 1))
        train_data = build_dataset(args.task, args.steps * args.batch_size, train_distances, queries_per_example=12,
                                   seed=args.seed, weights=distance_weights(train_distances, args.in_window_share))
        eval_distances = default_distances(WINDOW)
    results, timings = {}, {}
    for name in args.models:
        start = time.time()
        model = train_one(name, args, train_data)
        timings[name] = time.time() - start
        if capacity:
            start = time.time()
            results[name] = measure_capacity(model, args, eval_seed)
            results[name]["eval_seconds"] = time.time() - start
            print(name, f"train {timings[name]:.0f}s eval {results[name]['eval_seconds']:.0f}s",
                  {n: round(100 * r, 1) for n, r in results[name]["recall_by_length"].items()}, flush=True)
            for length, cells in results[name]["recall"].items():
                print(f"    length {length}:", {f: round(100 * r, 1) for f, r in cells.items()},
                      f"cache {results[name]['cache_bytes'][length]} bytes", flush=True)
        else:
            results[name] = measure(model, name, args.task, eval_distances, args.eval_examples, eval_seed)
            for mode, recall in results[name].items():
                if isinstance(recall, dict) and mode != "drift":
                    print(name, mode, f"{timings[name]:.0f}s", {d: round(100 * r, 1) for d, r in recall.items()},
                          flush=True)
        if args.save_models is not None:
            args.save_models.mkdir(parents=True, exist_ok=True)
            save_recall_model(model, args.save_models / name, name, eval_distances, args)
        write_results(results, timings, args)  # after every model, so a long run can be read as it goes


def measure(model, name: str, task: RecallTask, distances: list[int], examples: int, seed: int) -> dict:
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


def measure_capacity(model, args: argparse.Namespace, seed: int) -> dict:
    """Capacity recall per evaluation length (mean over the fact counts) and per (length, facts), the cache's bytes
    per sequence (float32, at the last query's answer) and, for KVM, the state slots per layer at each length."""
    lengths = [args.task.seq_len * multiple for multiple in args.eval_multiples]
    found = evaluate_capacity(model, args.task, lengths, args.facts, args.eval_sequences, seed)
    row = {
        "recall_by_length": {str(n): r for n, r in recall_by_length(found["recall"]).items()},
        "recall": {str(n): {str(f): r for f, r in cells.items()} for n, cells in found["recall"].items()},
        "cache_bytes": {str(n): b for n, b in found["cache_bytes"].items()},
        "window": WINDOW,
        "chance": chance_level(args.task),
    }
    if isinstance(model, KVMForCausalLM):
        row["state_slots"] = {str(n): state_slots_after(model.config, n) for n in lengths}
    return row


def write_results(results: dict[str, dict], timings: dict[str, float], args: argparse.Namespace) -> None:
    summary = {
        "command": "python examples/train_recall.py " + " ".join(_argv_of(args)),
        "task": args.task.__dict__,
        "settings": {k: str(v) for k, v in vars(args).items() if k != "task"},
        "train_seconds": timings,
        "models": results,
    }
    (args.out / "recall.json").write_text(json.dumps(summary, indent=1))
    if isinstance(args.task, CapacityTask):
        plot_capacity({name: row["recall"] for name, row in results.items()}, chance_level(args.task),
                      args.task.seq_len, args.out / "recall.png")
    else:
        curves = {}
        for name, row in results.items():
            curves[name] = {int(d): r for d, r in row["recurrent"].items()}
            if "prefiller" in row:
                curves[f"{name} (prefiller-fed)"] = {int(d): r for d, r in row["prefiller"].items()}
        plot_recall(curves, chance_level(args.task), WINDOW, args.out / "recall.png")
    print(f"wrote {args.out / 'recall.json'} and {args.out / 'recall.png'}", flush=True)


def _argv_of(args: argparse.Namespace) -> list[str]:
    capacity = isinstance(args.task, CapacityTask)
    words = ["--task", "capacity"] if capacity else []
    words += ["--models", *args.models, "--facts", *map(str, args.facts), "--steps", str(args.steps), "--seed",
              str(args.seed), "--weight-init", args.weight_init]
    words += [] if capacity else ["--eval-examples", str(args.eval_examples)]
    words += ["--batch-size", str(args.batch_size), "--lr", str(args.lr), "--out", str(args.out)]
    if capacity:
        words += ["--train-length", str(args.task.seq_len), "--eval-multiples", *map(str, args.eval_multiples),
                  "--eval-sequences", str(args.eval_sequences)]
    if args.state_factor != 4.0:
        words += ["--state-factor", str(args.state_factor)]
    if args.in_window_share is not None:
        words += ["--in-window-share", str(args.in_window_share)]
    if args.threads is not None:
        words += ["--threads", str(args.threads)]
    return words


if __name__ == "__main__":
    main()
