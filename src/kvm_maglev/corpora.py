"""Offline byte-level corpora for language-modelling comparisons of long-context memory.

- `cast_corpus`: seeded synthetic stories. Each opens with a short cast of random names that later
  sentences reuse, so a model with a short attention window cannot tell which names are in play once
  the cast has scrolled out of it, while a model with memory can.
- `stdlib_corpus`: the Python sources of the running interpreter's standard library, split into
  training and validation files by a hash of the file's path (stable across machines and runs).
Both return lists of byte strings (documents); `pack_bytes` cuts them into fixed-length rows.
`cast_header` reads a story's cast back (for an oracle memory, or a probe of what a memory holds).
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path

import torch

_SYLLABLES = ("ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "na", "qui", "bex", "ul", "fa", "ri", "zan",
              "po", "em", "tiv", "gar", "os")
_VERBS = ("met", "thanked", "followed", "called", "helped", "warned", "visited", "praised", "teased", "trusted")
_THINGS = ("a lamp", "the map", "some bread", "a letter", "the key", "a coin", "the boat", "a song")
_PLACES = ("the market", "the river", "the hill", "the library", "the harbour", "the old mill")
_SETTINGS = ("The morning was grey.", "Rain fell on the roofs.", "A bell rang twice.", "The road was long.",
             "Smoke rose from the chimneys.", "It was the end of summer.", "Nobody spoke for a while.")


def name_pool(size: int, seed: int) -> list[str]:
    """`size` distinct capitalised names of two or three syllables, the same for a given seed."""
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < size:
        names.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize())
    return sorted(names)


def preamble(rng: random.Random, max_bytes: int) -> list[str]:
    """Setting sentences without names, as many as stay within a length drawn uniformly from [0, max_bytes]:
    they move a story's cast header away from the row's first bytes."""
    budget, used, lines = rng.randint(0, max_bytes), 0, []
    while True:
        sentence = rng.choice(_SETTINGS)
        used += len(sentence) + 1  # the space that joins it to the next sentence
        if used > budget:
            return lines
        lines.append(sentence)


def cast_story(rng: random.Random, pool: list[str], cast_size: int, sentences: int, preamble_bytes: int = 0) -> str:
    """One story: "Cast: A, B, C." then sentences about the cast members only; with `preamble_bytes`, up to
    that many bytes of setting sentences come before the header."""
    lines = preamble(rng, preamble_bytes) if preamble_bytes else []
    cast = rng.sample(pool, cast_size)
    lines.append(f"Cast: {', '.join(cast)}.")
    for _ in range(sentences):
        first, second = rng.sample(cast, 2)
        form = rng.randrange(3)
        if form == 0:
            lines.append(f"{first} {rng.choice(_VERBS)} {second}.")
        elif form == 1:
            lines.append(f"{first} gave {second} {rng.choice(_THINGS)}.")
        else:
            lines.append(f"{first} went to {rng.choice(_PLACES)} with {second}.")
    return " ".join(lines) + "\n"


def cast_corpus(num_documents: int, seed: int, pool_size: int = 200, cast_size: int = 3,
                sentences: int = 10, preamble_bytes: int = 0) -> list[bytes]:
    """Synthetic stories with long-range structure (see the module docstring); one seed, one corpus.
    `preamble_bytes` > 0 starts each story's header at a random offset (0 to that many bytes in)."""
    if preamble_bytes < 0:
        raise ValueError(f"preamble_bytes must be >= 0, got {preamble_bytes}")
    pool = name_pool(pool_size, seed=0)  # the same names for every seed: only the stories differ
    rng = random.Random(seed)
    return [cast_story(rng, pool, cast_size, sentences, preamble_bytes).encode("ascii")
            for _ in range(num_documents)]


def cast_header(story: bytes) -> tuple[list[str], int]:
    """(the cast's names, the index of the "." that closes the "Cast: A, B, C." header) of a story's opening
    bytes; the header may follow a preamble."""
    prefix = b"Cast: "
    start = story.find(prefix)
    end = story.find(b".", start)
    if start < 0 or end < 0:
        raise ValueError(f"not the opening of a cast story: {story[:40]!r}")
    return story[start + len(prefix):end].decode("ascii").split(", "), end


def stdlib_corpus(split: str, max_files: int | None = None) -> list[bytes]:
    """The standard library's .py files (tests excluded) of the split "train" or "validation" (one file in ten,
    chosen by the SHA-256 of its path relative to the library root)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0].lower()
                   and "site-packages" not in p.parts)
    chosen = []
    for path in files:
        bucket = hashlib.sha256(path.relative_to(root).as_posix().encode()).digest()[0] % 10
        if (bucket == 0) == (split == "validation"):
            chosen.append(path.read_bytes())
        if max_files is not None and len(chosen) >= max_files:
            break
    return chosen


def pack_bytes(documents: list[bytes], length: int, bos: int = 256, rows_per_document: int | None = None
               ) -> torch.Tensor:
    """Rows of `length` byte ids: each document starts with `bos` and is cut into whole rows (a document's
    tail shorter than a row is dropped, so every row starts at a document's start or continues it); at most
    `rows_per_document` rows from each."""
    rows = []
    for document in documents:
        ids = [bos, *document]
        starts = range(0, len(ids) - length + 1, length)
        rows.extend(ids[start:start + length] for start in list(starts)[:rows_per_document])
    if not rows:
        raise ValueError(f"no document is {length - 1} bytes or longer")
    return torch.tensor(rows, dtype=torch.long)


__all__ = ["cast_corpus", "cast_header", "cast_story", "name_pool", "pack_bytes", "stdlib_corpus"]
