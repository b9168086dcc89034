"""KVMConfig: validation errors name the field and the allowed values; budget fields can be
overridden at load time; the research -> ours mapping covers every switch or rejects it."""

from __future__ import annotations

import pytest
import torch
import yaml

from kvm_maglev.convert.kvm import convert, convert_state_dict, kvm_config_from_research
from kvm_maglev.models.common.transformers_versions import returned_cache
from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.configuration_kvm import BUDGET_FIELDS
from kvm_maglev.models.kvm.state_kvm import state_budget, state_slots_after

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8, chunk_size=4,
            state_budget_min=4)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("chunk_size", 0, "positive integer"),
        ("window_chunks", -1, "positive integer"),
        ("num_attention_heads", 3, "divisor of hidden_size"),
        ("rotary_dim", 7, "even integer"),
        ("rotary_dim", 64, "even integer in \\[2, head_dim=16\\]"),
        ("sliding_window_rotary_dim", 18, "even integer in \\[0, head_dim=16\\]"),
        ("sink_slots", 4, "mergeable slot"),
        ("sink_slots", -1, "mergeable slot"),
        ("state_budget_mode", "linear", "one of \\('fixed', 'power_law', 'kvm_saturation'\\)"),
        ("state_budget_round_to", 0, "positive integer"),
        ("kvm_value_residual_mode", "mean", "one of \\('linear', 'rwkv', 'rwkv_post_tokenshift'\\)"),
        ("sliding_window_every", 1, "0 \\(no sliding-window layers\\) or an integer >= 2"),
        ("state_max_chunks", 0, "positive integer"),
        ("logit_softcap", -1.0, ">= 0"),
        ("state_value_norms", False, "never grows past one chunk"),
    ],
)
def test_invalid_values_name_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field}={value!r}.*{allowed}"):
        KVMConfig(**{**TINY, "state_budget_mode": "power_law", "state_max_chunks": 8, field: value})


def test_mode_specific_parameters_are_checked():
    with pytest.raises(ValueError, match="state_budget_saturation"):
        KVMConfig(**TINY, state_budget_mode="kvm_saturation")
    with pytest.raises(ValueError, match="state_budget_factor"):
        KVMConfig(**TINY, state_budget_mode="power_law", state_budget_factor=0.0)


def test_state_budget_modes():
    fixed = KVMConfig(**TINY)
    assert [state_budget(fixed, n) for n in (1, 100, 10_000)] == [4, 4, 4]
    power = KVMConfig(**{**TINY, "state_budget_mode": "power_law", "state_budget_factor": 4.0,
                         "state_budget_min": 16, "state_max_chunks": 10_000, "state_budget_round_to": 8})
    assert state_budget(power, 100) == 40 and state_budget(power, 4) == 16 and state_budget(power, 10_000) == 400
    capped = KVMConfig(**{**TINY, "state_budget_mode": "power_law", "state_budget_factor": 4.0, "state_max_chunks": 3})
    assert state_budget(capped, 10_000) == 12
    saturating = KVMConfig(**{**TINY, "state_budget_mode": "kvm_saturation", "state_budget_saturation": 64,
                              "state_budget_min": 1, "state_max_chunks": 10_000})
    assert state_budget(saturating, 64) == 32 and state_budget(saturating, 10**9) == 63


def test_budget_fields_can_be_overridden_when_loading(tmp_path):
    model = KVMForCausalLM(KVMConfig(**TINY))
    model.save_pretrained(tmp_path)
    overrides = dict(state_budget_mode="power_law", state_budget_factor=2.0, state_budget_exponent=0.6,
                     state_budget_saturation=32, state_budget_min=2, state_budget_round_to=2, state_max_chunks=50,
                     sink_slots=2)
    assert set(overrides) == set(BUDGET_FIELDS)
    loaded = KVMForCausalLM.from_pretrained(tmp_path, **overrides)
    assert all(getattr(loaded.config, name) == value for name, value in overrides.items())
    ids = torch.randint(0, 50, (1, 60))
    with torch.no_grad():
        out = loaded(ids)
    cache = returned_cache(out)
    assert cache.state_lengths()[0] == state_slots_after(loaded.config, 60) > 4
    with pytest.raises(ValueError, match="state_budget_mode"):
        KVMForCausalLM.from_pretrained(tmp_path, state_budget_mode="unbounded")


def test_config_round_trip(tmp_path):
    config = KVMConfig(**TINY, sliding_window_every=2, sliding_window=6, merge_gate_appends=False)
    config.save_pretrained(tmp_path)
    again = KVMConfig.from_pretrained(tmp_path)
    assert again.to_dict() == config.to_dict()


RESEARCH = dict(token_mixer="kvm", vocab_size=50, num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                ffn_expansion=4, use_tokenshift_att=1, use_tokenshift_ffn=1, rope_partial_dim=8, sink_len=1,
                chunk_len=4, n_max_d_chunks=1, n_bswa_chunks=2, state_budget_mode="fixed", state_min_len=4)


def test_research_mapping():
    config = kvm_config_from_research({**RESEARCH, "kvm_use_vlens": 0, "kvm_apply_merge_gate_to_appends": 0,
                                       "alt_layer_every": 2, "alt_rope_partial_dim": 16, "swa_window_size": -1,
                                       "kvm_token_shift_mode": "none", "residual_scale": None})
    assert config.state_value_norms is False and config.merge_gate_appends is False
    assert config.sliding_window_every == 2 and config.sliding_window == 4 and config.sliding_window_rotary_dim == 16
    assert config.kvm_token_shift is False and config.sliding_window_token_shift is True
    assert config.residual_scale == 1.0 and config.intermediate_size == 128 and config.chunk_size == 4


@pytest.mark.parametrize(
    "field, value",
    [("use_skip_connections", 1), ("use_l2wrap", 1), ("token_mixer", "rwkv7"), ("alt_token_mixer", "gptalpha"),
     ("kvm_token_shift_mode", "conv"), ("token_mixer_class_path", "model.ovq_mixer.SequenceMixer")],
)
def test_unsupported_research_switches_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        kvm_config_from_research({**RESEARCH, field: value})


def test_unknown_research_parameter_is_rejected():
    with pytest.raises(ValueError, match="transformer.skip_weights"):
        convert_state_dict({"transformer.skip_weights": torch.ones(1)})


def test_converter_refuses_existing_output_and_bad_sources(tmp_path, data_dir):
    case = data_dir / "kvm" / "kvm_fixed"
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(case / "research_final", out)
    convert(case / "research_final", out, overwrite=True)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left behind
    with pytest.raises(ValueError, match="--config"):
        convert(case / "research" / "model_step000050.pt", tmp_path / "x")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(yaml.safe_dump({"train": {}}))
    with pytest.raises(ValueError, match="model:"):
        convert(case / "research" / "model_step000050.pt", tmp_path / "y", config_path=bad_yaml)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_compiled_prefix_and_cli(tmp_path, data_dir):
    """`_orig_mod.` keys (torch.compile) are accepted; the CLI entry point writes a loadable folder."""
    import argparse

    from kvm_maglev.convert import kvm as kvm_convert

    case = data_dir / "kvm" / "kvm_fixed" / "research"
    checkpoint = torch.load(case / "model_step000050.pt", weights_only=True)
    checkpoint["model"] = {f"_orig_mod.{k}": v for k, v in checkpoint["model"].items()}
    compiled = tmp_path / "model_step000050.pt"
    torch.save(checkpoint, compiled)
    parser = argparse.ArgumentParser()
    kvm_convert.add_arguments(parser)
    argv = [str(compiled), str(tmp_path / "out"), "--config", str(case / "config.yaml"),
            "--tokenizer", str(case.parent / "research_final")]
    assert kvm_convert.run(parser.parse_args(argv)) == 0
    assert kvm_convert.run(parser.parse_args(argv)) == 2
    model = KVMForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.chunk_size == 16


def test_sharded_research_folder(tmp_path, data_dir):
    """A research final folder saved in shards (model.safetensors.index.json) converts the same."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = data_dir / "kvm" / "kvm_fixed" / "research_final"
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(source / "config.json", sharded / "config.json")
    state = load_file(str(source / "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for shard, part in (("model-00001-of-00002.safetensors", names[::2]), ("model-00002-of-00002.safetensors", names[1::2])):
        save_file({k: state[k].contiguous() for k in part}, str(sharded / shard))
        weight_map.update({k: shard for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = load_file(str(convert(sharded, tmp_path / "a") / "model.safetensors"))
    b = load_file(str(convert(source, tmp_path / "b") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
