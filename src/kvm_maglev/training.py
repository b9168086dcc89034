"""Reusable pieces for fine-tuning KVM and Maglev models with Trainer, PEFT and accelerate.

- `group_texts_dataset`: tokenise texts and pack them into fixed-length causal-LM blocks.
- `LossComponentsTrainer`: a Trainer that also logs the loss terms a model returns beside
  `loss` (Maglev: `lm_loss` and `consistency_loss`), for training and evaluation.
- `LORA_TARGET_MODULES` / `lora_target_modules`: the documented LoRA targets per architecture.
- `parameter_digest`: one hash over all parameters, to check replicas and resumed runs agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, Trainer

# Linear layers worth adapting, per `config.model_type` and group. PEFT matches each name
# against the last component of a module's dotted path, so "c_proj" selects both the
# attention output and the MLP output projection in nanochat-style blocks.
LORA_TARGET_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "kvm": {
        "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mlp": ("up_proj", "down_proj"),
    },
    "maglev": {
        "attention": ("c_q", "c_k", "c_v", "c_proj"),
        "mlp": ("c_fc", "c_proj"),
        # the projections that inject the carried memory into keys and values
        "memory": ("mem_k", "mem_v"),
    },
}

LOSS_COMPONENT_NAMES = ("lm_loss", "consistency_loss")


def lora_target_modules(model: nn.Module, groups: Sequence[str] | None = None) -> list[str]:
    """LoRA `target_modules` for a KVM or Maglev model: the documented groups that exist in it.

    `groups` picks from LORA_TARGET_MODULES[model_type] (default: all groups). Raises ValueError
    for an unknown architecture or when a documented name matches no linear layer of the model.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LORA_TARGET_MODULES:
        raise ValueError(
            f"no documented LoRA target modules for model_type {model_type!r}; "
            f"known: {sorted(LORA_TARGET_MODULES)}. Pass target_modules to peft.LoraConfig yourself."
        )
    documented = LORA_TARGET_MODULES[model_type]
    chosen_groups = list(documented) if groups is None else list(groups)
    unknown = [group for group in chosen_groups if group not in documented]
    if unknown:
        raise ValueError(f"unknown LoRA group(s) {unknown} for {model_type}; known: {list(documented)}")
    linear_names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    names: list[str] = []
    for group in chosen_groups:
        for name in documented[group]:
            if name not in linear_names:
                raise ValueError(f"documented LoRA target {name!r} ({group}) is not a linear layer of this {model_type} model")
            if name not in names:
                names.append(name)
    return names


def group_texts_dataset(
    texts: Iterable[str],
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    *,
    separator_token_id: int | None = None,
) -> Any:
    """Tokenise `texts`, join them (separated by `separator_token_id`, default the EOS token) and cut
    the stream into blocks of `block_size` tokens: a `datasets.Dataset` with `input_ids` and `labels`.

    Packed blocks need no padding, which keeps training on the models' unpadded fast path. The
    remainder shorter than one block is dropped.
    """
    import datasets

    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    texts = [text for text in texts if text and text.strip()]
    if not texts:
        raise ValueError("no non-empty texts to tokenise")
    if separator_token_id is None:
        separator_token_id = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        if separator_token_id is not None:
            stream.append(separator_token_id)
    num_blocks = len(stream) // block_size
    if num_blocks == 0:
        raise ValueError(f"the texts give {len(stream)} tokens, fewer than one block of {block_size}")
    blocks = [stream[i * block_size : (i + 1) * block_size] for i in range(num_blocks)]
    return datasets.Dataset.from_dict({"input_ids": blocks, "labels": [list(block) for block in blocks]})


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's name and exact bytes (in float32 on CPU)."""
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


class LossComponentsTrainer(Trainer):
    """Trainer that logs the extra loss terms of a model's output beside the total loss.

    Maglev returns `loss = lm_loss + consistency_weight * consistency_loss`; this Trainer logs
    `lm_loss` and `consistency_loss` (training) and `eval_lm_loss`, `eval_consistency_loss`
    (evaluation), each averaged over the micro-batches since the last log and over processes.
    Models without these outputs train exactly as with a plain Trainer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._component_sums: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}
        self._component_counts: dict[str, int] = {"train": 0, "eval": 0}

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self._record_components(outputs, "train" if model.training else "eval")
        return (loss, outputs) if return_outputs else loss

    def _record_components(self, outputs: Any, phase: str) -> None:
        sums = self._component_sums[phase]
        found = False
        for name in LOSS_COMPONENT_NAMES:
            value = outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name, None)
            if isinstance(value, torch.Tensor):
                value = value.detach().float().mean()
                sums[name] = sums[name] + value if name in sums else value
                found = True
        if found:
            self._component_counts[phase] += 1

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self._pop_component_means("train", prefix=""))
        elif "eval_loss" in logs:
            logs.update(self._pop_component_means("eval", prefix="eval_"))
        super().log(logs, start_time)

    def _pop_component_means(self, phase: str, prefix: str) -> dict[str, float]:
        # every process logs at the same step, so the cross-process mean is a collective here
        sums, count = self._component_sums[phase], self._component_counts[phase]
        self._component_sums[phase], self._component_counts[phase] = {}, 0
        means = {}
        for name in sorted(sums):
            mean = (sums[name] / count).to(self.args.device)
            means[prefix + name] = round(self.accelerator.reduce(mean, reduction="mean").item(), 4)
        return means
