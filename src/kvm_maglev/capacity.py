"""Capacity-bound multi-key recall: many key-value facts spread through long filler, queried after all of them.

A sequence of ``seq_len`` tokens is ``BOS``, then ``num_facts`` facts ``k v`` (distinct keys, random values) at
random pair-aligned places among random filler, at least ``gap`` filler tokens after the last fact, and at the end
``num_queries`` queries ``Q k v`` of distinct facts, back to back. Only the answers are labelled. Token ids are
the recall task's (`kvm_maglev.recall`): a `CapacityTask` is a `RecallTask` with a query block and a gap.

A model trained at one length is measured at multiples of it with the same facts: they spread further apart
and the memory must keep the same number of facts across more filler. KVM's fixed state keeps its slot count
whatever the length; its power-law state grows with the tokens read (the KVM paper's trade-off). Answers are
greedy `generate()` tokens on the model's own cache: one prefill up to the first answer, then each later query
continues the same cache with the true answer and the next query appended.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .models.common.transformers_versions import CACHE_NAME, returned_cache
from .recall import BOS_ID, PAD_ID, QUERY_ID, RecallExample, RecallTask


@dataclass(frozen=True)
class CapacityTask(RecallTask):
    """Sizes of the capacity task; ``num_facts`` and ``seq_len`` are one cell's (see `cell`)."""

    num_keys: int = 128
    num_values: int = 64
    num_filler: int = 32
    num_facts: int = 16
    seq_len: int = 256
    num_queries: int = 8
    gap: int = 32

    @property
    def queries_start(self) -> int:
        """Position of the first query's ``Q``."""
        return self.seq_len - 3 * self.num_queries

    @property
    def fact_places(self) -> int:
        """Pair-aligned places a fact can take: positions ``1 + 2 j`` for ``j < fact_places``, all ending at least
        ``gap`` tokens before the queries."""
        return max(0, (self.queries_start - self.gap - 1) // 2)

    @property
    def answer_positions(self) -> list[int]:
        return [self.queries_start + 3 * i + 2 for i in range(self.num_queries)]

    def cell(self, seq_len: int, num_facts: int) -> "CapacityTask":
        return replace(self, seq_len=seq_len, num_facts=num_facts)

    def validate(self) -> None:
        if min(self.num_keys, self.num_values, self.num_filler, self.num_facts, self.num_queries) <= 0:
            raise ValueError("num_keys, num_values, num_filler, num_facts and num_queries must all be positive")
        if self.num_facts > self.num_keys:
            raise ValueError(f"num_facts ({self.num_facts}) must not exceed num_keys ({self.num_keys})")
        if self.num_queries > self.num_facts:
            raise ValueError(f"num_queries ({self.num_queries}) must not exceed num_facts ({self.num_facts}): "
                             "each query asks a different fact")
        if self.gap < 0:
            raise ValueError(f"gap must be >= 0, got {self.gap}")
        if self.fact_places < self.num_facts:
            raise ValueError(f"seq_len {self.seq_len} holds {self.fact_places} fact places before the gap and "
                             f"the queries, fewer than num_facts={self.num_facts}")


def make_capacity_example(task: CapacityTask, generator: torch.Generator) -> RecallExample:
    """One sequence of the task's cell; ``distances`` are answer position minus the fact's value position."""
    task.validate()
    facts = task.num_facts
    keys = torch.randperm(task.num_keys, generator=generator)[:facts] + task.key_ids.start
    values = torch.randint(task.num_values, (facts,), generator=generator) + task.value_ids.start
    ids = torch.randint(task.num_filler, (task.seq_len,), generator=generator) + task.filler_ids.start
    ids[0] = BOS_ID
    places = 1 + 2 * torch.randperm(task.fact_places, generator=generator)[:facts].sort().values
    ids[places], ids[places + 1] = keys, values
    labels = torch.full((task.seq_len,), -100, dtype=torch.long)
    asked = torch.randperm(facts, generator=generator)[: task.num_queries].tolist()
    distances = []
    for answer, fact in zip(task.answer_positions, asked):
        ids[answer - 2], ids[answer - 1], ids[answer] = QUERY_ID, keys[fact], values[fact]
        labels[answer] = values[fact]
        distances.append(answer - int(places[fact]) - 1)
    return RecallExample(ids.tolist(), labels.tolist(), task.answer_positions, distances)


def build_capacity_dataset(task: CapacityTask, num_examples: int, facts: Sequence[int], seed: int):
    """A ``datasets.Dataset`` (input_ids / labels / answer_positions / distances / num_facts) of rows of
    ``task.seq_len`` tokens; each row's fact count is drawn uniformly from ``facts``."""
    import datasets

    generator = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {"input_ids": [], "labels": [], "answer_positions": [], "distances": [], "num_facts": []}
    cells = {count: task.cell(task.seq_len, count) for count in facts}
    for count in cells.values():
        count.validate()
    choices = list(facts)
    for _ in range(num_examples):
        count = choices[int(torch.randint(len(choices), (1,), generator=generator))]
        example = make_capacity_example(cells[count], generator)
        for column in ("input_ids", "labels", "answer_positions", "distances"):
            rows[column].append(getattr(example, column))
        rows["num_facts"].append(count)
    return datasets.Dataset.from_dict(rows)


@torch.no_grad()
def answer_queries(model, input_ids: torch.Tensor, answer_positions: Sequence[int]) -> tuple[torch.Tensor, int]:
    """Greedy answers [batch, queries] of rows whose queries sit at the same positions, through `generate()` on one
    cache: the first call reads the prompt up to the first answer, each later one continues the cache with the true
    answer and the next query. Also returns the cache's bytes per row when the last answer is asked for."""
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    cache, answers = None, []
    for position in answer_positions:
        prompt = input_ids[:, :position]
        kwargs = {} if cache is None else {CACHE_NAME: cache}
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False,
                             pad_token_id=PAD_ID, return_dict_in_generate=True, **kwargs)
        cache = returned_cache(out)
        answers.append(out.sequences[:, -1].cpu())
    return torch.stack(answers, dim=1), cache.nbytes() // input_ids.shape[0]


def evaluate_capacity(model, task: CapacityTask, lengths: Sequence[int], facts: Sequence[int], num_sequences: int,
                      seed: int, tokens_per_batch: int = 32768) -> dict[str, dict]:
    """Exact-match recall per (evaluation length, fact count) over ``num_sequences`` sequences of ``num_queries``
    queries each, answered with `answer_queries`; and the cache bytes per sequence at the last answer, per length.
    Batches hold about ``tokens_per_batch`` tokens. Prompts come from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    recall: dict[int, dict[int, float]] = {}
    cache_bytes: dict[int, int] = {}
    for length in lengths:
        batch = max(1, tokens_per_batch // length)
        recall[length] = {}
        for count in facts:
            cell = task.cell(length, count)
            rows = [make_capacity_example(cell, generator) for _ in range(num_sequences)]
            correct = 0
            for start in range(0, num_sequences, batch):
                part = rows[start:start + batch]
                ids = torch.tensor([row.input_ids for row in part])
                predicted, cache_bytes[length] = answer_queries(model, ids, cell.answer_positions)
                correct += (predicted == ids[:, cell.answer_positions]).sum().item()
            recall[length][count] = correct / (num_sequences * task.num_queries)
    return {"recall": recall, "cache_bytes": cache_bytes}


def recall_by_length(recall: dict[int, dict[int, float]]) -> dict[int, float]:
    """Mean recall over the fact counts (equal queries each) per evaluation length."""
    return {length: sum(cells.values()) / len(cells) for length, cells in recall.items()}


def plot_capacity(results: dict[str, dict], chance: float, train_length: int, path) -> None:
    """Recall (%) against evaluation length, one panel per fact count and one line per model; ``results`` maps a
    model to {length: {facts: recall}} (keys may be strings, as in the JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({int(f) for cells in results.values() for row in cells.values() for f in row})
    fig, axes = plt.subplots(1, len(counts), figsize=(3.2 * len(counts), 3.4), sharey=True, squeeze=False)
    for ax, count in zip(axes[0], counts):
        for index, (name, cells) in enumerate(results.items()):
            points = sorted((int(n), row[f]) for n, row in cells.items() for f in row if int(f) == count)
            ax.plot([n for n, _ in points], [100 * r for _, r in points], marker="os^Dv"[index % 5], label=name)
        ax.axhline(100 * chance, color="grey", linestyle=":", label="chance")
        ax.axvline(train_length, color="grey", linestyle="--", label="training length")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_title(f"{count} facts", fontsize=10)
        ax.set_xlabel("evaluation length (tokens)")
    axes[0][0].set_ylabel("exact-match recall (%)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = [
    "plot_capacity",
    "CapacityTask",
    "make_capacity_example",
    "build_capacity_dataset",
    "answer_queries",
    "evaluate_capacity",
    "recall_by_length",
]
