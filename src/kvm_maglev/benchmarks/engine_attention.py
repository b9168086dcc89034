"""KVM's decoding attention over an engine's pages, four ways on CPU: gathering every request's state and window
pages into one batch (`state_window_attention_torch`, the reference) against reading each request's pages in place
one request at a time (`vllm.in_place_reads.state_window_attention_by_page`), the two eager torch forms; the CPU
kernel (`in_place_reads.state_window_attention_kernel`, every request in one call; the eager step's choice where it
builds); and the form the compiled decoding step runs (`state_window_attention_as_sums`, compiled: sums of products
over the pages). The bytes a request reads where the two torch forms cross set `in_place_reads.IN_PLACE_MIN_BYTES`
(their choice without the kernel).

    python -m kvm_maglev.benchmarks.engine_attention --out docs/engine_attention.json

One torch thread; each case the median of `--repeats` timed calls after warm-up calls; random pages and queries.
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

from kvm_maglev.models.kvm.decode_attention_kvm import state_window_attention_torch
from kvm_maglev.vllm import paged_attention_cpu
from kvm_maglev.vllm.decode_kvm import compiled, state_window_attention_as_sums
from kvm_maglev.vllm.in_place_reads import (
    IN_PLACE_MIN_BYTES,
    state_window_attention_by_page,
    state_window_attention_kernel,
)

# (name, requests, query heads, key/value heads, head dim, state slots read, window slots read)
CASES = (
    ("benchmark shape, short contexts", 32, 4, 2, 64, 16, 32),
    ("benchmark shape, window full", 32, 4, 2, 64, 64, 128),
    ("benchmark shape, 8 requests", 8, 4, 2, 64, 64, 128),
    ("benchmark shape, a larger state", 32, 4, 2, 64, 256, 128),
    ("benchmark shape, a larger state and window", 32, 4, 2, 64, 512, 256),
    ("120M shape, first chunk", 8, 6, 6, 128, 128, 128),
    ("120M shape, contexts ~450", 8, 6, 6, 128, 200, 250),
    ("120M shape, 32 requests, window full", 32, 6, 6, 128, 256, 512),
)


# (name, requests, query heads, key/value heads, head dim, window slots read): requests early in their decoding, as
# the decode-heavy workload's are (no live state slot; each request's ring visible from slot 0 to its position, at
# half the reach to all of it) on pages of a whole ring's width, as vLLM's are: the cases whose crossing sets
# IN_PLACE_MIN_BYTES (the random cases above give every request live state slots and hidden ring slots)
EARLY_CASES = (
    ("benchmark shape, early decoding, 16 window slots", 32, 4, 2, 64, 16),
    ("benchmark shape, early decoding, 32 window slots", 32, 4, 2, 64, 32),
    ("benchmark shape, early decoding, 64 window slots", 32, 4, 2, 64, 64),
    ("benchmark shape, early decoding, 128 window slots", 32, 4, 2, 64, 128),
)
RING_SLOTS = 512  # KVMConfig's default window: 2 chunks of 256


def early_inputs(requests: int, heads: int, kv_heads: int, dim: int, window: int) -> dict:
    """`case_inputs` of requests early in their decoding (`EARLY_CASES`): the state's 2 slots read and none live,
    ring pages `RING_SLOTS` wide read to `window`, each request seeing its ring's leading slots."""
    inputs = case_inputs(requests, heads, kv_heads, dim, 2, RING_SLOTS)
    seen = torch.randint(window // 2, window + 1, (requests,), generator=torch.Generator().manual_seed(1))
    return dict(inputs, state_slots=torch.zeros(requests, dtype=torch.long),
                window_keys=inputs["window_keys"][:, :, :window], window_values=inputs["window_values"][:, :, :window],
                window_visible=torch.arange(window) < seen[:, None])


def case_inputs(requests: int, heads: int, kv_heads: int, dim: int, state: int, window: int) -> dict:
    """Random inputs over 2 x `requests` pages (the requests on every other page), as the engine's step reads them."""
    generator = torch.Generator().manual_seed(0)
    pages = 2 * requests

    def normal(*shape):
        return torch.randn(*shape, generator=generator)

    return dict(q=normal(requests, heads, dim), page=torch.randperm(pages, generator=generator)[:requests],
                state_keys=normal(pages, kv_heads, state, dim), state_values=normal(pages, kv_heads, state, dim),
                state_slots=torch.randint(1, state + 1, (requests,), generator=generator),
                window_keys=normal(pages, kv_heads, window, dim), window_values=normal(pages, kv_heads, window, dim),
                window_visible=torch.rand(requests, window, generator=generator) < 0.9,
                state_temperature=torch.rand(heads, generator=generator) + 0.5,
                window_temperature=torch.rand(heads, generator=generator) + 0.5, scale=dim ** -0.5)


def median_ms(function, inputs: dict, repeats: int) -> float:
    for _ in range(3):
        function(**inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(**inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    as_sums = compiled(state_window_attention_as_sums)
    has_kernel = paged_attention_cpu.available()
    rows = []
    cases = [(case, case_inputs(*case[1:])) for case in CASES]
    cases += [((name, requests, heads, kv_heads, dim, 2, window), early_inputs(requests, heads, kv_heads, dim, window))
              for name, requests, heads, kv_heads, dim, window in EARLY_CASES]
    for (name, requests, heads, kv_heads, dim, state, window), inputs in cases:
        gathered = median_ms(state_window_attention_torch, inputs, args.repeats)
        in_place = median_ms(state_window_attention_by_page, inputs, args.repeats)
        with torch._dynamo.config.patch(recompile_limit=len(cases)):
            sums = median_ms(as_sums, inputs, args.repeats)
        kernel = median_ms(state_window_attention_kernel, inputs, args.repeats) if has_kernel else None
        read = kv_heads * (state + window) * 2 * dim * 4  # float32 keys and values
        rows.append({"case": name, "requests": requests, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                     "state_slots": state, "window_slots": window, "bytes_read_per_request": read,
                     "gathered_ms": round(gathered, 3), "in_place_ms": round(in_place, 3),
                     "as_sums_compiled_ms": round(sums, 3), "kernel_ms": None if kernel is None else round(kernel, 3),
                     "chosen_without_kernel": "in place" if read >= IN_PLACE_MIN_BYTES else "gathered"})
        kernel_text = "did not build" if kernel is None else f"{kernel:.2f} ms"
        print(f"{name}: {read / 1024:.0f} KiB a request; gathered {gathered:.2f} ms, in place {in_place:.2f} ms "
              f"(torch's choice: {rows[-1]['chosen_without_kernel']}); compiled as sums {sums:.2f} ms; kernel "
              f"{kernel_text}", flush=True)
    payload = {"command": "python -m kvm_maglev.benchmarks.engine_attention "
                          + shlex.join(sys.argv[1:] if argv is None else argv),
               "in_place_min_bytes": IN_PLACE_MIN_BYTES, "torch": torch.__version__, "threads": 1, "cases": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return payload


if __name__ == "__main__":
    main()
