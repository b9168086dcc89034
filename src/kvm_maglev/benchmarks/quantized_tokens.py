"""Greedy agreement of a compressed-tensors W8A8 folder served on vLLM with transformers' `generate()` on the same
folder (issue 56's ">= 7 of 8 prompts" at the 120M shape): both models at a serving benchmark shape, random weights
(`kvm_maglev.benchmarks.serve`'s folders, float32), the first `--prompts` prompts of its decode-heavy workload
(16-64 tokens), `--new-tokens` greedy tokens each. Per prompt: whether the continuations are equal, and where they
first differ, both paths' tokens there and each path's logit margin (its top token's logit less its second's): random
weights give near-tied logits, so a small margin means a tie that rounding breaks either way.

vLLM rounds each W8A8 layer's input to int8 with the scale max/127 per token, compressed-tensors' forward in
transformers with max/127.5, so the two paths differ by a rounding step wherever a value falls between.

    nice python -m kvm_maglev.benchmarks.quantized_tokens --out docs/quantized_tokens_120M.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from kvm_maglev.benchmarks import serve


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(serve.SHAPES), default="120M")
    parser.add_argument("--models", nargs="+", choices=["kvm", "maglev"], default=["kvm", "maglev"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the weights' and the prompts' seed")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM eager (default: its default, compiled)")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def hf_greedy(folder: Path, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """transformers' greedy continuation of each prompt (one at a time) and its logit margin at each step."""
    from transformers import AutoModelForCausalLM

    import kvm_maglev

    kvm_maglev.register_auto_classes()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        top = [step[0].float().topk(2).values for step in out.logits]
        results.append({"tokens": out.sequences[0, len(prompt):].tolist(),
                        "margins": [float(values[0] - values[1]) for values in top]})
    return results


def vllm_greedy(folder: Path, prompts: list[list[int]], new_tokens: int, eager: bool) -> list[dict]:
    """vLLM's greedy continuation of each prompt (one batch) and its logit margin at each step (the difference of
    the top two log-probabilities, which is that of their logits)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), skip_tokenizer_init=True, dtype="float32", enforce_eager=eager,
              max_model_len=256, max_num_seqs=len(prompts), gpu_memory_utilization=0.3,
              kv_cache_memory_bytes=1 << 29)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                           SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=2),
                           use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        margins = []
        for step in completion.logprobs:
            best = sorted((entry.logprob for entry in step.values()), reverse=True)
            margins.append(best[0] - best[1])
        results.append({"tokens": list(completion.token_ids), "margins": margins})
    del llm
    return results


def compare(prompts: list[list[int]], hf: list[dict], served: list[dict]) -> dict:
    """How many continuations are equal and, for each prompt, where they first differ and the margins there."""
    rows = []
    for prompt, a, b in zip(prompts, hf, served):
        first = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        row = {"prompt_tokens": len(prompt), "equal": first is None}
        if first is not None:
            row.update(first_difference=first, hf_token=a["tokens"][first], vllm_token=b["tokens"][first],
                       hf_margin=round(a["margins"][first], 5), vllm_margin=round(b["margins"][first], 5))
        before = a["margins"][:first]  # the steps both paths took alike
        row["smallest_hf_margin_before"] = round(min(before), 5) if before else None
        rows.append(row)
    return {"equal": sum(row["equal"] for row in rows), "prompts": len(rows), "per_prompt": rows}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = "python -m kvm_maglev.benchmarks.quantized_tokens " + shlex.join(sys.argv[1:] if argv is None else argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    shape = serve.parse_args(["--shape", args.shape, "--seed", str(args.seed)])
    prompts = [r.prompt for r in serve.make_requests(serve.WORKLOADS["decode-heavy"], args.seed, shape.vocab)]
    prompts = prompts[:args.prompts]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            folder = serve.make_folder(f"{kind}_w8a8", Path(tmp) / f"{kind}_w8a8", shape)
            hf = hf_greedy(folder, prompts, args.new_tokens)
            served = vllm_greedy(folder, prompts, args.new_tokens, args.enforce_eager)
            results[kind] = compare(prompts, hf, served)
            print(f"{kind} W8A8: {results[kind]['equal']} of {len(prompts)} greedy continuations equal", flush=True)
            for row in results[kind]["per_prompt"]:
                print("  ", row, flush=True)
    import transformers
    import vllm

    payload = {"command": command, "shape": {k: getattr(shape, k) for k in ("hidden", "layers", "heads", "kv_heads",
                                                                           "vocab", "window", "kvm_budget")},
               "settings": {"prompts": args.prompts, "new_tokens": args.new_tokens, "seed": args.seed,
                            "dtype": "float32", "enforce_eager": args.enforce_eager,
                            "prompt_source": "serve's decode-heavy workload, its first prompts"},
               "versions": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "vllm": vllm.__version__},
               "code": serve.code_version(), "results": results}
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return payload


if __name__ == "__main__":
    main()
