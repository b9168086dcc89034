"""The capacity-bound multi-key recall task (`kvm_maglev.capacity`) and `examples/train_recall.py --task capacity`:
the layout, the mixed training data, answers through `generate()` on one continued cache, the equal state bytes of
the fixed and power-law KVM states at the training length, and the JSON a run writes."""

import json
from types import SimpleNamespace

import pytest
import torch

from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.capacity import (
    CapacityTask,
    answer_queries,
    build_capacity_dataset,
    evaluate_capacity,
    make_capacity_example,
    recall_by_length,
)
from kvm_maglev.models.kvm.state_kvm import state_slots_after
from kvm_maglev.recall import BOS_ID, QUERY_ID
from tests.ecosystem.ecosystem_support import load_example

train_recall = load_example("train_recall")


def test_layout_spreads_distinct_facts_and_asks_after_the_gap():
    task = CapacityTask(seq_len=256, num_facts=32)
    for seed in range(5):
        example = make_capacity_example(task, torch.Generator().manual_seed(seed))
        ids = example.input_ids
        assert len(ids) == 256 and ids[0] == BOS_ID
        facts = {ids[p]: (p, ids[p + 1]) for p in range(1, task.queries_start) if ids[p] in task.key_ids}
        assert len(facts) == 32  # distinct keys, each once before the queries
        assert all(ids[p + 1] in task.value_ids for p, _ in facts.values())
        assert max(p for p, _ in facts.values()) + 1 < task.queries_start - task.gap
        answers = example.answer_positions
        assert answers == [task.queries_start + 3 * i + 2 for i in range(task.num_queries)]
        asked = [ids[a - 1] for a in answers]
        assert len(set(asked)) == task.num_queries
        for answer, key, distance in zip(answers, asked, example.distances):
            assert ids[answer - 2] == QUERY_ID and ids[answer] == facts[key][1]
            assert distance == answer - facts[key][0] - 1
        assert [i for i, label in enumerate(example.labels) if label != -100] == answers


def test_a_longer_cell_spreads_the_same_facts_further():
    task = CapacityTask(seq_len=256, num_facts=8)
    near = [make_capacity_example(task, torch.Generator().manual_seed(s)).distances for s in range(20)]
    far = [make_capacity_example(task.cell(8192, 8), torch.Generator().manual_seed(s)).distances for s in range(20)]
    assert sum(map(sum, far)) / sum(map(sum, near)) > 20


def test_cells_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="fact places"):
        CapacityTask(seq_len=128, num_facts=64).validate()
    with pytest.raises(ValueError, match="num_queries"):
        CapacityTask(num_facts=4).validate()
    with pytest.raises(ValueError, match="fact places"):
        train_recall.parse_args(["--task", "capacity", "--facts", "64", "--train-length", "128"])
    with pytest.raises(SystemExit):
        train_recall.parse_args(["--task", "capacity", "--facts", "8", "--in-window-share", "0.5"])


def test_training_data_mixes_the_fact_counts_and_repeats_with_its_seed():
    task = CapacityTask(seq_len=256)
    data = build_capacity_dataset(task, 64, [8, 64], seed=3)
    counts = data["num_facts"]
    assert set(counts) == {8, 64} and 16 < counts.count(8) < 48
    for row in data.select(range(4)):
        keys = [t for t in row["input_ids"][: task.queries_start] if t in task.key_ids]
        assert len(keys) == row["num_facts"]
    assert build_capacity_dataset(task, 8, [8, 64], seed=3)["input_ids"] == data["input_ids"][:8]


def _capacity_args(tmp_path, *extra):
    return train_recall.parse_args(["--task", "capacity", "--train-length", "256", "--out", str(tmp_path), *extra])


def test_fixed_state_holds_the_power_law_states_bytes_at_the_training_length(tmp_path):
    args = _capacity_args(tmp_path)
    assert args.models == train_recall.CAPACITY_MODELS and args.facts == [8, 16, 32, 64]
    fixed, sqrt = train_recall.MODELS["kvm_fixed"](args), train_recall.MODELS["kvm_sqrt"](args)
    assert fixed.config.state_budget_mode == "fixed" and sqrt.config.state_budget_mode == "power_law"
    length = args.task.seq_len
    assert state_slots_after(fixed.config, length) == state_slots_after(sqrt.config, length) > 32
    assert cache_bytes(fixed.config, length) == cache_bytes(sqrt.config, length)
    # past the training length the fixed state stays, the power-law one grows about as the square root
    longest = 32 * length
    assert state_slots_after(fixed.config, longest) == state_slots_after(fixed.config, length)
    assert 4.5 < state_slots_after(sqrt.config, longest) / state_slots_after(sqrt.config, length) < 6
    assert fixed.config.window_size == sqrt.config.window_size == train_recall.WINDOW
    # full attention's window covers the longest evaluation; the sliding window keeps the others' window
    full, window = train_recall.MODELS["full_attention"](args), train_recall.MODELS["swa_baseline"](args)
    assert full.config.sliding_window is None and full.config.max_position_embeddings >= longest
    assert window.config.sliding_window == train_recall.WINDOW


def test_demo_models_are_unchanged_by_the_capacity_options(tmp_path):
    args = train_recall.parse_args(["--out", str(tmp_path)])
    assert args.models == train_recall.DEMO_MODELS and args.task.num_facts == 4
    fixed, sqrt = train_recall.MODELS["kvm_fixed"](args).config, train_recall.MODELS["kvm_sqrt"](args).config
    assert (fixed.state_budget_min, fixed.state_max_chunks) == (16, 2)
    assert (sqrt.state_budget_factor, sqrt.state_budget_min, sqrt.state_max_chunks) == (4.0, 8, 1000)
    assert train_recall.MODELS["swa_baseline"](args).config.max_position_embeddings == 4096
    with pytest.raises(SystemExit):
        train_recall.parse_args(["--facts", "2", "4"])


@pytest.mark.parametrize("name", ["kvm_sqrt", "full_attention"])
def test_answers_on_the_continued_cache_are_the_uncached_forwards(tmp_path, name):
    args = _capacity_args(tmp_path)
    torch.manual_seed(0)
    model = train_recall.MODELS[name](args).eval()
    cell = args.task.cell(512, 16)
    rows = torch.tensor([make_capacity_example(cell, torch.Generator().manual_seed(s)).input_ids for s in range(3)])
    answers, nbytes = answer_queries(model, rows, cell.answer_positions)
    with torch.no_grad():
        logits = model(input_ids=rows).logits
    expected = logits[:, [p - 1 for p in cell.answer_positions]].argmax(-1)
    assert torch.equal(answers, expected)
    assert nbytes == cache_bytes(model.config, cell.answer_positions[-1], dtype=torch.float32)


class _Oracle(torch.nn.Module):
    """A stand-in model whose generate() answers from the facts in the prompt (or always one value)."""

    def __init__(self, task, know: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.task, self.know = task, know

    def generate(self, prompt, cache=None, past_key_values=None, **kwargs):
        answers = []
        for row in prompt.tolist():
            key = row[-1]
            fact = row.index(key)  # the fact comes first in the row
            answers.append(row[fact + 1] if self.know else self.task.value_ids.start)
        cache = SimpleNamespace(nbytes=lambda: 7 * prompt.shape[0])
        sequences = torch.cat([prompt, torch.tensor(answers)[:, None]], dim=1)
        return SimpleNamespace(sequences=sequences, cache=cache, past_key_values=cache)


def test_evaluation_scores_a_model_that_knows_the_facts_and_one_that_guesses():
    task = CapacityTask(seq_len=256)
    knows = evaluate_capacity(_Oracle(task, True), task, [256, 1024], [8, 32], num_sequences=5, seed=0)
    assert knows["recall"] == {256: {8: 1.0, 32: 1.0}, 1024: {8: 1.0, 32: 1.0}}
    assert knows["cache_bytes"] == {256: 7, 1024: 7}
    guesses = evaluate_capacity(_Oracle(task, False), task, [256], [8, 64], num_sequences=20, seed=0)
    assert all(r < 0.1 for r in guesses["recall"][256].values())
    assert recall_by_length({256: {8: 0.5, 64: 0.0}, 1024: {8: 1.0, 64: 1.0}}) == {256: 0.25, 1024: 1.0}


def test_a_capacity_run_writes_recall_by_length(tmp_path):
    train_recall.main(["--task", "capacity", "--models", "kvm_fixed", "swa_baseline", "--facts", "8", "16",
                       "--steps", "2", "--batch-size", "2", "--eval-multiples", "1", "2", "--eval-sequences", "1",
                       "--threads", "1", "--no-progress", "--out", str(tmp_path)])
    run = json.loads((tmp_path / "recall.json").read_text())
    assert run["command"].startswith("python examples/train_recall.py --task capacity --models kvm_fixed")
    assert (tmp_path / "recall.png").stat().st_size > 0
    for name in ("kvm_fixed", "swa_baseline"):
        row = run["models"][name]
        assert set(row["recall_by_length"]) == {"256", "512"}
        assert all(0 <= r <= 1 for r in row["recall_by_length"].values())
        assert set(row["recall"]["512"]) == {"8", "16"} and set(row["cache_bytes"]) == {"256", "512"}
    assert run["models"]["kvm_fixed"]["state_slots"]["256"] == run["models"]["kvm_fixed"]["state_slots"]["512"]


def test_summary_of_capacity_runs_spreads_over_seeds(tmp_path):
    summarize = load_example("summarize_recall")
    for seed, recall in ((0, 0.25), (1, 0.75)):
        row = {"recall_by_length": {"256": recall}, "recall": {"256": {"8": recall}}, "cache_bytes": {"256": 99},
               "window": 16, "chance": 1 / 64, "state_slots": {"256": 62}}
        run = {"task": {"num_queries": 8, "seq_len": 256, "num_facts": 16}, "models": {"kvm_sqrt": row},
               "settings": {"seed": str(seed), "out": f"o{seed}", "steps": "2000"}}
        (tmp_path / f"capacity_s{seed}.json").write_text(json.dumps(run))
    (entry,) = summarize.summarize_capacity([tmp_path / "capacity_s0.json", tmp_path / "capacity_s1.json"])
    assert entry["seeds"] == [0, 1] and entry["label"] == "kvm_sqrt"
    assert entry["recall_by_length"]["256"] == {"mean": 0.5, "median": 0.5, "min": 0.25, "max": 0.75}
    assert entry["recall"]["256"]["8"]["mean"] == 0.5 and entry["state_slots"] == {"256": 62}
    assert not summarize.load_runs([tmp_path / "capacity_s0.json"], {})  # the recall summary leaves them alone


def test_summary_keeps_a_longer_trained_arm_apart(tmp_path):
    summarize = load_example("summarize_recall")
    for name, seed, steps, recall in (("a", 0, "2000", 0.2), ("b", 1, "2000", 0.4), ("long", 0, "8000", 0.9)):
        row = {"recall_by_length": {"256": recall}, "recall": {"256": {"8": recall}}, "cache_bytes": {"256": 99},
               "window": 16, "chance": 1 / 64}
        run = {"task": {"num_queries": 8, "seq_len": 256, "num_facts": 16}, "models": {"full_attention": row},
               "settings": {"seed": str(seed), "out": name, "steps": steps}}
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    entries = summarize.summarize_capacity(sorted(tmp_path.glob("*.json")))
    by_label = {entry["label"]: entry for entry in entries}
    assert set(by_label) == {"full_attention", "full_attention (8000 steps)"}
    assert by_label["full_attention"]["recall_by_length"]["256"]["median"] == pytest.approx(0.3)
    assert by_label["full_attention (8000 steps)"]["seeds"] == [0]
