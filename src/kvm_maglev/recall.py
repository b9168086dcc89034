"""Synthetic long-range recall: key-value facts early, filler, queries far later.

A sequence is ``BOS k1 v1 k2 v2 ... kF vF <filler ...> Q kj vj <filler ...> Q kl vl ...``.
The facts are random (key, value) pairs with distinct keys; each query repeats a key after
the marker ``Q`` and the model must produce its value. The distance of a query is the number
of tokens between the fact's value and the query's answer position, so a model whose
attention window is ``W`` can only answer queries past ``W`` through its memory.
Filler and values are random, so the only learnable targets are the answers: labels are
``-100`` everywhere else.
"""

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

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
    input_ids: list[int]
    labels: list[int]
    answer_positions: list[int]  # index i such that input_ids[i] is the answer (predicted at i-1)
    distances: list[int]


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
    task: RecallTask, num_examples: int, distances: Sequence[int], queries_per_example: int, seed: int,
    weights: Sequence[float] | None = None,
):
    """A ``datasets.Dataset`` with input_ids / labels / answer_positions / distances columns.

    Each example draws ``queries_per_example`` distances from ``distances``: uniformly, or in proportion to
    ``weights`` (one non-negative weight per distance) when given.
    """
    import datasets

    pool = torch.tensor(list(distances))
    if weights is not None:
        weights = torch.tensor(list(weights), dtype=torch.float64)
        if weights.shape != pool.shape or (weights < 0).any() or not weights.sum() > 0:
            raise ValueError(f"weights must be {len(pool)} non-negative numbers, one per distance, not all zero")
    generator = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {"input_ids": [], "labels": [], "answer_positions": [], "distances": []}
    for _ in range(num_examples):
        if weights is None:
            picks = pool[torch.randint(len(pool), (queries_per_example,), generator=generator)].tolist()
        else:
            picks = pool[torch.multinomial(weights, queries_per_example, replacement=True, generator=generator)].tolist()
        example = make_example(task, generator, picks)
        for column in rows:
            rows[column].append(getattr(example, column))
    return datasets.Dataset.from_dict(rows)


@torch.no_grad()
def evaluate_recall(
    model, task: RecallTask, distances: Sequence[int], num_examples: int, seed: int, use_generate: bool = True
) -> dict[int, float]:
    """Exact-match recall per distance: each prompt is cut right before its answer.

    The prompts of one distance form one left-padded batch. With ``use_generate`` the answer
    is one greedy ``generate()`` token on the model's cache, as a user would query the model;
    otherwise the argmax of an uncached forward at the last position.
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    recall: dict[int, float] = {}
    for distance in distances:
        prompts, answers = [], []
        attempts = 0
        while len(prompts) < num_examples:
            example = make_example(task, generator, [distance])
            attempts += 1
            if not example.answer_positions:
                # this draw's fact left no room for the query; another fact may fit
                if attempts > 20 * num_examples and not prompts:
                    raise ValueError(f"distance {distance} does not fit in a sequence of {task.seq_len} tokens")
                continue
            answer = example.answer_positions[0]
            prompts.append(example.input_ids[:answer])
            answers.append(example.input_ids[answer])
        input_ids, attention_mask = left_pad(prompts, device)
        predicted = _predict_next(model, input_ids, attention_mask, use_generate)
        recall[int(distance)] = (predicted.cpu() == torch.tensor(answers)).float().mean().item()
    return recall


def prompt_modes(model) -> list[str]:
    """Maglev prompt modes a model can be measured in: "recurrent" always, "prefiller" when the
    prefiller was kept (MAGLEV.md asks for recall under both); other models have one way to run."""
    config = model.config
    if getattr(config, "model_type", None) != "maglev" or not config.use_memory:
        return [""]
    return ["recurrent", "prefiller"] if config.has_prefiller else ["recurrent"]


@contextmanager
def memory_prefill(model, mode: str):
    """Run a Maglev model with ``config.memory_prefill = mode`` inside the block ("" leaves it alone)."""
    before = getattr(model.config, "memory_prefill", None)
    if mode:
        model.config.memory_prefill = mode
    try:
        yield model
    finally:
        if mode:
            model.config.memory_prefill = before


def evaluate_recall_per_mode(
    model, name: str, task: RecallTask, distances: Sequence[int], num_examples: int, seed: int
) -> dict[str, dict[int, float]]:
    """`evaluate_recall` under each of the model's prompt modes, keyed `name` (the default mode) or
    `name_<mode>_fed` (e.g. a Maglev prompt fed by its prefiller)."""
    results = {}
    for mode in prompt_modes(model):
        label = name if mode in ("", "recurrent") else f"{name}_{mode}_fed"
        with memory_prefill(model, mode):
            results[label] = evaluate_recall(model, task, distances, num_examples, seed=seed)
    return results


@torch.no_grad()
def memory_drift(model, task: RecallTask, num_examples: int, seed: int, bucket: int) -> dict[str, float]:
    """Mean 1 - cosine between P's own recurrent memories m_t and the prefiller's m'_t, per block of
    ``bucket`` positions (keyed by the block's first position): how far inference drifts from what P was
    trained on. Needs a Maglev model that kept its prefiller."""
    generator = torch.Generator().manual_seed(seed)
    distances = default_distances(bucket)
    rows = [make_example(task, generator, distances).input_ids for _ in range(num_examples)]
    input_ids = torch.tensor(rows, device=next(model.parameters()).device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with memory_prefill(model, "recurrent"):
        own = base.model(input_ids=input_ids, use_cache=False, lifted=False).memories
    target = base.model.prefiller_memories(input_ids)
    distance = 1.0 - torch.nn.functional.cosine_similarity(own.float(), target.float(), dim=-1).mean(dim=0)
    return {str(start): distance[start : start + bucket].mean().item() for start in range(0, distance.shape[0], bucket)}


def left_pad(rows: list[list[int]], device: torch.device = None):
    """Left-pad token rows with ``PAD_ID``; returns ``(input_ids, attention_mask)``."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention_mask[i, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _predict_next(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_generate: bool) -> torch.Tensor:
    if use_generate:
        out = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False, pad_token_id=PAD_ID
        )
        return out[:, -1]
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -1].argmax(-1)


def default_distances(window: int, max_multiple: int = 8) -> list[int]:
    """Distances from half the attention window to ``max_multiple`` windows past it."""
    return sorted({max(2, window // 2), window - 2, *(window * k for k in (2, 4) if k <= max_multiple), window * max_multiple})


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINE_STYLES = ("-", "--", "-.", ":")


def plotted_curves(results: dict[str, dict[int, float]]) -> dict[str, tuple[list[float], list[float], str, str]]:
    """Per model the points `plot_recall` draws - (distances, recall %, marker, line style) - each model nudged
    sideways by a few percent on the log axis and given its own marker, so models with equal recall (two at 100%,
    say) stay visible side by side instead of one hiding the other."""
    count = len(results)
    curves = {}
    for index, (name, per_distance) in enumerate(results.items()):
        distances = sorted(per_distance)
        nudge = 2 ** (0.06 * (index - (count - 1) / 2))
        curves[name] = ([d * nudge for d in distances], [100 * per_distance[d] for d in distances],
                        MARKERS[index % len(MARKERS)], LINE_STYLES[index % len(LINE_STYLES)])
    return curves


def plot_recall(results: dict[str, dict[int, float]], chance: float, window: int, path) -> None:
    """Recall (%) against query distance per model, with chance and the attention window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, (distances, recall, marker, style) in plotted_curves(results).items():
        ax.plot(distances, recall, marker=marker, linestyle=style, markerfacecolor="none", label=name)
    ax.axhline(100 * chance, color="grey", linestyle=":", label="chance")
    ax.axvline(window, color="grey", linestyle="--", label="attention window")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("query distance (tokens)")
    ax.set_ylabel("exact-match recall (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chance_level(task: RecallTask) -> float:
    return 1.0 / task.num_values


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    """Stack recall rows for Trainer (the task makes every row ``seq_len`` long: no padding)."""
    return {
        "input_ids": torch.tensor([row["input_ids"] for row in batch]),
        "labels": torch.tensor([row["labels"] for row in batch]),
    }


__all__ = [
    "RecallTask",
    "RecallExample",
    "make_example",
    "left_pad",
    "prompt_modes",
    "memory_prefill",
    "build_dataset",
    "evaluate_recall",
    "evaluate_recall_per_mode",
    "memory_drift",
    "default_distances",
    "chance_level",
    "plot_recall",
    "plotted_curves",
    "collate",
    "PAD_ID",
    "BOS_ID",
    "QUERY_ID",
]

