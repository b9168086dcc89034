"""The shipped Maglev recipe and its schedule: `maglev_recipe_callbacks` switches a real Trainer run to P's own
rollouts at the recipe's share of the steps and restores the config after; the `maglev` model of both training
examples is `MAGLEV_RECIPE` with its callbacks."""

from types import SimpleNamespace

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from kvm_maglev.recall import build_dataset, collate
from kvm_maglev.training import (
    MAGLEV_RECIPE,
    MAGLEV_RECIPES,
    MAGLEV_SCHEDULES,
    MaglevRecurrentFrom,
    MaglevStepCallback,
    maglev_recipe_callbacks,
)
from tests.ecosystem.ecosystem_support import load_example

train_recall = load_example("train_recall")
train_lm = load_example("train_lm")


class _Forwards(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.seen.append(model.config.training_forward)


def test_schedule_trains_the_last_quarter_on_ps_own_rollouts_and_restores_the_config(tmp_path):
    args = train_recall.parse_args(["--facts", "1", "--out", str(tmp_path)])
    model = train_recall.MODELS["maglev_self_feed2_then_recurrent_late"](args)
    assert model.config.memory_self_feed_steps == 2 and model.config.training_forward == "lifted"
    data = build_dataset(args.task, 16, list(range(4, 40)), queries_per_example=4, seed=0)
    record = _Forwards()
    callbacks = maglev_recipe_callbacks("self_feed2_then_recurrent_late") + [record]
    training = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=8, per_device_train_batch_size=2,
                                 learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                                 remove_unused_columns=False, disable_tqdm=True, logging_steps=100)
    Trainer(model=model, args=training, train_dataset=data, data_collator=collate, callbacks=callbacks).train()
    assert record.seen == ["lifted"] * 6 + ["recurrent"] * 2
    assert model.config.training_forward == "lifted"  # a saved model's config says how it runs, not the schedule


def test_recipe_callbacks():
    (step,) = maglev_recipe_callbacks("self_feed2")
    assert isinstance(step, MaglevStepCallback)
    late = maglev_recipe_callbacks("self_feed2_then_recurrent_late", max_steps=4800)
    assert isinstance(late[1], MaglevRecurrentFrom) and late[1].step == 3600
    assert set(MAGLEV_SCHEDULES) <= set(MAGLEV_RECIPES)
    with pytest.raises(ValueError, match="unknown Maglev recipe"):
        maglev_recipe_callbacks("self_feed3")
    with pytest.raises(ValueError, match="either step or share"):
        MaglevRecurrentFrom()
    switch = MaglevRecurrentFrom(share=0.5)
    switch.on_train_begin(None, SimpleNamespace(max_steps=10), None, model=None)
    assert switch.step == 5


def _kinds(callbacks):
    return [(type(c).__name__, getattr(c, "step", None)) for c in callbacks]


def test_maglev_of_both_examples_is_the_shipped_recipe(tmp_path):
    args = train_recall.parse_args(["--out", str(tmp_path)])
    config = train_recall.MODELS["maglev"](args).config
    assert train_recall.model_recipe("maglev") == MAGLEV_RECIPE
    for field, value in MAGLEV_RECIPES[MAGLEV_RECIPE].items():
        assert getattr(config, field) == value
    steps = 40
    model = train_lm.ARMS["maglev"](steps)
    assert _kinds(train_lm.arm_callbacks("maglev", model, steps)) == _kinds(maglev_recipe_callbacks(MAGLEV_RECIPE, steps))
    assert train_lm.arm_recipe("maglev_teacher_w1") is None and train_lm.arm_recipe("swa_baseline") is None
    # the challenger arm keeps its switch at three quarters of the run, as in the issue-28 runs
    late = train_lm.arm_callbacks("maglev_self_feed2_then_recurrent_late", model, 4800)
    assert [c.step for c in late if isinstance(c, MaglevRecurrentFrom)] == [3600]


def test_finetune_trains_with_the_recipes_callbacks():
    finetune = load_example("finetune")
    kept = SimpleNamespace(model_type="maglev", use_memory=True, has_prefiller=True)
    late = finetune.recipe_callbacks(kept, "self_feed2_then_recurrent_late")
    assert [type(c) for c in late] == [MaglevStepCallback, MaglevRecurrentFrom] and late[1].share == 0.75
    assert _kinds(finetune.recipe_callbacks(kept, MAGLEV_RECIPE)) == _kinds(maglev_recipe_callbacks(MAGLEV_RECIPE))
    alone = SimpleNamespace(model_type="maglev", use_memory=True, has_prefiller=False)
    assert [type(c) for c in finetune.recipe_callbacks(alone, "self_feed2_then_recurrent_late")] == [MaglevStepCallback]
    assert finetune.recipe_callbacks(SimpleNamespace(model_type="kvm"), MAGLEV_RECIPE) == []


def test_the_card_names_a_recipe_and_its_schedule():
    from kvm_maglev.convert.cards import render_model_card

    config = train_recall.MODELS["maglev"](train_recall.parse_args(["--out", "unused"])).config
    late = render_model_card(config, num_parameters=10, recipe="self_feed2_then_recurrent_late")
    assert "`self_feed2_then_recurrent_late`: lifted parallel training" in late
    assert "own rollouts (the inference forward) for the last 25% of the optimizer steps" in late
    plain = render_model_card(config, num_parameters=10)
    assert "own rollouts" not in plain and "P fed its own memories in 2 more passes" in plain


def test_a_kept_maglev_records_its_recipe_and_the_shipped_demo_model_is_the_shipped_recipe(tmp_path):
    from kvm_maglev.demo import RECALL_MODELS_DIR, _demo_card, load_task

    args = train_recall.parse_args(["--facts", "1", "--out", str(tmp_path)])
    for name in ("maglev", "swa_baseline"):
        train_recall.save_recall_model(train_recall.MODELS[name](args), tmp_path / name, name, [8], args)
    assert load_task(tmp_path / "maglev")["recipe"] == MAGLEV_RECIPE
    assert "recipe" not in load_task(tmp_path / "swa_baseline")
    shipped = RECALL_MODELS_DIR / "maglev"
    assert load_task(shipped)["recipe"] == MAGLEV_RECIPE
    assert f"`{MAGLEV_RECIPE}`: " in _demo_card(shipped, "maglev")
