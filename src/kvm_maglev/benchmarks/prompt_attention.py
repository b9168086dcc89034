"""KVM's prompt pieces over their key sets on CPU, two ways: joined into one fused call (`modeling_kvm.fused_attention`,
the reference) and one flash call per key set merged by log-sum-exp (`speedups/merged_attention_kvm`, what the vLLM
plugin runs). Each case reads prompts through a KVM model of the paper's released 120M attention shape (hidden 768,
6 heads of 128, chunks of 256, a 2-chunk window, a 16 sqrt(n) state; 2 layers, small vocabulary and MLP: the
attention is what is timed) in one forward over a cache, as a vLLM prompt step reads them together, and times the
layers' `attend_pieces` calls and the whole forward.

    python -m kvm_maglev.benchmarks.prompt_attention --out docs/prompt_attention.json

One torch thread; each case the median of `--repeats` runs after a warm-up run; random weights and tokens.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM, modeling_kvm

# (name, tokens every request has read before, each request's tokens of the timed forward)
CASES = (
    ("mixed workload's first prompt step: 8 new requests, 1,365 tokens", 0, [256, 512, 96, 256, 23, 105, 85, 32]),
    ("chat: 8 requests' own parts after a 1,024-token shared prompt", 1024, [16, 40, 64, 100, 128, 160, 200, 256]),
    ("one 4,096-token prompt", 0, [4096]),
)
SHAPE = dict(hidden_size=768, num_attention_heads=6, chunk_size=256, window_chunks=2, state_budget_mode="power_law",
             state_budget_factor=16.0, state_budget_exponent=0.5, state_budget_min=256, state_max_chunks=10000,
             num_hidden_layers=2, vocab_size=512, intermediate_size=768, max_position_embeddings=8192)


def timed_forward(model: KVMForCausalLM, before: int, counts: list[int], merged: bool,
                  seed: int) -> tuple[float, float]:
    """Milliseconds of one forward of every request's `counts[r]` tokens (right-padded: padding is no token) after
    its `before` tokens (read beforehand, untimed), and of its `attend_pieces` calls, with the key sets merged or
    joined: the requests' pieces attend together, as in an engine's prompt step."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (len(counts), before + max(counts)), generator=generator)
    cache = KVMCache(model.config)
    if before:
        model(ids[:, :before], cache=cache)
    mask = torch.ones(len(counts), ids.shape[1], dtype=torch.long)
    for row, count in enumerate(counts):
        mask[row, before + count:] = 0
    attention = [0.0]
    plain = modeling_kvm.attend_pieces

    def attend_pieces(*args, **kwargs):
        begin = time.perf_counter()
        out = plain(*args, **kwargs)
        attention[0] += time.perf_counter() - begin
        return out
    modeling_kvm.attend_pieces = attend_pieces
    attentions = [layer.self_attn for layer in model.model.layers]
    for module in attentions:
        module.merged_key_sets = merged
    try:
        begin = time.perf_counter()
        model(ids[:, before:], attention_mask=mask, cache=cache)
        total = time.perf_counter() - begin
    finally:
        modeling_kvm.attend_pieces = plain
        for module in attentions:
            del module.merged_key_sets  # the class's default again
    return 1000 * total, 1000 * attention[0]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = KVMForCausalLM(KVMConfig(**SHAPE)).eval()
    results = []
    with torch.no_grad():
        for name, before, counts in CASES:
            row = {"case": name, "tokens_before": before, "tokens": counts}
            for merged in (False, True):
                timed_forward(model, before, counts, merged, 0)  # warm-up
                runs = [timed_forward(model, before, counts, merged, repeat) for repeat in range(args.repeats)]
                key = "merged" if merged else "joined"
                row[f"{key}_forward_ms"] = round(statistics.median(run[0] for run in runs), 2)
                row[f"{key}_attend_pieces_ms"] = round(statistics.median(run[1] for run in runs), 2)
            row["attend_pieces_speed_up"] = round(row["joined_attend_pieces_ms"] / row["merged_attend_pieces_ms"], 2)
            print(json.dumps(row), flush=True)
            results.append(row)
    payload = {"command": "python -m kvm_maglev.benchmarks.prompt_attention " + shlex.join(argv or sys.argv[1:]),
               "threads": 1, "shape": SHAPE, "results": results}
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return payload


if __name__ == "__main__":
    main()
