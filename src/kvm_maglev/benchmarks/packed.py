"""Training-step throughput of a packed batch against the same documents right-padded and against one unpadded
row of the same total length (KVM), on log-normal document lengths.

    python -m kvm_maglev.benchmarks.packed [--tokens 16384] [--steps 3] [--out docs/bench_packed.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM


def lognormal_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Document lengths, log-normal clipped to [low, high], until they fill `tokens` (the last one cut to fit)."""
    generator = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < tokens:
        n = int(min(high, max(low, math.exp(5.5 + 1.0 * torch.randn(1, generator=generator).item()))))
        n = min(n, tokens - total)
        lengths.append(n)
        total += n
    return lengths


def step_seconds(model, inputs: dict, steps: int) -> float:
    """Median seconds of a forward and backward with labels."""
    times = []
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        begin = time.perf_counter()
        model(**inputs, use_cache=False).loss.backward()
        times.append(time.perf_counter() - begin)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = KVMConfig(vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=4, rotary_dim=16, chunk_size=64, window_chunks=2,
                       state_budget_mode="power_law", state_budget_factor=2.0, state_budget_min=64)
    model = KVMForCausalLM(config).train()
    lengths = lognormal_lengths(args.tokens, 64, 2048, seed=0)
    docs = [torch.randint(0, 512, (n,)) for n in lengths]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
    width = max(lengths)
    padded = torch.zeros(len(docs), width, dtype=torch.long)
    padded_labels = torch.full((len(docs), width), -100)
    for i, d in enumerate(docs):
        padded[i, :len(d)], padded_labels[i, :len(d)] = d, d
    runs = {
        "packed": dict(input_ids=ids, position_ids=positions, labels=labels),
        "right_padded": dict(input_ids=padded, labels=padded_labels),
        "one_row": dict(input_ids=ids, labels=ids),
    }
    results = {name: args.tokens / step_seconds(model, inputs, args.steps) for name, inputs in runs.items()}
    report = {"documents": len(lengths), "tokens": args.tokens, "hidden": args.hidden, "layers": args.layers,
              "tokens_per_s": results, "packed_vs_padded": results["packed"] / results["right_padded"],
              "packed_vs_one_row": results["packed"] / results["one_row"]}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
