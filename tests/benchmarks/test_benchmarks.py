"""The benchmark harness on the tiny shape: every model runs, cache bytes equal the closed form
(padded rows included), targets are read off the rows, and the JSON/PNG land on disk."""

import argparse
import json

import pytest
import torch

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


def test_run_writes_json_with_targets_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    args = bench_args(tmp_path, models=["kvm_fixed", "llama_full"], batch_sizes=[1], contexts=[40])
    assert cli.run(args) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["machine"]["runtime_env"]["OMP_WAIT_POLICY"] == "ACTIVE"  # settings that move step times
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


def test_our_models_are_measured_inside_runtime_speedups(monkeypatch):
    """Batched decoding in the bench reads the blocked weight copies that generate() would use; they are
    freed, and the model is plain again, when the measurement ends."""
    from kvm_maglev.benchmarks.decode import measure
    from kvm_maglev.benchmarks.models import SHAPES
    from kvm_maglev.models.speedups import onednn_linear

    if onednn_linear.ONEDNN_PACK is None:
        pytest.skip("torch without oneDNN's weight reordering")
    monkeypatch.setattr(onednn_linear, "ONEDNN_MIN_WEIGHTS", 0)  # the tiny shape's layers are below the threshold
    packs = []
    real_pack = onednn_linear.ONEDNN_PACK
    monkeypatch.setattr(onednn_linear, "ONEDNN_PACK", lambda weight, rows: packs.append(rows) or real_pack(weight, rows))
    model = MODEL_BUILDERS["kvm_fixed"](SHAPES["tiny"]).eval()
    measure("kvm_fixed", model, 70, 3, 3, 32)
    assert 3 in packs
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(not isinstance(m, onednn_linear.OneDNNLinear) and "packed" not in vars(m) for m in linears)


def test_steps_the_host_stole_from_are_told_apart():
    """A step the hypervisor took CPU time from keeps counting in the plain check; a second check reads
    the slowest step without host steal."""
    row = _measurement("kvm_fixed", 8, 1024, median=10.0, worst=30.0)
    row.step_ms, row.step_steal_ms = [10.0, 11.0, 30.0, 10.0], [0.0, 0.0, 20.0, 0.0]
    checks = {c.target: c for c in check_targets([row])}
    assert not checks["kvm_fixed b8 ctx 1024: slowest step / median <= 1.5"].met
    unstolen = checks["kvm_fixed b8 ctx 1024: slowest step the host took no CPU from / median <= 1.5"]
    assert unstolen.met and unstolen.value == pytest.approx(1.1)
    row.step_steal_ms = None  # no steal counts (not Linux): only the plain check
    assert sum("host" in c.target for c in check_targets([row])) == 0


def test_steal_is_recorded_per_step_on_linux(tiny_results):
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/stat is Linux's")
    assert all(r.step_steal_ms is not None and len(r.step_steal_ms) == len(r.step_ms) for r in tiny_results)
    assert all(ms >= 0 for r in tiny_results for ms in r.step_steal_ms)


def test_compile_flag_runs_the_decoding_steps_through_torch_compile(monkeypatch):
    """`--compile`: torch.compile wraps the model for the decoding steps only (the prefill stays eager),
    and the row says so. A recording stand-in for torch.compile keeps this test fast."""
    import torch

    from kvm_maglev.benchmarks.decode import measure
    from kvm_maglev.benchmarks.models import SHAPES

    model = MODEL_BUILDERS["maglev"](SHAPES["tiny"]).eval()
    calls = {"forward": 0, "step": 0}

    def fake_compile(module):
        assert module is model

        def step(**kwargs):
            calls["step"] += 1
            return module(**kwargs)
        return step

    real_forward = model.forward

    def counted_forward(*args, **kwargs):
        calls["forward"] += 1
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted_forward)
    monkeypatch.setattr(torch, "compile", fake_compile)
    row = measure("maglev", model, 70, 1, 4, 32, compile_decode=True)
    assert row.compiled and calls["step"] == 1 + 4  # the untimed step and the timed ones
    assert calls["forward"] == 3 + 1 + 4  # 69 prompt tokens in chunks of 32, then the steps through the wrapper
    assert not measure("maglev", model, 70, 1, 2, 32).compiled


def test_direct_flag_steps_our_models_outside_runtime_speedups(tmp_path, monkeypatch):
    """`--direct`: the model is stepped as a loop of one's own steps it, without opening its block; each
    step's CPU time is kept beside its wall time."""
    from kvm_maglev.benchmarks.decode import measure
    from kvm_maglev.benchmarks.models import SHAPES

    assert bench_args(tmp_path).direct is False
    model = MODEL_BUILDERS["kvm_fixed"](SHAPES["tiny"]).eval()
    opened, real_block = [], model.runtime_speedups
    monkeypatch.setattr(model, "runtime_speedups", lambda: opened.append(True) or real_block())
    row = measure("kvm_fixed", model, 70, 1, 3, 32, direct=True)
    assert row.direct and not opened
    assert len(row.step_cpu_ms) == 3 and row.cpu_max_over_median >= 1.0
    assert not measure("kvm_fixed", model, 70, 1, 2, 32).direct and opened
    checks = [c.target for c in check_targets([row])]
    assert "kvm_fixed b1 ctx 70: slowest step's CPU time / median's <= 1.5" in checks


def test_grouped_query_variants_shrink_the_cache(tmp_path):
    """The *_gqa builders are the same models with key/value heads shared by 2 (or 4) query heads: on request only,
    their caches follow the closed form and hold less than the model without GQA."""
    from kvm_maglev.benchmarks.models import GQA_BUILDERS, SHAPES

    assert not set(GQA_BUILDERS) & set(MODEL_BUILDERS)
    rows = cli.run_benchmarks(bench_args(tmp_path, models=["kvm_sqrt16", "kvm_sqrt16_gqa2"], batch_sizes=[1],
                                         contexts=[70]))
    size = {r.model: r.cache_bytes for r in rows if r.context == 70}
    assert all(r.cache_bytes == r.cache_bytes_closed_form for r in rows)
    assert size["kvm_sqrt16_gqa2"] < size["kvm_sqrt16"]
    with pytest.raises(ValueError, match="divisible by 4.*heads8"):
        GQA_BUILDERS["kvm_fixed_gqa4"](SHAPES["tiny"])
    assert GQA_BUILDERS["kvm_fixed_gqa4"](SHAPES["tiny"].__class__(num_layers=1, hidden_size=64, num_heads=4,
                                                                   vocab_size=64, chunk_len=16)).config.kv_heads == 1
