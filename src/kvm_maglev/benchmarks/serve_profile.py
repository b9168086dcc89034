"""aten calls in one vLLM decoding step: our models on vLLM (the kvm_maglev plugin) against vLLM's own Llama and
Mistral of the same shape, counted with torch.profiler before anyone optimises the step.

    python -m kvm_maglev.benchmarks.serve_profile --out docs/serve_decode_step_profile.json
    python -m kvm_maglev.benchmarks.serve_profile --enforce-eager --engines kvm maglev llama

Each engine (serve.py's models and shape, `--shape`) runs in its own process, one torch thread, the engine core in
that process: `--requests` requests (the decode-heavy workload's first ones) are added and stepped until every one
has read its prompt and decoded `--warm-steps` tokens, then one engine step - every request decoding one token - is
profiled. Counted under vLLM's "forward" range of that step (the model's forward alone; sampling and scheduling
are the same code for every engine) and in the whole step: every aten event (nested calls included), the outermost
aten calls (what the model's code dispatches) and the leaf calls (no aten call below them); and, in the forward, the
self CPU time of each operator name (the largest), to see where the time goes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from kvm_maglev.benchmarks import serve

ENGINES = ("kvm", "maglev", "llama", "mistral")
FORWARD_RANGE = "gpu_model_runner: forward"  # vLLM's record_function range around the model's forward


def aten_counts(events) -> dict:
    """Counts of aten events among `events` (profiler FunctionEvents): all, outermost (no aten ancestor among them)
    and leaves (no aten child), and the ten most frequent outermost operators."""
    aten = [event for event in events if event.name.startswith("aten::")]
    ids = {id(event) for event in aten}

    def has_aten_ancestor(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if id(parent) in ids:
                return True
            parent = parent.cpu_parent
        return False

    outermost = [event for event in aten if not has_aten_ancestor(event)]
    leaves = [event for event in aten if not any(child.name.startswith("aten::") for child in event.cpu_children)]
    common = collections.Counter(event.name for event in outermost).most_common(10)
    return {"aten_events": len(aten), "outermost_aten_calls": len(outermost), "leaf_aten_calls": len(leaves),
            "most_frequent_outermost": dict(common)}


def self_time_by_name(events, top: int = 15) -> dict[str, float]:
    """Self CPU milliseconds of `events` summed by name (aten operators, the plugin's custom operators and vLLM's
    own), the `top` largest: where a step's time goes, beside how many calls it makes."""
    totals = collections.Counter()
    for event in events:
        totals[event.name] += event.self_cpu_time_total / 1000
    return {name: round(ms, 3) for name, ms in totals.most_common(top)}


def outermost_ranges(events) -> dict[str, float]:
    """Total CPU milliseconds of the step's outermost events (those with no parent) by name: the step's phases."""
    totals = collections.Counter()
    for event in events:
        if event.cpu_parent is None:
            totals[event.name] += event.cpu_time_total / 1000
    return {name: round(ms, 3) for name, ms in totals.most_common(12)}


def descendants(event) -> list:
    found, stack = [], list(event.cpu_children)
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(child.cpu_children)
    return found


def profile_engine(job: dict) -> dict:
    """Start the engine, bring every request to decoding, profile one step; the counts."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model=job["folder"], skip_tokenizer_init=True, seed=0, **job["vllm"])
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    for index, prompt in enumerate(job["prompts"]):
        engine.add_request(str(index), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=job["warm_steps"] + 8, ignore_eos=True))
    for _ in range(job["warm_steps"]):
        engine.step()
    decoding = [request for request in scheduler.running if request.num_computed_tokens >= request.num_prompt_tokens]
    if len(decoding) != len(job["prompts"]) or len(scheduler.running) != len(job["prompts"]):
        raise RuntimeError(f"{job['engine']}: {len(decoding)} of {len(job['prompts'])} requests decoding after "
                           f"{job['warm_steps']} steps (raise --warm-steps)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = list(prof.events())
    forwards = [event for event in events if event.name == FORWARD_RANGE]
    if len(forwards) != 1:
        raise RuntimeError(f"{job['engine']}: {len(forwards)} '{FORWARD_RANGE}' ranges in the step (is "
                           "VLLM_CUSTOM_SCOPES_FOR_PROFILING set?)")
    forward = forwards[0]
    inside = descendants(forward)
    return {"forward": {**aten_counts(inside), "cpu_ms": round(forward.cpu_time_total / 1000, 3),
                        "self_cpu_ms_by_name": self_time_by_name(inside)},
            "step": {**aten_counts(events), "self_cpu_ms_by_name": self_time_by_name(events),
                     "outermost_ranges_cpu_ms": outermost_ranges(events)},
            "requests_decoding": len(decoding),
            "enforce_eager": job["vllm"]["enforce_eager"]}


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--shape", choices=list(serve.SHAPES), default="benchmark")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--warm-steps", type=int, default=6, help="engine steps before the profiled one")
    parser.add_argument("--enforce-eager", action="store_true", help="every engine eager (default: vLLM's default)")
    parser.add_argument("--seed", type=int, default=0)
    serve.add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    """Profile one decoding step of each engine, print the counts and ratios, save the JSON."""
    args = parse_args(argv)
    if args.job is not None:  # one engine, started by the run below
        args.job_out.write_text(json.dumps(profile_engine(json.loads(args.job.read_text()))))
        return None
    command = "python -m kvm_maglev.benchmarks.serve_profile " + shlex.join(sys.argv[1:] if argv is None else argv)
    shape = serve.parse_args(["--shape", args.shape, "--seed", str(args.seed)] +
                             (["--enforce-eager"] if args.enforce_eager else []))
    requests = serve.make_requests(serve.WORKLOADS["decode-heavy"], args.seed, shape.vocab)[:args.requests]
    environment = serve.child_environment(shape) | {"VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            folder = str(serve.make_folder(serve.FOLDER_OF[engine], Path(tmp) / engine, shape))
            job = {"engine": engine, "folder": folder, "vllm": serve.vllm_settings(shape, engine),
                   "prompts": [r.prompt for r in requests], "warm_steps": args.warm_steps}
            job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
            job_file.write_text(json.dumps(job))
            subprocess.run([sys.executable, "-m", "kvm_maglev.benchmarks.serve_profile", "--job", str(job_file),
                            "--job-out", str(out_file)], env=environment, check=True)
            results[engine] = json.loads(out_file.read_text())
            print(f"[{engine}] forward: {results[engine]['forward']}", flush=True)
    ratios = {}
    if "llama" in results:
        base = results["llama"]["forward"]
        for engine in results:
            ratios[f"{engine}/llama"] = {key: round(results[engine]["forward"][key] / base[key], 3)
                                         for key in ("aten_events", "outermost_aten_calls", "leaf_aten_calls")}
    payload = {"command": command, "settings": {"shape": args.shape, "requests": args.requests,
                                                "warm_steps": args.warm_steps, "enforce_eager": args.enforce_eager,
                                                "vllm": serve.vllm_settings(shape)},
               "code": serve.code_version(), "machine": {"cpus": os.cpu_count()}, "results": results,
               "forward_ratios": ratios}
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    for engine, result in results.items():
        forward = result["forward"]
        print(f"{engine}: forward {forward['aten_events']} aten events, {forward['outermost_aten_calls']} outermost, "
              f"{forward['leaf_aten_calls']} leaves, {forward['cpu_ms']} CPU ms; whole step "
              f"{result['step']['aten_events']} aten events")
    print(json.dumps(ratios))
    return payload


if __name__ == "__main__":
    main()
