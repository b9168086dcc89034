"""Trainer fine-tuning: packing, loss normalisation, checkpointing, bf16, evaluation, resume."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, default_data_collator

import ecosystem_support as support
from kvm_maglev.training import LossComponentsTrainer, group_texts_dataset, parameter_digest

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


def packed(model_dir, block_size=32):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    return group_texts_dataset(support.corpus_lines(), tokenizer, block_size)


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
        "--model", str(model_dir), "--output-dir", str(out), "--block-size", "32", "--max-steps", "16",
        "--batch-size", "4", "--learning-rate", "5e-3", "--logging-steps", "4", "--eval-steps", "16",
        "--save-steps", "16",
    ]) == 0
    history = json.loads((out / "checkpoint-16" / "trainer_state.json").read_text())["log_history"]
    train_losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(train_losses) == 4 and train_losses[-1] < train_losses[0] - 0.2
    assert all(math.isfinite(entry["eval_loss"]) for entry in history if "eval_loss" in entry)
    reloaded = load(out)  # the final model is a loadable folder again
    assert parameter_digest(reloaded) != parameter_digest(load(model_dir))


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


def uneven_label_batch(model_dir):
    """Four sequences whose numbers of supervised tokens all differ (3, 9, 17, 31 of 32)."""
    ids = torch.tensor(packed(model_dir)["input_ids"][:4])
    labels = ids.clone()
    for row, keep in enumerate((3, 9, 17, 31)):
        labels[row, : 32 - keep] = -100
    return ids, labels


def test_gradient_accumulation_matches_one_big_batch(model_dir, tmp_path):
    """Micro-batches of 2 with accumulation 2 take the same SGD step as the full batch of 4:
    Trainer passes num_items_in_batch and the model divides by it instead of averaging means."""
    import datasets

    ids, labels = uneven_label_batch(model_dir)
    model = load(model_dir)
    lr = 0.5
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    expected = {name: (p - lr * p.grad).detach() for name, p in model.named_parameters()}

    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = load(model_dir)
        args = training_args(tmp_path / f"ga{accumulation}", max_steps=1, per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=lr,
                             lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0)
        LossComponentsTrainer(model=model, args=args, train_dataset=dataset,
                              data_collator=default_data_collator).train()
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter.detach(), expected[name], atol=2e-6, rtol=0,
                                       msg=f"{name} after batch {batch_size} x accumulation {accumulation}")


def test_gradient_checkpointing_gives_identical_gradients(model_dir):
    ids, labels = uneven_label_batch(model_dir)
    gradients = []
    for checkpointing in (False, True):
        model = load(model_dir)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
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


def test_resume_from_checkpoint_continues_identically(model_dir, tmp_path):
    dataset = packed(model_dir)

    def run(output_dir, resume=None):
        model = load(model_dir)
        args = training_args(output_dir, max_steps=6, save_strategy="steps", save_steps=3)
        trainer = LossComponentsTrainer(model=model, args=args, train_dataset=dataset,
                                        data_collator=default_data_collator)
        trainer.train(resume_from_checkpoint=resume)
        losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
        return parameter_digest(model), losses

    full_digest, full_losses = run(tmp_path / "full")
    resumed_digest, resumed_losses = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    # steps 1-3 come back from the checkpoint's state; 4-6 are computed again after resuming
    assert sorted(resumed_losses) == [1, 2, 3, 4, 5, 6]
    assert resumed_losses == full_losses
    assert resumed_digest == full_digest
