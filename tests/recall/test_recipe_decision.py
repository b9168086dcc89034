"""The rule that settles the shipped Maglev recipe (docs/maglev_memory.md), as summarize_lm.py --decide applies it:
score (1) is the mean own-memory BPB relative to the same run's sliding window; a recipe that misses a recall target
on one seed cannot win; a lead under half a point is the incumbent's."""

import json
import sys

import pytest

from tests.ecosystem.ecosystem_support import REPO_ROOT, load_example


@pytest.fixture
def summarize_lm(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples"))  # it imports train_lm and summarize_recall
    module = load_example("summarize_lm")
    yield module
    sys.modules.pop("summarize_recall", None)


def _lm_runs(folder, own):
    """own: arm -> {(steps, seed): BPB}; the sliding window is 1.0 on every run."""
    paths = []
    for arm, runs in {**own, "swa_baseline": {key: 1.0 for key in next(iter(own.values()))}}.items():
        for (steps, seed), bpb in runs.items():
            path = folder / f"lm_{steps}_s{seed}_{arm}.json"
            path.write_text(json.dumps({"corpus": "cast", "settings": {"steps": str(steps), "seed": str(seed)},
                                        "models": {arm: {"recurrent": {"all": bpb}}}}))
            paths.append(path)
    return paths


def _recall_runs(folder, arm, eight_x_two_facts):
    """Recall runs of one arm on seeds 0-2, 1 and 2 facts; 2-fact recall at 8x the window per seed as given."""
    paths = []
    for facts in (1, 2):
        for seed in (0, 1, 2):
            far = 1.0 if facts == 1 else eight_x_two_facts[seed]
            own = {"8": 1.0, "14": 1.0, "32": 0.9, "64": 0.9, "128": far} if facts == 2 else {
                d: 1.0 for d in ("8", "14", "32", "64", "128")}
            row = {"recurrent": own, "prefiller": {d: 1.0 for d in own}, "window": 16, "chance": 1 / 32}
            path = folder / f"recall_f{facts}_s{seed}_{arm}.json"
            path.write_text(json.dumps({"task": {"num_facts": facts}, "settings": {"seed": str(seed)},
                                        "models": {arm: row}}))
            paths.append(path)
    return paths


def test_the_lower_score_wins_when_both_meet_recall_and_a_miss_on_one_seed_disqualifies(tmp_path, summarize_lm):
    keys = [(n, s) for n in (2400, 4800) for s in (0, 1, 2)]
    lm = _lm_runs(tmp_path, {"maglev_a": {k: 0.95 for k in keys}, "maglev_b": {k: 0.90 for k in keys}})
    recall = _recall_runs(tmp_path, "maglev_a", [0.5, 0.5, 0.5]) + _recall_runs(tmp_path, "maglev_b", [0.5, 0.5, 0.5])
    decision = summarize_lm.decide(lm, recall, ["maglev_a", "maglev_b"])
    scores = {row["arm"]: row["score"] for row in decision["candidates"]}
    assert scores == pytest.approx({"maglev_a": -0.05, "maglev_b": -0.10})
    assert decision["winner"] == "maglev_b" and decision["lead_over_incumbent"] == pytest.approx(0.05)
    assert len(decision["candidates"][1]["runs"]) == 6

    missed = _recall_runs(tmp_path, "maglev_b", [0.5, 0.1, 0.5])  # seed 1 under 20% at 8x the window
    decision = summarize_lm.decide(lm, recall[:6] + missed, ["maglev_a", "maglev_b"])
    assert decision["winner"] == "maglev_a" and decision["qualified"] == ["maglev_a"]
    assert decision["candidates"][1]["recall"]["per_facts"]["2"]["missed"]["1"] == [
        "2 facts: >= 20% at 8x the window"]


def test_a_lead_under_half_a_point_is_a_tie_the_incumbent_keeps(tmp_path, summarize_lm):
    keys = [(2400, s) for s in (0, 1, 2)]
    lm = _lm_runs(tmp_path, {"maglev_a": {k: 0.950 for k in keys}, "maglev_b": {k: 0.946 for k in keys}})
    recall = _recall_runs(tmp_path, "maglev_a", [0.5] * 3) + _recall_runs(tmp_path, "maglev_b", [0.5] * 3)
    assert summarize_lm.decide(lm, recall, ["maglev_a", "maglev_b"])["winner"] == "maglev_a"
