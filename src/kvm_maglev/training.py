"""Reusable pieces for fine-tuning KVM and Maglev models with Trainer, PEFT and accelerate.

- `group_texts_dataset`: tokenise texts and pack them into fixed-length causal-LM blocks.
- `LossComponentsTrainer`: a Trainer that also logs the loss terms a model returns beside
  `loss` (Maglev: `lm_loss` and `consistency_loss`), for training and evaluation.
- `LORA_TARGET_MODULES` / `lora_target_modules`: the documented LoRA targets per architecture.
- `register_peft_defaults`: PEFT's default targets (LoRA, DoRA, IA3) for both model types, run on import.
- `parameter_digest`: one hash over all parameters, to check replicas and resumed runs agree.
- `training_block_size`: a block length that trains every weight (KVM's state needs one chunk past its window).
- `MaglevStepCallback`: tells a Maglev model the optimizer step, for its step-dependent training switches.
- `MAGLEV_RECIPES` / `MAGLEV_RECIPE`: named Maglev memory-training recipes, and the one the examples use;
  `maglev_recipe_callbacks(recipe)`: the Trainer callbacks a recipe trains with (its schedule, if any).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, Trainer, TrainerCallback

# Linear layers worth adapting, per `config.model_type` and group. PEFT matches each name
# against the last component of a module's dotted path, so one name covers every layer (and,
# for Maglev with a separate prefiller Q, Q's blocks as well as P's).
LORA_TARGET_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "kvm": {
        "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mlp": ("up_proj", "down_proj"),
    },
    "maglev": {
        "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mlp": ("up_proj", "down_proj"),
        # the projections that inject the carried memory into keys and values
        "memory": ("memory_k_proj", "memory_v_proj"),
    },
}

# Maglev memory-training recipes: MaglevConfig fields over the paper's (pass 0 fed the prefiller's memories
# only). Measured on the recall task in docs/maglev_memory.md; `MAGLEV_RECIPE` is the one examples train with.
MAGLEV_RECIPES: dict[str, dict[str, Any]] = {
    "paper": {},
    # the paper's pass-0 training at other consistency weights (train_recall/train_lm's default is 0.1): weight 0
    # leaves the prefiller free (the language-modelling ladder's rung), weight 1 is the paper's separate-parameter run
    "paper_w0": {"consistency_weight": 0.0},
    "paper_w1": {"consistency_weight": 1.0},
    "self_feed1": {"memory_self_feed_steps": 1},
    "self_feed2": {"memory_self_feed_steps": 2},
    # two self-fed passes without the consistency coupling (the language-modelling ladder's suggestion)
    "self_feed2_w0": {"memory_self_feed_steps": 2, "consistency_weight": 0.0},
    "self_feed4": {"memory_self_feed_steps": 4},
    "residual": {"memory_residual_injection": True},
    "self_feed2_residual": {"memory_self_feed_steps": 2, "memory_residual_injection": True},
    "self_feed2_projection": {"memory_self_feed_steps": 2, "memory_projection": True},
    "self_feed2_detach": {"memory_self_feed_steps": 2, "memory_self_feed_detach": True},
    "self_feed2_noise": {"memory_self_feed_steps": 2, "memory_noise_std": 0.1},
    # self_feed2, then P trained on its own rollouts for the last quarter (the schedule in MAGLEV_SCHEDULES)
    "self_feed2_then_recurrent_late": {"memory_self_feed_steps": 2},
}
# Recipes that change the training forward during a run: recipe -> the share of the optimizer steps trained lifted
# before P trains on its own rollouts (`training_forward="recurrent"`, the inference forward). A schedule is a
# callback (`maglev_recipe_callbacks`), not a config field: the saved config says how the model runs, not the run.
MAGLEV_SCHEDULES: dict[str, float] = {"self_feed2_then_recurrent_late": 0.75}
# Settled by the rule in docs/maglev_memory.md (issue 42): both candidates meet every recall target on seeds 0-2, and
# own-memory BPB on the cast corpus against the sliding window is -12.8% (mean of 2400 and 4800 steps, seeds 0-2)
# against self_feed2's -5.7% (docs/recall/recipe_decision.json).
MAGLEV_RECIPE = "self_feed2_then_recurrent_late"


def lora_target_modules(model: nn.Module, groups: Sequence[str] | None = None) -> list[str]:
    """LoRA `target_modules` for a KVM or Maglev model from LORA_TARGET_MODULES[model_type].

    `groups=None` takes every documented name that is a linear layer of this model (a Maglev
    checkpoint without memory has no memory projections); naming groups requires all their
    layers. Raises ValueError for an unknown architecture, group or missing layer.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LORA_TARGET_MODULES:
        raise ValueError(
            f"no documented LoRA target modules for model_type {model_type!r}; "
            f"known: {sorted(LORA_TARGET_MODULES)}. Pass target_modules to peft.LoraConfig yourself."
        )
    documented = LORA_TARGET_MODULES[model_type]
    unknown = [group for group in groups or () if group not in documented]
    if unknown:
        raise ValueError(f"unknown LoRA group(s) {unknown} for {model_type}; known: {list(documented)}")
    linear_names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    names: list[str] = []
    for group in documented if groups is None else groups:
        for name in documented[group]:
            if name not in linear_names:
                if groups is None:
                    continue
                raise ValueError(f"documented LoRA target {name!r} ({group}) is not a linear layer of this {model_type} model")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"none of the documented LoRA targets is a linear layer of this {model_type} model")
    return names


# PEFT's defaults when a config names no `target_modules`: PEFT looks them up per `model_type` in tables that
# know only in-library models. LoRA (and DoRA, a LoRA option) adapts every documented linear layer; IA3
# scales keys, values and the MLP's input to its down projection, as PEFT's Llama default does.
PEFT_DEFAULT_TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING": {
        model_type: tuple(name for group in groups.values() for name in group)
        for model_type, groups in LORA_TARGET_MODULES.items()
    },
    "TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING": dict.fromkeys(LORA_TARGET_MODULES,
                                                                        ("k_proj", "v_proj", "down_proj")),
    "TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING": dict.fromkeys(LORA_TARGET_MODULES, ("down_proj",)),
}


def register_peft_defaults() -> bool:
    """Add KVM's and Maglev's default targets to PEFT's tables, so `LoraConfig()` / `IA3Config()` without
    `target_modules` work on them. Done when this module is imported; False when PEFT is not installed."""
    try:
        from peft.utils import constants
    except ImportError:
        return False
    for table_name, defaults in PEFT_DEFAULT_TARGETS.items():
        table = getattr(constants, table_name)  # the dict PEFT's tuners read, changed in place
        for model_type, names in defaults.items():
            table.setdefault(model_type, list(names))
    return True


register_peft_defaults()


def training_block_size(config: Any, default: int = 128) -> int:
    """Packed-block length for fine-tuning: for KVM the shortest whole number of chunks that trains the state
    (its merge gate and norm get no gradient from shorter blocks), at least `default`; `default` otherwise."""
    if getattr(config, "model_type", None) != "kvm":
        return default
    from .models.kvm.modeling_kvm import state_training_length

    chunk = config.chunk_size
    return max(default, -(-state_training_length(config) // chunk) * chunk)


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
    (evaluation) since the previous log, over all micro-batches and processes: `lm_loss` as the
    mean cross-entropy per supervised token, `consistency_loss` as the mean of the per-batch
    values. Models without these outputs train exactly as with a plain Trainer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._component_totals: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        labels = inputs.get("labels")
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self._record_components(outputs, labels, num_items_in_batch, "train" if model.training else "eval")
        return (loss, outputs) if return_outputs else loss

    def _record_components(self, outputs: Any, labels: torch.Tensor | None, num_items_in_batch: Any,
                           phase: str) -> None:
        def output(name: str) -> torch.Tensor | None:
            value = outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name, None)
            return value.detach().float() if isinstance(value, torch.Tensor) else None

        found: dict[str, torch.Tensor] = {}
        lm_loss = output("lm_loss")
        if lm_loss is not None and labels is not None:
            supervised = labels[..., 1:].ne(-100).sum().float()
            # Trainer passes num_items_in_batch (the supervised tokens of the whole accumulated,
            # all-process batch) to models taking loss kwargs, which then divide their summed
            # cross-entropy by it instead of by this micro-batch's own count
            divisor = num_items_in_batch if num_items_in_batch is not None and self.model_accepts_loss_kwargs \
                else supervised
            found["lm_loss_sum"] = lm_loss * torch.as_tensor(divisor, dtype=torch.float32, device=lm_loss.device)
            found["lm_loss_tokens"] = supervised.to(lm_loss.device)
        consistency = output("consistency_loss")
        if consistency is not None:
            found["consistency_loss_sum"] = consistency.mean()
            found["consistency_loss_batches"] = torch.ones((), device=consistency.device)
        totals = self._component_totals[phase]
        for key, value in found.items():
            totals[key] = totals[key] + value if key in totals else value

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self._pop_component_means("train", prefix=""))
        elif "eval_loss" in logs:
            logs.update(self._pop_component_means("eval", prefix="eval_"))
        super().log(logs, start_time)

    def _pop_component_means(self, phase: str, prefix: str) -> dict[str, float]:
        # every process logs at the same step, so summing over processes is a collective here
        totals, self._component_totals[phase] = self._component_totals[phase], {}
        means = {}
        for name, count_key in (("lm_loss", "lm_loss_tokens"), ("consistency_loss", "consistency_loss_batches")):
            if count_key not in totals:
                continue
            pair = torch.stack([totals[f"{name}_sum"], totals[count_key]]).to(self.args.device)
            total, count = self.accelerator.reduce(pair, reduction="sum").tolist()
            means[prefix + name] = round(total / max(count, 1.0), 4)
        return means


class MaglevStepCallback(TrainerCallback):
    """Sets the training schedules (ramps, teacher switch) of every Maglev model inside the trained model (PEFT
    wrappers included) at each step's start from Trainer's global step, resumed runs too; the models read the
    schedules, not the step."""

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        if model is None:
            return
        for module in model.modules():
            if hasattr(module, "schedule") and hasattr(module, "set_training_step"):  # a MaglevModel
                module.set_training_step(state.global_step)


class MaglevRecurrentFrom(TrainerCallback):
    """Trains every Maglev model inside the trained model on P's own recurrent rollouts (`training_forward=
    "recurrent"`: P alone, token after token, gradients through the recurrence - what inference runs) from optimizer
    step `step` on, or from `round(share * max_steps)` when a share is given; before it the lifted forward trains P
    and the prefiller in parallel. At the end of training the forward the model came with is restored, so a saved
    model's config keeps it."""

    def __init__(self, step: int | None = None, *, share: float | None = None):
        if (step is None) == (share is None):
            raise ValueError("give either step or share")
        if share is not None and not 0 <= share <= 1:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.step, self.share = step, share
        self._before: dict[int, str] = {}

    def _models(self, model: nn.Module | None) -> list[nn.Module]:
        if model is None:
            return []
        return [m for m in model.modules() if getattr(getattr(m, "config", None), "model_type", None) == "maglev"
                and hasattr(m, "set_training_step")]

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        if self.share is not None:
            self.step = round(self.share * state.max_steps)
        self._before = {id(m.config): m.config.training_forward for m in self._models(model)}

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        forward = "recurrent" if state.global_step >= self.step else "lifted"
        for module in self._models(model):
            module.config.training_forward = forward

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        for module in self._models(model):
            module.config.training_forward = self._before.get(id(module.config), module.config.training_forward)


def maglev_recipe_callbacks(recipe: str = MAGLEV_RECIPE, max_steps: int | None = None) -> list[TrainerCallback]:
    """The Trainer callbacks a Maglev model trains with under `recipe`: the step callback, and the switch to P's own
    rollouts where the recipe has a schedule (MAGLEV_SCHEDULES), at its share of `max_steps` when given, else of
    the run's `max_steps` as Trainer reports it."""
    if recipe not in MAGLEV_RECIPES:
        raise ValueError(f"unknown Maglev recipe {recipe!r}; known: {sorted(MAGLEV_RECIPES)}")
    callbacks: list[TrainerCallback] = [MaglevStepCallback()]
    if recipe in MAGLEV_SCHEDULES:
        share = MAGLEV_SCHEDULES[recipe]
        callbacks.append(MaglevRecurrentFrom(share=share) if max_steps is None
                         else MaglevRecurrentFrom(round(share * max_steps)))
    return callbacks
