"""Our configs declare their fields as transformers' do (annotated class attributes with defaults, which transformers
makes keyword-only dataclass fields) and also take them by position, in declaration order, as they always have."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any


@functools.cache
def own_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The dataclass fields `cls`'s own body declares, in order."""
    return tuple(field for field in dataclasses.fields(cls) if field.name in inspect.get_annotations(cls))


@functools.cache
def init_signature(cls: type) -> inspect.Signature:
    """`(self, <cls's own fields with their defaults>, **kwargs)`: how its `__init__` binds, and what help() shows."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter("self", kind)] + [
        inspect.Parameter(field.name, kind, default=field.default, annotation=field.type) for field in own_fields(cls)
    ] + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def store_fields(cls: type, config, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Store `cls`'s own fields on `config` from `__init__`'s arguments, bound by `init_signature(cls)` (a bad call
    is a TypeError); return the other keywords, transformers' own."""
    try:
        bound = init_signature(cls).bind(config, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{cls.__name__}.__init__(): {error}") from None
    bound.apply_defaults()
    for field in own_fields(cls):
        setattr(config, field.name, bound.arguments[field.name])
    return bound.arguments["kwargs"]
