"""Medians over seeds of the recall runs written by train_recall.py, and the memory targets they meet.

    python examples/summarize_recall.py results/recall_eval --out docs/recall/summary.json
    python examples/summarize_recall.py docs/recall/runs/capacity_s*.json --plot docs --out docs/recall/capacity_summary.json

Reads every ``recall.json`` below the given folders (or the run files given), groups the models by (facts, model),
and reports per group the median over seeds of recall per distance (P's own memory and prefiller-fed) with the
seeds used, the mean recall past the window, and the targets of the Maglev memory issue checked on the medians and
on each seed alone (``per_seed_targets``: what docs/maglev_memory.md's rule for the shipped recipe asks).
Runs of the capacity task (``--task capacity``) are summarized apart: per model the mean, minimum and maximum
over seeds (and the median) of recall per evaluation length and per (length, facts), and the cache bytes per
length (``--plot``: ``capacity.png``, medians over seeds).
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def run_files(paths: list[Path]) -> list[Path]:
    """Every ``recall.json`` below the folders given, and the files given."""
    return [found for path in paths for found in ([path] if path.is_file() else sorted(path.rglob("recall.json")))]


def is_capacity_run(run: dict) -> bool:
    return "num_queries" in run["task"]


def load_runs(folders: list[Path], aliases: dict[str, str]) -> dict[tuple, list[dict]]:
    """(facts, model) -> the per-seed result rows (each with its seed); a model trained with another init than
    PyTorch's defaults is its own group. Capacity runs are left to `summarize_capacity`."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for path in run_files(folders):
        run = json.loads(path.read_text())
        if is_capacity_run(run):
            continue
        facts, seed = run["task"]["num_facts"], int(run["settings"]["seed"])
        init = run["settings"].get("weight_init", "torch")
        for name, row in run["models"].items():
            name = aliases.get(name, name)
            label = name if init == "torch" else f"{name} ({init} init)"
            groups[(facts, label)].append({**row, "seed": seed, "file": str(path)})
    return groups


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def summarize_capacity(paths: list[Path]) -> list[dict]:
    """Per model of the capacity runs (grouped by the run's settings but the seed and output): seeds, recall by
    length and by (length, facts) as mean / median / min / max over seeds, per-seed recall by length, cache bytes
    per length (the same on every seed) and, for KVM, the state slots. A group trained for other steps than most
    runs is labelled with its steps, so an extra arm never mixes with the equal-steps comparison."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for path in run_files(paths):
        run = json.loads(path.read_text())
        if not is_capacity_run(run):
            continue
        settings = {k: v for k, v in run["settings"].items() if k not in ("seed", "out", "models", "progress",
                                                                           "threads", "eval_seed")}
        for name, row in run["models"].items():
            key = (name, json.dumps(settings, sort_keys=True))
            groups[key].append({**row, "seed": int(run["settings"]["seed"]), "file": str(path),
                                "train_length": run["task"]["seq_len"], "settings": settings})
    usual_steps = statistics.mode([row["settings"].get("steps") for rows in groups.values() for row in rows] or [None])
    summary = []
    for (name, _), rows in sorted(groups.items()):
        steps = rows[0]["settings"].get("steps")
        lengths = list(rows[0]["recall_by_length"])
        entry = {
            "model": name, "label": name if steps == usual_steps else f"{name} ({steps} steps)",
            "seeds": sorted(row["seed"] for row in rows), "train_length": rows[0]["train_length"],
            "chance": rows[0]["chance"], "window": rows[0]["window"], "settings": rows[0]["settings"],
            "recall_by_length": {n: _spread([row["recall_by_length"][n] for row in rows]) for n in lengths},
            "recall": {n: {f: _spread([row["recall"][n][f] for row in rows]) for f in rows[0]["recall"][n]}
                       for n in lengths},
            "per_seed_recall_by_length": {str(row["seed"]): row["recall_by_length"] for row in rows},
            "cache_bytes": rows[0]["cache_bytes"],
        }
        if "state_slots" in rows[0]:
            entry["state_slots"] = rows[0]["state_slots"]
        summary.append(entry)
    return summary


def median_curve(rows: list[dict], key: str) -> dict[str, float] | None:
    curves = [row[key] for row in rows if key in row]
    if not curves:
        return None
    return {d: statistics.median(curve[d] for curve in curves) for d in curves[0]}


def past_window(curve: dict[str, float], window: int) -> dict[str, float]:
    return {d: r for d, r in curve.items() if int(d) > window}


def check_targets(facts: int, own: dict[str, float], fed: dict[str, float] | None, window: int) -> dict[str, bool]:
    """The issue's targets for P's own memory, on median recall."""
    inside = [r for d, r in own.items() if int(d) <= window]
    beyond = past_window(own, window)
    checks: dict[str, bool] = {}
    if facts == 1:
        checks["1 fact: >= 95% at every distance up to 8x the window"] = min(own.values()) >= 0.95
    elif facts == 2:
        near = [r for d, r in beyond.items() if int(d) <= 4 * window]
        checks["2 facts: >= 50% mean at 2x-4x the window"] = statistics.mean(near) >= 0.5
        checks["2 facts: >= 20% at 8x the window"] = own[str(8 * window)] >= 0.2
        checks["2 facts: >= 95% in the window"] = min(inside) >= 0.95
    elif facts == 4:
        checks["4 facts: >= 12% mean past the window"] = statistics.mean(beyond.values()) >= 0.12
        checks["4 facts: >= 85% in the window"] = min(inside) >= 0.85
    if fed is not None:
        checks["own memory >= 0.8x prefiller-fed at every distance past the window"] = all(
            own[d] >= 0.8 * fed[d] for d in past_window(fed, window))
    return checks


def summarize(groups: dict[tuple, list[dict]]) -> list[dict]:
    summary = []
    for (facts, name), rows in sorted(groups.items()):
        window = rows[0]["window"]
        own, fed = median_curve(rows, "recurrent"), median_curve(rows, "prefiller")
        entry = {"facts": facts, "model": name, "seeds": sorted(row["seed"] for row in rows), "window": window,
                 "chance": rows[0]["chance"], "recurrent_median": own, "prefiller_median": fed,
                 "recurrent_past_window_mean": statistics.mean(past_window(own, window).values()),
                 "per_seed_recurrent": {str(row["seed"]): row["recurrent"] for row in rows}}
        if name.startswith("maglev"):
            entry["targets"] = check_targets(facts, own, fed, window)
            entry["per_seed_targets"] = {str(row["seed"]): check_targets(facts, row["recurrent"], row.get("prefiller"),
                                                                         window) for row in rows}
            drift = median_curve(rows, "drift")
            if drift is not None:
                entry["drift_median"] = drift
        summary.append(entry)
    return summary


def plot_medians(summary: list[dict], folder: Path) -> None:
    """recall_facts<N>.png: median recall per distance of every model (Maglev also prefiller-fed)."""
    from kvm_maglev.recall import plot_recall

    folder.mkdir(parents=True, exist_ok=True)
    for facts in sorted({entry["facts"] for entry in summary}):
        curves = {}
        for entry in (e for e in summary if e["facts"] == facts):
            curves[entry["model"]] = {int(d): r for d, r in entry["recurrent_median"].items()}
            if entry["prefiller_median"] is not None:
                curves[f"{entry['model']} (prefiller-fed)"] = {int(d): r for d, r in entry["prefiller_median"].items()}
        first = next(e for e in summary if e["facts"] == facts)
        plot_recall(curves, first["chance"], first["window"], folder / f"recall_facts{facts}.png")


def main(argv: list[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="folder for one PNG of median recall per fact count")
    parser.add_argument("--alias", action="append", default=[], metavar="NAME=AS",
                        help="count model NAME as AS (e.g. maglev=maglev_self_feed2_then_recurrent_late: `maglev` is the shipped recipe)")
    args = parser.parse_args(argv)
    aliases = dict(alias.split("=", 1) for alias in args.alias)
    capacity = summarize_capacity(args.folders)
    for entry in capacity:
        cells = " ".join(f"{n}:{100 * r['median']:4.0f}" for n, r in entry["recall_by_length"].items())
        print(f"capacity {entry['label']:<16} seeds {entry['seeds']}  recall by length (median) {cells}")
        for n, row in entry["recall"].items():
            print(f"    length {n:>6}: " + "  ".join(f"{f} facts {100 * r['median']:4.0f}% ({100 * r['min']:.0f}-"
                                                    f"{100 * r['max']:.0f})" for f, r in row.items())
                  + f"  cache {entry['cache_bytes'][n]} B")
    summary = summarize(load_runs(args.folders, aliases))
    for entry in summary:
        cells = " ".join(f"{d}:{100 * r:4.0f}" for d, r in entry["recurrent_median"].items())
        fed = entry["prefiller_median"]
        fed_cells = "" if fed is None else "  fed " + " ".join(f"{100 * r:4.0f}" for r in fed.values())
        print(f"facts {entry['facts']} {entry['model']:<28} seeds {entry['seeds']}  {cells}{fed_cells}")
        for target, met in entry.get("targets", {}).items():
            missed = [seed for seed, checks in entry["per_seed_targets"].items() if not checks[target]]
            print(f"    {'met ' if met else 'MISS'} {target}"
                  + (f"  (missed on seeds {', '.join(missed)})" if missed else "  (met on every seed)"))
    if args.plot is not None:
        plot_medians(summary, args.plot)
        if capacity:
            from kvm_maglev.capacity import plot_capacity

            args.plot.mkdir(parents=True, exist_ok=True)
            # the median, not the mean: a seed that never leaves the loss plateau scores chance and would drag a
            # mean of three halfway there
            medians = {e["label"]: {n: {f: r["median"] for f, r in row.items()} for n, row in e["recall"].items()}
                       for e in capacity}
            plot_capacity(medians, capacity[0]["chance"], capacity[0]["train_length"], args.plot / "capacity.png")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        found = {"groups": summary} if summary else {}
        found.update({"capacity": capacity} if capacity else {})
        args.out.write_text(json.dumps({"command": "python examples/summarize_recall.py "
                                        + " ".join(map(str, args.folders)), **found}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
