"""Worker for the FSDP2 test: 5 Trainer steps on a model folder, whole (one process) or sharded by
transformers' FSDP2 at load time (`torchrun --nproc-per-node 2`, `DistributedConfig(fsdp_size=2)`); the same
4 blocks make each step either way. Writes the step losses and the trained model (gathered on rank 0)."""

from __future__ import annotations

import json
import os
import sys

import datasets
import torch
from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

from kvm_maglev.training import LossComponentsTrainer

GLOBAL_BATCH = 4


def main(model_dir: str, out_dir: str, block_size: int) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharding = {}
    if world > 1:
        from transformers.distributed import DistributedConfig

        sharding = {"distributed_config": DistributedConfig(fsdp_size=world)}
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32, **sharding)
    vocab = model.config.vocab_size
    ids = torch.arange(8 * GLOBAL_BATCH * block_size).mul(7).remainder(vocab - 10).add(5).view(-1, block_size)
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=out_dir, max_steps=5, per_device_train_batch_size=GLOBAL_BATCH // world, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
    )
    trainer = LossComponentsTrainer(model=model, args=args, train_dataset=blocks, data_collator=default_data_collator)
    trainer.train()
    if world > 1:
        from transformers.distributed.utils import gather_full_state_dict

        weights = gather_full_state_dict(trainer.model)  # every rank takes part; rank 0 gets the whole
    else:
        weights = trainer.model.state_dict()
    if trainer.is_world_process_zero():
        # a plain copy of the model with the trained weights, saved as any model is
        whole = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32)
        whole.load_state_dict(weights)
        whole.save_pretrained(os.path.join(out_dir, "final"))
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        with open(os.path.join(out_dir, "losses.json"), "w") as handle:
            json.dump({"world_size": world, "losses": losses}, handle)
    if torch.distributed.is_initialized():
        # torch's gloo group, left to the interpreter's exit, sometimes aborts the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
