"""The recall task, its evaluation (cached batched generate vs the uncached forward), and the demo
on the trained models kept in the package."""

import argparse
import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM, demo
from kvm_maglev.recall import (
    BOS_ID,
    QUERY_ID,
    RecallTask,
    build_dataset,
    evaluate_recall,
    make_example,
    memory_prefill,
    prompt_modes,
)
from tests.ecosystem.ecosystem_support import load_example

TASK = RecallTask(num_keys=8, num_values=8, num_filler=8, num_facts=3, seq_len=60)


def test_example_layout_puts_each_answer_its_distance_after_the_fact():
    example = make_example(TASK, torch.Generator().manual_seed(0), [5, 20, 40])
    ids = example.input_ids
    assert ids[0] == BOS_ID and len(ids) == TASK.seq_len
    facts = {ids[1 + 2 * i]: (2 + 2 * i, ids[2 + 2 * i]) for i in range(TASK.num_facts)}
    assert example.distances == [5, 20, 40]
    for answer, distance in zip(example.answer_positions, example.distances):
        assert ids[answer - 2] == QUERY_ID
        value_position, value = facts[ids[answer - 1]]
        assert ids[answer] == value and answer - value_position == distance
    labelled = [i for i, label in enumerate(example.labels) if label != -100]
    assert labelled == sorted(example.answer_positions)


def test_dataset_is_reproducible_from_its_seed():
    first = build_dataset(TASK, 6, range(4, 40), queries_per_example=3, seed=7)
    again = build_dataset(TASK, 6, range(4, 40), queries_per_example=3, seed=7)
    assert first.column_names == ["input_ids", "labels", "answer_positions", "distances"]
    assert first["input_ids"] == again["input_ids"] and first["labels"] == again["labels"]


def test_dataset_weights_set_the_share_of_each_distance():
    """Weights draw distances in proportion (a zero weight never), and the uniform default is untouched."""
    weighted = build_dataset(TASK, 40, [5, 20, 40], queries_per_example=3, seed=7, weights=[3.0, 1.0, 0.0])
    drawn = [d for row in weighted["distances"] for d in row]
    assert 40 not in drawn and drawn.count(5) > drawn.count(20) > 0
    with pytest.raises(ValueError, match="one per distance"):
        build_dataset(TASK, 2, [5, 20], queries_per_example=3, seed=7, weights=[1.0])
    with pytest.raises(ValueError, match="not all zero"):
        build_dataset(TASK, 2, [5, 20], queries_per_example=3, seed=7, weights=[0.0, 0.0])


def test_recall_example_weights_give_the_window_its_share():
    train_recall = load_example("train_recall")
    distances = list(range(4, 8 * train_recall.WINDOW + 1))
    weights = train_recall.distance_weights(distances, 0.5)
    inside = sum(w for d, w in zip(distances, weights) if d <= train_recall.WINDOW)
    assert inside == pytest.approx(0.5) and sum(weights) == pytest.approx(1.0)
    assert train_recall.distance_weights(distances, None) is None
    with pytest.raises(ValueError, match="in-window-share"):
        train_recall.distance_weights(distances, 1.0)


def _tiny_models():
    torch.manual_seed(0)
    kvm = KVMForCausalLM(KVMConfig(vocab_size=TASK.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   chunk_size=4, window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0,
                                   state_budget_min=4, state_max_chunks=100))
    maglev = MaglevForCausalLM(MaglevConfig(vocab_size=TASK.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            window_pattern="L", sliding_window=8, use_memory=True, has_prefiller=True,
                                            prefiller_window_pattern="L"))
    return {"kvm": kvm.eval(), "maglev": maglev.eval()}


@pytest.mark.parametrize("name", ["kvm", "maglev"])
def test_generate_path_agrees_with_the_uncached_forward(name):
    model = _tiny_models()[name]
    for mode in prompt_modes(model):
        with memory_prefill(model, mode):
            cached = evaluate_recall(model, TASK, [6, 30, 50], 6, seed=3, use_generate=True)
            uncached = evaluate_recall(model, TASK, [6, 30, 50], 6, seed=3, use_generate=False)
        assert cached == uncached


def test_prompt_modes_switch_and_restore():
    models = _tiny_models()
    assert prompt_modes(models["kvm"]) == [""]
    maglev = models["maglev"]
    assert prompt_modes(maglev) == ["recurrent", "prefiller"]
    with memory_prefill(maglev, "prefiller"):
        assert maglev.config.memory_prefill == "prefiller"
    assert maglev.config.memory_prefill == "recurrent"


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--examples", "32", "--decode-tokens", "4", "--out", str(out),
                              "--cache-dir", str(out / "cache")])
    assert demo.run(args) == 0
    assert (out / "recall.png").stat().st_size > 0
    return json.loads((out / "demo.json").read_text()), demo.load_task(demo.find_model_folders(demo.RECALL_MODELS_DIR)[0])


def test_demo_reports_every_kept_model(demo_rows):
    rows, spec = demo_rows
    assert {"kvm_fixed", "kvm_sqrt", "maglev", "swa_baseline"} <= set(rows)
    for row in rows.values():
        assert set(row["recall"]) == {str(d) for d in spec["distances"]}
        assert row["cache_bytes"] > 0 and row["ms_per_token"] > 0


def test_kept_kvm_models_recall_far_past_their_window(demo_rows):
    """The shipped models still work with the code as it is (a numerics regression drops this)."""
    rows, spec = demo_rows
    four_windows = str(4 * spec["window"])
    for name in ("kvm_fixed", "kvm_sqrt"):
        assert rows[name]["recall"][four_windows] >= 0.9, rows[name]
    assert rows["swa_baseline"]["recall"][four_windows] <= 0.25


def test_kept_baseline_reads_its_own_window(demo_rows):
    """A fair baseline: trained with half its facts inside the window, it recalls those (and only those)."""
    rows, spec = demo_rows
    for distance in spec["distances"]:
        recall = rows["swa_baseline"]["recall"][str(distance)]
        assert recall >= 0.9 if distance < spec["window"] else recall <= 0.25, (distance, recall)


def test_kept_folders_hold_weights_config_and_task_only():
    """Code and card are never copied into the package: the demo adds them from the package when it builds."""
    for folder in demo.find_model_folders(demo.RECALL_MODELS_DIR):
        assert sorted(p.name for p in folder.iterdir()) == sorted(demo.KEPT_FILES), folder.name


def test_demo_loads_the_package_code_as_it_is_now(tmp_path, monkeypatch):
    """The demo's Hub folder carries the code files generated from the package's modules as they are now, is
    reused while they are unchanged, and is rebuilt as soon as one changes."""
    from kvm_maglev.convert import export
    from kvm_maglev.models import hub_code

    kept = demo.RECALL_MODELS_DIR / "maglev"
    built = demo.build_demo_folder(kept, tmp_path / "cache")
    files = export.package_code_files("maglev")
    assert sorted(p.name for p in built.glob("*.py")) == sorted(files)
    for name, text in files.items():
        assert (built / name).read_text() == text, name
    config = json.loads((built / "config.json").read_text())
    assert config["auto_map"] == hub_code.hub_auto_map("maglev")
    assert "custom_code" in (built / "README.md").read_text()
    model = demo.load_demo_model(kept, tmp_path / "cache")
    loaded_from = Path(inspect.getfile(type(model)))
    assert loaded_from.read_text() == files[loaded_from.name]
    assert demo.build_demo_folder(kept, tmp_path / "cache") == built  # unchanged code: the same folder

    changed = tmp_path / "models"
    shutil.copytree(hub_code.MODELS_DIR, changed, ignore=shutil.ignore_patterns("__pycache__"))
    with open(changed / "common" / "step_plan.py", "a") as handle:
        handle.write("\n# a change to a module the model imports\n")
    monkeypatch.setattr(hub_code, "MODELS_DIR", changed)
    rebuilt = demo.build_demo_folder(kept, tmp_path / "cache")
    assert rebuilt != built
    assert "# a change to a module the model imports" in (rebuilt / "modeling_maglev.py").read_text()


def test_saved_demo_model_round_trips_through_the_build(tmp_path):
    model = _tiny_models()["kvm"]
    task = {"task": TASK.__dict__, "window": 8, "distances": [6, 30], "steps": 1, "seed": 0}
    folder = demo.save_demo_model(model, tmp_path / "tiny_kvm", task)
    assert sorted(p.name for p in folder.iterdir()) == sorted(demo.KEPT_FILES)
    assert demo.load_task(folder) == json.loads(json.dumps(task))
    loaded = demo.load_demo_model(folder, tmp_path / "cache")
    ids = torch.tensor([make_example(TASK, torch.Generator().manual_seed(1), []).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)



def test_plot_keeps_models_with_equal_recall_visible(tmp_path):
    """Two models at 100% everywhere (the demo's kvm_fixed and kvm_sqrt) are drawn apart, each with its own
    marker, so neither hides the other; the plot is written."""
    from kvm_maglev.recall import plot_recall, plotted_curves

    results = {"kvm_fixed": {8: 1.0, 32: 1.0, 128: 1.0}, "kvm_sqrt": {8: 1.0, 32: 1.0, 128: 1.0},
               "maglev": {8: 1.0, 32: 0.5, 128: 0.1}}
    curves = plotted_curves(results)
    points = [set(zip(xs, ys)) for xs, ys, _, _ in curves.values()]
    assert not points[0] & points[1]
    assert len({marker for _, _, marker, _ in curves.values()}) == len(results)
    for (xs, _, _, _), per_distance in zip(curves.values(), results.values()):  # nudged by a few percent only
        assert all(abs(x / d - 1) < 0.1 for x, d in zip(xs, sorted(per_distance)))
    plot_recall(results, 0.03, 16, tmp_path / "recall.png")
    assert (tmp_path / "recall.png").stat().st_size > 0
