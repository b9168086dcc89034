"""Checkpoints of the KVM authors' newer code (featherless-ai/KVM-paper 6bd7dfd): grouped-query attention
converts exactly from both checkpoint forms, and a key whose default changed between research commits is
never guessed.

Parity targets as in test_kvm_parity: `logits_full_fp32rope` and `decode_logits_fp32rope` within 1e-4 in
float32, and the research `state_len` per layer per step.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.cli import main
from kvm_maglev.convert.kvm import (
    CHANGED_DEFAULTS,
    convert,
    kvm_config_from_research,
    read_research_checkpoint,
    research_commit_of,
)
from kvm_maglev.models.common.transformers_versions import returned_cache
from kvm_maglev.models.kvm import KVMForCausalLM
from tests.convert.test_kvm_parity import assert_matches_reference

CASES = ("kvm_gqa_fixed", "kvm_upstream_fixed")
FORMS = ("research_pt", "research_final")
TOLERANCE = 1e-4
KEY = "kvm_apply_merge_gate_to_appends"


@pytest.fixture(scope="module")
def converted(data_dir, tmp_path_factory):
    folders = {}

    def get(case: str, form: str):
        if (case, form) not in folders:
            case_dir = data_dir / "kvm_upstream" / case
            out = tmp_path_factory.mktemp(f"{case}_{form}") / "model"
            if form == "research_pt":
                convert(case_dir / "research" / "model_step000050.pt", out,
                        config_path=case_dir / "research" / "config.yaml")
            else:
                convert(case_dir / "research_final", out)
            folders[case, form] = out
        return folders[case, form]

    return get


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES)
def test_parity_with_upstream_research(case, form, converted, data_dir):
    reference = load_file(str(data_dir / "kvm_upstream" / case / "reference.safetensors"))
    model = KVMForCausalLM.from_pretrained(converted(case, form), dtype=torch.float32).eval()
    assert_matches_reference(model, reference, f"{case}/{form}")


def test_gqa_case_keeps_state_per_key_value_head(converted):
    model = KVMForCausalLM.from_pretrained(converted("kvm_gqa_fixed", "research_pt"), dtype=torch.float32)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.kv_group_size) == (4, 2, 2)
    with torch.no_grad():
        cache = returned_cache(model(torch.arange(70).view(1, -1), use_cache=True))
    layer = cache.layers[0]
    assert layer.tensors["state_keys"].shape[1] == 2 and cache.nbytes() == cache_bytes(config, 70, dtype=torch.float32)


def test_both_forms_give_the_same_weights(converted):
    for case in CASES:
        pt = load_file(str(converted(case, "research_pt") / "model.safetensors"))
        final = load_file(str(converted(case, "research_final") / "model.safetensors"))
        assert pt.keys() == final.keys() and all(torch.equal(pt[k], final[k]) for k in pt)


# ---- defaults that changed between research commits ---------------------------------------------------
def growing_state_yaml(data_dir, tmp_path, **extra) -> tuple:
    """The 1932b9c kvm_sqrt trainer checkpoint (a growing, gated state) with its YAML, plus `extra` keys."""
    research = data_dir / "kvm" / "kvm_sqrt" / "research"
    document = yaml.safe_load((research / "config.yaml").read_text())
    assert KEY not in document["model"]  # as the published configs: the key is left to the default
    document["model"].update(extra)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document))
    return research / "model_step000050.pt", config


def test_only_the_append_gate_default_changed():
    assert CHANGED_DEFAULTS == {KEY: {"1932b9c": 1, "6bd7dfd": 0}}


def test_omitted_changed_default_is_refused_and_nothing_written(data_dir, tmp_path, capsys):
    checkpoint, config = growing_state_yaml(data_dir, tmp_path)
    out = tmp_path / "out"
    code = main(["convert", "kvm", str(checkpoint), str(out), "--config", str(config),
                 "--tokenizer", str(data_dir / "kvm" / "kvm_sqrt" / "research_final")])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert KEY in err and "--research-commit" in err and "1932b9c" in err and "6bd7dfd" in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("commit, gated", [("1932b9c", True), ("6bd7dfd", False)])
def test_research_commit_states_the_default(data_dir, tmp_path, commit, gated):
    checkpoint, config = growing_state_yaml(data_dir, tmp_path)
    fields = read_research_checkpoint(checkpoint, config).fields
    assert kvm_config_from_research(fields, research_commit=commit).merge_gate_appends is gated
    # the old commit's value is what its save_pretrained folder spells out
    final = read_research_checkpoint(data_dir / "kvm" / "kvm_sqrt" / "research_final").fields
    assert final[KEY] == 1


def test_key_only_the_new_commit_knows_names_the_commit(data_dir, tmp_path):
    checkpoint, config = growing_state_yaml(data_dir, tmp_path, num_key_value_heads=None)
    fields = read_research_checkpoint(checkpoint, config).fields
    assert research_commit_of(fields) == "6bd7dfd"
    assert kvm_config_from_research(fields).merge_gate_appends is False
    with pytest.raises(ValueError, match="contradicts"):
        kvm_config_from_research(fields, research_commit="1932b9c")


def test_spelled_out_key_wins_and_irrelevant_default_needs_no_commit(data_dir, tmp_path):
    checkpoint, config = growing_state_yaml(data_dir, tmp_path, **{KEY: 0})
    assert kvm_config_from_research(read_research_checkpoint(checkpoint, config).fields).merge_gate_appends is False
    # a fixed state never appends: the gate on appends changes nothing, so no commit is needed
    upstream = data_dir / "kvm_upstream" / "kvm_gqa_fixed" / "research"
    fields = read_research_checkpoint(upstream / "model_step000050.pt", upstream / "config.yaml").fields
    assert KEY not in fields
    kvm_config_from_research(fields)
    with pytest.raises(ValueError, match="not one of"):
        kvm_config_from_research(fields, research_commit="main")


def single_file_export(final, folder):
    """`final` laid out as the authors' export_hf_single_file.py leaves a save_pretrained folder for the Hub: the
    model code bundled into modeling_rwkv7_backbone.py, which config.json's auto_map then names. The bundled
    file here only raises: the converter must never run a source's code."""
    import json
    import shutil

    shutil.copytree(final, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_rwkv7_backbone.MixerConfig",
                          "AutoModelForCausalLM": "modeling_rwkv7_backbone.RWKV7BackboneForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "modeling_rwkv7_backbone.py").write_text('raise RuntimeError("bundled research code was run")\n')
    return folder


@pytest.mark.parametrize("case", CASES)
def test_single_file_hub_export_converts(case, converted, data_dir, tmp_path):
    source = single_file_export(data_dir / "kvm_upstream" / case / "research_final", tmp_path / "export")
    out = convert(source, tmp_path / "out")
    from_export = load_file(str(out / "model.safetensors"))
    from_final = load_file(str(converted(case, "research_final") / "model.safetensors"))
    assert from_export.keys() == from_final.keys() and all(torch.equal(from_export[k], from_final[k]) for k in from_final)
    reference = load_file(str(data_dir / "kvm_upstream" / case / "reference.safetensors"))
    model = KVMForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    assert (logits - reference["logits_full_fp32rope"]).abs().max().item() <= TOLERANCE


def test_float32_routing_mixer_converts(data_dir, tmp_path, converted):
    """A run with token_mixer_class_path naming the research float32-routing mixer converts to
    merge_routing_dtype="float32"; in float32 that mixer computes what kvm_mixer does, so the same logits."""
    research = data_dir / "kvm_upstream" / "kvm_upstream_fixed" / "research"
    document = yaml.safe_load((research / "config.yaml").read_text())
    document["model"]["token_mixer_class_path"] = "model.kvm_fp32_routing_reference.SequenceMixer"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document))
    out = convert(research / "model_step000050.pt", tmp_path / "out", config_path=config)
    model = KVMForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.merge_routing_dtype == "float32"
    reference = load_file(str(data_dir / "kvm_upstream" / "kvm_upstream_fixed" / "reference.safetensors"))
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    assert (logits - reference["logits_full_fp32rope"]).abs().max().item() <= TOLERANCE


def test_commit_stated_in_a_yaml_comment_is_read(data_dir, tmp_path):
    from kvm_maglev.convert.kvm import stated_commit

    upstream = data_dir / "kvm_upstream" / "kvm_upstream_fixed" / "research"
    assert stated_commit((upstream / "config.yaml").read_text()) == "6bd7dfd"
    assert stated_commit((data_dir / "kvm" / "kvm_sqrt" / "research" / "config.yaml").read_text()) is None
    checkpoint, config = growing_state_yaml(data_dir, tmp_path)
    config.write_text("# research code: github featherless-ai/KVM-paper, commit 6bd7dfd\n" + config.read_text())
    assert read_research_checkpoint(checkpoint, config).research_commit == "6bd7dfd"
    out = convert(checkpoint, tmp_path / "out", config_path=config)
    assert KVMForCausalLM.from_pretrained(out).config.merge_gate_appends is False
    with pytest.raises(ValueError, match="contradicts"):
        convert(checkpoint, tmp_path / "other", config_path=config, research_commit="1932b9c")
    assert not (tmp_path / "other").exists()
