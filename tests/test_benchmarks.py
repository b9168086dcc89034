"""The benchmark harness on the tiny shape: every model runs, cache bytes equal the closed form
(padded rows included), targets are read off the rows, and the JSON/PNG land on disk."""

import argparse
import json

import pytest

from kvm_maglev.benchmarks import cli
from kvm_maglev.benchmarks.decode import Measurement
from kvm_maglev.benchmarks.models import MODEL_BUILDERS
from kvm_maglev.benchmarks.targets import check_targets


def bench_args(tmp_path, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path)])
    args.contexts, args.batched_contexts, args.batch_sizes, args.decode_steps = [40, 70], [70], [1, 3], 3
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    return cli.run_benchmarks(bench_args(tmp_path_factory.mktemp("bench")))


def test_every_model_and_row_is_measured(tiny_results):
    seen = {(r.model, r.batch_size, r.context) for r in tiny_results}
    expected = {(m, 1, c) for m in MODEL_BUILDERS for c in (1, 40, 70)} | {(m, 3, c) for m in MODEL_BUILDERS for c in (1, 70)}
    assert seen == expected
    assert all(r.decode_ms_median > 0 and len(r.step_ms) == 3 for r in tiny_results)


def test_cache_bytes_equal_the_closed_form_including_padded_rows(tiny_results):
    for r in tiny_results:
        assert r.cache_bytes == r.cache_bytes_closed_form, (r.model, r.batch_size, r.context)


def test_maglev_prompt_modes_share_weights_and_cache_size(tiny_results):
    recurrent = {(r.batch_size, r.context): r.cache_bytes for r in tiny_results if r.model == "maglev"}
    prefiller = {(r.batch_size, r.context): r.cache_bytes for r in tiny_results if r.model == "maglev_prefiller"}
    assert recurrent == prefiller


def test_run_writes_json_with_targets_and_plot(tmp_path, capsys):
    args = bench_args(tmp_path, models=["kvm_fixed", "llama_full"], batch_sizes=[1], contexts=[40])
    assert cli.run(args) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert {r["model"] for r in payload["results"]} == {"kvm_fixed", "llama_full"}
    assert any("kvm_fixed prefill / llama_full prefill" in t["target"] for t in payload["targets"])
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "ms/tok med" in capsys.readouterr().out


def _measurement(model, batch, context, prefill=1.0, median=10.0, worst=11.0, size=100) -> Measurement:
    return Measurement(model, batch, context, prefill, median, median, worst, batch * 1e3 / median, size, size)


def test_targets_pass_and_fail_on_the_ratios():
    rows = [
        _measurement("kvm_fixed", 1, 1024, median=10.0), _measurement("kvm_fixed", 1, 32768, median=10.4),
        _measurement("kvm_fixed", 8, 1024, median=19.0), _measurement("kvm_sqrt16", 1, 32768, median=12.0, worst=30.0),
        _measurement("llama_full", 1, 8192, median=15.0),
        _measurement("maglev", 1, 4096, prefill=50.0), _measurement("maglev_prefiller", 1, 4096, prefill=6.0),
    ]
    checks = {c.target: c for c in check_targets(rows)}
    assert checks["kvm_fixed decode after 32768 / after 1024 <= 1.05"].met
    assert checks["kvm_sqrt16 decode after 32768 / llama_full after 8192 < 1"].met
    assert not checks["kvm_sqrt16 b1 ctx 32768: slowest step / median <= 1.5"].met
    assert checks["kvm_fixed ctx 1024: batch 8 tokens/s / batch 1 >= 4"].value == pytest.approx(80 / 19)
    assert not checks["maglev recurrent prompt / prefiller prompt at 4096 >= 10"].met
