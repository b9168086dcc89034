"""The trusted-code measures (kvm_maglev.benchmarks.trusted_code): what they count, and the two that hold."""

from __future__ import annotations

import pytest

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


def test_frames_are_counted_from_the_causal_lm_down():
    """Mistral's decoding step is the yardstick: six frames of its own, the causal LM's forward first."""
    mistral = trusted_code.decode_frames("mistral", 1)
    assert mistral["max"] == 6 and mistral["deepest_chain"][0] == "modeling_mistral.py:MistralForCausalLM.forward"


@pytest.mark.parametrize("name", ["kvm", "maglev"])
def test_a_decoding_step_reads_as_shallow_as_mistrals(name):
    """The model, its layers, their attention and what that asks of its cache layer: no deeper than Mistral's."""
    frames = trusted_code.decode_frames(name, 3)
    assert frames["deepest_chain"][0].endswith("ForCausalLM.forward") and len(frames["per_step"]) == 3
    assert frames["max"] <= 6, frames["deepest_chain"]
