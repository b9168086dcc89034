"""Benchmark decode ms/token, prefill time and cache bytes for KVM, Maglev and baselines."""

import argparse
import json
import math
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from .decode import Measurement, measure
from .models import ALL_BUILDERS, MODEL_BUILDERS, SHAPES
from .targets import check_targets, format_checks

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--models", nargs="+", choices=sorted(ALL_BUILDERS), default=list(MODEL_BUILDERS),
                        help="default: all but the grouped-query KVM variants (*_gqa2, *_gqa4; with --shape heads8)")
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--batched-contexts", nargs="+", type=int, default=[1024, 4096, 8192],
                        help="contexts for batch sizes > 1 (full attention at batch 8 and 32k takes most of an hour on 2 cores)")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="run every model's decoding steps through torch.compile (prefill stays eager)")
    parser.add_argument("--direct", action="store_true",
                        help="step our models directly with their caches, outside runtime_speedups(), as a "
                             "server's own loop does (generate() opens the block; without this flag so does the bench)")


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="run")
    except ImportError:  # pragma: no cover - tqdm is optional
        return None


def run_benchmarks(args: argparse.Namespace) -> list[Measurement]:
    shape = SHAPES[args.shape]
    dtype = _DTYPES[args.dtype]
    results: list[Measurement] = []
    runs = [(m, b, c) for m in args.models for b in args.batch_sizes
            for c in [1] + list(args.contexts if b == 1 else args.batched_contexts)]
    bar = _progress(len(runs))
    models: dict[str, torch.nn.Module] = {}
    for name, batch_size, context in runs:
        if name not in models:
            torch.manual_seed(args.seed)
            models = {name: ALL_BUILDERS[name](shape).to(device=args.device, dtype=dtype).eval()}
        if bar is not None:
            bar.set_description(f"{name} b{batch_size} ctx{context}")
        results.append(
            measure(name, models[name], context, batch_size, args.decode_steps, args.prefill_chunk, seed=args.seed,
                    compile_decode=args.compile, direct=args.direct)
        )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results


def _table(results: list[Measurement]) -> str:
    header = (f"{'model':<16} {'batch':>5} {'context':>8} {'prefill s':>10} {'ms/tok med':>10} {'p99':>8} {'max':>8} "
              f"{'max/med':>7} {'cpu max/med':>11} {'tok/s':>8} {'cache MiB':>10} {'closed MiB':>10}")
    lines = [header, "-" * len(header)]
    for r in results:
        closed = "" if r.cache_bytes_closed_form is None else f"{r.cache_bytes_closed_form / 2**20:10.2f}"
        lines.append(
            f"{r.model:<16} {r.batch_size:>5} {r.context:>8} {r.prefill_s:>10.3f} {r.decode_ms_median:>10.2f} "
            f"{r.decode_ms_p99:>8.2f} {r.decode_ms_max:>8.2f} {r.decode_ms_max / r.decode_ms_median:>7.2f} "
            f"{r.cpu_max_over_median or math.nan:>11.2f} "
            f"{r.decode_tokens_per_s:>8.1f} "
            f"{r.cache_bytes / 2**20:>10.2f} {closed:>10}"
        )
    return "\n".join(lines)


def _plot(results: list[Measurement], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [("decode_ms_median", "decode ms/token (median)"), ("prefill_s", "prefill seconds"), ("cache_bytes", "cache MiB")]
    for ax, (field, title) in zip(axes, panels):
        for (model, batch) in sorted({(r.model, r.batch_size) for r in results}):
            rows = sorted((r for r in results if r.model == model and r.batch_size == batch and r.context > 1), key=lambda r: r.context)
            values = [getattr(r, field) / (2**20 if field == "cache_bytes" else 1) for r in rows]
            ax.plot([r.context for r in rows], values, marker="o", label=f"{model} b{batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def runtime_env() -> dict:
    """Thread-runtime and allocator settings of this process (they move step times: OMP_WAIT_POLICY=ACTIVE
    keeps idle OpenMP workers spinning, which removed the rare 12-27 ms stalls of waking them here)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_"))}


def run(args: argparse.Namespace) -> int:
    results = run_benchmarks(args)
    print(_table(results))
    checks = check_targets(results)
    print(format_checks(checks))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "runtime_env": runtime_env()},
        "results": [asdict(r) for r in results],
        "targets": [{**asdict(c), "met": c.met} for c in checks],
    }
    (args.out / "bench.json").write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out / 'bench.json'} and {_plot(results, args.out)}")
    return 0
