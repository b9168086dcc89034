"""Trainer fine-tuning: packing, loss normalisation, checkpointing, bf16, evaluation, resume."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, default_data_collator

from kvm_maglev.models.common.activation_checkpointing import enable_activation_checkpointing
from kvm_maglev.training import (
    MAGLEV_RECIPE,
    MAGLEV_RECIPES,
    LossComponentsTrainer,
    group_texts_dataset,
    parameter_digest,
)
from tests.ecosystem import ecosystem_support as support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module", params=sorted(support.MODEL_BUILDERS))
def model_dir(request, tmp_path_factory):
    return support.model_folder(request.param, tmp_path_factory.getbasetemp())


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32)


def training_args(output_dir, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        use_cpu=True, disable_tqdm=True, label_names=["labels"],
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def packed(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    return group_texts_dataset(support.corpus_lines(), tokenizer, support.training_block_size(model_dir))


def test_group_texts_packs_the_token_stream_into_full_blocks(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    lines = support.corpus_lines()[:6]
    blocks = group_texts_dataset(lines, tokenizer, 16)
    stream = []
    for line in lines:
        stream += tokenizer(line, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(blocks) == len(stream) // 16
    assert [t for row in blocks["input_ids"] for t in row] == stream[: len(blocks) * 16]
    assert blocks["labels"] == blocks["input_ids"]
    with pytest.raises(ValueError, match="fewer than one block"):
        group_texts_dataset(["tiny"], tokenizer, 4096)
    with pytest.raises(ValueError, match="block_size"):
        group_texts_dataset(lines, tokenizer, 1)


def test_finetune_example_lowers_the_loss(model_dir, tmp_path):
    example = support.load_example("finetune")
    out = tmp_path / "run"
    assert example.main([
        "--model", str(model_dir), "--output-dir", str(out), "--block-size", str(support.training_block_size(model_dir)),
        "--max-steps", "12",
        "--batch-size", "4", "--learning-rate", "5e-3", "--logging-steps", "4", "--eval-steps", "12",
        "--save-steps", "12",
    ]) == 0
    history = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
    train_losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(train_losses) == 3 and train_losses[-1] < train_losses[0] - 0.2
    assert all(math.isfinite(entry["eval_loss"]) for entry in history if "eval_loss" in entry)
    reloaded = load(out)  # the final model is a loadable folder again
    assert parameter_digest(reloaded) != parameter_digest(load(model_dir))
    if reloaded.config.model_type == "maglev":  # trained with the example's memory recipe, recorded in its config
        for field, value in MAGLEV_RECIPES[MAGLEV_RECIPE].items():
            assert getattr(reloaded.config, field) == value, field


def test_eval_loss_equals_the_direct_mean_token_loss(model_dir, tmp_path):
    blocks = packed(model_dir).select(range(4))
    model = load(model_dir)
    trainer = LossComponentsTrainer(model=model, args=training_args(tmp_path), eval_dataset=blocks,
                                    data_collator=default_data_collator)
    eval_loss = trainer.evaluate()["eval_loss"]
    with torch.no_grad():
        ids = torch.tensor(blocks["input_ids"])
        direct = model(input_ids=ids, labels=ids).loss.item()
    assert eval_loss == pytest.approx(direct, abs=1e-5)


def test_maglev_eval_loss_is_the_cross_entropy_of_the_inference_logits(tmp_path, tmp_path_factory):
    """A Maglev folder with its prefiller: Trainer.evaluate() reports the loss of the logits generate() runs
    (P on its own memory), not the prefiller-fed training objective."""
    model_dir = support.model_folder("maglev", tmp_path_factory.getbasetemp())
    blocks = packed(model_dir).select(range(4))
    model = load(model_dir)
    assert model.config.has_prefiller
    trainer = LossComponentsTrainer(model=model, args=training_args(tmp_path), eval_dataset=blocks,
                                    data_collator=default_data_collator)
    eval_loss = trainer.evaluate()["eval_loss"]
    ids = torch.tensor(blocks["input_ids"])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, use_cache=False).logits
        lifted = model(input_ids=ids, labels=ids, use_cache=False, lifted=True).loss.item()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1)).item()
    assert eval_loss == pytest.approx(expected, abs=1e-5)
    assert abs(lifted - expected) > 1e-3  # the two objectives differ on this model, so the check can fail


def uneven_label_batch(model_dir):
    """Four sequences whose numbers of supervised tokens all differ (3, 9, 17, all)."""
    ids = torch.tensor(packed(model_dir)["input_ids"][:4])
    labels = ids.clone()
    for row, keep in enumerate((3, 9, 17)):
        labels[row, : ids.shape[1] - keep] = -100
    return ids, labels


def sgd_step_matches_full_batch(model_dir, tmp_path, ids, labels, consistency_weight=None):
    """Take one SGD step with Trainer as (batch 4) and as (batch 2 x accumulation 2) and compare
    both with the step computed directly from the full batch's loss."""
    import datasets

    def load_for_test():
        model = load(model_dir)
        if consistency_weight is not None:
            model.config.consistency_weight = consistency_weight
        return model

    lr = 0.5
    model = load_for_test()
    model.train()
    model(input_ids=ids, labels=labels).loss.backward()
    expected = {name: (p - lr * p.grad).detach() for name, p in model.named_parameters()}

    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = load_for_test()
        args = training_args(tmp_path / f"ga{accumulation}", max_steps=1, per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=lr,
                             lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0)
        LossComponentsTrainer(model=model, args=args, train_dataset=dataset,
                              data_collator=default_data_collator).train()
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter.detach(), expected[name], atol=2e-6, rtol=0,
                                       msg=f"{name} after batch {batch_size} x accumulation {accumulation}")


def test_gradient_accumulation_matches_one_big_batch(model_dir, tmp_path):
    """Micro-batches with different numbers of supervised tokens: Trainer passes num_items_in_batch
    and the model divides its summed cross-entropy by it instead of averaging per-batch means.
    (Maglev's consistency term is switched off here; see the next test.)"""
    ids, labels = uneven_label_batch(model_dir)
    sgd_step_matches_full_batch(model_dir, tmp_path, ids, labels, consistency_weight=0.0)


def test_gradient_accumulation_with_the_consistency_loss_matches_one_big_batch(tmp_path, tmp_path_factory):
    model_dir = support.model_folder("maglev", tmp_path_factory.getbasetemp())
    ids = torch.tensor(packed(model_dir)["input_ids"][:4])
    sgd_step_matches_full_batch(model_dir, tmp_path, ids, ids.clone())


def test_maglev_logs_lm_and_consistency_losses_and_trains_q_with_p(tmp_path, tmp_path_factory):
    import datasets

    model_dir = support.model_folder("maglev", tmp_path_factory.getbasetemp())
    ids = torch.tensor(packed(model_dir)["input_ids"][:4])
    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model = load(model_dir)
    assert model.config.has_prefiller and not model.config.prefiller_shares_blocks
    model.train()
    with torch.no_grad():
        direct = model(input_ids=ids, labels=ids)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = training_args(tmp_path, max_steps=1, gradient_accumulation_steps=2, eval_strategy="no")
    trainer = LossComponentsTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset,
                                    data_collator=default_data_collator)
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert logged["lm_loss"] == pytest.approx(direct.lm_loss.item(), abs=2e-4)
    assert logged["consistency_loss"] == pytest.approx(direct.consistency_loss.item(), abs=2e-4)
    metrics = trainer.evaluate()
    # evaluation scores the model generate() runs: no prefiller, so no consistency term
    assert {"eval_loss", "eval_lm_loss"} <= metrics.keys() and "eval_consistency_loss" not in metrics

    changed = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    prefiller = {name for name in before if "prefiller" in name}
    memory = {name for name in before if "memory" in name}
    assert prefiller and prefiller <= changed, sorted(prefiller - changed)
    assert memory and memory <= changed, sorted(memory - changed)
    assert "lm_head.weight" in changed


def test_gradient_checkpointing_gives_identical_gradients(model_dir):
    ids, labels = uneven_label_batch(model_dir)
    gradients = []
    for checkpointing in (False, True):
        model = load(model_dir)
        model.train()
        if checkpointing:
            enable_activation_checkpointing(model)
            # what `is_activation_checkpointing` (5.25; `is_gradient_checkpointing` before, now deprecated) reads
            assert any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
        model(input_ids=ids, labels=labels).loss.backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys() and gradients[0]
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_autocast_training_on_cpu(model_dir, tmp_path):
    model = load(model_dir)
    before = parameter_digest(model)
    trainer = LossComponentsTrainer(model=model, args=training_args(tmp_path, bf16=True, max_steps=2),
                                    train_dataset=packed(model_dir), data_collator=default_data_collator)
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    assert parameter_digest(model) != before
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast keeps fp32 master weights

    # weights in bfloat16 themselves (as published checkpoints often are) train too
    bf16_model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.bfloat16).train()
    ids = torch.tensor(packed(model_dir)["input_ids"][:2])
    bf16_model(input_ids=ids, labels=ids).loss.backward()
    gradients = [p.grad for p in bf16_model.parameters() if p.grad is not None]
    assert gradients and all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in gradients)


def test_resume_from_checkpoint_continues_identically(model_dir, tmp_path):
    dataset = packed(model_dir)

    def run(output_dir, resume=None):
        model = load(model_dir)
        args = training_args(output_dir, max_steps=4, save_strategy="steps", save_steps=2)
        trainer = LossComponentsTrainer(model=model, args=args, train_dataset=dataset,
                                        data_collator=default_data_collator)
        trainer.train(resume_from_checkpoint=resume)
        losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
        return parameter_digest(model), losses

    full_digest, full_losses = run(tmp_path / "full")
    resumed_digest, resumed_losses = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    # steps 1-2 come back from the checkpoint's state; 3-4 are computed again after resuming
    assert sorted(resumed_losses) == [1, 2, 3, 4]
    assert resumed_losses == full_losses
    assert resumed_digest == full_digest
