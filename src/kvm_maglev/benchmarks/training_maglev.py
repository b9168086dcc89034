"""Maglev's lifted training step against a nanochat GPT of the same shape: tokens/s, executed FLOPs, overhead.

Lifted training runs the prefiller Q over the sequence, then P once fed Q's shifted memories and once more
per self-fed pass, each P pass with its language-model head. Its cost over a plain GPT is therefore mostly
extra math; this script separates that from implementation overhead by counting every step's executed
FLOPs (`torch.utils.flop_counter`) beside its time. Arms (float32, batch 1, forward + backward, steps
interleaved so that every arm sees the same machine):

- `gpt`: our model with the memory off, nanochat's windows (`window_pattern`, L = the sequence length): the
  nanochat GPT, whose logits it reproduces (tests/models/maglev, nanochat's reference outputs);
- `maglev`: the paper's lifted training (Q shares P's blocks, nanochat's windows; P slides `--window`);
- `maglev_self_feed2` (the examples' recipe) and `maglev_self_feed4`: with two or four self-fed passes;
- `nanochat` (with `--nanochat-path`, a checkout of karpathy/nanochat; not shipped): nanochat's own GPT.

    python -m kvm_maglev.benchmarks.training_maglev --tokens 2048 [--nanochat-path ../nanochat]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from .models import SHAPES, Shape

SELF_FED_PASSES = {"maglev": 0, "maglev_self_feed2": 2, "maglev_self_feed4": 4}
OUR_ARMS = ("gpt", *SELF_FED_PASSES)


def our_model(arm: str, shape: Shape, tokens: int, window: int, seed: int) -> torch.nn.Module:
    """The arm's model: nanochat's shape and windows ("SSSL" over `tokens`), memory on or off."""
    from kvm_maglev import MaglevConfig, MaglevForCausalLM

    fields = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_heads, sequence_len=tokens,
                  window_pattern="SSSL", max_position_embeddings=tokens)
    if arm == "gpt":
        config = MaglevConfig(use_memory=False, has_prefiller=False, **fields)
    else:
        config = MaglevConfig(use_memory=True, sliding_window=window, has_prefiller=True,
                              prefiller_window_pattern="SSSL", memory_self_feed_steps=SELF_FED_PASSES[arm], **fields)
    torch.manual_seed(seed)
    return MaglevForCausalLM(config).float().train()


def nanochat_model(nanochat_path: Path, shape: Shape, tokens: int, seed: int) -> torch.nn.Module:
    """nanochat's own GPT of the shape, built as its training script builds it (on the meta device, then
    `init_weights()`); on the CPU its parameters are float32 (its rotary tables stay bfloat16, as it asserts)."""
    sys.path.insert(0, str(nanochat_path))
    from nanochat.gpt import GPT, GPTConfig

    config = GPTConfig(sequence_len=tokens, vocab_size=shape.vocab_size, n_layer=shape.num_layers,
                       n_head=shape.num_heads, n_kv_head=shape.num_heads, n_embd=shape.hidden_size,
                       window_pattern="SSSL")
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model.train()


def step_function(arm: str, model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], float]:
    """One forward + backward of the arm on `ids` ([1, tokens + 1]); returns the loss."""
    inputs = ids[:, :-1]
    if arm == "nanochat":  # nanochat takes the shifted targets; ours shifts its labels itself
        def loss() -> torch.Tensor:
            return model(inputs, targets=ids[:, 1:])
    else:
        def loss() -> torch.Tensor:
            return model(input_ids=inputs, labels=inputs, use_cache=False).loss

    def step() -> float:
        value = loss()
        value.backward()
        model.zero_grad(set_to_none=True)
        return float(value.detach())

    return step


def executed_flops(step: Callable[[], float]) -> int:
    """FLOPs of one step's products (matmuls, attention) as executed, forward and backward."""
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops()


def bench(arms: list[str], shape: Shape, tokens: int, window: int, repeats: int, seed: int,
          nanochat_path: Path | None) -> dict:
    ids = torch.randint(0, shape.vocab_size, (1, tokens + 1), generator=torch.Generator().manual_seed(seed))
    steps, flops = {}, {}
    for arm in arms:
        model = (nanochat_model(nanochat_path, shape, tokens, seed) if arm == "nanochat"
                 else our_model(arm, shape, tokens, window, seed))
        steps[arm] = step_function(arm, model, ids)
        flops[arm] = executed_flops(steps[arm])  # also the warm-up step
    seconds = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm in arms:
            start = time.perf_counter()
            steps[arm]()
            seconds[arm].append(time.perf_counter() - start)
    rows = {}
    for arm in arms:
        median = statistics.median(seconds[arm])
        rows[arm] = dict(seconds=seconds[arm], median_s=median, tokens_per_s=tokens / median,
                         tflops=flops[arm] / 1e12, seconds_per_tflop=median / (flops[arm] / 1e12))
        if arm in SELF_FED_PASSES:
            rows[arm]["p_passes"] = 1 + SELF_FED_PASSES[arm]
    for arm in arms:
        for reference in ("gpt", "nanochat"):
            if reference in rows and arm != reference:
                # time over the reference's = extra math (FLOPs ratio) x overhead per FLOP (efficiency ratio)
                rows[arm][f"time_over_{reference}"] = rows[arm]["median_s"] / rows[reference]["median_s"]
                rows[arm][f"flops_over_{reference}"] = flops[arm] / flops[reference]
                rows[arm][f"seconds_per_flop_over_{reference}"] = (
                    rows[arm]["seconds_per_tflop"] / rows[reference]["seconds_per_tflop"])
    return dict(tokens=tokens, window=window, shape=shape.__dict__, arms=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048])
    parser.add_argument("--window", type=int, default=None, help="P's sliding window (default: the shape's, 512)")
    parser.add_argument("--arms", nargs="+", choices=[*OUR_ARMS, "nanochat"], default=None,
                        help="default: all of ours, and nanochat's GPT when --nanochat-path is given")
    parser.add_argument("--nanochat-path", type=Path, default=None, help="a checkout of karpathy/nanochat")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each arm, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/bench_training_maglev.json"))
    args = parser.parse_args(argv)
    arms = args.arms or [*OUR_ARMS, *(["nanochat"] if args.nanochat_path else [])]
    has_nanochat = args.nanochat_path is not None and (args.nanochat_path / "nanochat" / "gpt.py").is_file()
    if "nanochat" in arms and not has_nanochat:
        parser.error(f"the nanochat arm needs --nanochat-path with nanochat/gpt.py in it (got {args.nanochat_path})")
    shape = SHAPES[args.shape]
    window = args.window or shape.window
    results = []
    for tokens in args.tokens:
        result = bench(arms, shape, tokens, window, args.repeats, args.seed, args.nanochat_path)
        results.append(result)
        for arm, row in result["arms"].items():
            ratios = ", ".join(f"{key} {value:.2f}" for key, value in row.items() if "_over_" in key)
            print(f"{tokens} tokens {arm}: {row['median_s']:.2f} s, {row['tokens_per_s']:.0f} tokens/s, "
                  f"{row['tflops']:.3f} TFLOP; {ratios}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(command=" ".join(["python -m kvm_maglev.benchmarks.training_maglev",
                                                          *(argv if argv is not None else sys.argv[1:])]),
                                        threads=torch.get_num_threads(), torch=torch.__version__,
                                        results=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
