"""Quantization's cost in quality on trained byte-level language models of hidden 256 (issue 56's loss target).

For each architecture and training seed, a KVM or Maglev model (hidden 256, 4 layers, 4 heads, vocabulary 257:
bytes and a BOS) trains on this interpreter's standard-library sources (`kvm_maglev.corpora.stdlib_corpus`, rows of
`--row` bytes) with AdamW for `--steps` steps; it is saved, reloaded with each quantization method, and scored on the
held-out split's rows: cross-entropy and bits per byte against the float32 model's. The score is the inference
forward (evaluation mode, no labels: Maglev's P on its own memory, token after token), so the memory's path is
scored as it serves. Maglev trains with the paper's lifted recipe (prefiller, consistency weight 0.1): it is the
cheapest of the package's recipes, and this measures the quantizers, not the recipe.

Methods: transformers' load-time quantizers (`benchmarks.quantized.METHODS`) and the compressed-tensors folders
`kvm-maglev quantize` writes (`ct_w8a8`, `ct_w4a16`: what vLLM serves), each loaded through transformers.

    python -m kvm_maglev.benchmarks.quantized_lm --seeds 0 1 --steps 150 --out docs/quantized_lm.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvm_maglev.benchmarks.quantized import METHODS, load
from kvm_maglev.corpora import pack_bytes, stdlib_corpus

VOCAB, BOS = 257, 256
WIDTH, LAYERS, HEADS = 256, 4, 4
COMPRESSED = {"ct_w8a8": "W8A8", "ct_w4a16": "W4A16"}


def build_model(kind: str, seed: int, row: int) -> nn.Module:
    """A fresh byte-level model of `kind` at the benchmark's shape; KVM with 16-byte chunks, two chunks of window
    and a fixed 32-slot state, Maglev with a 32-byte window, its memory and a prefiller (both windows 32 bytes)."""
    from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM

    torch.manual_seed(seed)
    if kind == "kvm":
        return KVMForCausalLM(KVMConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, chunk_size=16,
            window_chunks=2, sink_slots=1, state_budget_mode="fixed", state_budget_min=32, state_max_chunks=2))
    return MaglevForCausalLM(MaglevConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=row, window_pattern="L", weight_init="torch",
        use_memory=True, sliding_window=32, has_prefiller=True, prefiller_window_pattern="L",
        prefiller_shares_blocks=False, consistency_weight=0.1))


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of the steps, then a cosine down to a tenth of `peak`."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model: nn.Module, rows: torch.Tensor, steps: int, batch: int, seed: int, peak_lr: float) -> list[float]:
    """`steps` AdamW steps on batches drawn (seeded) from `rows`; the training loss every step."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr)
        ids = rows[torch.randint(len(rows), (batch,), generator=generator)]
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def inference_loss(model: nn.Module, rows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-byte cross-entropy (nats) of the evaluation-mode forward over `rows`, computed from the logits."""
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        ids = rows[start:start + batch]
        logits = model(input_ids=ids, use_cache=False).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(loss), count + ids[:, 1:].numel()
    return total / count


def quantized_model(method: str, folder: Path, scratch: Path) -> nn.Module:
    """The saved model reloaded quantized by `method`."""
    if method in COMPRESSED:
        from kvm_maglev.convert.quantize import quantize_folder

        out = quantize_folder(folder, COMPRESSED[method], scratch / f"{folder.name}_{method}", group_size=128)
        return load(out, None)
    return load(folder, method)


def score(method: str, folder: Path, scratch: Path, rows: torch.Tensor, float_loss: float) -> dict:
    """One method's evaluation loss, bits per byte and change against float32; an error is recorded by message."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = inference_loss(quantized_model(method, folder, scratch), rows)
    except Exception as error:  # a method that fails on this machine is a result, recorded
        return {"method": method, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    return {"method": method, "loss": loss, "bpb": loss / math.log(2),
            "loss_change": (loss - float_loss) / float_loss}


def run(kind: str, seed: int, args, train_rows: torch.Tensor, eval_rows: torch.Tensor, scratch: Path) -> dict:
    """Train one model, then score float32 and every method on the evaluation rows."""
    model = build_model(kind, seed, args.row)
    start = time.perf_counter()
    losses = train(model, train_rows, args.steps, args.batch, seed, args.lr)
    trained_s = time.perf_counter() - start
    folder = scratch / f"{kind}_seed{seed}"
    model.eval().save_pretrained(folder)
    float_loss = inference_loss(load(folder, None), eval_rows)
    result = {"model": kind, "seed": seed, "train_seconds": trained_s,
              "train_loss_last_20": sum(losses[-20:]) / len(losses[-20:]),
              "float32": {"loss": float_loss, "bpb": float_loss / math.log(2)}, "methods": []}
    print(json.dumps({k: v for k, v in result.items() if k != "methods"}), flush=True)
    for method in args.methods:
        result["methods"].append(score(method, folder, scratch, eval_rows, float_loss))
        print(json.dumps({"model": kind, "seed": seed, **result["methods"][-1]}), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["kvm", "maglev"], choices=["kvm", "maglev"])
    parser.add_argument("--methods", nargs="+", default=["bnb_int8", "torchao_int8_weight_only",
                                                         "torchao_int8_dynamic", "bnb_nf4", "ct_w8a8", "ct_w4a16"],
                        choices=[*METHODS, *COMPRESSED])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="training seeds (one model each)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--row", type=int, default=128, help="bytes per training and evaluation row")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-rows", type=int, default=32, help="held-out rows scored (first rows of each file)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    from kvm_maglev import register_auto_classes

    register_auto_classes()  # the saved folders load as the package's classes (this process only)
    train_rows = pack_bytes(stdlib_corpus("train"), args.row, bos=BOS)
    eval_rows = pack_bytes(stdlib_corpus("validation"), args.row, bos=BOS, rows_per_document=1)[:args.eval_rows]
    result = {"command": "python -m kvm_maglev.benchmarks.quantized_lm " + " ".join(argv or sys.argv[1:]),
              "shape": {"hidden": WIDTH, "layers": LAYERS, "heads": HEADS, "vocab": VOCAB, "row": args.row},
              "train_rows": len(train_rows), "eval_rows": len(eval_rows), "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for kind in args.models:
                result["runs"].append(run(kind, seed, args, train_rows, eval_rows, Path(scratch)))
                if args.out:  # each run saved as it comes: a long run stopped early keeps what it measured
                    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
