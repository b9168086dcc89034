"""A config's own fields are declared as transformers declares its configs' fields: annotated class attributes
with their defaults, documented in the class docstring's `Args:`. transformers makes every config a keyword-only
dataclass; ours also take their fields by position, in declaration order, as their constructors always have, so
their `__init__` binds its arguments with `store_fields`, and `init_signature` is the signature it shows.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any


@functools.cache
def own_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The dataclass fields `cls`'s own body declares, in order. One without a default, or one that redeclares a
    field of transformers' base config (whose `__init__` would overwrite it), is refused."""
    inherited = {field.name: base.__name__ for base in reversed(cls.__mro__[1:]) if dataclasses.is_dataclass(base)
                 for field in dataclasses.fields(base)}  # the nearest base that declares it wins
    own = inspect.get_annotations(cls)
    fields = tuple(field for field in dataclasses.fields(cls) if field.name in own)
    for field in fields:
        if field.name in inherited:
            raise TypeError(f"{cls.__name__}.{field.name} redeclares a field of {inherited[field.name]}")
        if field.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{field.name} has no default: every config field needs one")
    return fields


@functools.cache
def init_signature(cls: type) -> inspect.Signature:
    """`(self, <cls's own fields with their defaults, in order>, **kwargs)`: what `help()` and IDEs show for its
    `__init__`."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    parameters += [inspect.Parameter(field.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=field.default,
                                     annotation=field.type) for field in own_fields(cls)]
    parameters.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)


def store_fields(cls: type, config, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bind `cls.__init__`'s arguments as a function written with `init_signature(cls)` would (a bad call is a
    TypeError), store each of `cls`'s own fields on `config` and return the other keyword arguments, which go on
    to `PretrainedConfig.__init__`."""
    try:
        bound = init_signature(cls).bind(config, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{cls.__name__}.__init__(): {error}") from None
    bound.apply_defaults()
    for field in own_fields(cls):
        setattr(config, field.name, bound.arguments[field.name])
    return bound.arguments["kwargs"]
