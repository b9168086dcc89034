"""Mean and spread over seeds of the bits-per-byte runs written by train_lm.py, and the language-modelling target.

    python examples/summarize_lm.py results/lm_eval --out docs/recall/lm_summary.json

Target (Maglev memory issue): Maglev's recurrent validation BPB below the sliding-window baseline's by more
than 2 seed standard deviations and by at least 1% relative, per corpus.
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

BASELINE = "swa_baseline"


def load(folders: List[Path]) -> Dict[tuple, Dict[int, dict]]:
    """(corpus, arm) -> {seed: that run's result row}."""
    runs: Dict[tuple, Dict[int, dict]] = defaultdict(dict)
    for folder in folders:
        for path in sorted(folder.rglob("lm.json")):
            run = json.loads(path.read_text())
            seed = int(run["settings"]["seed"])
            for arm, row in run["models"].items():
                runs[(run["corpus"], arm)][seed] = row
    return runs


def spread(values: List[float]) -> Dict[str, float]:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(runs: Dict[tuple, Dict[int, dict]]) -> List[dict]:
    summary = []
    for (corpus, arm), per_seed in sorted(runs.items()):
        entry = {"corpus": corpus, "arm": arm, "seeds": sorted(per_seed)}
        for mode in ("recurrent", "prefiller"):
            rows = [row[mode] for row in per_seed.values() if mode in row]
            if rows:
                entry[mode] = {part: spread([row[part] for row in rows]) for part in rows[0]}
        baseline = runs.get((corpus, BASELINE))
        if arm.startswith("maglev") and baseline:
            seeds = sorted(set(per_seed) & set(baseline))
            ours = [per_seed[s]["recurrent"]["all"] for s in seeds]
            theirs = [baseline[s]["recurrent"]["all"] for s in seeds]
            gap = statistics.mean(theirs) - statistics.mean(ours)
            noise = max(spread(ours)["std"], spread(theirs)["std"])
            entry["vs_baseline"] = {
                "seeds": seeds, "bpb_gap": gap, "relative": gap / statistics.mean(theirs),
                "target_met": len(seeds) > 1 and gap > 2 * noise and gap >= 0.01 * statistics.mean(theirs),
            }
        summary.append(entry)
    return summary


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    summary = summarize(load(args.folders))
    for entry in summary:
        rec = entry["recurrent"]
        line = (f"{entry['corpus']} {entry['arm']:<20} seeds {entry['seeds']}  BPB {rec['all']['mean']:.4f}"
                f" ±{rec['all']['std']:.4f}  first window {rec['first_window']['mean']:.4f}"
                f"  past {rec['past_window']['mean']:.4f}")
        if "prefiller" in entry:
            line += f"  prefiller-fed {entry['prefiller']['all']['mean']:.4f}"
        if "vs_baseline" in entry:
            vs = entry["vs_baseline"]
            line += f"  vs baseline {-100 * vs['relative']:+.2f}% ({'met' if vs['target_met'] else 'MISS'})"
        print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "python examples/summarize_lm.py "
                                        + " ".join(map(str, args.folders)), "groups": summary}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
