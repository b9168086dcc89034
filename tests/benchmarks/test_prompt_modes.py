"""kvm_maglev.benchmarks.prompt_modes on tiny folders (no timings checked), and the rule it applies."""

import json
import math

import torch

from kvm_maglev import MaglevConfig, MaglevForCausalLM
from kvm_maglev.benchmarks import prompt_modes
from kvm_maglev.recall import RecallTask


def tiny_folder(path, vocab: int, window: int, task: RecallTask = None):
    torch.manual_seed(0)
    config = MaglevConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, use_memory=True, sliding_window=window, has_prefiller=True,
                          prefiller_window_pattern="L", prefiller_shares_blocks=False, sequence_len=512)
    model = MaglevForCausalLM(config)
    with torch.no_grad():  # away from the init's zero projections, so that memories reach the logits
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(path)
    if task is not None:
        (path / "recall_task.json").write_text(json.dumps({"task": task.__dict__, "window": window}))
    return path


def test_measure_writes_both_modes_per_length_and_the_command(tmp_path):
    task = RecallTask(num_facts=2, seq_len=64)
    recall = tiny_folder(tmp_path / "recall", task.vocab_size, 4, task)
    lm = tiny_folder(tmp_path / "lm", 257, 4)
    out = tmp_path / "measured.json"
    argv = ["measure", "--recall-models", str(recall), "--lm-models", str(lm), "--multiples", "1", "2",
            "--eval-seeds", "7", "--recall-examples", "3", "--lm-stories", "2", "--continuation", "5",
            "--speed-repeats", "1", "--out", str(out)]
    prompt_modes.main(argv)
    data = json.loads(out.read_text())
    assert data["command"].endswith(" ".join(argv))
    for folder, kind in ((recall, "recall"), (lm, "lm")):
        row = data["models"][str(folder)]
        for mode in prompt_modes.MODES:
            assert set(row[kind][mode]) == {"1", "2"} and set(row[kind][mode]["2"]) == {"7"}
            assert set(row["speed"][mode]) == {"1", "2"}
    assert all(0 <= v["7"] <= 1 for v in data["models"][str(recall)]["recall"]["prefiller"].values())
    assert all(v["7"] > 0 for v in data["models"][str(lm)]["lm"]["recurrent"].values())
    # the model is left in the mode it came with
    assert MaglevForCausalLM.from_pretrained(recall).config.memory_prefill == "recurrent"


def test_continuation_bits_depend_on_the_prompt_mode_only_through_the_cache(tmp_path):
    """The continuation is scored on the cache the prompt left: after a recurrent prompt it equals the uncached
    recurrent forward's bits; after a prefiller prompt (Q's memories, not P's own) it differs."""
    folder = tiny_folder(tmp_path / "lm", 257, 4)
    model = prompt_modes.load(folder)
    rows = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    bits = {}
    for mode in prompt_modes.MODES:
        with prompt_modes.memory_prefill(model, mode):
            bits[mode] = prompt_modes.continuation_bits(model, rows, 12, 8, batch=2)
    with torch.no_grad(), prompt_modes.memory_prefill(model, "recurrent"):
        logits = model(input_ids=rows[:, :19], use_cache=False).logits[:, 11:]
    direct = torch.nn.functional.cross_entropy(logits.reshape(-1, 257), rows[:, 12:].reshape(-1)).item() / math.log(2)
    assert abs(bits["recurrent"] - direct) < 1e-4
    assert bits["prefiller"] != bits["recurrent"]


def _file(recall_fed, recall_own, bits_fed, bits_own, fast=True, generate=True):
    speed = {"recurrent": {"2": {"tokens_per_cpu_s": 100.0}}, "prefiller": {"2": {"tokens_per_cpu_s": 200.0 if fast else 50.0}}}
    data = {"models": {
        "r": {"recall": {"recurrent": {"1": {"0": recall_own}}, "prefiller": {"1": {"0": recall_fed}}}, "speed": speed},
        "l": {"lm": {"recurrent": {"1": {"0": bits_own}}, "prefiller": {"1": {"0": bits_fed}}}},
    }}
    if generate:
        data["generate_4k"] = {"rows": {"maglev_prefiller": {"tokens_per_cpu_s": 900.0},
                                        "maglev_recurrent": {"tokens_per_cpu_s": 90.0}}}
    return data


def test_decide_follows_the_written_rule():
    assert prompt_modes.decide([_file(0.50, 0.51, 0.705, 0.70)])["default_mode"] == "prefiller"
    lost_recall = prompt_modes.decide([_file(0.47, 0.50, 0.70, 0.70)])
    assert lost_recall["default_mode"] == "recurrent"
    assert [c["check"] for c in lost_recall["failed"]] == ["recall r"]
    assert prompt_modes.decide([_file(0.5, 0.5, 0.72, 0.70)])["default_mode"] == "recurrent"  # BPB + 0.02
    assert prompt_modes.decide([_file(0.5, 0.5, 0.70, 0.70, fast=False)])["default_mode"] == "recurrent"
    missing = prompt_modes.decide([{"models": {"r": _file(0.5, 0.5, 0.7, 0.7)["models"]["r"]}}])
    assert missing["default_mode"] == "recurrent" and missing["missing"] == ["language modelling"]
