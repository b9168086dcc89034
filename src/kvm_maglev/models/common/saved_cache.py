"""A cache's identity, the same for every model's cache: the fingerprint of the config it was made for, which a
model checks before it reads the cache, and the format its tensors are saved in.

Writing and reading cache folders is the package's (`kvm_maglev.package_only.saved_cache`): a cache describes
itself as tensors (`saved_state()`) and is rebuilt from them (`from_saved(config, meta, tensors, dtype)`).
"""

from __future__ import annotations

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
    """Mixed into a model's cache: `check_compatible` from a few class fields; the cache defines `saved_state()`
    (tensors, JSON fields) and `from_saved(config, meta, tensors, dtype)`, what a saved cache holds."""

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


def tensors_under(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The saved tensors whose names start with `prefix`, named without it."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
