"""The prompt-attention benchmark on a tiny shape: both ways timed for every case, the model's attention modules
plain again after it, the JSON on disk with its command."""

import json

from kvm_maglev.benchmarks import prompt_attention
from kvm_maglev.models.kvm import modeling_kvm


def test_both_ways_are_timed_and_written(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_attention, "SHAPE", dict(prompt_attention.SHAPE, hidden_size=32, num_attention_heads=2,
                                                        chunk_size=4, state_budget_min=4, intermediate_size=32,
                                                        vocab_size=64))
    monkeypatch.setattr(prompt_attention, "CASES", (("tiny", 0, [9, 3]), ("tiny after a prefix", 6, [5, 11])))
    payload = prompt_attention.main(["--repeats", "1", "--out", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()) == payload
    assert payload["command"].endswith("--repeats 1 --out " + str(tmp_path / "out.json"))
    for row in payload["results"]:
        assert all(row[f"{way}_{part}_ms"] > 0 for way in ("joined", "merged") for part in ("forward", "attend_pieces"))
    assert modeling_kvm.KVMAttentionBase.merged_key_sets is False
    assert modeling_kvm.attend_pieces.__name__ == "attend_pieces" and modeling_kvm.attend_pieces.__module__ == modeling_kvm.__name__
