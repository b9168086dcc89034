"""Long generation runs in low precision (bfloat16, float16) for KVM and Maglev.

For each model and dtype: a short prompt, then `--tokens` tokens sampled one step at a time on the cache,
checking that
- every module's output and the logits stay finite (the first non-finite module and step are reported),
- the cache holds exactly what the config predicts (`cache_sizes.cache_bytes`) at checkpoints and at the end,
- the low-precision logits over the first `--compare-tokens` tokens match float32 teacher-forced logits of
  the same weights on the same tokens within TOLERANCES (documented in the README's "Reliability").

Weights are random but scaled like trained ones (every projection ~ fan_in ** -0.5, every gate, lambda and
norm perturbed), so every code path carries signal; a run checks the numerics of the code (long states,
merges, softmax over a growing state, the Maglev recurrence), not a trained model's outlier channels.

    python -m kvm_maglev.benchmarks.long_run --shape tiny --tokens 4096 --out results/long_run.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections import deque
from pathlib import Path

import torch

from kvm_maglev.cache_sizes import cache_bytes

from ..models.common.transformers_versions import returned_cache
from .models import MODEL_BUILDERS, SHAPES

MODELS = ("kvm_fixed", "kvm_sqrt16", "maglev")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Largest allowed |low precision - float32| over the compared logits, as a fraction of the float32 logits'
# standard deviation, and the smallest share of positions whose top-1 token agrees. bfloat16 keeps 8 bits of
# mantissa, float16 11: the bounds leave about 3x headroom over what the tiny shape shows.
TOLERANCES = {
    "bfloat16": {"max_relative_error": 0.25, "min_top1_agreement": 0.90},
    "float16": {"max_relative_error": 0.05, "min_top1_agreement": 0.97},
}


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Trained-like random weights: matrices ~ N(0, 1/fan_in) (embeddings N(0, 1)), vectors and scalars
    perturbed around their initial values, so no path starts at zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim >= 2:
                std = 1.0 if "embed" in name else param.shape[-1] ** -0.5
                param.copy_(noise * std)
            else:
                param.add_(0.1 * noise)
    return model


class NonFiniteWatch:
    """Forward hooks on every module recording the first (step, module) whose output is not finite."""

    def __init__(self, model: torch.nn.Module):
        self.step = 0
        self.first: dict | None = None
        self.handles = [module.register_forward_hook(self._check(name))
                        for name, module in model.named_modules() if name]

    def _check(self, name: str):
        def hook(module, args, output):
            if self.first is not None:
                return
            tensor = output if isinstance(output, torch.Tensor) else None
            for field in ("logits", "last_hidden_state"):
                tensor = getattr(output, field, None) if tensor is None else tensor
            if isinstance(output, tuple) and tensor is None:
                tensor = next((t for t in output if isinstance(t, torch.Tensor)), None)
            if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
                self.first = {"step": self.step, "module": name, "type": type(module).__name__,
                              "input_max_abs": max((float(a.abs().max()) for a in inputs), default=None)}
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def cache_max_abs(cache) -> float:
    """Largest magnitude held by the cache (e.g. KVM's merged value sums), to see how close float16's
    65504 is."""
    tensors = [t for layer in cache.layers for t in layer.tensors.values()]
    tensors += [t for t in (getattr(cache, "last_memory", None),) if t is not None]
    return max((float(t.float().abs().max()) for t in tensors if t.numel() and t.is_floating_point()), default=0.0)


def compare(low: torch.Tensor, high: torch.Tensor, tolerance: dict) -> dict:
    """Largest |low - high| (absolute, and relative to float32's logit std) and top-1 agreement."""
    rows = torch.isfinite(low).all(dim=-1)
    low, high = low[rows], high[rows]
    if not low.numel():
        return {"positions": 0, "max_abs_error": None, "max_relative_error": math.inf, "top1_agreement": 0.0,
                "passed": False}
    error = (low - high).abs()
    relative = float(error.max() / high.std())
    agreement = float((low.argmax(-1) == high.argmax(-1)).float().mean())
    return {"positions": int(rows.sum()), "max_abs_error": float(error.max()), "mean_abs_error": float(error.mean()),
            "float32_logit_std": float(high.std()), "max_relative_error": relative, "top1_agreement": agreement,
            "passed": relative <= tolerance["max_relative_error"] and agreement >= tolerance["min_top1_agreement"]}


def float32_logits(reference: torch.nn.Module, sequence: torch.Tensor, last: int, piece: int = 1024) -> torch.Tensor:
    """float32 logits of the last `last` positions of `sequence`, read on the cache in pieces."""
    cache, kept = None, []
    for start in range(0, sequence.shape[1], piece):
        output = reference(sequence[:, start:start + piece], past_key_values=cache, use_cache=True)
        cache = returned_cache(output)
        if start + piece > sequence.shape[1] - last:
            kept.append(output.logits[0].float())
    return torch.cat(kept, dim=0)[-last:]


@torch.no_grad()
def long_run(reference: torch.nn.Module, dtype_name: str, tokens: int, prompt_tokens: int, compare_tokens: int,
             checkpoint_every: int, seed: int, device: str) -> dict:
    """One model in one dtype: sample `tokens` tokens on the cache, check finiteness and sizes, compare the
    logits of the first and of the last `compare_tokens` positions with float32 on the same tokens."""
    dtype = DTYPES[dtype_name]
    model = copy.deepcopy(reference).to(dtype)
    config = model.config
    generator = torch.Generator(device="cpu").manual_seed(seed)
    sequence = torch.randint(0, config.vocab_size, (1, prompt_tokens), generator=generator)
    read_tokens = sequence[0].tolist()
    watch = NonFiniteWatch(model)
    started = time.perf_counter()
    output = model(sequence.to(device), use_cache=True)
    cache = returned_cache(output)
    logits = output.logits[:, -1].float()
    kept = [output.logits[0].float()]
    recent = deque(output.logits[0].float(), maxlen=compare_tokens)
    size_errors, checkpoints, logit_max_abs = [], [], float(output.logits.float().abs().max())
    while len(read_tokens) < tokens and watch.first is None and bool(torch.isfinite(logits).all()):
        token = torch.multinomial(torch.softmax(logits.cpu(), dim=-1), 1, generator=generator)
        watch.step = len(read_tokens)
        read_tokens.append(int(token))
        output = model(token.to(device), past_key_values=cache, use_cache=True)
        logits = output.logits[:, -1].float()
        logit_max_abs = max(logit_max_abs, float(logits.abs().max()))
        read = len(read_tokens)
        if read <= compare_tokens:
            kept.append(logits)
        recent.append(logits[0])
        if read % checkpoint_every == 0 or read == tokens:
            expected = cache_bytes(config, read, batch_size=1, dtype=dtype)
            checkpoints.append({"tokens": read, "nbytes": cache.nbytes(), "expected": expected})
            if cache.nbytes() != expected:
                size_errors.append(checkpoints[-1])
    seconds = time.perf_counter() - started
    watch.close()
    read = len(read_tokens)
    finite = watch.first is None and bool(torch.isfinite(logits).all())

    tolerance = TOLERANCES[dtype_name]
    sequence = torch.tensor([read_tokens], device=device)
    first = min(compare_tokens, read)
    first_span = compare(torch.cat(kept, dim=0)[:first],
                         reference(sequence[:, :first], use_cache=False).logits[0].float(), tolerance)
    recent = torch.stack(list(recent))
    last_span = compare(recent, float32_logits(reference, sequence, recent.shape[0]), tolerance)
    return {
        "dtype": dtype_name, "tokens": read, "finite": finite, "first_non_finite": watch.first,
        "logit_max_abs": logit_max_abs, "cache_max_abs": cache_max_abs(cache),
        "cache_nbytes": cache.nbytes(), "cache_bytes_expected": cache_bytes(config, read, 1, dtype=dtype),
        "size_errors": size_errors, "checkpoints": checkpoints, "tolerance": tolerance,
        "first_tokens_vs_float32": first_span, "last_tokens_vs_float32": last_span,
        "tokens_per_second": (read - prompt_tokens) / seconds,
        "passed": finite and not size_errors and first_span["passed"] and read == tokens,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens read per run (prompt included)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--compare-tokens", type=int, default=256, help="teacher-forced float32 comparison span")
    parser.add_argument("--checkpoint-every", type=int, default=1024, help="cache-size check interval (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/long_run.json"))
    args = parser.parse_args(argv)
    if not 1 <= args.prompt_tokens < args.tokens:
        parser.error(f"--prompt-tokens must be in [1, --tokens={args.tokens}), got {args.prompt_tokens}")
    if args.compare_tokens < 1 or args.checkpoint_every < 1:
        parser.error("--compare-tokens and --checkpoint-every must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    shape = SHAPES[args.shape]
    results = []
    for name in args.models:
        reference = randomize(MODEL_BUILDERS[name](shape), args.seed).eval().to(args.device)
        for dtype_name in args.dtypes:
            result = {"model": name, "shape": args.shape,
                      **long_run(reference, dtype_name, args.tokens, args.prompt_tokens, args.compare_tokens,
                                 args.checkpoint_every, args.seed, args.device)}
            results.append(result)
            first, last = result["first_tokens_vs_float32"], result["last_tokens_vs_float32"]
            print(f"{name:10s} {dtype_name:8s} tokens={result['tokens']} finite={result['finite']} "
                  f"cache={result['cache_nbytes']}B (config {result['cache_bytes_expected']}B) "
                  f"first: max|d|/std={first['max_relative_error']:.4f} top1={first['top1_agreement']:.3f} "
                  f"last: max|d|/std={last['max_relative_error']:.4f} top1={last['top1_agreement']:.3f} "
                  f"cache max|x|={result['cache_max_abs']:.1f} {result['tokens_per_second']:.0f} tok/s "
                  f"{'PASS' if result['passed'] else 'FAIL'}", flush=True)
            if result["first_non_finite"]:
                print(f"  first non-finite output: {result['first_non_finite']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"device": args.device, "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
               "results": results}
    temporary = args.out.with_suffix(args.out.suffix + ".tmp")
    temporary.write_text(json.dumps(summary, indent=2))
    temporary.replace(args.out)
    print(f"wrote {args.out}")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
