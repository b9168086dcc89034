"""Train tiny byte-level language models with and without memory, and compare validation bits per byte.

The paper's claim is language modelling: Maglev beats a matched sliding-window model. Here every arm has
width 64, 2 layers and (where it has one) an attention window of 32 bytes, trains on 256-byte rows for the
same steps with the same data and seed, and is scored on held-out rows: bits per byte with Maglev's P
recurrent on its own memory (and fed by its prefiller), split into the first window and the rest.

Corpora (offline, see kvm_maglev.corpora): "cast" - synthetic stories whose cast of names is stated once at
the start; "stdlib" - this interpreter's standard-library sources, split by file hash.

    python examples/train_lm.py --corpus cast --seed 0 --out results/lm_cast_s0
"""

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import Trainer, TrainingArguments, set_seed

from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM
from kvm_maglev.corpora import cast_corpus, pack_bytes, stdlib_corpus
from kvm_maglev.recall import memory_prefill
from kvm_maglev.training import MAGLEV_RECIPE, MAGLEV_RECIPES, MaglevStepCallback

WIDTH, LAYERS, HEADS, WINDOW, SEQ_LEN, VOCAB = 64, 2, 2, 32, 256, 257  # 256 bytes + BOS
BOS = 256
EVAL_SEED_OFFSET = 10_000


def _nanochat(**fields) -> MaglevForCausalLM:
    base = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=HEADS, max_position_embeddings=SEQ_LEN, window_pattern="L", weight_init="torch")
    return MaglevForCausalLM(MaglevConfig(**{**base, **fields}))


def _maglev(**recipe) -> MaglevForCausalLM:
    return _nanochat(use_memory=True, sliding_window=WINDOW, has_prefiller=True, prefiller_window_pattern="L",
                     prefiller_shares_blocks=False, consistency_weight=0.1, **recipe)


ARMS: Dict[str, Callable[[], torch.nn.Module]] = {
    "swa_baseline": lambda: _nanochat(use_memory=False, sliding_window=WINDOW, has_prefiller=False),
    **{f"maglev_{name}": (lambda recipe=recipe: _maglev(**recipe)) for name, recipe in MAGLEV_RECIPES.items()},
    "kvm_fixed": lambda: KVMForCausalLM(KVMConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, chunk_size=16,
        window_chunks=WINDOW // 16, sink_slots=1, state_budget_mode="fixed", state_budget_min=32,
        state_max_chunks=2)),
    "full_attention": lambda: _nanochat(use_memory=False, sliding_window=None, has_prefiller=False),
}

# what the memory issue compares: the sliding window, the paper's recipe, the examples' recipe, KVM, the ceiling
DEFAULT_ARMS = ("swa_baseline", "maglev_paper", f"maglev_{MAGLEV_RECIPE}", "kvm_fixed", "full_attention")


def corpus_rows(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows) of SEQ_LEN byte ids; validation never shares a document with training."""
    if name == "cast":
        train = pack_bytes(cast_corpus(40_000, seed=seed), SEQ_LEN, BOS, rows_per_document=1)
        validation = pack_bytes(cast_corpus(512, seed=EVAL_SEED_OFFSET + seed), SEQ_LEN, BOS, rows_per_document=1)
        return train, validation
    train = pack_bytes(stdlib_corpus("train"), SEQ_LEN, BOS)
    validation = pack_bytes(stdlib_corpus("validation"), SEQ_LEN, BOS)
    pick = torch.randperm(validation.shape[0], generator=torch.Generator().manual_seed(EVAL_SEED_OFFSET))[:512]
    return train, validation[pick]


def train_one(name: str, rows: torch.Tensor, args: argparse.Namespace) -> torch.nn.Module:
    set_seed(args.seed)
    model = ARMS[name]()
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(args.seed))
    data = [{"input_ids": rows[i], "labels": rows[i]} for i in order[: args.steps * args.batch_size].tolist()]
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer" / name), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 20), weight_decay=0.0,
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[], seed=args.seed,
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, disable_tqdm=not args.progress,
    )
    callbacks = [MaglevStepCallback()] if isinstance(model, MaglevForCausalLM) else []
    Trainer(model=model, args=training_args, train_dataset=data, callbacks=callbacks).train()
    return model.eval()


@torch.no_grad()
def bits_per_byte(model, rows: torch.Tensor, mode: str, batch: int, progress: bool) -> Dict[str, float]:
    """Validation bits per byte over all predicted bytes, the first window's and the rest's (uncached forward
    in the given Maglev prompt mode; "" for other models)."""
    losses = []
    with memory_prefill(model, mode):
        for start in tqdm(range(0, rows.shape[0], batch), desc=f"eval {mode or 'model'}", disable=not progress):
            ids = rows[start:start + batch]
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                          reduction="none").view(ids.shape[0], -1))
    nats = torch.cat(losses)  # [rows, SEQ_LEN - 1]: column j predicts byte j + 1
    first = nats[:, : WINDOW - 1]
    return {"all": nats.mean().item() / math.log(2), "first_window": first.mean().item() / math.log(2),
            "past_window": nats[:, WINDOW - 1:].mean().item() / math.log(2)}


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--corpus", choices=("cast", "stdlib"), default="cast")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(DEFAULT_ARMS))
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/lm"))
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    train_rows, validation_rows = corpus_rows(args.corpus, args.seed)
    results, timings = {}, {}
    for name in args.arms:
        start = time.time()
        model = train_one(name, train_rows, args)
        timings[name] = time.time() - start
        modes = {"recurrent": "recurrent", "prefiller": "prefiller"} if name.startswith("maglev") else {"recurrent": ""}
        results[name] = {key: bits_per_byte(model, validation_rows, mode, args.eval_batch, args.progress)
                         for key, mode in modes.items()}
        results[name].update(window=WINDOW)
        print(name, f"{timings[name]:.0f}s", json.dumps(results[name]), flush=True)
        summary = {
            "command": f"python examples/train_lm.py --corpus {args.corpus} --seed {args.seed} --steps {args.steps} "
                       f"--arms {' '.join(args.arms)} --out {args.out}",
            "corpus": args.corpus, "train_rows": train_rows.shape[0], "validation_rows": validation_rows.shape[0],
            "settings": {k: str(v) for k, v in vars(args).items()}, "train_seconds": timings, "models": results,
        }
        (args.out / "lm.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'lm.json'}", flush=True)


if __name__ == "__main__":
    main()
