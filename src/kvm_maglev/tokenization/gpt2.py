"""The KVM research run's GPT-2 byte-level BPE tokenizer, carried into the converted folder.

The research trainer saves its tokenizer with `model_max_length=0` and trains a model whose
embedding has more rows than the tokenizer has tokens (50304 vs 50257); the padded ids are
recorded so that generation can suppress them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _special_token_text(value) -> str | None:
    """A special token from tokenizer_config.json: a plain string or an AddedToken-like mapping."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_research_tokenizer(
    folder: str | os.PathLike, *, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """Load `tokenizer.json` (+ `tokenizer_config.json`) from a research folder as a PreTrainedTokenizerFast.

    A stored `model_max_length` that is not a positive length (the trainer writes 0) is replaced
    by `model_max_length` when given, otherwise dropped (transformers' "no limit").
    """
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"no tokenizer.json in {folder}; pass the folder holding the research tokenizer files")
    config_file = folder / "tokenizer_config.json"
    stored = {}
    if config_file.is_file():
        try:
            stored = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file} is not valid JSON: {error}") from error
    kwargs = {key: _special_token_text(stored.get(key)) for key in _SPECIAL_TOKEN_KEYS}
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    stored_length = stored.get("model_max_length")
    if model_max_length is not None:
        if model_max_length <= 0:
            raise ValueError(f"model_max_length must be positive, got {model_max_length}")
        kwargs["model_max_length"] = model_max_length
    elif isinstance(stored_length, int) and 0 < stored_length:
        kwargs["model_max_length"] = stored_length
    try:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_file),
            add_prefix_space=bool(stored.get("add_prefix_space", False)),
            clean_up_tokenization_spaces=bool(stored.get("clean_up_tokenization_spaces", False)),
            **kwargs,
        )
    except Exception as error:  # the tokenizers library reports broken files with its own exception type
        raise ValueError(f"cannot load {tokenizer_file}: {error}") from error
    for key, text in kwargs.items():
        if key.endswith("_token") and tokenizer.convert_tokens_to_ids(text) is None:
            raise ValueError(f"{config_file}: {key} {text!r} is not in the tokenizer's vocabulary")
    return tokenizer


def padded_token_ids(tokenizer_vocab_size: int, model_vocab_size: int) -> list[int]:
    """Ids the model can score but the tokenizer never produces (embedding rows added for speed)."""
    if model_vocab_size < tokenizer_vocab_size:
        raise ValueError(
            f"the model's vocabulary ({model_vocab_size}) is smaller than the tokenizer's ({tokenizer_vocab_size})"
        )
    return list(range(tokenizer_vocab_size, model_vocab_size))


def generation_token_fields(tokenizer: PreTrainedTokenizerFast, model_vocab_size: int) -> dict:
    """generation_config fields: bos/eos/pad ids, and `suppress_tokens` so padded ids are never generated."""
    fields = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    fields = {key: value for key, value in fields.items() if value is not None}
    padded = padded_token_ids(len(tokenizer), model_vocab_size)
    if padded:
        fields["suppress_tokens"] = padded
    return fields
