"""The GPU check's logic on the CPU (`--device cpu --tiny`): every check runs and passes, the timings and
their ratios to the baselines land in the JSON, and without CUDA the default run stops with a clear message."""

import json

import pytest
import torch

from kvm_maglev.benchmarks import gpu_check


def test_tiny_cpu_run_checks_times_and_writes_json(tmp_path, capsys):
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--tiny", "--check-models", "kvm_sqrt16", "--models", "kvm_sqrt16", "mistral_swa",
            "--decode-steps", "2", "--out", str(out)]
    assert gpu_check.main(argv) == 0
    payload = json.loads(out.read_text())
    checks = payload["checks"]
    assert {c["model"] for c in checks} == {"kvm_sqrt16"} and all(c["passed"] for c in checks)
    names = [c["check"] for c in checks]
    assert any("float32" in n for n in names) and any("bfloat16" in n for n in names)
    assert sum("equals the uncached forward" in n for n in names) == 2
    assert [c.get("skipped") for c in checks if "sync" in c["check"]] == ["needs CUDA", "needs CUDA"]
    assert [r["model"] for r in payload["timings"]] == ["kvm_sqrt16", "mistral_swa"]
    assert all(r["train_step_s"] > 0 and r["decode_ms_median"] > 0 and r["prefill_s"] > 0 for r in payload["timings"])
    (ratio,) = payload["ratios"]
    assert ratio["baseline"] == "mistral_swa" and ratio["train_step"] > 0
    assert "checks passed" in capsys.readouterr().out


def test_results_off_by_more_than_the_bound_fail():
    """A float32 result off by more than 1e-4 of the logits' spread, or with another greedy token, fails."""
    reference = torch.randn(40, 512, generator=torch.Generator().manual_seed(0))
    close = reference + 0.5e-4 * reference.std()
    assert gpu_check.float32_check("t", "m", close, reference)["passed"]
    failed = gpu_check.float32_check("t", "m", reference + 2e-4 * reference.std(), reference)
    assert not failed["passed"] and failed["max_relative_error"] > gpu_check.FLOAT32_RELATIVE_BOUND
    assert not gpu_check.float32_check("t", "m", close, reference, tokens_equal=False)["passed"]


def test_without_cuda_the_default_run_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert gpu_check.main([]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
