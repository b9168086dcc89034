"""Maglev's memory-training switches (issue: P trained on its own memories): self-fed passes, mixing,
memory source/projection, residual injection, schedules; each against a simpler path that must agree."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.curriculum_maglev import Schedule
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM
from kvm_maglev.training import MaglevStepCallback
from tests.models.maglev.test_maglev_model import VOCAB, random_ids, tiny_config, tiny_model

SHAPE_SWITCHES = [
    {"memory_projection": True},
    {"memory_source_layer": 1},
    {"memory_residual_injection": True},
    {"memory_projection": True, "memory_source_layer": 0, "memory_residual_injection": True},
]


@torch.no_grad()
@pytest.mark.parametrize("switches", SHAPE_SWITCHES)
def test_memory_shape_switches_keep_cached_decoding_equal_to_uncached(switches):
    model = tiny_model(**switches)
    ids = random_ids(2, 40)
    full = model(ids, use_cache=False).logits
    cache = MaglevCache(model.config)
    steps = [model(ids[:, :9], past_key_values=cache, use_cache=True).logits]
    steps += [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(9, 40)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 2e-5


@torch.no_grad()
@pytest.mark.parametrize("switches", SHAPE_SWITCHES)
def test_memory_shape_switches_keep_lifted_consistency(switches):
    """Invariant 4 with the memory read elsewhere: P in parallel on shift(own m) reproduces the recurrent run."""
    model = tiny_model(**switches)
    ids = random_ids(2, 40)
    recurrent = model.model(ids, use_cache=False)
    mu = model.model.shifted_memories(recurrent.memories, None)
    lifted = model.model(ids, use_cache=False, memory_inputs=mu)
    assert (lifted.memories - recurrent.memories).abs().max() < 2e-5
    assert (lifted.last_hidden_state - recurrent.last_hidden_state).abs().max() < 2e-5
    if switches.get("memory_projection") or "memory_source_layer" in switches:
        assert (recurrent.memories - recurrent.last_hidden_state).abs().max() > 1e-2  # the memory is not the head input


@torch.no_grad()
def test_zero_residual_projection_changes_nothing():
    model = tiny_model(memory_residual_injection=True)
    model.model.memory_residual_proj.weight.zero_()
    plain = MaglevForCausalLM(tiny_config()).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and unexpected == ["model.memory_residual_proj.weight"]
    ids = random_ids(2, 30)
    assert (model(ids, use_cache=False).logits - plain(ids, use_cache=False).logits).abs().max() < 1e-6


def test_self_fed_pass_is_p_on_the_previous_pass_memories():
    """k=1: pass 1 equals P run in parallel on the shifted memories of pass 0 (fed the prefiller's)."""
    model = tiny_model(memory_self_feed_steps=1).train()
    ids = random_ids(2, 30)
    out = model.model(ids, lifted=True)
    first, second = out.pass_hidden_states
    with torch.no_grad():
        targets = model.model.prefiller_memories(ids)
        pass0 = model.model(ids, use_cache=False, memory_inputs=model.model.shifted_memories(targets, None))
        pass1 = model.model(ids, use_cache=False, memory_inputs=model.model.shifted_memories(pass0.memories, None))
    assert (first - pass0.last_hidden_state).abs().max() < 1e-5
    assert (second - pass1.last_hidden_state).abs().max() < 1e-5
    assert (out.last_hidden_state - second).abs().max() == 0


def test_self_fed_loss_is_the_mean_over_passes():
    model = tiny_model(memory_self_feed_steps=2, consistency_weight=0.3).train()
    ids = random_ids(2, 30)
    torch.manual_seed(0)
    out = model(ids, labels=ids)
    heads = model.model(ids, lifted=True).pass_hidden_states
    per_pass = [torch.nn.functional.cross_entropy(model.logits(h)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                for h in heads]
    assert len(heads) == 3
    assert torch.allclose(out.lm_loss, torch.stack(per_pass).mean(), atol=1e-5)
    assert torch.allclose(out.loss, out.lm_loss + 0.3 * out.consistency_loss, atol=1e-6)
    # evaluation mode runs the paper's single lifted pass
    assert model.eval().model(ids, lifted=True, use_cache=False).pass_hidden_states is None


@pytest.mark.parametrize("detach", [False, True])
def test_self_feed_detach_cuts_the_gradient_between_passes(detach):
    """With the loss of the last pass alone, P's first pass gets a gradient only through the fed memories."""
    model = tiny_model(memory_self_feed_steps=1, memory_self_feed_detach=detach, prefiller_shares_blocks=False).train()
    ids = random_ids(2, 30)
    out = model.model(ids, lifted=True)
    out.pass_hidden_states[-1].square().sum().backward()
    prefiller_grad = model.model.prefiller_layers[0].mlp.up_proj.weight.grad
    # pass 1 is fed pass 0's memories only; pass 0 is fed Q's, so Q sees the last pass only through pass 0
    assert (prefiller_grad is None or prefiller_grad.abs().max() == 0) == detach


def test_mix_zero_feeds_the_prefiller_and_mix_one_feeds_p():
    ids = random_ids(2, 30)
    for mix, equal_to_pass0 in ((0.0, True), (1.0, False)):
        model = tiny_model(memory_self_feed_steps=1, memory_self_feed_mix=mix).train()
        first, second = model.model(ids, lifted=True).pass_hidden_states
        assert torch.equal(first, second) == equal_to_pass0


def test_mix_ramp_and_consistency_schedule_follow_the_step():
    model = tiny_model(memory_self_feed_steps=1, memory_self_feed_mix_ramp_steps=10,
                       consistency_weight=0.1, consistency_weight_final=1.1, consistency_weight_ramp_steps=10,
                       consistency_detach_target_after=20, consistency_weight_after_detach=5.0).train()
    ids = random_ids(2, 30)
    with pytest.raises(ValueError, match="MaglevStepCallback"):
        model(ids, labels=ids)
    model.set_training_step(0)
    first, second = model.model(ids, lifted=True).pass_hidden_states
    assert torch.equal(first, second)  # mix ramps from 0: all prefiller at step 0
    assert model.model.schedule == Schedule(self_feed_mix=0.0, consistency_weight=pytest.approx(0.1),
                                            frozen_teacher=False)
    model.set_training_step(5)
    assert model.model.schedule == Schedule(0.5, pytest.approx(0.6), False)
    model.set_training_step(25)
    assert model.model.schedule == Schedule(1.0, 5.0, True)
    # past the teacher step the prefiller gets no gradient at all
    separate = tiny_model(prefiller_shares_blocks=False, consistency_detach_target_after=3).train()
    separate.set_training_step(3)
    separate(ids, labels=ids).loss.backward()
    grad = separate.model.prefiller_layers[0].mlp.up_proj.weight.grad
    assert grad is None or grad.abs().max() == 0


def test_step_callback_sets_the_step_inside_trainer_with_accumulation_and_checkpointing(tmp_path):
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=2, memory_self_feed_steps=1, memory_self_feed_mix_ramp_steps=4,
                         memory_noise_std=0.05, memory_residual_injection=True, consistency_weight=0.1)
    model = MaglevForCausalLM(config)
    ids = random_ids(8, 24)
    data = [{"input_ids": row, "labels": row} for row in ids]
    seen = []

    class Record(MaglevStepCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(model.model.schedule.self_feed_mix)

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, gradient_checkpointing=True, learning_rate=1e-3,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Record()]).train()
    assert seen == [0.0, 0.25, 0.5]  # the ramp over 4 steps, at Trainer's global steps 0, 1, 2
    assert model.model.memory_residual_proj.weight.abs().max() > 0  # the zero-initialised way in learned


@torch.no_grad()
def test_training_switches_leave_inference_unchanged():
    """Training-only switches change nothing at inference (same weights, same logits and cache)."""
    ids = random_ids(2, 30)
    plain = tiny_model()
    switched = tiny_model(memory_self_feed_steps=3, memory_self_feed_mix=0.5, memory_noise_std=0.3,
                          consistency_detach_target_after=0)
    assert torch.equal(plain(ids, use_cache=False).logits, switched(ids, use_cache=False).logits)
    assert torch.equal(plain.generate(ids[:, :5], max_new_tokens=6, do_sample=False),
                       switched.generate(ids[:, :5], max_new_tokens=6, do_sample=False))


def test_switches_round_trip_and_validate(tmp_path):
    model = tiny_model(memory_projection=True, memory_self_feed_steps=2, consistency_weight_final=0.5,
                       consistency_weight_ramp_steps=100)
    model.save_pretrained(tmp_path)
    loaded = MaglevForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.memory_self_feed_steps == 2 and loaded.config.consistency_weight_ramp_steps == 100
    assert torch.equal(loaded.model.memory_proj.weight, model.model.memory_proj.weight)
    for fields, name in [({"memory_source_layer": 3}, "memory_source_layer"),
                         ({"memory_self_feed_steps": -1}, "memory_self_feed_steps"),
                         ({"memory_self_feed_mix": 1.5}, "memory_self_feed_mix"),
                         ({"consistency_weight_final": 1.0}, "consistency_weight_final"),
                         ({"weight_init": "xavier"}, "weight_init"),
                         ({"use_memory": False, "memory_self_feed_steps": 1, "has_prefiller": False},
                          "memory_self_feed_steps")]:
        with pytest.raises(ValueError, match=name):
            tiny_config(**fields)



def test_model_card_names_the_training_recipe():
    from kvm_maglev.convert.cards import render_model_card

    paper = render_model_card(tiny_config(), num_parameters=10)
    fed = render_model_card(tiny_config(memory_self_feed_steps=2, memory_residual_injection=True,
                                        weight_init="torch"), num_parameters=10)
    assert "training recipe" in paper and "own memories" not in paper
    assert "P fed its own memories in 2 more passes" in fed and "block input" in fed and "torch init" in fed


def test_the_forward_mode_is_chosen_in_one_place_from_the_callers_switches(monkeypatch):
    """`forward_mode` picks each of FORWARD_MODES: in training mode `training_forward` decides (lifted, or what
    generate() samples from: here the prefiller reads the prompt), a cache that has read tokens continues
    recurrently, given memory inputs and use_memory=False have their own."""
    from kvm_maglev.models.maglev import modeling_maglev

    picked = []
    real = modeling_maglev.MaglevModel.forward_mode
    monkeypatch.setattr(modeling_maglev.MaglevModel, "forward_mode",
                        lambda self, *args: picked.append(real(self, *args)) or picked[-1])
    ids = random_ids(2, 12)
    model = tiny_model(memory_prefill="prefiller")
    model.train()
    model(ids)
    model.config.training_forward = "recurrent"
    model(ids)
    model.eval()
    with torch.no_grad():
        cache = model(ids[:, :8], use_cache=True).past_key_values
        model(ids[:, 8:], past_key_values=cache)
        model.model(ids, memory_inputs=torch.zeros(2, 12, 64))
        tiny_model(use_memory=False)(ids)
    assert picked == ["lifted", "prefill", "prefill", "recurrent", "given_memory", "no_memory"]
    assert set(picked) == set(modeling_maglev.FORWARD_MODES)
