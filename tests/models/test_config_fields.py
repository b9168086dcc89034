"""Config fields are declared as transformers declares them: annotated class attributes with a default, documented in
the class docstring (models/common/config_fields.py). `__init__`'s signature and defaults, the saved config.json and
the docs' tables (convert/config_tables.py, with the converters' research names) follow the declarations;
CACHE_CONFIG_FIELDS names declared fields."""

from __future__ import annotations

import inspect
import json

import pytest

from kvm_maglev.convert import config_tables
from kvm_maglev.convert.kvm import RESEARCH_NAMES, _config_from_fields
from kvm_maglev.convert.maglev import MAGLEV_META_FIELDS, META_NAMES
from kvm_maglev.models.common.config_fields import own_fields
from kvm_maglev.models.kvm import KVMCache, KVMConfig
from kvm_maglev.models.maglev import MaglevCache, MaglevConfig

MODELS = [(KVMConfig, own_fields(KVMConfig), KVMCache), (MaglevConfig, own_fields(MaglevConfig), MaglevCache)]
IDS = ["kvm", "maglev"]
SECTIONS = {KVMConfig: ("Args",), MaglevConfig: ("Args", "Training args")}


def documented(config_class) -> dict[str, str]:
    """Each documented field's meaning, as the docs' tables read it from the class docstring."""
    rows = config_tables.field_rows(config_class, SECTIONS[config_class])
    return {row.name: row.doc for section in rows.values() for row in section}


@pytest.mark.parametrize("config_class, fields, cache_class", MODELS, ids=IDS)
def test_the_constructor_signature_lists_every_declared_field_with_its_default(config_class, fields, cache_class):
    annotations = inspect.get_annotations(config_class)
    declared = [name for name in annotations if name in config_class.__dataclass_fields__]
    assert [field.name for field in fields] == declared  # every annotated class attribute, in order
    for signature in (inspect.signature(config_class), inspect.signature(config_class.__init__)):
        parameters = [p for p in signature.parameters.values() if p.name != "self"]
        assert [p.name for p in parameters] == [*declared, "kwargs"]
        assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD  # other keywords go on to PretrainedConfig
        for parameter in parameters[:-1]:
            assert parameter.default == getattr(config_class, parameter.name)
            assert parameter.annotation == annotations[parameter.name]
    docs = documented(config_class)
    assert list(docs) == declared and all(docs.values())  # each documented, in order, one line (a table cell)
    assert all("\n" not in doc for doc in docs.values())


def declare(body: str, docs: str = "") -> type:
    """A config class `Declared` with `body` under a docstring documenting `docs`, its `__init__` as ours."""
    namespace = {}
    exec("from typing import Any\n"
         "from transformers import PretrainedConfig\n"
         "from kvm_maglev.models.common.config_fields import init_signature, store_fields\n\n\n"
         "class Declared(PretrainedConfig):\n"
         f'    """A declared config.\n\n    Args:\n{docs}    """\n\n{body}\n'
         "    def __init__(self, *args: Any, **kwargs: Any) -> None:\n"
         "        super().__init__(**store_fields(Declared, self, args, kwargs))\n\n\n"
         "Declared.__init__.__signature__ = init_signature(Declared)\n", namespace)
    return namespace["Declared"]


@pytest.mark.parametrize("body, docs, message", [
    ("    size: int = 1\n", "        size (`int`): a size\n        size (`int`): again\n", "documents 'size' twice"),
    ("    size: int = 1\n", "", "undocumented \\['size'\\]"),
    ("    size: int = 1\n    width: int = 2\n", "        width (`int`): a width\n", "undocumented \\['size'\\]"),
    ("    size: int = 1\n", "        size (`int`): a size\n        width (`int`): a width\n", "no such field \\['width'\\]"),
    ("    size: int = 1\n", "        size (`float`): a size\n", "Declared.size is declared `int`, documented `float`"),
    ("    size: int = 1\n", "        size: a size\n", "'size: a size' is not a `name"),
], ids=["twice", "no docstring", "docstring of another", "no such field", "another type", "no type"])
def test_a_bad_docstring_is_refused(body, docs, message):
    with pytest.raises(ValueError, match=message):
        config_tables.field_rows(declare(body, docs))


@pytest.mark.parametrize("body, docs, message", [
    ('    size: int\n', "        size (`int`): a size\n", "Declared.size has no default"),
    ('    dtype: str = "float32"\n', "        dtype (`str`): a dtype\n",
     "Declared.dtype redeclares a field of PreTrainedConfig"),
], ids=["no default", "a transformers field"])
def test_a_bad_declaration_is_refused(body, docs, message):
    # the tables' reading of the declarations refuses it, as it does for both configs' (`documented`, the docs check)
    with pytest.raises(ValueError, match=message):
        config_tables.field_rows(declare(body, docs))


def test_a_declaration_gives_the_constructor_its_fields_and_the_table_its_docs():
    declared = declare("    size: int = 1\n    label: str | None = None\n",
                       "        size (`int`): a size,\n            in two lines\n        label (`str | None`): a label\n")
    config = declared(2, note="kept")
    assert (config.size, config.label, config.note) == (2, None, "kept")  # by position; extras go to PretrainedConfig
    assert str(inspect.signature(declared)) == "(size: 'int' = 1, label: 'str | None' = None, **kwargs)"
    size, label = config_tables.field_rows(declared)["Args"]
    assert (size.doc, size.type, size.default, label.doc, label.type) == ("a size, in two lines", "int", 1,
                                                                          "a label", "str | None")
    assert "    size (`int`): a size," in declared.__doc__
    with pytest.raises(TypeError, match="Declared.__init__\\(\\): got an unexpected keyword|multiple values"):
        declared(1, size=2)


@pytest.mark.parametrize("config_class, fields, cache_class", MODELS, ids=IDS)
def test_defaults_docstring_and_saved_keys_follow_the_declaration(config_class, fields, cache_class, tmp_path):
    config = config_class()
    for field in fields:
        if field.default is not None:  # None defaults are resolved from other fields
            assert getattr(config, field.name) == field.default, field.name
        assert f"    {field.name} (`" in config_class.__doc__
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {field.name for field in fields} <= set(saved)
    assert config_class.from_pretrained(tmp_path).to_dict() == config.to_dict()


@pytest.mark.parametrize("config_class, fields, cache_class", MODELS, ids=IDS)
def test_configs_compare_by_their_fields(config_class, fields, cache_class):
    # declared fields are dataclass fields, which the class's (dataclass) equality compares
    assert config_class() == config_class() != config_class(num_hidden_layers=4)


@pytest.mark.parametrize("config_class, fields, cache_class", MODELS, ids=IDS)
def test_cache_fingerprint_fields_are_declared_fields(config_class, fields, cache_class):
    flagged = set(cache_class.CACHE_CONFIG_FIELDS)
    # declared fields, in declaration order (a saved cache's fingerprint lists them so)
    assert cache_class.CACHE_CONFIG_FIELDS == tuple(field.name for field in fields if field.name in flagged)
    assert {"use_cache", "tie_word_embeddings"}.isdisjoint(flagged) and {"vocab_size", "hidden_size"} <= flagged


def test_arguments_bind_as_a_written_signature_would():
    config = KVMConfig(64, 32, 2, 2, merge_gate_keys=0, chunk_size=4, state_budget_min=4, custom_note="kept")
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (64, 32, 2)
    assert config.merge_gate_keys is False and config.custom_note == "kept"  # switches coerced; extras kept
    assert config.rotary_dim == 8 and config.sliding_window_rotary_dim == 16  # None: derived from the head
    with pytest.raises(TypeError, match="KVMConfig.__init__\\(\\): multiple values for argument 'vocab_size'"):
        KVMConfig(64, vocab_size=64)
    maglev = MaglevConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, max_position_embeddings=512)
    assert (maglev.intermediate_size, maglev.num_key_value_heads, maglev.sequence_len, maglev.backout_layer) == (
        256, 4, 512, 2)


def test_converter_reads_the_declared_maglev_meta_fields():
    declared = {field.name for field in own_fields(MaglevConfig)}
    assert set(MAGLEV_META_FIELDS) <= declared and set(META_NAMES) <= declared
    assert all(META_NAMES[name] == f"maglev.{name}" for name in MAGLEV_META_FIELDS)


class ReadKeys(dict):
    """Research config fields that record which keys the converter reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def test_the_kvm_research_names_are_the_ones_the_converter_reads():
    assert set(RESEARCH_NAMES) <= {field.name for field in own_fields(KVMConfig)}
    fields = ReadKeys(hidden_size=64, num_attention_heads=4, chunk_len=8, n_bswa_chunks=2, use_tokenshift_att=1,
                      alt_layer_every=2, num_hidden_layers=4, rope_partial_dim=8, alt_rope_partial_dim=8,
                      token_mixer_class_path="model.kvm_mixer.SequenceMixer")
    _config_from_fields(fields, {})
    for name, research in RESEARCH_NAMES.items():
        if research.startswith("config.json"):  # token ids, read by the same names
            assert name in fields.read, name
            continue
        for key in research.replace(" + ", " / ").split(" / "):
            assert key in fields.read, (name, key)


def test_docs_tables_are_generated_from_the_declarations(tmp_path, capsys):
    assert config_tables.main(["--check"]) == 0, "run `python -m kvm_maglev.convert.config_tables`"
    docs = tmp_path / "conversion.md"
    docs.write_text(config_tables.DOCS_FILE.read_text().replace("| `chunk_size` | `int` | `256` |",
                                                                "| `chunk_size` | `int` | `128` |"))
    assert config_tables.main(["--check", "--docs", str(docs)]) == 1
    assert "config tables differ" in capsys.readouterr().err
    assert config_tables.main(["--docs", str(docs)]) == 0
    assert docs.read_text() == config_tables.DOCS_FILE.read_text()
