"""The trained-LM quantization benchmark's pieces: its loss is the model's own, and a short run writes every row."""

import json

import pytest
import torch

from kvm_maglev.benchmarks import quantized_lm

# main() registers the package's Auto classes; the fixture takes them back after this module
pytestmark = [pytest.mark.usefixtures("package_auto_classes"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]


def test_inference_loss_is_the_models_own_loss_over_the_rows():
    """The logits' cross-entropy equals the loss KVM returns for the same rows as labels (one path, no lifting)."""
    model = quantized_lm.build_model("kvm", seed=0, row=48).eval()
    rows = torch.randint(0, quantized_lm.VOCAB, (5, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = float(model(input_ids=rows, labels=rows).loss)
    assert quantized_lm.inference_loss(model, rows, batch=5) == pytest.approx(expected, abs=1e-5)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    rates = [quantized_lm.learning_rate(step, 100, 1.0) for step in range(100)]
    assert rates[0] == pytest.approx(0.2) and max(rates) == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(0.1, abs=1e-3) and rates[10:] == sorted(rates[10:], reverse=True)


def test_a_short_run_trains_and_scores_every_method(tmp_path):
    out = tmp_path / "lm.json"
    quantized_lm.main(["--models", "kvm", "--seeds", "0", "--steps", "3", "--row", "32", "--batch", "2",
                       "--eval-rows", "4", "--methods", "ct_w8a8", "bnb_int8", "--out", str(out)])
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["train_loss_last_20"] < 6.0 and [m["method"] for m in run["methods"]] == ["ct_w8a8", "bnb_int8"]
    for method in run["methods"]:
        assert "error" not in method, method
        assert abs(method["loss_change"]) < 0.05  # int8 weights move an almost untrained model's loss very little
