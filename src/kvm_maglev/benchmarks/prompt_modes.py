"""Maglev's two prompt modes measured side by side: recall, bits per byte and prefill speed by prompt length.

A Maglev folder that kept its prefiller Q reads a prompt either recurrently (P token after token, the paper's
inference) or with Q in parallel (P then continues from Q's memories). The mode only changes what the cache holds
when decoding starts, so each quality measurement here reads a prompt in the mode under test and scores what
follows it:

- recall (folders written by ``examples/train_recall.py --save-models`` or the package's demo model): the facts at
  the start of the prompt, a query whose answer lies k windows after its fact at its end; exact match of one
  greedy ``generate()`` token (``kvm_maglev.recall.evaluate_recall``);
- language modelling (folders written by ``examples/train_lm.py --save-models``): the first k windows of a
  held-out cast story are the prompt, the next ``--continuation`` bytes are scored teacher-forced with P
  continuing recurrently from the prompt's cache (bits per byte);
- speed: tokens/s of one prompt (batch 1) read by ``generate()`` in each mode, and with ``--generate-4k`` the
  issue's comparison on the benchmark shape (4 layers, width 768) against a same-shape Llama.

``decide`` applies the rule written in docs/maglev_memory.md ("Default prompt mode") to measurement files.

    python -m kvm_maglev.benchmarks.prompt_modes measure --recall-models src/kvm_maglev/assets/recall_models/maglev \\
        --lm-models results/lm600_s0/models/maglev --out docs/prompt_modes/quality.json
    python -m kvm_maglev.benchmarks.prompt_modes measure --generate-4k --out docs/prompt_modes/generate_4k.json
    python -m kvm_maglev.benchmarks.prompt_modes decide docs/prompt_modes/*.json --out docs/prompt_modes/decision.json

Speeds are CPU seconds of this process (``time.process_time``) with one torch thread, so other jobs on a shared
machine cost less noise than wall time would; wall seconds are recorded beside them.
"""

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

# absolute imports: the file also runs as a script against another checkout's package (PYTHONPATH=<checkout>/src
# python src/kvm_maglev/benchmarks/prompt_modes.py measure --generate-4k ...), e.g. the code before a change
from kvm_maglev.models.common.transformers_versions import CACHE_NAME, returned_cache
from kvm_maglev.recall import RecallTask, evaluate_recall, memory_prefill

MODES = ("recurrent", "prefiller")
MULTIPLES = (1, 2, 4, 8, 16, 32)
# evaluation seeds never used for training or an earlier evaluation (training used 0-7 and 100-101, recall
# evaluation 10000 + training seed)
EVAL_SEEDS = (50000, 50001, 50002)
LM_BOS = 256  # examples/train_lm.py's byte vocabulary: 256 bytes + BOS
LM_STORY_SENTENCES = 80  # cast stories long enough for 32 windows of 32 bytes and a continuation


def load(folder) -> torch.nn.Module:
    from kvm_maglev import MaglevForCausalLM

    model = MaglevForCausalLM.from_pretrained(folder).eval()
    if not model.config.has_prefiller:
        raise ValueError(f"{folder}: the folder has no prefiller, so it has one prompt mode only")
    return model


# ----- recall --------------------------------------------------------------------------------------------------
def recall_task(folder) -> tuple:
    """(RecallTask, window) a kept recall model was trained on (its recall_task.json)."""
    spec = json.loads((Path(folder) / "recall_task.json").read_text())
    return RecallTask(**spec["task"]), int(spec["window"])


def recall_by_length(model, task: RecallTask, window: int, multiples: Sequence[int], seeds: Sequence[int],
                     examples: int) -> dict[str, dict[str, dict[str, float]]]:
    """{mode: {k: {seed: recall}}}: the query's answer k windows after its fact (the prompt ends right before it).

    Each length gets a task just long enough for its prompts (the facts block, the distance and the query), so the
    prompts of one length are as long as that distance allows and no longer."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    for mode in MODES:
        with memory_prefill(model, mode):
            for k in multiples:
                distance = k * window
                sized = replace(task, seq_len=2 * task.num_facts + distance + 1)
                for seed in seeds:
                    recall = evaluate_recall(model, sized, [distance], examples, seed=seed)[distance]
                    result.setdefault(mode, {}).setdefault(str(k), {})[str(seed)] = recall
    return result


# ----- language modelling --------------------------------------------------------------------------------------
def lm_rows(seed: int, stories: int, length: int) -> torch.Tensor:
    """`stories` held-out cast stories as rows of `length` byte ids (BOS first), from the story stream of `seed`."""
    from kvm_maglev.corpora import cast_corpus, pack_bytes

    rows = pack_bytes(cast_corpus(stories * 2, seed=seed, sentences=LM_STORY_SENTENCES), length, LM_BOS,
                      rows_per_document=1)
    if rows.shape[0] < stories:
        raise ValueError(f"only {rows.shape[0]} of {stories * 2} stories reach {length} bytes")
    return rows[:stories]


@torch.no_grad()
def continuation_bits(model, rows: torch.Tensor, prompt: int, continuation: int, batch: int) -> float:
    """Bits per byte of rows[:, prompt : prompt + continuation] after reading rows[:, :prompt] in the model's
    current prompt mode; the continuation is read on the prompt's cache (recurrently, as decoding would)."""
    nats, count = 0.0, 0
    for start in range(0, rows.shape[0], batch):
        ids = rows[start:start + batch, : prompt + continuation]
        out = model(input_ids=ids[:, :prompt], use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1]
        rest = model(input_ids=ids[:, prompt:-1], use_cache=True, **{CACHE_NAME: returned_cache(out)}).logits
        logits = torch.cat([first[:, None], rest], dim=1).float()
        targets = ids[:, prompt:]
        nats += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
    return nats / count / math.log(2)


def lm_by_length(model, multiples: Sequence[int], seeds: Sequence[int], stories: int, continuation: int,
                 batch: int) -> dict[str, dict[str, dict[str, float]]]:
    """{mode: {k: {seed: continuation BPB}}} with prompts of k windows (`config.sliding_window` bytes each)."""
    window = model.config.sliding_window
    rows = {seed: lm_rows(seed, stories, max(multiples) * window + continuation) for seed in seeds}
    result: dict[str, dict[str, dict[str, float]]] = {}
    for mode in MODES:
        with memory_prefill(model, mode):
            for k in multiples:
                for seed in seeds:
                    bits = continuation_bits(model, rows[seed], k * window, continuation, batch)
                    result.setdefault(mode, {}).setdefault(str(k), {})[str(seed)] = bits
    return result


# ----- speed ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def time_generate_prompt(model, length: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """CPU and wall seconds (medians of `repeats`) of ``generate()`` reading one random prompt of `length` tokens
    and choosing one token: the prompt's forward is all it runs. One untimed warm-up call on a short prompt first
    (first-call allocations and dispatch caches are not what a prompt costs)."""
    ids = torch.randint(1, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    kwargs = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    model.generate(ids[:, : min(length, 8)], attention_mask=torch.ones_like(ids[:, :8]), **kwargs)
    cpu, wall = [], []
    for _ in range(repeats):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return {"tokens": length, "repeats": repeats, "cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
            "tokens_per_cpu_s": length / statistics.median(cpu), "tokens_per_wall_s": length / statistics.median(wall),
            "cpu_s_all": cpu, "wall_s_all": wall}


def speed_by_length(model, window: int, multiples: Sequence[int], repeats: int) -> dict[str, dict[str, dict]]:
    """{mode: {k: time_generate_prompt of a k-window prompt}}."""
    result: dict[str, dict[str, dict]] = {}
    for mode in MODES:
        with memory_prefill(model, mode):
            for k in multiples:
                result.setdefault(mode, {})[str(k)] = time_generate_prompt(model, k * window, repeats)
    return result


def generate_4k(length: int, repeats: dict[str, int], shape_name: str) -> dict[str, dict]:
    """The issue's measurement: prefill tokens/s of ``generate()`` on a `length`-token prompt, batch 1, for Maglev
    (the benchmark shape, prefiller kept; the same weights read in both modes) and a same-shape Llama from
    transformers, random weights, each with its ratio to Llama's (CPU time)."""
    from kvm_maglev.benchmarks.models import MODEL_BUILDERS, SHAPES

    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    maglev = MODEL_BUILDERS["maglev_prefiller"](shape).eval()
    llama = MODEL_BUILDERS["llama_full"](shape).eval()
    rows = {"llama": time_generate_prompt(llama, length, repeats["llama"])}
    del llama
    for mode in ("prefiller", "recurrent"):
        if not repeats[mode]:
            continue
        with memory_prefill(maglev, mode):
            rows[f"maglev_{mode}"] = time_generate_prompt(maglev, length, repeats[mode])
    for row in rows.values():
        row["vs_llama_cpu"] = row["tokens_per_cpu_s"] / rows["llama"]["tokens_per_cpu_s"]
        row["vs_llama_wall"] = row["tokens_per_wall_s"] / rows["llama"]["tokens_per_wall_s"]
    return {"shape": shape_name, "shape_fields": shape.__dict__, "prompt_tokens": length, "rows": rows}


# ----- the rule ------------------------------------------------------------------------------------------------
def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def decide(files: Sequence[dict], recall_margin: float = 0.02, bits_margin: float = 0.01,
           speed_from: int = 2) -> dict:
    """docs/maglev_memory.md's rule on measurement files: "prefiller" only if at every length the prefiller-fed
    recall of each recall model is at least recurrent's minus `recall_margin`, the continuation BPB (mean over the
    language models) at most recurrent's plus `bits_margin`, and from `speed_from` windows on the prefiller
    prompt is at least as fast on every model and on the 4k generate() measurement; otherwise "recurrent"."""
    checks: list[dict] = []

    def check(name: str, k, prefiller: float, recurrent: float, passed: bool) -> None:
        checks.append({"check": name, "k": k, "prefiller": prefiller, "recurrent": recurrent, "passed": passed})

    bits: dict[str, dict[str, list[float]]] = {}
    generate_rows = []
    for data in files:
        for name, model in data.get("models", {}).items():
            if "recall" in model:
                for k, per_seed in model["recall"]["recurrent"].items():
                    own = _mean(per_seed.values())
                    fed = _mean(model["recall"]["prefiller"][k].values())
                    check(f"recall {name}", int(k), fed, own, fed >= own - recall_margin)
            if "lm" in model:
                for mode in MODES:
                    for k, per_seed in model["lm"][mode].items():
                        bits.setdefault(k, {}).setdefault(mode, []).append(_mean(per_seed.values()))
            for k, row in model.get("speed", {}).get("prefiller", {}).items():
                if int(k) >= speed_from:
                    own = model["speed"]["recurrent"][k]["tokens_per_cpu_s"]
                    check(f"speed {name} (tokens/CPU s)", int(k), row["tokens_per_cpu_s"], own,
                          row["tokens_per_cpu_s"] >= own)
        if "generate_4k" in data:
            generate_rows.append(data["generate_4k"]["rows"])
    for k, per_mode in sorted(bits.items(), key=lambda item: int(item[0])):
        fed, own = _mean(per_mode["prefiller"]), _mean(per_mode["recurrent"])
        check(f"BPB, mean of {len(per_mode['recurrent'])} language models", int(k), fed, own, fed <= own + bits_margin)
    for rows in generate_rows:
        fed, own = rows["maglev_prefiller"]["tokens_per_cpu_s"], rows["maglev_recurrent"]["tokens_per_cpu_s"]
        check("speed, 4k generate() on the benchmark shape (tokens/CPU s)", "4k", fed, own, fed >= own)
    kinds = {"recall": any(c["check"].startswith("recall") for c in checks),
             "language modelling": bool(bits), "speed": any(c["check"].startswith("speed") for c in checks)}
    missing = [kind for kind, present in kinds.items() if not present]
    failed = [c for c in checks if not c["passed"]]
    mode = "prefiller" if not failed and not missing else "recurrent"
    return {"rule": "docs/maglev_memory.md#default-prompt-mode-issue-50-the-decision-rule",
            "margins": {"recall": recall_margin, "bits_per_byte": bits_margin, "speed_from_windows": speed_from},
            "default_mode": mode, "missing": missing, "failed": failed, "checks": checks}


# ----- command line --------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    import kvm_maglev

    result: dict = {"command": args.command, "package": str(Path(kvm_maglev.__file__).parent),
                    "threads": args.threads, "eval_seeds": list(args.eval_seeds),
                    "multiples": list(args.multiples), "models": {}}
    for folder in args.recall_models:
        model = load(folder)
        task, window = recall_task(folder)
        row = {"kind": "recall", "folder": str(folder), "window": window, "task": task.__dict__,
               "examples_per_seed": args.recall_examples}
        row["recall"] = recall_by_length(model, task, window, args.multiples, args.eval_seeds, args.recall_examples)
        if args.speed_repeats:
            row["speed"] = speed_by_length(model, window, args.multiples, args.speed_repeats)
        result["models"][str(folder)] = row
        _progress(folder, row)
    for folder in args.lm_models:
        model = load(folder)
        row = {"kind": "lm", "folder": str(folder), "window": model.config.sliding_window,
               "stories_per_seed": args.lm_stories, "continuation": args.continuation}
        row["lm"] = lm_by_length(model, args.multiples, args.eval_seeds, args.lm_stories, args.continuation,
                                 args.batch)
        if args.speed_repeats:
            row["speed"] = speed_by_length(model, model.config.sliding_window, args.multiples, args.speed_repeats)
        result["models"][str(folder)] = row
        _progress(folder, row)
    if args.generate_4k:
        repeats = {"llama": args.generate_repeats, "prefiller": args.generate_repeats,
                   "recurrent": args.recurrent_repeats}
        result["generate_4k"] = generate_4k(args.generate_length, repeats, args.shape)
        for name, row in result["generate_4k"]["rows"].items():
            print(f"{name:<18} {row['tokens_per_cpu_s']:8.0f} tokens/CPU s  {row['vs_llama_cpu']:.3f}x Llama "
                  f"(wall {row['tokens_per_wall_s']:.0f} tokens/s, {row['vs_llama_wall']:.3f}x)", flush=True)
    return result


def _progress(folder, row: dict) -> None:
    for kind in ("recall", "lm", "speed"):
        for mode, per_k in row.get(kind, {}).items():
            values = {k: (v["tokens_per_cpu_s"] if kind == "speed" else _mean(v.values())) for k, v in per_k.items()}
            print(f"{Path(folder).name:<10} {kind:<6} {mode:<9}", "  ".join(f"{k}x {v:.3f}" for k, v in values.items()),
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("measure", help="measure folders and/or the 4k generate() comparison")
    run.add_argument("--recall-models", nargs="*", type=Path, default=[])
    run.add_argument("--lm-models", nargs="*", type=Path, default=[])
    run.add_argument("--multiples", nargs="+", type=int, default=list(MULTIPLES), help="prompt lengths in windows")
    run.add_argument("--eval-seeds", nargs="+", type=int, default=list(EVAL_SEEDS))
    run.add_argument("--recall-examples", type=int, default=200, help="recall prompts per length and seed")
    run.add_argument("--lm-stories", type=int, default=64, help="language-modelling stories per seed")
    run.add_argument("--continuation", type=int, default=64, help="bytes scored after each language-model prompt")
    run.add_argument("--batch", type=int, default=64, help="language-modelling rows per forward")
    run.add_argument("--speed-repeats", type=int, default=3, help="timed prompts per mode and length (0: no speed)")
    run.add_argument("--generate-4k", action="store_true", help="the benchmark shape against a same-shape Llama")
    run.add_argument("--generate-length", type=int, default=4096)
    run.add_argument("--generate-repeats", type=int, default=3, help="timed 4k prompts for Llama and the prefiller")
    run.add_argument("--recurrent-repeats", type=int, default=1,
                     help="timed 4k recurrent prompts (about a minute each; 0: not measured)")
    run.add_argument("--shape", default="default", help="kvm_maglev.benchmarks.models.SHAPES entry")
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--out", type=Path, required=True)
    rule = sub.add_parser("decide", help="apply docs/maglev_memory.md's rule to measurement files")
    rule.add_argument("files", nargs="+", type=Path)
    rule.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    # as run: as a module, or as a file against the package PYTHONPATH names (another checkout's)
    runner = "python -m kvm_maglev.benchmarks.prompt_modes" if __spec__ is not None else \
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} python {sys.argv[0]}"
    args.command = runner + " " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.what == "measure":
        result = measure(args)
    else:
        result = {"command": args.command, "files": [str(path) for path in args.files],
                  **decide([json.loads(path.read_text()) for path in args.files])}
        for row in result["failed"]:
            print(f"failed: {row['check']} at {row['k']}x: prefiller {row['prefiller']:.4f}, "
                  f"recurrent {row['recurrent']:.4f}")
        print("default prompt mode:", result["default_mode"], "(missing: " + ", ".join(result["missing"]) + ")"
              if result["missing"] else "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
