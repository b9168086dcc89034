"""Serving benchmark: our models on vLLM (the kvm_maglev.vllm plugin) against vLLM's own Llama and Mistral of the
same shape and against HF `generate()` in static batches, on seeded workloads.

    python -m kvm_maglev.benchmarks.serve --out docs/bench_serve.json
    python -m kvm_maglev.benchmarks.serve --workloads mixed --engines kvm llama --kvm-budget power_law
    python -m kvm_maglev.benchmarks.serve --workloads long-prompt --engines maglev-prefiller maglev llama
    python -m kvm_maglev.benchmarks.serve --shape 120M --workloads decode-heavy chat --requests 8

Workloads (every request submitted at once, fixed output lengths: `ignore_eos`, greedy):
- mixed: 32 requests, prompts log-uniform 16-1024 tokens, outputs 16-96;
- decode-heavy: 32 requests, prompts 16-64, outputs 128-256;
- long: 16 requests, prompts 2048-4096, outputs 32-64;
- long-prompt: 8 requests, prompts 8192-16384, outputs 64-128 (prompt processing dominates);
- chat: 32 requests sharing a 1,024-token system prompt, each with its own part of 16-256 tokens after it,
  outputs 32-128 (what a chat server sees most; vLLM's own models reuse the shared prompt's cache).
Lengths are uniform integers unless said otherwise; token ids uniform over the vocabulary; one seed (`--seed`).
Prefix caching is left at vLLM's default (on) for every engine, its cache emptied before each timed run; the
plugin may turn it off for our models, and the output says which engines ran with it (`--no-prefix-caching`
turns it off for every engine).

Shapes (`--shape`; every model of a run has it, float32, random weights):
- benchmark (the default): hidden 256, 4 layers, 4 query / 2 key-value heads, vocabulary 4096, window 128;
- 120M: the paper's released 120M KVM, `kvmpaper_kvmsqrt16_120M` (hidden 768, 12 layers, 6 heads, vocabulary
  50,304, chunks of 256, a window of 2 chunks = 512 tokens, a power-law state of 16 sqrt(n) slots, at least 256);
  Maglev, Llama and Mistral at the same shape, Maglev's and Mistral's window 512 (KVM's).
`--hidden`, `--layers`, ... override a shape's fields.

Engines:
- kvm, maglev: our models on vLLM (KVM: KVMConfig defaults but the shape, or the `--kvm-budget`; Maglev:
  the shape's sliding window, no prefiller);
- maglev-prefiller: the same Maglev with its prefiller Q kept (Q runs P's blocks with nanochat's default "SSSL"
  windows: L = the training length `--prefiller-sequence-len`, by default max_model_len, so that Q's long layer sees
  every prompt token; S = a quarter of it) and `memory_prefill="prefiller"`: Q reads each prompt in parallel, P
  runs on it in parallel and decodes recurrently; its token budget per step is at least max_model_len (prompts are
  scheduled whole);
- kvm-w8a8, maglev-w8a8: the kvm / maglev folder quantized to compressed-tensors W8A8 (`kvm-maglev quantize`:
  int8 weights per channel, int8 activations per token), served with vLLM's int8 linear layers;
- llama, mistral: vLLM's own LlamaForCausalLM (full attention) and MistralForCausalLM (sliding window 128);
- hf-kvm, hf-maglev: our models' `generate()` in static left-padded batches of 8 requests in submission order, each
  batch run to its longest output (`min_new_tokens = max_new_tokens`); each request counts its own output tokens.
Each engine runs in its own process (one torch thread; vLLM's engine core in that process), is warmed up on a few
short requests, then times every selected workload. Reported: output tokens/s, processed (prompt + output) tokens/s,
wall seconds (and the process's CPU seconds: on a shared machine, wall time includes other jobs' turns).

Memory per request: our models' vLLM state pages at max_model_len (declared per layer, and as allocated: vLLM pads
every layer's page to the largest) against the KV bytes full attention (Llama) holds for a request of max_model_len
tokens, 2 * layers * kv_heads * head_dim * dtype bytes * tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VLLM_ENGINES = ("kvm", "maglev", "maglev-prefiller", "llama", "mistral", "kvm-w8a8", "maglev-w8a8")
STATE_PAGE_ENGINES = ("kvm", "maglev", "maglev-prefiller", "kvm-w8a8", "maglev-w8a8")  # our models on vLLM, whose state pages are measured
HF_ENGINES = ("hf-kvm", "hf-maglev")
ENGINES = VLLM_ENGINES + HF_ENGINES
# what a run without --engines / --workloads measures; the prefiller and its long-prompt workload are asked for by name
DEFAULT_ENGINES = ("kvm", "maglev", "llama", "mistral") + HF_ENGINES
DEFAULT_WORKLOADS = ("mixed", "decode-heavy", "long")
# ratios of output tokens/s (the same as of processed tokens/s: every engine serves the same requests)
RATIOS = (("kvm", "llama"), ("kvm", "mistral"), ("kvm", "hf-kvm"), ("maglev", "mistral"), ("maglev", "llama"),
          ("maglev", "hf-maglev"), ("maglev-prefiller", "maglev"), ("maglev-prefiller", "llama"),
          ("kvm-w8a8", "kvm"), ("maglev-w8a8", "maglev"))
FOLDER_OF = {"kvm": "kvm", "hf-kvm": "kvm", "maglev": "maglev", "hf-maglev": "maglev",
             "maglev-prefiller": "maglev_prefiller", "llama": "llama", "mistral": "mistral",
             "kvm-w8a8": "kvm_w8a8", "maglev-w8a8": "maglev_w8a8"}


@dataclass(frozen=True)
class Workload:
    """`requests` requests, prompt lengths in `prompt` (inclusive; log-uniform or uniform), output lengths uniform
    in `output` (inclusive); with `shared_prefix`, every prompt starts with the same `shared_prefix` tokens (a
    system prompt) and `prompt` bounds each request's own part after it."""

    name: str
    requests: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    prompt_distribution: str = "uniform"  # or "log-uniform"
    shared_prefix: int = 0


WORKLOADS = {
    "mixed": Workload("mixed", 32, (16, 1024), (16, 96), "log-uniform"),
    "decode-heavy": Workload("decode-heavy", 32, (16, 64), (128, 256)),
    "long": Workload("long", 16, (2048, 4096), (32, 64)),
    "long-prompt": Workload("long-prompt", 8, (8192, 16384), (64, 128)),
    "chat": Workload("chat", 32, (16, 256), (32, 128), shared_prefix=1024),
}

# `--shape`: the fields every model of a run shares (`--hidden` etc. override them)
SHAPES = {
    "benchmark": dict(hidden=256, layers=4, heads=4, kv_heads=2, vocab=4096, window=128, kvm_budget="fixed",
                      max_model_len=32768, kv_cache_memory_bytes=1 << 30),
    # the paper's released kvmpaper_kvmsqrt16_120M (KVMConfig's default shape: chunks of 256, a 2-chunk window);
    # Maglev's and Mistral's window = KVM's, 512 tokens. max_model_len 2048 holds every request of the mixed,
    # decode-heavy and chat workloads: KVM's pages are sized for it (16 sqrt(n) slots of 128 + 128 channels, 6 heads,
    # 12 layers), and 3 GiB of pages hold each engine's requests on a small machine
    "120M": dict(hidden=768, layers=12, heads=6, kv_heads=6, vocab=50304, window=512, kvm_budget="sqrt16",
                 max_model_len=2048, kv_cache_memory_bytes=3 << 30),
}
# the paper's sqrt16 models' state: 16 sqrt(n) slots, at least 256, capped far beyond any context
SQRT16_BUDGET = dict(state_budget_mode="power_law", state_budget_factor=16.0, state_budget_exponent=0.5,
                     state_budget_min=256, state_max_chunks=10000)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def draw_length(rng: random.Random, bounds: tuple[int, int], distribution: str) -> int:
    low, high = bounds
    if distribution == "uniform":
        return rng.randint(low, high)
    if distribution == "log-uniform":
        return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))
    raise ValueError(f"unknown length distribution {distribution!r}")


def make_requests(workload: Workload, seed: int, vocab: int) -> list[Request]:
    """The workload's requests in submission order; the same for a given (workload, seed, vocab) on every
    machine (`random.Random` seeded with a string)."""
    rng = random.Random(f"{seed}:{workload.name}")
    shared = [rng.randrange(vocab) for _ in range(workload.shared_prefix)]
    requests = []
    for _ in range(workload.requests):
        length = draw_length(rng, workload.prompt, workload.prompt_distribution)
        output = rng.randint(*workload.output)
        requests.append(Request(shared + [rng.randrange(vocab) for _ in range(length)], output))
    return requests


def warmup_requests(seed: int, vocab: int) -> list[Request]:
    """A few short requests that run each engine's paths (prefill of several lengths, decoding) before timing."""
    rng = random.Random(f"{seed}:warmup")
    return [Request([rng.randrange(vocab) for _ in range(n)], 8) for n in (16, 90, 300, 700)]


def static_batches(requests: list[Request], batch_size: int) -> list[list[Request]]:
    """HF's batches: consecutive requests in submission order."""
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def hf_generated_tokens(requests: list[Request], batch_size: int) -> int:
    """Tokens HF's static batches compute in decoding (each batch runs to its longest output), against which the
    requests' own outputs (`sum(r.max_tokens)`) are what is counted."""
    return sum(len(batch) * max(r.max_tokens for r in batch) for batch in static_batches(requests, batch_size))


def workload_tokens(requests: list[Request]) -> dict[str, int]:
    prompt = sum(len(r.prompt) for r in requests)
    output = sum(r.max_tokens for r in requests)
    return {"prompt_tokens": prompt, "output_tokens": output, "processed_tokens": prompt + output}


def rates(requests: list[Request], seconds: float) -> dict[str, float]:
    tokens = workload_tokens(requests)
    return {"output_tokens_per_s": tokens["output_tokens"] / seconds,
            "processed_tokens_per_s": tokens["processed_tokens"] / seconds}


def full_attention_kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tokens: int) -> int:
    """Keys and values full attention keeps for one request of `tokens` tokens."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes * tokens


def padded_page_bytes(layer_bytes: list[int]) -> int:
    """What vLLM allocates per request when every layer's page is padded to the largest."""
    return max(layer_bytes) * len(layer_bytes)


def power_law_max_chunks(factor: float, exponent: float, chunk: int, max_len: int) -> int:
    """`state_max_chunks` large enough that a power-law budget never hits the cap within `max_len` tokens."""
    return max(1, math.ceil(factor * max_len ** exponent / chunk))


# ---- model folders ---------------------------------------------------------------------------------------------


def shape_kwargs(args) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)


def kvm_config_kwargs(args) -> dict:
    """KVMConfig keywords: the defaults (chunks of 256, a 2-chunk window, a fixed 256-slot state) but the shape, or a
    growing power-law state (`--power-law-*`, or the paper's sqrt16)."""
    kwargs = shape_kwargs(args)
    if args.kvm_budget == "sqrt16":
        kwargs.update(SQRT16_BUDGET)
    elif args.kvm_budget == "power_law":
        kwargs.update(state_budget_mode="power_law", state_budget_factor=args.power_law_factor,
                      state_budget_exponent=args.power_law_exponent,
                      state_max_chunks=power_law_max_chunks(args.power_law_factor, args.power_law_exponent,
                                                            256, args.max_model_len))
    return kwargs


def make_folder(kind: str, folder: Path, args) -> Path:
    """A random-weight folder of one of the benchmark's models (the speed does not depend on the weights' values);
    `<kind>_w8a8`: that model's folder quantized to compressed-tensors W8A8 (`kvm-maglev quantize`)."""
    import torch

    if kind.endswith("_w8a8"):
        from kvm_maglev.convert.quantize import quantize_folder

        base = folder.parent / kind.removesuffix("_w8a8")
        if not base.exists():
            make_folder(kind.removesuffix("_w8a8"), base, args)
        return quantize_folder(base, "W8A8", folder)
    torch.manual_seed(args.seed)
    if kind == "kvm":
        from kvm_maglev import KVMConfig, KVMForCausalLM

        model = KVMForCausalLM(KVMConfig(**kvm_config_kwargs(args)))
    elif kind in ("maglev", "maglev_prefiller"):
        from kvm_maglev import MaglevConfig, MaglevForCausalLM

        prefiller = dict(has_prefiller=False)
        if kind == "maglev_prefiller":
            prefiller = dict(has_prefiller=True, memory_prefill="prefiller",
                             sequence_len=args.prefiller_sequence_len or args.max_model_len)
        model = MaglevForCausalLM(MaglevConfig(**shape_kwargs(args), sliding_window=args.window, **prefiller,
                                               max_position_embeddings=args.max_model_len))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

        common = dict(shape_kwargs(args), intermediate_size=4 * args.hidden,
                      max_position_embeddings=args.max_model_len, tie_word_embeddings=False, dtype="float32")
        if kind == "llama":
            model = LlamaForCausalLM(LlamaConfig(**common))
        else:
            model = MistralForCausalLM(MistralConfig(**common, sliding_window=args.window))
    model.eval().save_pretrained(folder)
    return folder


# ---- one engine, in its own process ----------------------------------------------------------------------------


def state_page_bytes(llm) -> list[int]:
    """Bytes of one request's state page in each layer, as the layers declare them (read from the engine's model:
    the engine core runs in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from math import prod

    from vllm.utils.torch_utils import get_dtype_size

    model = engine_model(llm)
    return [sum(prod(shape) * get_dtype_size(dtype) for shape, dtype in zip(layer.get_state_shape(),
                                                                             layer.get_state_dtype()))
            for layer in model.state_layers]


def engine_model(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model


def allocated_page_bytes(llm) -> int | None:
    """Bytes vLLM's cache manager sets aside per request for a state-page model: the page size of its cache
    groups' spec (every layer's page padded to the largest), summed over the layers."""
    try:
        config = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner \
            .kv_cache_config
        return sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in config.kv_cache_groups)
    except AttributeError:
        return None


def engine_settings(llm) -> dict:
    """The settings the engine runs with, as vLLM resolved them."""
    config = llm.llm_engine.vllm_config
    scheduler, cache = config.scheduler_config, config.cache_config
    return {"max_model_len": config.model_config.max_model_len, "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "chunked_prefill": scheduler.enable_chunked_prefill,
            "prefix_caching": cache.enable_prefix_caching, "block_size": cache.block_size,
            "num_blocks": cache.num_gpu_blocks, "dtype": str(config.model_config.dtype),
            "enforce_eager": config.model_config.enforce_eager}


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (the engine core runs here): compiling one while a
    workload is timed is a recompilation while serving."""
    import torch

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def timed(function) -> tuple[float, float]:
    cpu, start = time.process_time(), time.perf_counter()
    function()
    return time.perf_counter() - start, time.process_time() - cpu


def run_vllm(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    engine = job["engine"]
    if job.get("compile_decode"):
        from kvm_maglev.vllm.kvm import VllmKVMForCausalLM

        VllmKVMForCausalLM.COMPILE_DECODE = True
    llm = LLM(model=job["folder"], skip_tokenizer_init=True, seed=job["seed"], **job["vllm"])

    cached = []  # each generate()'s prompt tokens found in the prefix cache

    def generate(requests: list[Request]):
        outputs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests],
                               [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                                for r in requests], use_tqdm=False)
        produced = [len(o.outputs[0].token_ids) for o in outputs]
        if produced != [r.max_tokens for r in requests]:
            raise RuntimeError(f"{engine}: produced {produced} tokens, asked for {[r.max_tokens for r in requests]}")
        cached.append(sum(o.num_cached_tokens or 0 for o in outputs))

    generate([Request(**r) for r in job["warmup"]])
    # and a request alone: steps of one row, which a model compiled with dynamic shapes compiles apart (a size of 1
    # is a special case), so that no compilation falls in a timed run
    generate([Request(**job["warmup"][0])])
    results = {}
    for name, raw in job["workloads"].items():
        requests = [Request(**r) for r in raw]
        runs, graphs = [], compiled_graphs()
        for _ in range(job["repeats"]):
            llm.reset_prefix_cache()  # each run starts cold: no prompt cached by the warm-up or the run before
            runs.append(timed(lambda: generate(requests)))
        results[name] = summarize(requests, runs)
        results[name]["graphs_compiled_while_serving"] = compiled_graphs() - graphs
        results[name]["cached_prompt_tokens"] = cached[-len(runs):]  # per run
        print(f"[{engine}] {name}: {results[name]['output_tokens_per_s']:.1f} output tok/s, "
              f"{results[name]['wall_s']:.2f} s, {results[name]['graphs_compiled_while_serving']} graphs compiled",
              flush=True)
    report = {"results": results, "engine_settings": engine_settings(llm),
              "graphs_compiled_before_timing": compiled_graphs()}
    if engine in STATE_PAGE_ENGINES:
        layers = state_page_bytes(llm)
        config = llm.llm_engine.model_config.hf_config
        import torch

        from kvm_maglev.cache_sizes import cache_bytes

        report["pages"] = {"declared_per_layer": layers, "declared": sum(layers),
                           "padded_to_largest": padded_page_bytes(layers),
                           "allocated": allocated_page_bytes(llm),
                           "config_cache_bytes": cache_bytes(config, job["vllm"]["max_model_len"],
                                                             dtype=getattr(torch, job["dtype"]))}
    return report


def run_hf(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import kvm_maglev

    kvm_maglev.register_auto_classes()
    model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=getattr(torch, job["dtype"])).eval()
    batch_size = job["hf_batch_size"]

    def generate_batch(batch: list[Request]) -> None:
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new = max(r.max_tokens for r in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        if out.shape[1] != width + new:
            raise RuntimeError(f"{job['engine']}: generated {out.shape[1] - width} tokens, asked for {new}")

    def generate(requests: list[Request]) -> None:
        for batch in static_batches(requests, batch_size):
            generate_batch(batch)

    generate([Request(r["prompt"][:24], 4) for r in job["warmup"][:2]])
    results = {}
    for name, raw in job["workloads"].items():
        requests = [Request(**r) for r in raw]
        runs = [timed(lambda: generate(requests)) for _ in range(job["repeats"])]
        results[name] = summarize(requests, runs)
        results[name]["decoded_tokens"] = hf_generated_tokens(requests, batch_size)
        print(f"[{job['engine']}] {name}: {results[name]['output_tokens_per_s']:.1f} output tok/s, "
              f"{results[name]['wall_s']:.2f} s", flush=True)
    return {"results": results}


def summarize(requests: list[Request], runs: list[tuple[float, float]]) -> dict:
    """The median run's rates by wall time, and by the engine process's CPU time (with one torch thread, its own
    compute: on a shared machine wall time also counts other jobs' turns on the cores); every run's seconds."""
    walls, cpus = [wall for wall, _ in runs], [cpu for _, cpu in runs]
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    by_cpu = rates(requests, cpu)
    return {**{k: round(v, 2) for k, v in rates(requests, wall).items()}, "wall_s": round(wall, 3),
            "output_tokens_per_cpu_s": round(by_cpu["output_tokens_per_s"], 2),
            "processed_tokens_per_cpu_s": round(by_cpu["processed_tokens_per_s"], 2), "cpu_s": round(cpu, 3),
            "walls_s": [round(w, 3) for w in walls], "cpus_s": [round(c, 3) for c in cpus],
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def run_job(job: dict) -> dict:
    """One engine on its workloads, in this process."""
    import torch

    torch.set_num_threads(job["threads"])
    return run_vllm(job) if job["engine"] in VLLM_ENGINES else run_hf(job)


# ---- the whole run ---------------------------------------------------------------------------------------------


def vllm_settings(args, engine: str | None = None) -> dict:
    """Engine keywords every vLLM engine gets: all requests of a workload run at once (max_num_seqs 32, a KV budget
    that holds every request of the largest workload in full for Llama), vLLM's default compilation unless
    `--enforce-eager`, its default prefix caching unless `--no-prefix-caching`, its default token budget per step
    unless `--max-num-batched-tokens` (the prefiller's engine schedules prompts whole: the plugin sets its budget to
    max_model_len, and a budget given here is raised to it)."""
    settings = dict(enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, dtype=args.dtype, gpu_memory_utilization=0.3,
                    kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    if args.max_num_batched_tokens is not None:
        budget = args.max_num_batched_tokens
        settings["max_num_batched_tokens"] = max(budget, args.max_model_len) if engine == "maglev-prefiller" else budget
    if args.no_prefix_caching:
        settings["enable_prefix_caching"] = False
    return settings


def child_environment(args) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)  # vLLM's CPU worker reads it (else it cuts torch to one thread)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the engine's process: its model is read
    return env


def code_version() -> dict:
    """Where the measured package was imported from, its git commit, and whether its model or plugin code differs
    from that commit (a benchmark of uncommitted code says so)."""
    import kvm_maglev

    package = Path(kvm_maglev.__file__).resolve().parent
    version = {"package": str(package)}

    def git(*command: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(package), *command], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    version["commit"] = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--", str(package / "models"), str(package / "vllm"))
    version["models_or_plugin_uncommitted"] = None if changed is None else bool(changed)
    return version


def run_engine(engine: str, job: dict, args, workdir: Path) -> dict:
    if args.in_process:
        os.environ.update(child_environment(args))
        return run_job(job)
    job_file, out_file = workdir / f"{engine}.job.json", workdir / f"{engine}.out.json"
    job_file.write_text(json.dumps(job))
    command = [sys.executable, "-m", "kvm_maglev.benchmarks.serve", "--job", str(job_file), "--job-out",
               str(out_file)]
    subprocess.run(command, env=child_environment(args), check=True)
    return json.loads(out_file.read_text())


def ratio_table(results: dict, key: str = "output_tokens_per_s") -> dict:
    """Per workload, RATIOS of `key` (output tokens per wall or per CPU second) where both sides ran."""
    table = {}
    for workload, engines in results.items():
        table[workload] = {}
        for top, bottom in RATIOS:
            a, b = engines.get(top, {}), engines.get(bottom, {})
            if key in a and key in b:
                table[workload][f"{top}/{bottom}"] = round(a[key] / b[key], 3)
    return table


def print_tables(payload: dict) -> None:
    print(f"\nseed {payload['seed']}; output / processed tokens per wall second (wall seconds; the engine process's CPU "
          "seconds)")
    engines = payload["settings"]["engines"]
    print("| workload | " + " | ".join(engines) + " |")
    print("| --- |" + " --- |" * len(engines))
    for workload, row in payload["results"].items():
        cells = []
        for engine in engines:
            result = row.get(engine)
            if result is None:
                cells.append("-")
            elif "skipped" in result or "error" in result:
                cells.append("skipped" if "skipped" in result else "failed")
            else:
                cells.append(f"{result['output_tokens_per_s']:.0f} / {result['processed_tokens_per_s']:.0f} "
                             f"({result['wall_s']:.1f} s; CPU {result['cpu_s']:.1f} s)")
        print(f"| {workload} | " + " | ".join(cells) + " |")
    for workload, ratios in payload["ratios"].items():
        print(f"{workload} (wall): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        print(f"{workload} (CPU):  " + ", ".join(f"{k} {v:.2f}x" for k, v in payload["ratios_cpu"][workload].items()))
    for engine, report in payload["engines"].items():
        settings = report.get("engine_settings", {})
        if "prefix_caching" in settings:
            asked = "off (--no-prefix-caching)" if payload["settings"]["no_prefix_caching"] else "vLLM's default (on)"
            ran = "on" if settings["prefix_caching"] else "off"
            print(f"{engine}: prefix caching asked {asked}, ran {ran}"
                  + (" (turned off by the plugin)" if ran == "off" and asked.startswith("vLLM") else ""))
    memory = payload["memory"]
    for engine, pages in memory["pages"].items():
        allocated = pages["allocated"] or pages["padded_to_largest"]
        print(f"{engine}: pages {pages['declared']:,} B declared per request (per layer {pages['declared_per_layer']}), "
              f"{allocated:,} B allocated; Llama's KV {memory['llama_kv_bytes']:,} B at {memory['tokens']} tokens "
              f"({allocated / memory['llama_kv_bytes']:.4f}x)")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(DEFAULT_WORKLOADS))
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(DEFAULT_ENGINES))
    parser.add_argument("--shape", choices=list(SHAPES), default="benchmark",
                        help="every model's shape: the benchmark's small one, or the paper's released 120M KVM "
                             "(kvmpaper_kvmsqrt16_120M); the options below override its fields")
    parser.add_argument("--requests", type=int, default=None,
                        help="the first N requests of each workload (default: all of them)")
    parser.add_argument("--kvm-budget", choices=["fixed", "power_law", "sqrt16"], default=None,
                        help="KVM's state: KVMConfig's default fixed 256 slots, a growing power-law state "
                             "(--power-law-*), or the paper's sqrt16 (default: the shape's)")
    parser.add_argument("--power-law-factor", type=float, default=16.0)
    parser.add_argument("--power-law-exponent", type=float, default=0.5)
    parser.add_argument("--skip-hf-long", action="store_true", help="leave the HF engines out of the long workload")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="every vLLM engine eager (default: vLLM's default, the model compiled)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="KVM's decoding steps' functions (vllm/decode_kvm.py) compiled at start-up too "
                             "(VllmKVMForCausalLM.COMPILE_DECODE; default: eager, the forward compiled as vLLM "
                             "compiles it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each workload (the median is reported)")
    parser.add_argument("--hidden", type=int, default=None, help="default: the shape's")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--heads", type=int, default=None, help="default: the shape's")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: the shape's")
    parser.add_argument("--vocab", type=int, default=None, help="default: the shape's")
    parser.add_argument("--window", type=int, default=None, help="Maglev's and Mistral's sliding window (default: the shape's)")
    parser.add_argument("--prefiller-sequence-len", type=int, default=None,
                        help="maglev-prefiller's training length, which sets Q's windows (L = it, S = a quarter); "
                             "default: --max-model-len")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="every vLLM engine's max_model_len; the pages are measured at it (default: the shape's)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="every engine's token budget per step (default: vLLM's, 4096 on CPU for LLM(); "
                             "the plugin's max_model_len for maglev-prefiller, which a value here is raised to)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="prefix caching off for every engine (default: vLLM's default, on)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="default: the shape's")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every engine")
    parser.add_argument("--in-process", action="store_true",
                        help="run the engines in this process (for profilers) rather than one process each")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    for field, value in SHAPES[args.shape].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    return args


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """`--out` (the run's JSON) and the hidden `--job`/`--job-out` a run passes to each engine's own process."""
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job-out", type=Path, help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> dict | None:
    """Run the benchmark, print its tables and save its JSON."""
    args = parse_args(argv)
    if args.job is not None:  # one engine, started by the run below
        args.job_out.write_text(json.dumps(run_job(json.loads(args.job.read_text()))))
        return None
    command = "python -m kvm_maglev.benchmarks.serve " + shlex.join(sys.argv[1:] if argv is None else argv)
    requests = {name: make_requests(WORKLOADS[name], args.seed, args.vocab)[:args.requests]
                for name in args.workloads}
    print(f"seed {args.seed}: " + "; ".join(
        f"{name} {len(r)} requests, {workload_tokens(r)['prompt_tokens']} prompt + "
        f"{workload_tokens(r)['output_tokens']} output tokens" for name, r in requests.items()), flush=True)
    results = {name: {} for name in args.workloads}
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        folders = {}
        for engine in args.engines:
            kind = FOLDER_OF[engine]
            if kind not in folders:
                folders[kind] = str(make_folder(kind, workdir / kind, args))
        for engine in args.engines:
            names = [n for n in args.workloads if not (engine in HF_ENGINES and n == "long" and args.skip_hf_long)]
            for name in set(args.workloads) - set(names):
                results[name][engine] = {"skipped": "--skip-hf-long"}
            job = {"engine": engine, "folder": folders[FOLDER_OF[engine]], "seed": args.seed,
                   "threads": args.threads, "dtype": args.dtype, "repeats": args.repeats,
                   "hf_batch_size": args.hf_batch_size, "vllm": vllm_settings(args, engine),
                   "compile_decode": args.compile_decode,
                   "warmup": [asdict(r) for r in warmup_requests(args.seed, args.vocab)],
                   "workloads": {n: [asdict(r) for r in requests[n]] for n in names}}
            print(f"--- {engine}", flush=True)
            start = time.perf_counter()
            try:
                report = run_engine(engine, job, args, workdir)
            except subprocess.CalledProcessError as error:  # one engine failing leaves the others' numbers
                print(f"--- {engine} failed: {error}", flush=True)
                for name in names:
                    results[name][engine] = {"error": f"exit status {error.returncode}"}
                continue
            report["engine_seconds"] = round(time.perf_counter() - start, 1)
            for name, result in report.pop("results").items():
                results[name][engine] = result
            reports[engine] = report
    head_dim = args.hidden // args.heads
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    llama = full_attention_kv_bytes(args.layers, args.kv_heads, head_dim, dtype_bytes, args.max_model_len)
    memory = {"tokens": args.max_model_len, "llama_kv_bytes": llama,
              "mistral_window_kv_bytes": full_attention_kv_bytes(args.layers, args.kv_heads, head_dim, dtype_bytes,
                                                                 args.window),
              "pages": {engine: report["pages"] for engine, report in reports.items() if "pages" in report}}
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("vllm", "transformers"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - a version is informative only
            versions[package] = None
    settings = {key: getattr(args, key) for key in ("engines", "workloads", "shape", "requests", "kvm_budget",
                                                    "enforce_eager", "compile_decode", "no_prefix_caching", "seed",
                                                    "repeats",
                                                    "hidden", "layers", "heads", "kv_heads", "vocab", "window",
                                                    "dtype", "max_model_len", "hf_batch_size", "threads",
                                                    "prefiller_sequence_len")}
    if args.kvm_budget != "fixed":
        settings["kvm_config"] = {k: v for k, v in kvm_config_kwargs(args).items() if k.startswith("state_")}
    settings["vllm"] = vllm_settings(args)
    payload = {"command": command, "seed": args.seed, "settings": settings, "versions": versions,
               "code": code_version(),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "workloads": {name: {**asdict(WORKLOADS[name]), **workload_tokens(r),
                                    "prompt_lengths": [len(x.prompt) for x in r],
                                    "output_lengths": [x.max_tokens for x in r]} for name, r in requests.items()},
               "results": results, "ratios": ratio_table(results),
               "ratios_cpu": ratio_table(results, "output_tokens_per_cpu_s"), "memory": memory,
               "engines": {engine: {k: v for k, v in report.items() if k != "pages"}
                           for engine, report in reports.items()}}
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print_tables(payload)
    return payload


if __name__ == "__main__":
    main()
