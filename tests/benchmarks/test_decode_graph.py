"""The decode-graph measurement (kvm_maglev.benchmarks.decode_graph) on a tiny shape: it runs, finds no graph break
in a prepared decode step and counts fewer aten calls for Maglev's step than the profiler's nested events."""

import torch

from kvm_maglev.benchmarks import decode_graph
from kvm_maglev.models.maglev.cache_maglev import MaglevCache

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)


def test_decode_graph_measures_a_tiny_model():
    model = decode_graph.maglev(TINY)
    calls = decode_graph.step_calls(model, MaglevCache(model.config), prompt=8)
    assert 0 < calls["dispatched"] < calls["profiler_events"]
    assert decode_graph.graph_breaks(model)["graph_breaks"] == 0
    times = decode_graph.step_times(model, context=16, steps=2, compiled=False)
    assert times["eager"]["wall_ms"] > 0
    torch._dynamo.reset()
