"""The plan modules against plain per-row loops: positions, predecessors, the flat token layout, KVM's pieces."""

import pytest
import torch

from kvm_maglev.models.common.step_plan import RowTokens, StepPlan
from kvm_maglev.models.kvm import KVMConfig
from kvm_maglev.models.kvm.step_plan_kvm import chunk_pieces


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


@pytest.mark.parametrize("seed", range(4))
def test_row_tokens_lay_out_real_tokens_flat_with_their_predecessors(seed):
    """RowTokens against a per-row loop: each real token's row, position and predecessor (the token before it, the
    row's carry, or - a row's very first token - itself or zero), each row's last token; flatten/unflatten."""
    valid = random_valid(seed, 5, 11)
    starts = [0, 3, 7, 0, 12]
    tokens = RowTokens.from_batch(starts, valid, 5, 11, "cpu")
    batch = 5
    rows, positions, previous_first, previous_zero, last = [], [], [], [], []
    for row, begin in enumerate(starts):
        count = int(valid[row].sum())
        offset = len(rows)
        for i in range(count):
            rows.append(row)
            positions.append(begin + i)
            before = batch + 1 + offset + i - 1 if i else (row if begin else None)
            previous_first.append(before if before is not None else batch + 1 + offset)
            previous_zero.append(before if before is not None else batch)
        last.append(batch + 1 + offset + count - 1 if count else row)
    assert tokens.row.tolist() == rows and tokens.position.tolist() == positions
    assert [t.tolist() for t in tokens.predecessors("first")] == [previous_first, last]
    assert tokens.predecessors("zero")[0].tolist() == previous_zero
    x = torch.randn(5, 11, 3)
    assert torch.equal(tokens.flatten(x), x[valid])
    assert torch.equal(tokens.unflatten(tokens.flatten(x)), torch.where(valid[..., None], x, 0))


@pytest.mark.parametrize("starts,counts", [([0, 5, 23], [37, 3, 1]), ([16, 0], [40, 1]), ([31, 8], [9, 0])])
def test_kvm_pieces_follow_each_row_chunk_grid(starts, counts):
    """Each row's new tokens cut at its own chunk boundaries, every token in exactly one piece, in flat order; a
    query sees its chunk and the window_chunks - 1 before it."""
    config = KVMConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, rotary_dim=2,
                       chunk_size=4, window_chunks=3)
    tokens = RowTokens(starts, counts, "cpu")
    pieces = chunk_pieces(config, tokens)
    queries = pieces.query_index.reshape(-1)[pieces.order]
    assert queries.tolist() == list(range(tokens.total))
    for piece, row in enumerate(pieces.rows):
        positions = pieces.query_pos[piece][pieces.query_valid[piece]].tolist()
        assert len({p // 4 for p in positions}) == 1
        assert starts[row] <= positions[0] and positions[-1] < starts[row] + counts[row]
        window_start = max(0, positions[0] // 4 + 1 - 3) * 4
        assert set(pieces.query_low[piece].tolist()) == {window_start}
