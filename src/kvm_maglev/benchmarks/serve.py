"""Serving benchmark: a model on vLLM (the kvm_maglev.vllm plugin) against HF generate() batches of the same prompts.

    python -m kvm_maglev.benchmarks.serve --model maglev --out docs/bench_serve_cpu.json
    python -m kvm_maglev.benchmarks.serve --model kvm --out docs/bench_serve_kvm_cpu.json

Output tokens per second with 1, 16 and 64 requests at once (vLLM: that many requests given to `LLM.generate`
together; HF: one `generate()` batch of them), greedy, equal-length prompts so that HF needs no padding. Memory per
request: the bytes of vLLM's state pages for one request (as declared per layer, and as allocated: vLLM pads every
layer's page to the largest) against `config.cache_bytes(max_model_len)`. A random-weight model is made in a
temporary folder (the speed does not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch


def make_folder(folder: Path, args) -> Path:
    """A random-weight folder of the benchmark's model and size."""
    from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM

    shared = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    if args.model == "kvm":
        model = KVMForCausalLM(KVMConfig(**shared, chunk_size=args.chunk))
    else:
        model = MaglevForCausalLM(MaglevConfig(**shared, max_position_embeddings=args.max_model_len,
                                               sliding_window=args.window, has_prefiller=False))
    torch.manual_seed(0)
    model.eval().save_pretrained(folder)
    return folder


def hf_tokens_per_second(folder: Path, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s of one greedy generate() batch of the prompts, after a warm-up call (as vLLM gets one)."""
    from transformers import AutoModelForCausalLM

    import kvm_maglev

    kvm_maglev.register_auto_classes()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(prompts)
    model.generate(ids[:2], max_new_tokens=2, do_sample=False)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / seconds


def state_page_bytes(llm) -> tuple[int, int]:
    """Bytes of one request's state pages: summed as the layers declare them, and as vLLM allocates them (every
    layer's page padded to the largest)."""
    from math import prod

    from vllm.utils.torch_utils import get_dtype_size

    # the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its worker's model is reachable
    model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    pages = [sum(prod(shape) * get_dtype_size(dtype) for shape, dtype in zip(layer.get_state_shape(),
                                                                                 layer.get_state_dtype()))
             for layer in model.state_layers]
    return sum(pages), max(pages) * len(pages)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print and save its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["kvm", "maglev"], default="maglev")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=128, help="Maglev's sliding window")
    parser.add_argument("--chunk", type=int, default=16, help="KVM's chunk size (its window: 2 chunks by default)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of both sides (vLLM's CPU worker takes OMP_NUM_THREADS, else it cuts to 1)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its model is read
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)  # HF's side, in this process
    from vllm import LLM, SamplingParams

    generator = torch.Generator().manual_seed(0)
    most = max(args.concurrency)
    prompts = torch.randint(0, args.vocab, (most, args.prompt_tokens), generator=generator).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp) / args.model, args)
        llm = LLM(model=str(folder), enforce_eager=True, max_model_len=args.max_model_len, max_num_seqs=most,
                  dtype=args.dtype, gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 28,
                  skip_tokenizer_init=True)  # token-id prompts: no tokenizer needed
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params)  # warm-up
        rows = []
        for concurrency in args.concurrency:
            batch = prompts[:concurrency]
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            vllm_rate = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
            hf_rate = hf_tokens_per_second(folder, batch, args.new_tokens)
            rows.append({"concurrency": concurrency, "vllm_tokens_per_s": round(vllm_rate, 1),
                         "hf_generate_tokens_per_s": round(hf_rate, 1), "speedup": round(vllm_rate / hf_rate, 2)})
            print(rows[-1], flush=True)
        config = llm.llm_engine.model_config.hf_config
        dtype = getattr(torch, args.dtype)
        declared, allocated = state_page_bytes(llm)
        expected = config.cache_bytes(args.max_model_len, dtype=dtype)
        settings = ("model", "hidden", "layers", "heads", "kv_heads", "window" if args.model == "maglev" else "chunk",
                    "vocab", "max_model_len", "dtype")
        result = {"command": f"python -m kvm_maglev.benchmarks.serve --model {args.model}",
                  "torch_threads": args.threads, "model": {k: getattr(args, k) for k in settings},
                  "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": rows,
                  "state_page_bytes_per_request": declared, "allocated_page_bytes_per_request": allocated,
                  "config_cache_bytes": expected, "declared_over_cache_bytes": round(declared / expected, 4)}
        del llm
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
