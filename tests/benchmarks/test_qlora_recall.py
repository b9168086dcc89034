"""The QLoRA-against-LoRA benchmark's pieces: its fine-tuning rows hold eight facts, and a short run scores both arms."""

import json

import pytest
import torch

from kvm_maglev.benchmarks import qlora_recall

# main() registers the package's Auto classes; the fixture takes them back after this module
pytestmark = [pytest.mark.usefixtures("package_auto_classes"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]


def test_fine_tuning_rows_state_eight_facts_at_the_models_own_layout():
    from kvm_maglev.recall import RecallTask

    folder = qlora_recall.RECALL_MODELS["kvm"]
    task = RecallTask(**json.loads((folder / "recall_task.json").read_text())["task"])
    rows = qlora_recall.recall_rows(folder, 3, seed=0)
    keys = rows["input_ids"][:, 1:2 * qlora_recall.FINE_TUNE_FACTS:2]
    assert keys.shape == (3, 8) and bool(((keys >= task.key_ids.start) & (keys < task.key_ids.stop)).all())
    assert torch.equal(rows["input_ids"], qlora_recall.recall_rows(folder, 3, seed=0)["input_ids"])
    assert bool((rows["labels"] != -100).any())


def test_a_short_run_trains_both_arms_and_reports_their_ratio(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "qlora.json"
    qlora_recall.main(["--models", "kvm", "--seeds", "0", "--steps", "2", "--batch", "2", "--train-examples", "8",
                       "--eval-examples", "4", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(run["arm"], run["seed"]) for run in result["runs"]] == [("lora", 0), ("qlora", 0)]
    lora, qlora = result["runs"]
    assert lora["eval_loss_after"] != lora["eval_loss_before"]  # the adapters trained
    assert result["ratios"]["kvm_seed0"] == pytest.approx(qlora["eval_loss_after"] / lora["eval_loss_after"])
    assert abs(qlora["eval_loss_before"] - lora["eval_loss_before"]) < 0.1 * lora["eval_loss_before"]
