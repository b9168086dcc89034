"""Tensor-parallel speed-up on vLLM: our models and vLLM's Llama and Mistral at tensor_parallel_size 1 and 2.

Our models are KVM and Maglev (the kvm_maglev.vllm plugin), vLLM's own Llama and Mistral of the same shape; the
workload is one of serve.py's long ones (its models, folders and engine settings): "long" (prompts 2-4k, the
default) or "long-prompt" (8-16k).

    python -m kvm_maglev.benchmarks.serve_tp --requests 8 --repeats 2 --out docs/bench_serve_tp_cpu.json
    python -m kvm_maglev.benchmarks.serve_tp --engines maglev mistral --workload long-prompt --repeats 1

Each (engine, size) runs in its own process, is warmed up, then times the workload `--repeats` times (median wall
time, and the best run's: on a shared machine other jobs' turns on the cores lengthen some runs), and the CPU seconds
of each run in the engine's process and in each rank's process (at size 1 the rank runs in the engine's process; on
a loaded machine CPU seconds show whether a rank's work halved when the wall clock cannot). On CPU every rank
is one thread on its own core (`VLLM_CPU_OMP_THREADS_BIND`), so size 2 uses two cores where size 1 uses one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kvm_maglev.benchmarks import serve

ENGINES = ("kvm", "maglev", "maglev-prefiller", "llama", "mistral")
DEFAULT_ENGINES = ("kvm", "llama")  # what a run without --engines measures (the first runs' pair)


def run_job(job: dict) -> dict:
    """One engine at one tensor-parallel size on the workload, in this process (the engine core here, the ranks in
    vLLM's workers)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["folder"], skip_tokenizer_init=True, seed=job["seed"],
              tensor_parallel_size=job["tp_size"], **job["vllm"])

    def generate(requests: list[serve.Request]) -> None:
        outputs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests],
                               [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                                for r in requests], use_tqdm=False)
        if [len(o.outputs[0].token_ids) for o in outputs] != [r.max_tokens for r in requests]:
            raise RuntimeError(f"{job['engine']}: fewer tokens than asked for")

    generate([serve.Request(**r) for r in job["warmup"]])
    requests = [serve.Request(**r) for r in job["requests"]]
    walls, cpus, rank_cpus = [], [], []
    for _ in range(job["repeats"]):
        start, cpu, ranks = time.perf_counter(), time.process_time(), llm.collective_rpc(rank_cpu_seconds)
        generate(requests)
        walls.append(time.perf_counter() - start)
        cpus.append(round(time.process_time() - cpu, 2))
        rank_cpus.append([round(end - begin, 2) for begin, end in zip(ranks, llm.collective_rpc(rank_cpu_seconds))])
    wall = statistics.median(walls)
    return {"wall_s": round(wall, 3), "best_wall_s": round(min(walls), 3), "walls_s": [round(w, 3) for w in walls],
            "engine_cpu_s": cpus, "rank_cpu_s": rank_cpus,
            **{k: round(v, 2) for k, v in serve.rates(requests, wall).items()},
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def rank_cpu_seconds(worker) -> float:
    """CPU seconds of the process a rank runs in (vLLM's `collective_rpc` calls this in every rank)."""
    return time.process_time()


def child_environment(tp_size: int) -> dict:
    """One torch thread per rank, each rank bound to its own core; the engine core in the launched process; the ranks
    may run this module's `rank_cpu_seconds` (vLLM sends a function to its workers only with this set)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if tp_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in sorted(os.sched_getaffinity(0))[:tp_size])
    return env


def report(command: str, args, shape, requests: list[serve.Request], results: dict) -> dict:
    """The run's JSON: workload, settings, code version, each (engine, size)'s times and the speed-ups over the
    first size (median and best wall time), for the engines measured at every size so far."""
    base = f"tp{args.tp_sizes[0]}"
    speedups = {f"{key}_{engine}": {f"tp{size}/{base}": round(by_size[base][key] / by_size[f"tp{size}"][key], 3)
                                    for size in args.tp_sizes[1:] if f"tp{size}" in by_size}
                for engine, by_size in results.items() if base in by_size for key in ("wall_s", "best_wall_s")}
    return {"command": command, "workload": {**asdict(serve.WORKLOADS[args.workload]), "requests": len(requests),
                                             **serve.workload_tokens(requests)},
            "settings": {"vllm": {engine: serve.vllm_settings(shape, engine) for engine in results},
                         "window": shape.window, "hidden": shape.hidden, "layers": shape.layers,
                         "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab,
                         "repeats": args.repeats, "threads_per_rank": 1},
            "code": serve.code_version(), "machine": {"cpus": os.cpu_count()},
            "results": results, "speedups": speedups}


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(DEFAULT_ENGINES))
    parser.add_argument("--workload", choices=("long", "long-prompt"), default="long")
    parser.add_argument("--tp-sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--requests", type=int, default=None,
                        help="the first N requests of the workload (default: all of them)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    serve.add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    """Run every (engine, size), print the speed-ups and save the JSON."""
    args = parse_args(argv)
    if args.job is not None:  # one engine at one size, started by the run below
        args.job_out.write_text(json.dumps(run_job(json.loads(args.job.read_text()))))
        return None
    command = "python -m kvm_maglev.benchmarks.serve_tp " + shlex.join(sys.argv[1:] if argv is None else argv)
    shape = serve.parse_args(["--seed", str(args.seed)])  # serve.py's models and engine settings
    requests = serve.make_requests(serve.WORKLOADS[args.workload], args.seed, shape.vocab)[:args.requests]
    results: dict[str, dict] = {}
    payload: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            folder = str(serve.make_folder(serve.FOLDER_OF[engine], Path(tmp) / engine, shape))
            results[engine] = {}
            for tp_size in args.tp_sizes:
                job = {"engine": engine, "folder": folder, "seed": args.seed, "tp_size": tp_size,
                       "repeats": args.repeats, "vllm": serve.vllm_settings(shape, engine),
                       "warmup": [asdict(r) for r in serve.warmup_requests(args.seed, shape.vocab)],
                       "requests": [asdict(r) for r in requests]}
                job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
                job_file.write_text(json.dumps(job))
                subprocess.run([sys.executable, "-m", "kvm_maglev.benchmarks.serve_tp", "--job", str(job_file),
                                "--job-out", str(out_file)], env=child_environment(tp_size), check=True)
                results[engine][f"tp{tp_size}"] = json.loads(out_file.read_text())
                print(f"[{engine} tp{tp_size}] {results[engine][f'tp{tp_size}']}", flush=True)
                payload = report(command, args, shape, requests, results)
                if args.out is not None:  # after every engine: a run cut short keeps what it measured
                    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    speedups = payload["speedups"]
    print(json.dumps(speedups))
    return payload


if __name__ == "__main__":
    main()
