# Generated from kvm_maglev/models/common/saved_cache.py (python -m kvm_maglev.models.sync_shared); do not edit by hand.
"""Saved caches ("prompt caching") and config fingerprints, the same for every model's cache.

A cache folder holds the cache's tensors as safetensors and a JSON with its format, its own fields and the
fingerprint of the config it was made for; loading refuses a cache made for another architecture.
"""

from __future__ import annotations

import json
import os

import torch


def config_fingerprint(config, fields: tuple[str, ...]) -> dict:
    """The config fields a cache depends on, as plain JSON values."""
    return {name: getattr(config, name) for name in fields}


def fingerprint_mismatch(expected: dict, found: dict) -> list[str]:
    """Fields where two fingerprints differ, with both values."""
    names = sorted(set(expected) | set(found))
    return [f"{n}: cache {found.get(n)!r} vs model {expected.get(n)!r}"
            for n in names if expected.get(n) != found.get(n)]


class SavedCache:
    """Mixed into a model's cache: `save`, `load` and `check_compatible` from a few class fields and two
    methods, `saved_state()` (tensors, JSON fields) and `from_saved(config, meta, tensors, dtype)`."""

    MODEL_NAME: str  # as the errors name the model
    CACHE_FORMAT: str
    CACHE_FORMAT_VERSION: int
    TENSORS_FILE: str
    META_FILE: str
    CACHE_CONFIG_FIELDS: tuple[str, ...]  # the config fields that decide what the cache holds

    @classmethod
    def config_fingerprint(cls, config) -> dict:
        return config_fingerprint(config, cls.CACHE_CONFIG_FIELDS)

    def check_compatible(self, config) -> None:
        """Refuse a cache made for a model with another architecture."""
        if config is self.config:
            return
        differences = fingerprint_mismatch(self.config_fingerprint(config), self.fingerprint)
        if differences:
            raise ValueError(f"this {type(self).__name__} was made for another {self.MODEL_NAME} config: "
                             + "; ".join(differences))

    def saved_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError

    @classmethod
    def from_saved(cls, config, meta: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache to folder `path`: tensors as safetensors plus a JSON with the config fingerprint."""
        from safetensors.torch import save_file

        tensors, fields = self.saved_state()
        meta = {"format": self.CACHE_FORMAT, "version": self.CACHE_FORMAT_VERSION, **fields,
                "config": self.fingerprint}
        os.makedirs(path, exist_ok=True)
        tensor_path, meta_path = os.path.join(path, self.TENSORS_FILE), os.path.join(path, self.META_FILE)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tensor_path + ".tmp")
        with open(meta_path + ".tmp", "w") as handle:
            json.dump(meta, handle, indent=2)
        os.replace(tensor_path + ".tmp", tensor_path)
        os.replace(meta_path + ".tmp", meta_path)

    @classmethod
    def load(cls, path: str | os.PathLike, model):
        """Read a cache written by `save` for `model` (onto its device); refuses one made for another config."""
        from safetensors.torch import load_file

        meta_path, tensor_path = os.path.join(path, cls.META_FILE), os.path.join(path, cls.TENSORS_FILE)
        if not (os.path.isfile(meta_path) and os.path.isfile(tensor_path)):
            raise ValueError(f"{path} is not a saved {cls.__name__} (needs {cls.META_FILE} and {cls.TENSORS_FILE})")
        with open(meta_path) as handle:
            meta = json.load(handle)
        if meta.get("format") != cls.CACHE_FORMAT or meta.get("version") != cls.CACHE_FORMAT_VERSION:
            raise ValueError(f"{meta_path} is not a {cls.CACHE_FORMAT} version {cls.CACHE_FORMAT_VERSION} file")
        differences = fingerprint_mismatch(cls.config_fingerprint(model.config), meta.get("config", {}))
        if differences:
            raise ValueError(f"the cache in {path} was made for another {cls.MODEL_NAME} config: "
                             + "; ".join(differences))
        # fresh copies: on CPU the loaded tensors are views into the file's buffer at any byte offset, and
        # unaligned data takes other vector kernels, which round differently from the live cache
        tensors = {k: v.clone() for k, v in load_file(tensor_path, device=str(model.device)).items()}
        return cls.from_saved(model.config, meta, tensors, model.dtype)


def tensors_under(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The saved tensors whose names start with `prefix`, named without it."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
