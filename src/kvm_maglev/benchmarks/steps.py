"""CPU seconds of a few whole steps, for comparing two checkouts of the code in one session (before and after a
restructuring): generate() from a left-padded batch, and training steps.

    PYTHONPATH=<checkout>/src python src/kvm_maglev/benchmarks/steps.py --what kvm_generate --out runs.jsonl

Runnable as a file so the same measurement runs on an older checkout that lacks it. Times are `time.process_time`
of the timed part (one torch thread), so other jobs on the machine cost less noise than wall time would.
"""

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from kvm_maglev.benchmarks.models import MODEL_BUILDERS, TINY

# what -> (model, kind): a 4-row left-padded generate() of 200 tokens (rows at different counts: a per-row plan
# every step), 3 forward+backward steps on 2 x 512 tokens, or a cached 4 x 4,096-token prefill
MEASURES = {
    "kvm_generate": ("kvm_sqrt16", "generate"),
    "maglev_generate": ("maglev", "generate"),
    "kvm_train": ("kvm_sqrt16", "train"),
    "maglev_train": ("maglev", "train"),
    "kvm_small_chunks_prefill": ("kvm_small_chunks", "prefill"),
}


def padded_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows of 24, 40, 56 and 72 tokens, left-padded to 72."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (4, 72), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate((24, 40, 56, 72)):
        mask[row, -length:] = 1
    return ids * mask, mask


def time_generate(model) -> float:
    ids, mask = padded_prompts(model.config.vocab_size)
    model.eval()
    with torch.no_grad():
        start = time.process_time()
        model.generate(ids, attention_mask=mask, max_new_tokens=200, min_new_tokens=200, do_sample=False,
                       pad_token_id=0)
        return time.process_time() - start


def small_chunks_kvm() -> torch.nn.Module:
    """The capacity experiment's KVM (width 64, 2 layers, chunks of 8, a square-root state): a long prompt is
    hundreds of chunks, each reading its own version of the state."""
    from kvm_maglev import KVMConfig, KVMForCausalLM

    return KVMForCausalLM(KVMConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    chunk_size=8, window_chunks=2, sink_slots=1, state_budget_mode="power_law",
                                    state_budget_exponent=0.5, state_budget_min=8, state_max_chunks=1000))


def time_prefill(model) -> float:
    """A cached forward of 4 rows of 4,096 tokens, as generate()'s prefill."""
    ids = torch.randint(0, model.config.vocab_size, (4, 4096), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        start = time.process_time()
        model(ids, use_cache=True)
        return time.process_time() - start


def time_train(model) -> float:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, model.config.vocab_size, (2, 512), generator=torch.Generator().manual_seed(0))
    start = time.process_time()
    for _ in range(3):
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.process_time() - start


def code_commit() -> str:
    """The commit of the checkout whose package is imported."""
    import kvm_maglev

    folder = Path(kvm_maglev.__file__).resolve().parent
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=sorted(MEASURES), required=True)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs in the process after one warm-up")
    parser.add_argument("--label", default="", help="a name for the checkout (before, after)")
    parser.add_argument("--out", type=Path, help="append one JSON line here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    name, kind = MEASURES[args.what]
    model = small_chunks_kvm() if name == "kvm_small_chunks" else MODEL_BUILDERS[name](TINY)
    measure = {"generate": time_generate, "train": time_train, "prefill": time_prefill}[kind]
    measure(model)  # warm-up
    seconds = [round(measure(model), 4) for _ in range(args.repeats)]
    row = {"what": args.what, "label": args.label, "commit": code_commit(), "cpu_seconds": seconds,
           "fastest": min(seconds)}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
