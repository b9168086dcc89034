"""Config fields are declared once, as annotated class attributes with a default and a docstring
(models/common/config_fields.py): `__init__`'s signature and defaults, the docstring, the saved config.json,
CACHE_CONFIG_FIELDS and the docs' tables all follow the declarations."""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys

import pytest

from kvm_maglev.convert.maglev import MAGLEV_META_FIELDS
from kvm_maglev.models import config_tables
from kvm_maglev.models.common.config_fields import cache_fields, declared_fields
from kvm_maglev.models.kvm import KVMCache, KVMConfig
from kvm_maglev.models.kvm.configuration_kvm import KVM_FIELDS
from kvm_maglev.models.maglev import MaglevCache, MaglevConfig
from kvm_maglev.models.maglev.configuration_maglev import MAGLEV_FIELDS

MODELS = [(KVMConfig, KVM_FIELDS, KVMCache), (MaglevConfig, MAGLEV_FIELDS, MaglevCache)]
IDS = ["kvm", "maglev"]


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
    assert all(field.doc and "\n" not in field.doc for field in fields)  # each a docstring, one line


def declare(body: str, folder) -> type:
    """A config class `Declared` with `body`, imported from a module file (its fields' docstrings are read from it)."""
    path = folder / "declared_config.py"
    path.write_text("from transformers import PretrainedConfig\n"
                    "from kvm_maglev.models.common.config_fields import config_field, declare_fields\n\n\n"
                    f"@declare_fields\nclass Declared(PretrainedConfig):\n{body}")
    spec = importlib.util.spec_from_file_location("declared_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.Declared


@pytest.mark.parametrize("body, message", [
    ('    size: int = 1\n    "a size"\n    size: int = 2\n    "again"\n', "'size' declared more than once"),
    ("    size: int = 1\n", "Declared.size has no docstring"),
    ('    size: int = config_field(1, cache=True)\n    width: int = 2\n    "a width"\n', "size has no docstring"),
    ('    size: int\n    "a size"\n', "Declared.size has no default"),
    ('    dtype: str = "float32"\n    "the weights\' dtype"\n', "Declared.dtype redeclares a field of PreTrainedConfig"),
], ids=["twice", "no docstring", "docstring of another", "no default", "a transformers field"])
def test_a_bad_declaration_is_refused(body, message, tmp_path):
    with pytest.raises(TypeError, match=message):
        declare(body, tmp_path)


def test_a_declaration_gives_the_constructor_its_fields_metadata_and_docstring(tmp_path):
    declared = declare('    size: int = config_field(1, research="n", cache=True, coerce=int)\n'
                       '    """a size,\n    in two lines"""\n'
                       '    label: str | None = None\n    "a label"\n', tmp_path)
    config = declared("2", note="kept")
    assert (config.size, config.label, config.note) == (2, None, "kept")  # coerced; extras go to PretrainedConfig
    assert str(inspect.signature(declared)) == "(size: 'int' = 1, label: 'str | None' = None, **kwargs)"
    size, label = declared_fields(declared)
    assert (size.doc, size.research, size.cache, label.research, label.cache) == ("a size, in two lines", "n", True,
                                                                                  "-", False)
    assert "    size (`int`, *optional*, defaults to `1`):\n        a size, in two lines. Research name: `n`." \
        in declared.__doc__


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
def test_cache_fingerprint_fields_are_the_flagged_ones(config_class, fields, cache_class):
    assert cache_class.CACHE_CONFIG_FIELDS == cache_fields(fields)
    flagged = set(cache_class.CACHE_CONFIG_FIELDS)
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
    declared = {field.name for field in MAGLEV_FIELDS if field.research.startswith("maglev.")}
    assert declared == set(MAGLEV_META_FIELDS)
    assert all(field.research == f"maglev.{field.name}" for field in MAGLEV_FIELDS if field.name in declared)


def test_docs_tables_are_generated_from_the_declarations(tmp_path, capsys):
    assert config_tables.main(["--check"]) == 0, "run `python -m kvm_maglev.models.config_tables`"
    docs = tmp_path / "conversion.md"
    docs.write_text(config_tables.DOCS_FILE.read_text().replace("| `chunk_size` | `int` | `256` |",
                                                                "| `chunk_size` | `int` | `128` |"))
    assert config_tables.main(["--check", "--docs", str(docs)]) == 1
    assert "config tables differ" in capsys.readouterr().err
    assert config_tables.main(["--docs", str(docs)]) == 0
    assert docs.read_text() == config_tables.DOCS_FILE.read_text()
