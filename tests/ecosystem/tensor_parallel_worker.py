"""Worker for the tensor-parallel test, run by `torchrun --nproc-per-node 2`: loads a model folder sharded
with `tp_plan="auto"` and whole, and writes (rank 0) how far their logits and greedy generations differ."""

from __future__ import annotations

import json
import sys
import warnings

import torch
from transformers import AutoModelForCausalLM


def sharded_parameters(model: torch.nn.Module) -> dict[str, list[int]]:
    """Local shapes of the parameters this rank holds only a part of."""
    return {name: list(p.to_local().shape) for name, p in model.named_parameters()
            if hasattr(p, "to_local") and p.to_local().shape != p.shape}


def main(model_dir: str, out_path: str, prompt_length: int, new_tokens: int) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.24 prefers DistributedConfig(tp_plan=...)
        sharded = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, tp_plan="auto",
                                                       dtype=torch.float32).eval()
    whole = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    vocab = whole.config.vocab_size
    ids = torch.randint(5, vocab - 5, (2, prompt_length))
    with torch.no_grad():
        logits_gap = (sharded(input_ids=ids).logits - whole(input_ids=ids).logits).abs().max().item()
    generate = dict(max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    same_generations = torch.equal(sharded.generate(ids, **generate), whole.generate(ids, **generate))
    if torch.distributed.get_rank() == 0:
        report = {"world_size": torch.distributed.get_world_size(), "logits_max_abs_diff": logits_gap,
                  "same_generations": same_generations, "sharded": sharded_parameters(sharded)}
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=2)
    torch.distributed.barrier()
    # torch's gloo group, left to the interpreter's exit, sometimes aborts the process
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
