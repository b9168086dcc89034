"""QLoRA against float LoRA on the recall task, at equal steps (issue 56's QLoRA target: within 10%).

The package's trained recall models (`assets/recall_models`: KVM with a fixed state, Maglev; hidden 64) learned four
facts a sequence; here each is fine-tuned with LoRA (rank 8 on every projection `lora_target_modules` names) to
recall eight. Two arms from the same saved folder, the same seed, data and steps: "lora" on the float32 model and
"qlora" on the model loaded in bitsandbytes 4-bit nf4 and prepared for k-bit training. Each arm's loss on the
recalled values of held-out examples (their own generator seed, never a training seed) is reported before and after
training, and the ratio qlora / lora after.

    python -m kvm_maglev.benchmarks.qlora_recall --seeds 0 1 2 --out docs/qlora_recall.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

import torch
from torch import nn

from kvm_maglev.benchmarks.quantized import RECALL_MODELS, load, recall_loss

EVAL_SEED = 10_000  # held-out examples' generator: apart from every training seed
FINE_TUNE_FACTS = 8


def recall_rows(folder, examples: int, seed: int) -> dict:
    """`examples` recall rows of the model's own task with FINE_TUNE_FACTS facts, queried at its trained distances."""
    from kvm_maglev.recall import RecallTask, make_example

    spec = json.loads((folder / "recall_task.json").read_text())
    task = dataclasses.replace(RecallTask(**spec["task"]), num_facts=FINE_TUNE_FACTS)
    generator = torch.Generator().manual_seed(seed)
    rows = [make_example(task, generator, spec["distances"]) for _ in range(examples)]
    return {"input_ids": torch.tensor([row.input_ids for row in rows]),
            "labels": torch.tensor([row.labels for row in rows])}


def adapted_model(folder, arm: str, seed: int) -> nn.Module:
    """The folder's model with fresh LoRA adapters (seeded), on a float32 base or a 4-bit nf4 one."""
    import peft

    from kvm_maglev.training import lora_target_modules

    base = load(folder, "bnb_nf4" if arm == "qlora" else None)
    if arm == "qlora":
        base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=lora_target_modules(base))
    return peft.get_peft_model(base, config)


def fine_tune(model: nn.Module, rows: dict, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    """`steps` AdamW steps on the adapters over batches drawn (seeded) from `rows`; the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        pick = torch.randint(len(rows["input_ids"]), (batch,), generator=generator)
        loss = model(input_ids=rows["input_ids"][pick], labels=rows["labels"][pick]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def run_arm(kind: str, arm: str, seed: int, args, train_rows: dict, eval_rows: dict) -> dict:
    folder = RECALL_MODELS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = adapted_model(folder, arm, seed)
        before = recall_loss(model.eval(), eval_rows)
        losses = fine_tune(model, train_rows, args.steps, args.batch, args.lr, seed)
        after = recall_loss(model.eval(), eval_rows)
    return {"model": kind, "arm": arm, "seed": seed, "eval_loss_before": before, "eval_loss_after": after,
            "train_loss_first_10": sum(losses[:10]) / len(losses[:10]),
            "train_loss_last_10": sum(losses[-10:]) / len(losses[-10:])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["kvm", "maglev"], choices=sorted(RECALL_MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--train-examples", type=int, default=512)
    parser.add_argument("--eval-examples", type=int, default=64)
    parser.add_argument("--out", type=str, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    from kvm_maglev import register_auto_classes

    register_auto_classes()  # the recall folders load as the package's classes (this process only)
    result = {"command": "python -m kvm_maglev.benchmarks.qlora_recall " + " ".join(argv or sys.argv[1:]),
              "facts": FINE_TUNE_FACTS, "torch": torch.__version__, "runs": [], "ratios": {}}
    for kind in args.models:
        eval_rows = recall_rows(RECALL_MODELS[kind], args.eval_examples, EVAL_SEED)
        for seed in args.seeds:
            train_rows = recall_rows(RECALL_MODELS[kind], args.train_examples, seed)
            arms = {arm: run_arm(kind, arm, seed, args, train_rows, eval_rows) for arm in ("lora", "qlora")}
            result["runs"].extend(arms.values())
            result["ratios"][f"{kind}_seed{seed}"] = arms["qlora"]["eval_loss_after"] / arms["lora"]["eval_loss_after"]
            print(json.dumps(list(arms.values())), flush=True)
            if args.out:  # each seed saved as it comes
                with open(args.out, "w", encoding="utf-8") as handle:
                    handle.write(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
