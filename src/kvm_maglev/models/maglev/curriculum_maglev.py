"""Maglev's training curriculum, kept apart from the model's math (modeling_maglev).

- The lifted pass: the prefiller Q reads the sequence in parallel and its shifted memories m' feed P.
- The self-fed passes after it (`memory_self_feed_steps`): P fed its own shifted memories, as inference
  feeds it, mixed per position with Q's (`memory_self_feed_mix`), with optional noise (`memory_noise_std`).
- The consistency loss between P's memories and Q's.
- The step schedules: the self-feeding chance's ramp, the consistency weight's ramp, the step from which Q
  is a frozen teacher. The training loop sets them once per optimizer step (`kvm_maglev.training.
  MaglevStepCallback`, or `model.set_training_step(step)` in a loop of one's own) as a `Schedule`; the
  forward reads that schedule, never the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Schedule:
    """The step-dependent training switches at one optimizer step."""

    self_feed_mix: float  # chance per position that a self-fed pass reads P's own memory
    consistency_weight: float  # loss = lm_loss + consistency_weight * consistency_loss
    frozen_teacher: bool  # Q's memories are fixed targets (no gradient into Q): consistency_detach_target_after


def schedule_at(config, step: int) -> Schedule:
    """`config`'s schedule at optimizer step `step`: the self-feeding chance ramped linearly over
    `memory_self_feed_mix_ramp_steps`; the consistency weight constant, ramped linearly to
    `consistency_weight_final`, or `consistency_weight_after_detach` once Q is a frozen teacher."""
    after = config.consistency_detach_target_after
    frozen = after is not None and step >= after
    mix = config.memory_self_feed_mix
    if config.memory_self_feed_mix_ramp_steps:
        mix *= min(1.0, step / config.memory_self_feed_mix_ramp_steps)
    if frozen and config.consistency_weight_after_detach is not None:
        weight = config.consistency_weight_after_detach
    elif config.consistency_weight_ramp_steps:
        progress = min(1.0, step / config.consistency_weight_ramp_steps)
        weight = config.consistency_weight + progress * (config.consistency_weight_final - config.consistency_weight)
    else:
        weight = config.consistency_weight
    return Schedule(mix, weight, frozen)


def step_dependent(config) -> bool:
    """Whether a training switch changes with the optimizer step (then the model must be told the step)."""
    return bool(config.memory_self_feed_mix_ramp_steps or config.consistency_weight_ramp_steps
                or config.consistency_detach_target_after is not None)


def current_schedule(model) -> Schedule:
    """The schedule the training loop set on `model` (a MaglevModel); step 0's when none was set, which
    training with step-dependent switches refuses (it would train on step 0's schedule throughout)."""
    if model.schedule is not None:
        return model.schedule
    if model.training and step_dependent(model.config):
        raise ValueError("this Maglev config changes its training with the step (memory_self_feed_mix_ramp_steps, "
                         "consistency_weight_ramp_steps or consistency_detach_target_after): pass "
                         "kvm_maglev.training.MaglevStepCallback() to Trainer, or call "
                         "model.set_training_step(step) in your loop")
    return schedule_at(model.config, 0)


def lifted_passes(prefiller: Callable[[], torch.Tensor], decoder: Callable[[torch.Tensor, bool], tuple],
                  shifted: Callable[[torch.Tensor], torch.Tensor], config, schedule: Schedule, passes: int,
                  valid: torch.Tensor | None, noise_std: float) -> tuple:
    """Lifted parallel training: pass 0 feeds P the prefiller's shifted memories m'; each later pass (the
    self-fed passes of training) feeds P the shifted memories of the pass before, mixed with m' by the schedule's
    chance and noised (`noise_std`). `prefiller()` gives Q's memories m' of the sequence, `decoder(mu, last)` P's
    head inputs and memories in parallel fed `mu` (the `last` pass writes the cache and the hidden states),
    `shifted(m)` a sequence of memories shifted one token on. Returns per pass the head inputs, the last pass's
    memories, m' and the consistency loss averaged over passes."""
    targets = prefiller()
    teacher = schedule.frozen_teacher
    prefiller_mu = shifted(targets.detach() if teacher else targets)
    heads, losses, memories = [], [], None
    for i in range(passes):
        mu = prefiller_mu
        if memories is not None:
            own = memories.detach() if config.memory_self_feed_detach else memories
            mu = mixed_memories(shifted(own), prefiller_mu, schedule.self_feed_mix)
        head, memories = decoder(noisy(mu, noise_std), i == passes - 1)
        heads.append(head)
        losses.append(consistency(config, memories, targets, valid, detach=teacher))
    return heads, memories, targets, torch.stack(losses).mean()


def mixed_memories(own: torch.Tensor, prefiller_mu: torch.Tensor, chance: float) -> torch.Tensor:
    """Per position P's own shifted memory with probability `chance`, else the prefiller's: parallel
    scheduled sampling."""
    if chance >= 1.0:
        return own
    pick = torch.rand(own.shape[:2], device=own.device) < chance
    return torch.where(pick[..., None], own, prefiller_mu)


def noisy(mu: torch.Tensor, std: float) -> torch.Tensor:
    """Gaussian noise on the memory inputs (`memory_noise_std`, training only), so that P learns to read
    imperfect memories like its own at inference."""
    return mu + std * torch.randn_like(mu) if std else mu


def consistency(config, memories, targets, valid, detach: bool = False) -> torch.Tensor:
    """L_cons over real tokens: mean squared error over tokens and channels, or mean 1 - cosine."""
    if detach or config.consistency_detach_target:
        targets = targets.detach()
    memories, targets = memories.float(), targets.float()
    if config.consistency_loss == "mse":
        per_token = (memories - targets).square().mean(dim=-1)
    else:
        per_token = 1.0 - F.cosine_similarity(memories, targets, dim=-1)
    if valid is None:
        return per_token.mean()
    weights = valid.to(per_token.dtype)
    return (per_token * weights).sum() / weights.sum().clamp(min=1.0)
