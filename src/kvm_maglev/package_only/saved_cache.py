"""Saved caches ("prompt caching"): a cache written to a folder and read back for the model it was made for.

A cache folder holds the cache's tensors as safetensors and a JSON with its format, its own fields and the
fingerprint of the config it was made for (the cache class's `CACHE_CONFIG_FIELDS`); loading refuses a cache made
for another architecture. Any of our caches can be saved, a Hub folder's (remote code) included: each cache class
has a format here (`FORMATS`, by class name), which says how its state becomes tensors and back; the model files
carry none of it.

    save_cache(cache, "doc_cache")
    cache = load_cache("doc_cache", model)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheFormat:
    """How one cache class is saved: its format's name and version, its two files, its state as tensors and JSON
    fields (`state(cache)`), and the cache rebuilt from them (`restore(cls, config, meta, tensors, dtype)`)."""

    name: str
    version: int
    tensors_file: str
    meta_file: str
    state: Callable
    restore: Callable


def kvm_state(cache) -> tuple[dict[str, torch.Tensor], dict]:
    """A KVMCache's layer tensors and its columns, rows and each row's position."""
    if not cache.rows or cache.columns == 0:
        raise ValueError("the cache is empty: read some tokens before saving it")
    tensors = {f"layers.{i}.{name}": tensor for i, layer in enumerate(cache.layers)
               for name, tensor in layer.tensors.items()}
    dtype = cache.layers[0].tensors["window_keys"].dtype
    fields = {"columns": cache.columns, "batch_size": cache.rows, "seen": cache.seen,
              "dtype": str(dtype).removeprefix("torch.")}
    return tensors, fields


def kvm_restore(cls, config, meta: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """The KVMCache `kvm_state` described (its tensors keep their saved dtypes)."""
    cache = cls(config)
    cache.columns, cache.rows, cache.seen = meta["columns"], meta["batch_size"], list(meta["seen"])
    for i, layer in enumerate(cache.layers):
        layer.tensors = tensors_under(tensors, f"layers.{i}.")
    return cache


def maglev_state(cache) -> tuple[dict[str, torch.Tensor], dict]:
    """A MaglevCache's rings, each row's position, memory and smear embedding, and its columns."""
    if cache.positions is None:
        raise ValueError("the cache is empty: read some tokens before saving it")
    tensors = {"positions": cache.positions, "previous_embedding": cache.previous_embedding}
    if cache.last_memory is not None:
        tensors["last_memory"] = cache.last_memory
    for i, layer in enumerate(cache.layers):
        tensors.update({f"layers.{i}.{name}": t for name, t in layer.tensors.items()})
    fields = {"seen_tokens": cache.columns, "batch_size": cache.batch_size,
              "dtype": str(cache.previous_embedding.dtype).removeprefix("torch.")}
    return tensors, fields


def maglev_restore(cls, config, meta: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """The MaglevCache `maglev_state` described, in the model's dtype."""
    cache = cls(config)
    cache.columns = meta["seen_tokens"]
    cache.positions = tensors["positions"]
    cache.previous_embedding = tensors["previous_embedding"].to(dtype)
    cache.last_memory = tensors["last_memory"].to(dtype) if "last_memory" in tensors else None
    for i, layer in enumerate(cache.layers):
        layer.batch = meta["batch_size"]
        ring = tensors_under(tensors, f"layers.{i}.")
        if ring:
            layer.tensors = {name: t.to(dtype).contiguous() for name, t in ring.items()}
            layer.capacity = layer.tensors["keys"].shape[2]
    return cache


FORMATS = {
    "KVMCache": CacheFormat("kvm-cache", 2, "kvm_cache.safetensors", "kvm_cache.json", kvm_state, kvm_restore),
    # 2: nanochat window patterns keep growing rings, no longer every column; 3: the config fingerprint records
    # where the memory comes from (source layer, projection, residual injection)
    "MaglevCache": CacheFormat("maglev-cache", 3, "maglev_cache.safetensors", "maglev_cache.json", maglev_state,
                               maglev_restore),
}


def cache_format(cls: type) -> CacheFormat:
    """The saved format of cache class `cls` (ours, or a Hub folder's class of the same name)."""
    if cls.__name__ not in FORMATS:
        raise TypeError(f"{cls.__name__} has no saved-cache format (saved are: {', '.join(FORMATS)})")
    return FORMATS[cls.__name__]


def config_fingerprint(config, fields: tuple[str, ...]) -> dict:
    """The config fields a cache depends on, as plain JSON values."""
    return {name: getattr(config, name) for name in fields}


def fingerprint_mismatch(expected: dict, found: dict) -> list[str]:
    """Fields where two fingerprints differ, with both values."""
    names = sorted(set(expected) | set(found))
    return [f"{n}: cache {found.get(n)!r} vs model {expected.get(n)!r}"
            for n in names if expected.get(n) != found.get(n)]


def tensors_under(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The saved tensors whose names start with `prefix`, named without it."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def save_cache(cache, path: str | os.PathLike) -> None:
    """Write `cache` to folder `path`: tensors as safetensors plus a JSON with the config fingerprint."""
    from safetensors.torch import save_file

    form = cache_format(type(cache))
    tensors, fields = form.state(cache)
    meta = {"format": form.name, "version": form.version, **fields,
            "config": config_fingerprint(cache.config, cache.CACHE_CONFIG_FIELDS)}
    os.makedirs(path, exist_ok=True)
    tensor_path, meta_path = os.path.join(path, form.tensors_file), os.path.join(path, form.meta_file)
    # written beside and then renamed: an interrupted save never leaves a half-written cache under the real names
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tensor_path + ".tmp")
    with open(meta_path + ".tmp", "w") as handle:
        json.dump(meta, handle, indent=2)
    os.replace(tensor_path + ".tmp", tensor_path)
    os.replace(meta_path + ".tmp", meta_path)


def load_cache(path: str | os.PathLike, model: torch.nn.Module, cache_class: type | None = None):
    """Read a cache written by `save_cache` for `model` (onto its device), as `cache_class` (default: the model's
    `cache_class`); refuses one made for another config."""
    cls = cache_class or getattr(model, "cache_class", None)
    if cls is None:
        raise TypeError(f"{type(model).__name__} names no cache_class: pass the cache class to load")
    form = cache_format(cls)
    meta_path, tensor_path = os.path.join(path, form.meta_file), os.path.join(path, form.tensors_file)
    if not (os.path.isfile(meta_path) and os.path.isfile(tensor_path)):
        raise ValueError(f"{path} is not a saved {cls.__name__} (needs {form.meta_file} and {form.tensors_file})")
    with open(meta_path) as handle:
        meta = json.load(handle)
    if meta.get("format") != form.name or meta.get("version") != form.version:
        raise ValueError(f"{meta_path} is not a {form.name} version {form.version} file")
    differences = fingerprint_mismatch(config_fingerprint(model.config, cls.CACHE_CONFIG_FIELDS),
                                       meta.get("config", {}))
    if differences:
        raise ValueError(f"the cache in {path} was made for another {cls.MODEL_NAME} config: " + "; ".join(differences))
    from safetensors.torch import load_file

    # fresh copies: on CPU the loaded tensors are views into the file's buffer at any byte offset, and
    # unaligned data takes other vector kernels, which round differently from the live cache
    tensors = {k: v.clone() for k, v in load_file(tensor_path, device=str(model.device)).items()}
    return form.restore(cls, model.config, meta, tensors, model.dtype)
