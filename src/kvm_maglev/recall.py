"""Synthetic long-range recall: key-value facts early, filler, queries far later.

A sequence is ``BOS k1 v1 k2 v2 ... kF vF <filler ...> Q kj vj <filler ...> Q kl vl ...``.
The facts are random (key, value) pairs with distinct keys; each query repeats a key after
the marker ``Q`` and the model must produce its value. The distance of a query is the number
of tokens between the fact's value and the query's answer position, so a model whose
attention window is ``W`` can only answer queries past ``W`` through its memory.
Filler and values are random, so the only learnable targets are the answers: labels are
``-100`` everywhere else.
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

PAD_ID, BOS_ID, QUERY_ID = 0, 1, 2
_FIRST_FREE_ID = 3


@dataclass(frozen=True)
class RecallTask:
    """Token layout and sizes of the recall task (defaults: chance = 1 / num_values)."""

    num_keys: int = 32
    num_values: int = 32
    num_filler: int = 32
    num_facts: int = 4
    seq_len: int = 320

    @property
    def key_ids(self) -> range:
        return range(_FIRST_FREE_ID, _FIRST_FREE_ID + self.num_keys)

    @property
    def value_ids(self) -> range:
        start = self.key_ids.stop
        return range(start, start + self.num_values)

    @property
    def filler_ids(self) -> range:
        start = self.value_ids.stop
        return range(start, start + self.num_filler)

    @property
    def vocab_size(self) -> int:
        return self.filler_ids.stop

    @property
    def facts_end(self) -> int:
        """Index of the first token after the facts block."""
        return 1 + 2 * self.num_facts

    def validate(self) -> None:
        if self.num_facts > self.num_keys:
            raise ValueError(f"num_facts ({self.num_facts}) must not exceed num_keys ({self.num_keys})")
        if min(self.num_keys, self.num_values, self.num_filler, self.num_facts) <= 0:
            raise ValueError("num_keys, num_values, num_filler and num_facts must all be positive")
        if self.seq_len < self.facts_end + 3:
            raise ValueError(f"seq_len ({self.seq_len}) leaves no room for a query after the facts")


@dataclass
class RecallExample:
    input_ids: List[int]
    labels: List[int]
    answer_positions: List[int]  # index i such that input_ids[i] is the answer (predicted at i-1)
    distances: List[int]


def _fact_value_position(fact_index: int) -> int:
    return 2 + 2 * fact_index


def make_example(
    task: RecallTask, generator: torch.Generator, query_distances: Sequence[int]
) -> RecallExample:
    """One sequence with a query answered ``d`` tokens after its fact, for each ``d`` given.

    Distances that do not fit in ``task.seq_len`` or collide with another query are skipped.
    """
    task.validate()
    keys = torch.randperm(task.num_keys, generator=generator)[: task.num_facts] + task.key_ids.start
    values = torch.randint(task.num_values, (task.num_facts,), generator=generator) + task.value_ids.start
    ids = torch.randint(task.num_filler, (task.seq_len,), generator=generator) + task.filler_ids.start
    ids[0] = BOS_ID
    ids[1 : task.facts_end : 2] = keys
    ids[2 : task.facts_end : 2] = values
    labels = torch.full((task.seq_len,), -100, dtype=torch.long)
    taken = torch.zeros(task.seq_len, dtype=torch.bool)
    taken[: task.facts_end] = True
    answers, distances = [], []
    for distance in query_distances:
        fact = int(torch.randint(task.num_facts, (1,), generator=generator))
        answer = _fact_value_position(fact) + int(distance)
        if answer >= task.seq_len or answer - 2 < task.facts_end or taken[answer - 2 : answer + 1].any():
            continue
        ids[answer - 2], ids[answer - 1], ids[answer] = QUERY_ID, keys[fact], values[fact]
        labels[answer] = values[fact]
        taken[answer - 2 : answer + 1] = True
        answers.append(answer)
        distances.append(int(distance))
    return RecallExample(ids.tolist(), labels.tolist(), answers, distances)


def build_dataset(
    task: RecallTask, num_examples: int, distances: Sequence[int], queries_per_example: int, seed: int
):
    """A ``datasets.Dataset`` with input_ids / labels / answer_positions / distances columns.

    Each example draws ``queries_per_example`` distances uniformly from ``distances``.
    """
    import datasets

    generator = torch.Generator().manual_seed(seed)
    rows: Dict[str, list] = {"input_ids": [], "labels": [], "answer_positions": [], "distances": []}
    pool = torch.tensor(list(distances))
    for _ in range(num_examples):
        picks = pool[torch.randint(len(pool), (queries_per_example,), generator=generator)].tolist()
        example = make_example(task, generator, picks)
        for column in rows:
            rows[column].append(getattr(example, column))
    return datasets.Dataset.from_dict(rows)


@torch.no_grad()
def evaluate_recall(
    model, task: RecallTask, distances: Sequence[int], num_examples: int, seed: int, use_generate: bool = True
) -> Dict[int, float]:
    """Exact-match recall per distance: the prompt is cut right before the answer.

    With ``use_generate`` the answer is one greedy ``generate()`` token on a cache, as a user
    would query the model; otherwise the argmax of one uncached forward.
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    hits: Dict[int, List[bool]] = {int(d): [] for d in distances}
    for _ in range(num_examples):
        for distance in distances:
            example = make_example(task, generator, [distance])
            if not example.answer_positions:
                continue
            answer = example.answer_positions[0]
            prompt = torch.tensor([example.input_ids[:answer]], device=device)
            predicted = _predict_next(model, prompt, use_generate)
            hits[int(distance)].append(predicted == example.input_ids[answer])
    return {d: (sum(h) / len(h) if h else float("nan")) for d, h in hits.items()}


def _predict_next(model, prompt: torch.Tensor, use_generate: bool) -> int:
    if use_generate:
        out = model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=PAD_ID)
        return int(out[0, -1])
    return int(model(input_ids=prompt).logits[0, -1].argmax())


def default_distances(window: int, max_multiple: int = 8) -> List[int]:
    """Distances from half the attention window to ``max_multiple`` windows past it."""
    return sorted({max(2, window // 2), window - 2, *(window * k for k in (2, 4) if k <= max_multiple), window * max_multiple})


def chance_level(task: RecallTask) -> float:
    return 1.0 / task.num_values


def collate(batch: List[dict]) -> Dict[str, torch.Tensor]:
    """Stack recall rows for Trainer (the task makes every row ``seq_len`` long: no padding)."""
    return {
        "input_ids": torch.tensor([row["input_ids"] for row in batch]),
        "labels": torch.tensor([row["labels"] for row in batch]),
    }


__all__ = [
    "RecallTask",
    "RecallExample",
    "make_example",
    "build_dataset",
    "evaluate_recall",
    "default_distances",
    "chance_level",
    "collate",
    "PAD_ID",
    "BOS_ID",
    "QUERY_ID",
]

