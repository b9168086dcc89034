# Generated from kvm_maglev/models/common/config_fields.py (python -m kvm_maglev.models.sync_shared); do not edit by hand.
"""Config fields declared once: each model's configuration module lists its fields as `ConfigField`s, and
`__init__`'s signature and defaults, the class docstring, the cache fingerprint's field list and the docs'
tables are all read from that list, so none of them can fall out of step with the others."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ConfigField:
    """One keyword of a config's `__init__`, stored under the same name on the config."""

    name: str
    type: Any  # the annotation the signature shows: int, int | None, ...
    default: Any
    doc: str  # one line: what it does, and what a None default becomes
    research: str = "-"  # the research code's name for it; "-": none
    cache: bool = False  # a saved cache depends on it (part of the cache's config fingerprint)
    coerce: Callable[[Any], Any] | None = None  # applied to the value before it is stored


def token_id_fields(research: str) -> tuple[ConfigField, ...]:
    """pad/bos/eos token ids, declared as transformers' decoder configs declare them (None when a checkpoint sets
    none; clients read `config.pad_token_id`). `research` names where a converted checkpoint's ids come from."""
    return (
        ConfigField("pad_token_id", int | None, None, "id of the padding token (None: none)", research),
        ConfigField("bos_token_id", int | None, None, "id of the beginning-of-sequence token (None: none)", research),
        ConfigField("eos_token_id", int | list[int] | None, None, "id(s) of the end-of-sequence token (None: none)",
                    research),
    )


def check_declaration(fields: tuple[ConfigField, ...]) -> None:
    """Refuse a declaration that names a field twice (the signature could not tell them apart)."""
    names = [field.name for field in fields]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise TypeError(f"config fields declared more than once: {repeated}")


def init_signature(fields: tuple[ConfigField, ...]) -> inspect.Signature:
    """`(self, <fields with defaults, in order>, **kwargs)`: what `help()` and IDEs show for `__init__`."""
    check_declaration(fields)
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    parameters += [inspect.Parameter(field.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=field.default,
                                     annotation=field.type) for field in fields]
    parameters.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)


def assign_fields(config, fields: tuple[ConfigField, ...], args: tuple, kwargs: dict) -> dict:
    """Bind `__init__`'s arguments as a function written with `init_signature(fields)` would (a bad call is a
    TypeError), store each declared field on `config` and return the other keyword arguments, which go on to
    `PretrainedConfig.__init__`."""
    try:
        bound = init_signature(fields).bind(config, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{type(config).__name__}.__init__(): {error}") from None
    bound.apply_defaults()
    for field in fields:
        value = bound.arguments[field.name]
        setattr(config, field.name, value if field.coerce is None else field.coerce(value))
    return bound.arguments["kwargs"]


def cache_fields(fields: tuple[ConfigField, ...]) -> tuple[str, ...]:
    """Names of the fields a saved cache depends on, in declaration order."""
    return tuple(field.name for field in fields if field.cache)


def type_text(field: ConfigField) -> str:
    return inspect.formatannotation(field.type)


def docstring_args(fields: tuple[ConfigField, ...]) -> str:
    """The fields as a transformers-style `Args:` section (name, type, default, meaning, research name)."""
    lines = ["Args:"]
    for field in fields:
        lines.append(f"    {field.name} (`{type_text(field)}`, *optional*, defaults to `{field.default!r}`):")
        research = "" if field.research == "-" else f" Research name: `{field.research}`."
        cache = " A saved cache records it." if field.cache else ""
        lines.append(f"        {field.doc}.{research}{cache}")
    return "\n".join(lines)


def markdown_table(fields: tuple[ConfigField, ...], research_header: str,
                   research_only: tuple[tuple[str, str], ...] = ()) -> str:
    """The fields as a Markdown table; `research_only` adds (research name, note) rows with no field."""
    rows = [f"| field | type | default | {research_header} | meaning |", "|---|---|---|---|---|"]
    for field in fields:
        research = "-" if field.research == "-" else f"`{field.research}`"
        cells = (f"`{field.name}`", f"`{type_text(field)}`", f"`{field.default!r}`", research, field.doc)
        rows.append(_table_row(cells))
    rows += [_table_row(("-", "", "", f"`{name}`", note)) for name, note in research_only]
    return "\n".join(rows)


def _table_row(cells: tuple[str, ...]) -> str:
    # a bare | ends a cell even inside backticks
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def declare_fields(fields: tuple[ConfigField, ...]):
    """Class decorator: append the fields' `Args:` section to the docstring and give `__init__` their
    signature, so `help(Config)` and IDEs show every keyword with its default."""

    def decorate(cls):
        args = docstring_args(fields)
        cls.__doc__ = f"{inspect.cleandoc(cls.__doc__)}\n\n{args}" if cls.__doc__ else args
        cls.__init__.__signature__ = init_signature(fields)
        return cls

    return decorate
