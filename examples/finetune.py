"""Fine-tune a KVM or Maglev model (any causal-LM folder) on local text with Trainer.

Single process:
    python examples/finetune.py --model MODEL_DIR --output-dir runs/ft
LoRA (attention, MLP and, for Maglev, the memory projections):
    python examples/finetune.py --model MODEL_DIR --output-dir runs/lora --lora
Several processes (DDP; on a machine without GPUs this runs on CPU with gloo):
    accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --model MODEL_DIR --output-dir runs/ddp
Sharded weights, gradients and optimizer state (FSDP2, one unit per decoder block):
    accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --model MODEL_DIR --output-dir runs/fsdp --fsdp
DeepSpeed ZeRO-3 (also on CPU; docs/distributed.md):
    accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --model MODEL_DIR --output-dir runs/z3
        --deepspeed examples/deepspeed_zero3.json   (one command line)

The text file is read with `datasets` (one document per line), tokenised and packed into blocks
of `--block-size` tokens; a fraction of the blocks is held out for the evaluation loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from kvm_maglev.models.common.activation_checkpointing import enable_activation_checkpointing
from kvm_maglev.training import (
    MAGLEV_RECIPE,
    MAGLEV_RECIPES,
    MAGLEV_SCHEDULES,
    LossComponentsTrainer,
    MaglevStepCallback,
    group_texts_dataset,
    lora_target_modules,
    maglev_recipe_callbacks,
    parameter_digest,
    training_block_size,
)

DEFAULT_TEXT = Path(__file__).parent / "data" / "tiny_corpus.txt"
# Maglev fields that add or move layers (the rest of a recipe only changes how training runs)
ARCHITECTURE_FIELDS = ("memory_projection", "memory_residual_injection", "memory_source_layer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (or Hub id) loaded with trust_remote_code")
    parser.add_argument("--output-dir", required=True, help="where checkpoints and the final model go")
    parser.add_argument("--train-file", default=str(DEFAULT_TEXT), help="plain text, one document per line")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per packed training block (default: 128, or for KVM the shortest whole number "
                             "of chunks that trains its state, if longer)")
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="share of blocks held out (0 = no eval)")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4, help="per-device micro-batch size")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--eval-steps", type=int, default=50)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (also works on CPU)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--resume", nargs="?", const=True, default=None,
                        help="resume from the latest checkpoint in --output-dir, or from the given checkpoint")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of all weights")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=int, default=16)
    parser.add_argument("--lora-targets", default=None,
                        help="comma-separated module names (default: the documented targets of the architecture)")
    parser.add_argument("--merge-lora", action="store_true", help="also save the merged model to OUTPUT_DIR/merged")
    parser.add_argument("--maglev-recipe", choices=sorted(MAGLEV_RECIPES), default=MAGLEV_RECIPE,
                        help="Maglev memory-training recipe (applies to Maglev models that kept their prefiller)")
    parser.add_argument("--ddp-find-unused-parameters", action="store_true",
                        help="let DDP look for parameters without a gradient each step (slower; needed when a "
                             "step can leave some unused, e.g. KVM on blocks shorter than its attention window)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard weights, gradients and optimizer state across the processes (FSDP2, one unit "
                             "per decoder block); checkpoints are sharded, the final model is saved whole")
    parser.add_argument("--deepspeed", default=None, metavar="CONFIG_JSON",
                        help="train with DeepSpeed (ZeRO) from this config file instead of DDP")
    parser.add_argument("--check-replicas", action="store_true",
                        help="after training, check that every process holds identical parameters "
                             "(writes OUTPUT_DIR/replicas.json)")
    args = parser.parse_args(argv)
    if not 0 <= args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.check_replicas and (args.fsdp or args.deepspeed):
        parser.error("--check-replicas compares whole replicas: FSDP and DeepSpeed ZeRO shard them")
    if args.fsdp and args.deepspeed:
        parser.error("choose one of --fsdp and --deepspeed")
    return args


def build_datasets(args: argparse.Namespace, tokenizer) -> tuple:
    """Packed train and evaluation datasets from the local text file."""
    import datasets

    raw = datasets.load_dataset("text", data_files={"train": args.train_file}, split="train")
    blocks = group_texts_dataset(raw["text"], tokenizer, args.block_size)
    if args.eval_fraction == 0:
        return blocks, None
    num_eval = max(1, round(len(blocks) * args.eval_fraction))
    if num_eval >= len(blocks):
        raise ValueError(f"only {len(blocks)} blocks of {args.block_size} tokens: too few to hold out {num_eval}")
    split = blocks.train_test_split(test_size=num_eval, shuffle=True, seed=args.seed)
    return split["train"], split["test"]


def add_lora(model, args: argparse.Namespace):
    """Wrap `model` in a PEFT LoRA model on the documented (or given) target modules."""
    from peft import LoraConfig, get_peft_model

    if args.lora_targets:
        targets = [name.strip() for name in args.lora_targets.split(",") if name.strip()]
    else:
        targets = lora_target_modules(model)
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                        target_modules=targets, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.print_trainable_parameters()
    return model


def recipe_applies(config) -> bool:
    """Whether a memory recipe changes how this model trains: a Maglev model that kept its prefiller (one without
    it trains recurrently and has no lifted passes to change)."""
    return config.model_type == "maglev" and bool(config.use_memory and config.has_prefiller)


def recipe_callbacks(config, recipe: str) -> list:
    """Trainer callbacks: for a Maglev model the step callback, and the recipe's schedule where the recipe applies."""
    if config.model_type != "maglev":
        return []
    return maglev_recipe_callbacks(recipe) if recipe_applies(config) else [MaglevStepCallback()]


def apply_maglev_recipe(model, recipe: str) -> None:
    """Train a Maglev model that kept its prefiller with the named memory recipe (its fields saved in the config,
    its schedule run by a callback, `recipe_callbacks`); other models are left alone."""
    config = model.config
    if not recipe_applies(config):
        return
    for field, value in MAGLEV_RECIPES[recipe].items():
        if field in ARCHITECTURE_FIELDS and getattr(config, field) != value:
            raise ValueError(f"recipe {recipe!r} sets {field}, which changes the model's layers: "
                             "it applies to models trained from scratch, not to a loaded one")
        setattr(config, field, value)
    config.validate_maglev()


def fsdp_config(model) -> dict:
    """Trainer's FSDP2 settings: each decoder block (`_no_split_modules`) is one sharding unit, gathered for
    its own forward and backward; checkpoints hold each process's shard (resumable with --resume)."""
    return {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": list(model._no_split_modules),
        "state_dict_type": "SHARDED_STATE_DICT",
        "reshard_after_forward": True,
    }


def save_final_model(trainer, output_dir: str) -> None:
    """Save the trained model as one folder `from_pretrained` reads; under FSDP its shards are gathered
    first (checkpoints written during training stay sharded)."""
    if trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(output_dir)


def check_replicas(model, output_dir: str) -> dict:
    """Gather every process's parameter digest; raise if they differ, and record them."""
    digest = parameter_digest(model)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        digests = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, digest)
        rank = torch.distributed.get_rank()
    else:
        digests, rank = [digest], 0
    report = {"world_size": len(digests), "digests": digests, "identical": len(set(digests)) == 1}
    if rank == 0:
        Path(output_dir, "replicas.json").write_text(json.dumps(report, indent=2))
    if not report["identical"]:
        raise RuntimeError(f"processes ended with different parameters: {digests}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype=torch.float32)
    apply_maglev_recipe(model, args.maglev_recipe)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if args.lora:
        model = add_lora(model, args)
    if args.block_size is None:
        args.block_size = training_block_size(model.config)
    train_dataset, eval_dataset = build_datasets(args, tokenizer)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if eval_dataset is not None else "no",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        bf16=args.bf16,
        seed=args.seed,
        report_to="none",
        label_names=["labels"],
        # by default every parameter must get a gradient each step: DDP then skips the unused-parameter search.
        # A recipe's switch to P's own rollouts leaves the prefiller without one from then on: DDP must search.
        ddp_find_unused_parameters=args.ddp_find_unused_parameters or (
            recipe_applies(model.config) and args.maglev_recipe in MAGLEV_SCHEDULES),
        use_cpu=not torch.cuda.is_available(),
        fsdp=True if args.fsdp else None,
        fsdp_config=fsdp_config(model) if args.fsdp else None,
        deepspeed=args.deepspeed,
    )
    trainer = LossComponentsTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=recipe_callbacks(model.config, args.maglev_recipe),
    )
    if args.fsdp and not trainer.is_fsdp_enabled:
        raise SystemExit("--fsdp: accelerate applies FSDP only on GPUs (and other accelerators); on CPU it runs the "
                         "processes as MULTI_CPU and would train unsharded. See docs/distributed.md for CPU FSDP2.")
    try:
        train_and_save(trainer, args, eval_dataset is not None, tokenizer)
    finally:
        # a gloo process group left to the interpreter's exit can abort the process after a finished run; DDP's
        # reducer goes first, as it still holds the group
        trainer.model_wrapped = trainer.model
        trainer.accelerator.free_memory()
        trainer.accelerator.end_training()
    return 0


def train_and_save(trainer: Trainer, args: argparse.Namespace, evaluate: bool, tokenizer) -> None:
    """Train, evaluate, save the final model and, if asked, check the replicas and merge LoRA."""
    trainer.train(resume_from_checkpoint=args.resume)
    if evaluate:
        trainer.evaluate()
    save_final_model(trainer, args.output_dir)
    if args.check_replicas:
        check_replicas(trainer.model, args.output_dir)
    if args.lora and args.merge_lora and trainer.is_world_process_zero():
        merged = trainer.model.merge_and_unload()
        merged.save_pretrained(os.path.join(args.output_dir, "merged"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "merged"))


if __name__ == "__main__":
    sys.exit(main())
