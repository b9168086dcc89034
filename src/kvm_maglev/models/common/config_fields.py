"""Config fields declared as annotated class attributes, as transformers declares its own configs' fields: each
with its type, its default and a docstring, the string literal right under it. What the attribute cannot say (the
research code's name for the field, whether a saved cache depends on it, a coercion) is `config_field`'s metadata:

    class KVMConfig(PretrainedConfig):
        chunk_size: int = config_field(256, research="chunk_len", cache=True)
        \"\"\"tokens per chunk\"\"\"

transformers makes every config subclass a dataclass, so the declarations are dataclass fields: static tools show
them as the constructor's keywords. `declare_fields` reads them back (`declared_fields`) to give `__init__` its
signature and the class docstring its `Args:` section; the cache fingerprint's field list and the docs' tables are
read from them too, so none of these can fall out of step with the declarations.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

ConfigClass = TypeVar("ConfigClass", bound=type)


@dataclass(frozen=True)
class ConfigField:
    """One declared field, as `declared_fields` reads it: a keyword of the config's `__init__`, stored under the same
    name on the config."""

    name: str
    type: str  # the annotation as written: "int", "int | None", ...
    default: Any
    doc: str  # its docstring, one line: what it does, and what a None default becomes
    research: str = "-"  # the research code's name for it; "-": none
    cache: bool = False  # a saved cache depends on it (part of the cache's config fingerprint)
    coerce: Callable[[Any], Any] | None = None  # applied to the value before it is stored
    training: bool = False  # read by training only (the docs list these apart)


def config_field(default: Any, *, research: str = "-", cache: bool = False,
                 coerce: Callable[[Any], Any] | None = None, training: bool = False) -> Any:
    """A field's default with its metadata (see `ConfigField`), for a declaration that needs some; a plain default
    needs none. A dataclass field: transformers' dataclass processing of the class stores the plain default."""
    metadata = {"research": research, "cache": cache, "coerce": coerce, "training": training}
    return dataclasses.field(default=default, metadata=metadata)


def attribute_docs(cls: type) -> dict[str, str]:
    """Each annotated attribute of `cls`'s own body -> the string literal right under it, whitespace collapsed to
    one line (a table cell). Read from the source: Python keeps no attribute docstrings."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError) as error:
        raise TypeError(f"{cls.__name__}: its fields' docstrings are read from its source, which cannot be read "
                        f"({error})") from None
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:] + [None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name in docs:
            raise TypeError(f"{cls.__name__}: field {name!r} declared more than once")
        is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
            and isinstance(following.value.value, str)
        docs[name] = " ".join(following.value.value.split()) if is_doc else ""
    return docs


@functools.cache
def declared_fields(cls: type) -> tuple[ConfigField, ...]:
    """The fields `cls`'s own body declares, in order. A declaration without a default or a docstring, or one that
    redeclares a field of transformers' base config (whose `__init__` would overwrite it), is refused."""
    if "__dataclass_fields__" not in vars(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass: transformers' PretrainedConfig makes every subclass one, "
                        "and its fields are read from that")
    docs = attribute_docs(cls)
    inherited = {field.name: base.__name__ for base in reversed(cls.__mro__[1:]) if dataclasses.is_dataclass(base)
                 for field in dataclasses.fields(base)}  # the nearest base that declares it wins
    fields = []
    for field in dataclasses.fields(cls):
        if field.name not in docs:
            continue
        if field.name in inherited:
            raise TypeError(f"{cls.__name__}.{field.name} redeclares a field of {inherited[field.name]}")
        if field.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{field.name} has no default: every config field needs one")
        if not docs[field.name]:
            raise TypeError(f"{cls.__name__}.{field.name} has no docstring: write one line right under it")
        metadata = {key: field.metadata[key] for key in ("research", "cache", "coerce", "training")
                    if key in field.metadata}  # what config_field gives; a plain default gives none
        fields.append(ConfigField(field.name, type_text(field.type), field.default, docs[field.name], **metadata))
    return tuple(fields)


def type_text(annotation: Any) -> str:
    """An annotation as written in the source (a string under `from __future__ import annotations`)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def init_signature(fields: tuple[ConfigField, ...]) -> inspect.Signature:
    """`(self, <fields with defaults, in order>, **kwargs)`: what `help()` and IDEs show for `__init__`."""
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


def docstring_args(fields: tuple[ConfigField, ...]) -> str:
    """The fields as a transformers-style `Args:` section (name, type, default, meaning, research name)."""
    lines = ["Args:"]
    for field in fields:
        lines.append(f"    {field.name} (`{field.type}`, *optional*, defaults to `{field.default!r}`):")
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
        cells = (f"`{field.name}`", f"`{field.type}`", f"`{field.default!r}`", research, field.doc)
        rows.append(_table_row(cells))
    rows += [_table_row(("-", "", "", f"`{name}`", note)) for name, note in research_only]
    return "\n".join(rows)


def _table_row(cells: tuple[str, ...]) -> str:
    # a bare | ends a cell even inside backticks
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def declare_fields(cls: ConfigClass) -> ConfigClass:
    """Class decorator of a config that declares its fields: give it an `__init__` that takes them (positionally
    too, in order) with that signature, and append their `Args:` section to its docstring.

    The `__init__` stores each field (coerced), then runs `PretrainedConfig.__init__` with the other keywords, which
    stores its own fields and calls the class's `__post_init__`: there a config derives the defaults that follow
    from other fields, and validates. Written in the class body instead, `__init__` would hide the fields' keywords
    from static tools, which read them from the declarations (transformers' configs are `dataclass_transform`s)."""
    fields = declared_fields(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs = assign_fields(self, fields, args, kwargs)
        super(cls, self).__init__(**kwargs)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__signature__ = init_signature(fields)
    cls.__init__ = __init__
    args = docstring_args(fields)
    cls.__doc__ = f"{inspect.cleandoc(cls.__doc__)}\n\n{args}" if cls.__doc__ else args
    return cls
