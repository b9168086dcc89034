"""The Maglev training benchmark on the tiny shape: every arm trains a step, its FLOPs are counted as
executed, and the ratios to the GPT follow from the rows."""

import json

import pytest

from kvm_maglev.benchmarks import training_maglev


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "training_maglev.json"
    assert training_maglev.main(["--shape", "tiny", "--tokens", "96", "--window", "32", "--repeats", "1",
                                 "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_arm_is_timed_with_its_flops(written):
    (result,) = written["results"]
    arms = result["arms"]
    assert list(arms) == list(training_maglev.OUR_ARMS)
    for row in arms.values():
        assert len(row["seconds"]) == 1 and row["tokens_per_s"] > 0 and row["tflops"] > 0
    assert written["command"].startswith("python -m kvm_maglev.benchmarks.training_maglev --shape tiny")


def test_self_fed_passes_add_p_passes_of_math(written):
    """Each self-fed pass is one more P pass with its head: the executed FLOPs grow with the passes, and
    lifted training costs more math than the GPT (Q and P both run)."""
    arms = written["results"][0]["arms"]
    flops = [arms[arm]["flops_over_gpt"] for arm in ("maglev", "maglev_self_feed2", "maglev_self_feed4")]
    assert 1.5 < flops[0] < flops[1] < flops[2]
    for arm in training_maglev.SELF_FED_PASSES:
        row = arms[arm]
        assert row["time_over_gpt"] == pytest.approx(row["flops_over_gpt"] * row["seconds_per_flop_over_gpt"])


def test_the_nanochat_arm_needs_a_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        training_maglev.main(["--arms", "nanochat", "--nanochat-path", str(tmp_path)])
    assert "needs --nanochat-path with nanochat/gpt.py" in capsys.readouterr().err
