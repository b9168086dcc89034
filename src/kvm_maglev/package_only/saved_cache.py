"""Saved caches ("prompt caching"): a cache written to a folder and read back for the model it was made for.

A cache folder holds the cache's tensors as safetensors and a JSON with its format, its own fields and the
fingerprint of the config it was made for; loading refuses a cache made for another architecture. Any of our
caches can be saved, a Hub folder's (remote code) included: the cache describes itself (`saved_state`,
`from_saved`, models/common/saved_cache.py), this module reads and writes the files.

    save_cache(cache, "doc_cache")
    cache = load_cache("doc_cache", model)
"""

from __future__ import annotations

import json
import os

import torch

from ..models.common.saved_cache import fingerprint_mismatch


def save_cache(cache, path: str | os.PathLike) -> None:
    """Write `cache` to folder `path`: tensors as safetensors plus a JSON with the config fingerprint."""
    from safetensors.torch import save_file

    tensors, fields = cache.saved_state()
    meta = {"format": cache.CACHE_FORMAT, "version": cache.CACHE_FORMAT_VERSION, **fields,
            "config": cache.fingerprint}
    os.makedirs(path, exist_ok=True)
    tensor_path, meta_path = os.path.join(path, cache.TENSORS_FILE), os.path.join(path, cache.META_FILE)
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
    meta_path, tensor_path = os.path.join(path, cls.META_FILE), os.path.join(path, cls.TENSORS_FILE)
    if not (os.path.isfile(meta_path) and os.path.isfile(tensor_path)):
        raise ValueError(f"{path} is not a saved {cls.__name__} (needs {cls.META_FILE} and {cls.TENSORS_FILE})")
    with open(meta_path) as handle:
        meta = json.load(handle)
    if meta.get("format") != cls.CACHE_FORMAT or meta.get("version") != cls.CACHE_FORMAT_VERSION:
        raise ValueError(f"{meta_path} is not a {cls.CACHE_FORMAT} version {cls.CACHE_FORMAT_VERSION} file")
    differences = fingerprint_mismatch(cls.config_fingerprint(model.config), meta.get("config", {}))
    if differences:
        raise ValueError(f"the cache in {path} was made for another {cls.MODEL_NAME} config: " + "; ".join(differences))
    from safetensors.torch import load_file

    # fresh copies: on CPU the loaded tensors are views into the file's buffer at any byte offset, and
    # unaligned data takes other vector kernels, which round differently from the live cache
    tensors = {k: v.clone() for k, v in load_file(tensor_path, device=str(model.device)).items()}
    return cls.from_saved(model.config, meta, tensors, model.dtype)
