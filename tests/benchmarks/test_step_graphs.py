"""The decode-step measurement (kvm_maglev.benchmarks.step_graphs) on the tiny shape: it runs for every model, finds
one graph with no break in each prepared decode step and prompt forward, and counts aten calls both ways."""

import pytest
import torch

from kvm_maglev.benchmarks import step_graphs


@pytest.mark.parametrize("name", step_graphs.MODELS)
def test_step_graphs_measures_each_model(name):
    result = step_graphs.measure(name, context=10, steps=2, compiled=False, shape="tiny", prompt=14)
    torch._dynamo.reset()
    assert (result["graphs"], result["breaks"]) == (1, 0), result["reasons"]
    prompt = result["prompt_chunk"]
    assert (prompt["graphs"], prompt["breaks"]) == (1, 0), prompt["reasons"]
    assert 0 < result["aten_calls"]["dispatched"] < result["aten_calls"]["profiler_events"]
    assert result["eager_step"]["wall_ms"] > 0
