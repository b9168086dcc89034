"""The trusted-code measures (kvm_maglev.benchmarks.trusted_code): what they count, and the one that holds."""

from __future__ import annotations

import pytest
import torch

from kvm_maglev.benchmarks import trusted_code


@pytest.mark.parametrize("name", ["kvm", "maglev"])
def test_every_generic_cache_method_works_or_says_why_not(name):
    assert trusted_code.cache_methods(name)["failing_without_reason"] == []


def test_the_probe_counts_an_error_without_a_reason():
    class Broken:
        @property
        def is_initialized(self):
            raise AttributeError("no such thing")

        def crop(self, max_length):
            raise ValueError()

        def get_seq_length(self, layer_idx=0):
            raise NotImplementedError("rows stand at their own positions")

    assert trusted_code.probe(Broken(), "is_initialized").startswith("fails: AttributeError")
    assert trusted_code.probe(Broken(), "crop") == "fails: bare ValueError"
    assert trusted_code.probe(Broken(), "get_seq_length").startswith("refused: rows stand")


def test_the_calls_of_a_known_forward_are_counted():
    """The counts are not vacuous: a Sequential of a linear layer and a ReLU is three module calls, one of them a
    ReLU operator."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    modules, operators = trusted_code.step_calls(model, {"input": torch.randn(2, 4)})
    assert modules == 3 and operators["aten.relu"] == 1 and operators.total() >= 2


@pytest.mark.parametrize("name", ["kvm", "maglev", "mistral"])
def test_every_decoding_step_is_counted(name):
    """Each counted step is one decoding forward of the model, its layers' modules and operators in it."""
    calls = trusted_code.decode_calls(name, 2)
    assert len(calls["module_calls_per_step"]) == len(calls["operator_calls_per_step"]) == 2
    assert min(calls["module_calls_per_step"]) > 2 and min(calls["operator_calls_per_step"]) > 2
    assert sum(calls["busiest_step_operators"].values()) == calls["max_operator_calls"]
