"""One command to check and time our models on a GPU, writing JSON.

    python -m kvm_maglev.benchmarks.gpu_check --out gpu_check.json

On the device (CUDA by default) it checks, for KVM (fixed and power-law sqrt state) and Maglev with random
trained-like weights (`long_run.randomize`) on a small shape whose sequences cross many chunk boundaries:
- float32 logits equal the CPU's: max |device - CPU| at most 1e-4 of the CPU logits' standard deviation;
- bfloat16 logits on the device stay within long_run's bfloat16 bounds of the CPU's float32 ones;
- greedy cached generation (generate(), and a loop stepping the model itself) reads the tokens and the
  logits of one uncached forward over the generated sequence;
- no decoding step synchronises host and device (`torch.cuda.set_sync_debug_mode("error")` around each
  step of a decode that crosses chunk boundaries, so the folds computed ahead and swapped in are among them);
then times prefill, decoding and a training step (forward + backward) at a 1B-class shape (`SHAPES["1b"]`)
for our models and transformers' Llama (full attention) and Mistral (sliding window), both with sdpa.
`--device cpu --tiny` runs the same code on the CPU at the tiny shape (the sync check needs CUDA and is
skipped), which the tests do. Exit status: 0 when every check passed, 1 when one failed, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from ..models.common.transformers_versions import CACHE_NAME, returned_cache
from .decode import measure
from .long_run import TOLERANCES, compare, randomize
from .models import MODEL_BUILDERS, SHAPES, Shape

CHECKED_MODELS = ("kvm_fixed", "kvm_sqrt16", "maglev")
TIMED_MODELS = ("kvm_fixed", "kvm_sqrt16", "maglev", "llama_full", "mistral_swa")
# Parity shape: small enough for the CPU reference, chunks short enough that its sequences cross many
# boundaries and the sqrt state grows past its minimum.
CHECK_SHAPE = Shape(num_layers=4, hidden_size=256, num_heads=4, vocab_size=4096, chunk_len=64, window_chunks=2)
FLOAT32_RELATIVE_BOUND = 1e-4  # max |device - CPU| over the CPU logits' standard deviation
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a run of the logic only)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and lengths: a quick run of every step")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="dtype of the timed models (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens before timed decoding (default 8192)")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed decoding steps (default 64)")
    parser.add_argument("--train-tokens", type=int, default=None, help="tokens of the timed training step (default 2048)")
    parser.add_argument("--check-models", nargs="+", choices=CHECKED_MODELS, default=list(CHECKED_MODELS))
    parser.add_argument("--models", nargs="+", choices=TIMED_MODELS, default=list(TIMED_MODELS),
                        help="models to time")
    parser.add_argument("--skip-timing", action="store_true", help="run the checks only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.context = args.context or (70 if tiny else 8192)
    args.decode_steps = args.decode_steps or (4 if tiny else 64)
    args.train_tokens = args.train_tokens or (64 if tiny else 2048)
    return args


def check_result(name: str, model: str, passed: bool, **detail) -> dict:
    return {"check": name, "model": model, "passed": bool(passed), **detail}


def build(name: str, shape: Shape, seed: int) -> torch.nn.Module:
    """`name` at `shape` with random trained-like weights, in float32 on the CPU, in eval mode."""
    torch.manual_seed(seed)
    return randomize(MODEL_BUILDERS[name](shape), seed).eval()


def float32_check(title: str, name: str, value: torch.Tensor, reference: torch.Tensor, **detail) -> dict:
    """Passed when max |value - reference| is at most FLOAT32_RELATIVE_BOUND of the reference's std."""
    error = float((value.float() - reference).abs().max())
    relative = error / float(reference.std())
    return check_result(title, name, relative <= FLOAT32_RELATIVE_BOUND and detail.get("tokens_equal", True),
                        max_abs_error=error, max_relative_error=relative, bound=FLOAT32_RELATIVE_BOUND, **detail)


@torch.no_grad()
def parity_checks(name: str, reference: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> list[dict]:
    """The uncached forward on `device` in float32 and bfloat16 against the CPU's float32 forward."""
    cpu_logits = reference(ids, use_cache=False).logits[0]
    results = []
    model = copy.deepcopy(reference).to(device)
    logits = model(ids.to(device), use_cache=False).logits[0].cpu()
    results.append(float32_check("float32 logits equal the CPU's", name, logits, cpu_logits, positions=ids.shape[1]))
    model = model.to(torch.bfloat16)
    low = model(ids.to(device), use_cache=False).logits[0].float().cpu()
    drift = compare(low, cpu_logits, TOLERANCES["bfloat16"])
    results.append(check_result("bfloat16 logits within long_run's bfloat16 bounds of CPU float32", name,
                                drift.pop("passed"), bounds=TOLERANCES["bfloat16"], **drift))
    return results


@torch.no_grad()
def cached_checks(name: str, model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[dict]:
    """Greedy generate() and a loop of one's own on the cache against one uncached forward (float32)."""
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    sequence = out.sequences
    full = model(sequence, use_cache=False).logits[:, prompt.shape[1] - 1 : -1]
    generated = torch.stack(out.logits, dim=1)
    tokens_equal = torch.equal(full.argmax(-1), sequence[:, prompt.shape[1]:])
    stepped = step_directly(model, sequence, prompt.shape[1])
    return [float32_check("generate() on the cache equals the uncached forward", name, generated, full,
                          tokens_equal=tokens_equal, new_tokens=new_tokens),
            float32_check("stepping the model on its cache equals the uncached forward", name, stepped, full)]


def step_directly(model: torch.nn.Module, sequence: torch.Tensor, prompt: int,
                  around_step=contextlib.nullcontext) -> torch.Tensor:
    """Logits of positions prompt-1 .. end-1 of `sequence`: the prompt in one forward, then one token a
    step on the cache, as a server's loop does; each step runs inside `around_step()`."""
    output = model(sequence[:, :prompt], use_cache=True)
    cache, logits = returned_cache(output), [output.logits[:, -1:]]
    for position in range(prompt, sequence.shape[1] - 1):
        with around_step():
            output = model(sequence[:, position : position + 1], use_cache=True, **{CACHE_NAME: cache})
        cache = returned_cache(output)
        logits.append(output.logits)
    return torch.cat(logits, dim=1)


@torch.no_grad()
def sync_check(name: str, model: torch.nn.Module, prompt: torch.Tensor, steps: int, device: torch.device,
               speedups: bool) -> dict:
    """No decoding step synchronises host and device: each runs under sync debug mode "error" (CUDA only),
    the model stepped directly or inside its `runtime_speedups()` as generate() steps it."""
    title = f"no host-device sync inside a decoding step ({'inside runtime_speedups' if speedups else 'direct'})"
    if device.type != "cuda":
        return check_result(title, name, True, skipped="needs CUDA")
    sequence = torch.cat([prompt, torch.randint(1, model.config.vocab_size, (1, steps + 1),
                                                generator=torch.Generator().manual_seed(1))], dim=1).to(device)

    @contextlib.contextmanager
    def no_sync():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    try:
        with model.runtime_speedups() if speedups else contextlib.nullcontext():
            step_directly(model, sequence, prompt.shape[1], around_step=no_sync)
    except RuntimeError as error:
        return check_result(title, name, False, error=str(error)[:500])
    return check_result(title, name, True, steps=steps)


def run_checks(args: argparse.Namespace, device: torch.device) -> list[dict]:
    shape = SHAPES["tiny"] if args.tiny else CHECK_SHAPE
    length = shape.chunk_len * (12 if args.tiny else 16)  # past the window and many folds
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, shape.vocab_size, (1, length), generator=generator)
    prompt = ids[:, : length - 2 * shape.chunk_len]
    results = []
    for name in args.check_models:
        reference = build(name, shape, args.seed)
        results += parity_checks(name, reference, ids, device)
        model = copy.deepcopy(reference).to(device)
        results += cached_checks(name, model, prompt.to(device), 2 * shape.chunk_len + 1)
        results += [sync_check(name, model, prompt, 2 * shape.chunk_len + 1, device, speedups)
                    for speedups in (False, True)]
        del model, reference
    return results


def time_training_step(model: torch.nn.Module, tokens: int, vocab: int, device: torch.device, repeats: int) -> float:
    """Median seconds of forward + backward on one row of `tokens` tokens (after one untimed step)."""
    model.train()
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for step in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        model(ids, labels=ids, use_cache=False).loss.backward()
        synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    model.eval()
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_timings(args: argparse.Namespace, device: torch.device) -> list[dict]:
    shape = SHAPES["tiny"] if args.tiny else SHAPES["1b"]
    dtype = _DTYPES[args.dtype]
    rows = []
    for name in args.models:
        torch.manual_seed(args.seed)
        model = MODEL_BUILDERS[name](shape).to(device=device, dtype=dtype).eval()
        parameters = sum(p.numel() for p in model.parameters())
        row = measure(name, model, args.context, 1, args.decode_steps, prefill_chunk=args.context, seed=args.seed)
        train_s = time_training_step(model, args.train_tokens, shape.vocab_size, device, repeats=3)
        timing = {k: v for k, v in asdict(row).items() if k not in ("step_ms", "step_steal_ms")}
        rows.append({**timing, "parameters": parameters, "dtype": args.dtype, "train_tokens": args.train_tokens,
                     "train_step_s": train_s, "train_tokens_per_s": args.train_tokens / train_s})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def relative_to_baselines(rows: list[dict]) -> list[dict]:
    """Each of our models' times over Llama's and Mistral's (below 1: faster)."""
    by_name = {r["model"]: r for r in rows}
    ratios = []
    for ours in ("kvm_fixed", "kvm_sqrt16", "maglev"):
        for baseline in ("llama_full", "mistral_swa"):
            if ours in by_name and baseline in by_name:
                a, b = by_name[ours], by_name[baseline]
                ratios.append({"model": ours, "baseline": baseline,
                               "decode": a["decode_ms_median"] / b["decode_ms_median"],
                               "prefill": a["prefill_s"] / b["prefill_s"],
                               "train_step": a["train_step_s"] / b["train_step_s"]})
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here (torch.cuda.is_available() is False); run it on a machine "
              "with an NVIDIA GPU, or `--device cpu --tiny` to run its logic on the CPU.", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means float32 products
    torch.backends.cudnn.allow_tf32 = False
    checks = run_checks(args, device)
    for c in checks:
        print(f"{'pass' if c['passed'] else 'FAIL'}  {c['model']:<11} {c['check']}"
              + (f"  ({c['skipped']})" if "skipped" in c else ""))
    timings = [] if args.skip_timing else run_timings(args, device)
    for r in timings:
        print(f"{r['model']:<12} prefill {r['context']} tok {r['prefill_s']:.3f} s  decode {r['decode_ms_median']:.2f} "
              f"ms/tok (max {r['decode_ms_max']:.2f})  train step {r['train_tokens']} tok {r['train_step_s']:.3f} s")
    payload = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "device": str(device),
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "checks": checks,
        "timings": timings,
        "ratios": relative_to_baselines(timings),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    failed = [c for c in checks if not c["passed"]]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
