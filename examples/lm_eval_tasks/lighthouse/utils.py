"""Local data for the lighthouse tasks: JSON lines beside this file, so the tasks run offline
from any working directory (lm-eval resolves `!function utils.<name>` relative to the YAML)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _read_jsonl(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_choice_docs(**kwargs) -> datasets.DatasetDict:
    """Multiple-choice questions: question, choices, answer (index of the right choice)."""
    return _read_jsonl("lighthouse_choice.jsonl")


def load_answer_docs(**kwargs) -> datasets.DatasetDict:
    """Short-answer questions: question, answer."""
    return _read_jsonl("lighthouse_answer.jsonl")
