"""Checks of what a model's forward is given, with clear errors, and the cache under either keyword name (the names:
`transformers_versions`)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

# why a transformers cache of per-layer keys and values is refused, and what PEFT users (prefix tuning hands the
# model one holding the learned prefix) can use instead
PREFIX_KEYS_REFUSED = (": a cache of per-layer keys/values, as PEFT prefix tuning passes, has no place for this model's "
                       "compressed state, so PEFT prefix tuning does not apply; use LoRA "
                       "(peft.LoraConfig(target_modules='all-linear')), or prompt tuning on KVM")


def take_cache(past_key_values, cache):
    """The cache given as `past_key_values` or as `cache` (transformers >= 5.24); two different ones are refused."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("Pass the cache once, as `cache` or `past_key_values`, not both.")
    return past_key_values if past_key_values is not None else cache


def check_token_ids(input_ids, vocab_size: int, cache) -> None:
    """Refuse token ids the embeddings cannot read. Ids are range-checked on CPU always, and on accelerators
    for prompts (a decoding step's ids come from the model's own logits; checking them would stall the
    device every token)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool \
            or input_ids.is_complex():
        raise TypeError(f"input_ids must be an integer tensor, got {getattr(input_ids, 'dtype', type(input_ids))}")
    if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got shape {tuple(input_ids.shape)}")
    prompt = cache is None or cache.get_seq_length() == 0 or input_ids.shape[1] > 1
    if input_ids.device.type == "cpu" or prompt:
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"input_ids must be in [0, vocab_size={vocab_size}), got values in [{low}, {high}]")


def check_cache(cache, cache_class: type, config) -> None:
    """Refuse a cache of another class, or one made for another architecture."""
    if not isinstance(cache, cache_class):
        raise TypeError(f"{cache_class.MODEL_NAME} models need a {cache_class.__name__}, got {type(cache).__name__}"
                        + (PREFIX_KEYS_REFUSED if isinstance(cache, Cache) else ""))
    cache.check_compatible(config)
