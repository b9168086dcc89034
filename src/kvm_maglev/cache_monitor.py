"""Watch a model's cache while `generate()` runs: bytes held and entries per layer, step by step.

generate() does not hand its cache to stopping criteria or logits processors, so the monitor
observes the model instead: a forward hook keeps the cache the model's last forward returned
(or was given), and the monitor - a `StoppingCriteria` that never stops anything - records a
description of it after every step. Works with any cache that has `nbytes()` (MaglevCache,
KVMCache); `layer_lengths()` is used when the cache has it.

    with CacheMonitor(model) as monitor:
        model.generate(ids, max_new_tokens=100, stopping_criteria=[monitor])
    monitor.trace[-1]["nbytes"]
"""

import torch
from transformers import StoppingCriteria


def describe_cache(cache) -> dict:
    """Type, columns read, batch size, bytes held and entries per layer of a cache with `nbytes()`."""
    if not callable(getattr(cache, "nbytes", None)):
        raise TypeError(f"describe_cache needs a cache with an nbytes() method, got {type(cache).__name__}")
    if callable(getattr(cache, "layer_lengths", None)):
        layer_lengths = list(cache.layer_lengths())
    else:
        layer_lengths = [
            0 if getattr(layer, "keys", None) is None else int(layer.keys.shape[-2])
            for layer in getattr(cache, "layers", [])
        ]
    return {
        "type": type(cache).__name__,
        "seq_length": int(cache.get_seq_length()),
        "batch_size": int(getattr(cache, "batch_size", -1)),
        "nbytes": int(cache.nbytes()),
        "layer_lengths": layer_lengths,
    }


def _output_cache(output):
    for name in ("cache", "past_key_values"):
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    return None


class CacheMonitor(StoppingCriteria):
    """A stopping criterion that never stops: after each generate step it appends
    `{"step", "length", **describe_cache(...)}` for the cache the model used last to `trace`."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.trace: list[dict] = []
        self.last_cache = None
        self._hook = model.register_forward_hook(self._remember_cache, with_kwargs=True)

    def _remember_cache(self, module, args, kwargs, output) -> None:
        cache = _output_cache(output)
        if cache is None:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            self.last_cache = cache

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if self.last_cache is not None and callable(getattr(self.last_cache, "nbytes", None)):
            entry = {"step": len(self.trace), "length": input_ids.shape[1], **describe_cache(self.last_cache)}
            self.trace.append(entry)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def close(self) -> None:
        """Remove the forward hook from the model."""
        self._hook.remove()

    def __enter__(self) -> "CacheMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
