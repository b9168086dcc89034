"""generate() for a model with a cache class of its own, run inside the model's runtime speed-ups, and saved folders
that decode with that cache."""

from __future__ import annotations

from typing import Any

import torch

from .model_inputs import check_cache
from .transformers_versions import GENERATE_CACHE_KWARG


class OwnCacheGenerationMixin:
    """Put before GenerationMixin: generate() opens `runtime_speedups()` and gets a `cache_class` cache
    (never a DynamicCache) unless the user passed one or disabled caching; an assistant's cache records
    its steps so that rejected draft tokens can be cropped."""

    cache_class: type

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' generate() inside `runtime_speedups()`."""
        with self.runtime_speedups():
            return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        user_cache = model_kwargs.get(GENERATE_CACHE_KWARG)
        if user_cache is not None:
            check_cache(user_cache, self.cache_class, self.config)
            super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        elif generation_config.use_cache is False:
            return
        elif generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                             f"{self.cache_class.MODEL_NAME} models always use their own {self.cache_class.__name__}.")
        else:
            model_kwargs[GENERATE_CACHE_KWARG] = self.cache_class(self.config)
        if getattr(generation_config, "is_assistant", False):
            model_kwargs[GENERATE_CACHE_KWARG].activate_past_recording()

    def _prepare_attention_mask_for_generation(self, inputs_tensor: torch.Tensor, generation_config,
                                               model_kwargs: dict) -> torch.LongTensor:
        """An assistant given no mask reads the main model's sequence, whose every token is real (the main model
        passes its mask on when it has padding): transformers would infer one from pad ids, marking each generated
        token equal to the pad id as padding while its own position_ids count it."""
        if getattr(generation_config, "is_assistant", False):
            return torch.ones(inputs_tensor.shape[:2], dtype=torch.long, device=inputs_tensor.device)
        return super()._prepare_attention_mask_for_generation(inputs_tensor, generation_config, model_kwargs)


class CachedDecodingSaveMixin:
    """Put before PreTrainedModel: a saved folder decodes with its cache whatever a training run set (Trainer turns
    `use_cache` off for gradient checkpointing, and transformers derives generate()'s setting from a folder's config
    when it has no generation config): `use_cache` is true in the saved config and generation config. The model
    in memory keeps its own setting."""

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> Any:
        """transformers' save_pretrained, with `use_cache` true in what it writes."""
        settings = [obj for obj in (self.config, getattr(self, "generation_config", None)) if obj is not None]
        before = [obj.use_cache for obj in settings]
        for obj in settings:
            obj.use_cache = True
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            for obj, value in zip(settings, before):
                obj.use_cache = value
