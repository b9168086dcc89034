"""The shared plan module against plain per-row loops: positions, predecessors, the KVM chunk grid, row groups."""

import pytest
import torch

from kvm_maglev.models.common.step_plan import GroupedStepPlan, RowGroup, StepPlan, chunk_pieces


def random_valid(seed: int, batch: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, length, generator=generator) < 0.7


def loop_geometry(start: list[int], valid: torch.Tensor):
    """Per row, by hand: each column's position, its key position, its predecessor index, the last real index."""
    positions, keys, previous, last = [], [], [], []
    for row, begin in enumerate(start):
        count, prev, row_pos, row_keys, row_prev = 0, 0, [], [], []
        for t, real in enumerate(valid[row].tolist()):
            row_pos.append(begin + count)
            row_keys.append(begin + count if real else -1)
            row_prev.append(prev)
            if real:
                count, prev = count + 1, t + 1
        positions.append(row_pos), keys.append(row_keys), previous.append(row_prev), last.append([prev])
    return [torch.tensor(x) for x in (positions, keys, previous, last)]


@pytest.mark.parametrize("seed", range(4))
def test_step_plan_matches_a_per_row_loop(seed):
    valid = random_valid(seed, 5, 11)
    start = [0, 3, 7, 0, 12]
    plan = StepPlan(torch.tensor(start), valid, 11)
    positions, keys, previous, last = loop_geometry(start, valid)
    assert torch.equal(plan.query_positions, positions)
    assert torch.equal(plan.key_positions, keys)
    got_previous, got_last = plan.predecessors()
    assert torch.equal(got_previous, previous) and torch.equal(got_last, last)
    for t in range(11):
        column_start, column_valid = plan.column(t)
        assert torch.equal(column_start, positions[:, t]) and torch.equal(column_valid, valid[:, t])


def test_step_plan_without_padding_is_consecutive():
    plan = StepPlan(torch.tensor([2, 5]), None, 4)
    assert torch.equal(plan.query_positions, torch.tensor([[2, 3, 4, 5], [5, 6, 7, 8]]))
    previous, last = plan.predecessors()
    assert torch.equal(previous, torch.tensor([[0, 1, 2, 3]] * 2)) and torch.equal(last, torch.tensor([[4]] * 2))


@pytest.mark.parametrize("seen,length", [(0, 1), (0, 37), (5, 3), (16, 40), (23, 1), (31, 9)])
def test_chunk_pieces_cover_the_tokens_on_the_chunk_grid(seen, length):
    chunk, window_chunks = 4, 3
    pieces = chunk_pieces(seen, length, chunk, window_chunks)
    assert pieces[0][0] == seen and pieces[-1][1] == seen + length
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    for pos, stop in pieces:
        if pos < window_chunks * chunk:  # the front window is one piece
            assert stop <= window_chunks * chunk
        else:  # then never across a chunk boundary
            assert pos // chunk == (stop - 1) // chunk


class CountedLayer:
    """A stand-in layer cache: how many tokens its rows have read, and its rows' ids."""

    def __init__(self, seen: int, ids: list[int]) -> None:
        self.seen, self.ids, self.window = seen, ids, type("Window", (), {"storage": None})()

    def take_rows(self, index: torch.Tensor) -> "CountedLayer":
        return CountedLayer(self.seen, [self.ids[i] for i in index.tolist()])


def test_grouped_plan_splits_rows_by_real_token_count_and_keeps_each_row_its_layers():
    batch, length = 4, 5
    valid = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    groups = [RowGroup([0, 1, 2, 3], [CountedLayer(6, [0, 1, 2, 3])])]
    plan = GroupedStepPlan(batch, length, valid, groups, "cpu")
    assert [g.rows for g in plan.groups] == [[0, 2], [1], [3]]
    assert all(g.layers[0].ids == g.rows for g in plan.groups)
    assert sorted(s.count for s in plan.segments) == [3, 5]  # the row with no real token reads nothing
    positions, _, previous, last = loop_geometry([6] * batch, valid)
    assert torch.equal(plan.positions, positions)
    assert torch.equal(plan.previous_index, previous) and torch.equal(plan.last_index, last)
    uniform = GroupedStepPlan(batch, length, None, groups, "cpu")
    assert uniform.uniform and torch.equal(uniform.positions, torch.arange(6, 11)) and uniform.previous_index is None
