"""`kvm-maglev convert kvm SOURCE OUT`: research KVM checkpoint -> Hub-ready transformers folder.

SOURCE is a research trainer checkpoint (`model_stepNNNNNN.pt`, with `--config` naming its
research YAML) or the research code's final `save_pretrained` folder. The steps are small
functions: read_research_checkpoint -> kvm_config_from_research + convert_state_dict ->
build_model (checked against the config) -> export_model (card, tokenizer, checked write).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from kvm_maglev.convert.common import (
    READ_STAGES,
    ExportOptions,
    add_output_arguments,
    check_out_dir,
    export_model,
    load_safetensors_file,
    load_torch_file,
    run_conversion,
    source_dtype,
    source_provenance,
)
from kvm_maglev.convert.export import check_state_dict, expected_shapes
from kvm_maglev.convert.hub_source import resolve_source
from kvm_maglev.convert.identify import check_source_kind
from kvm_maglev.package_only.classes import KVMConfig, KVMForCausalLM
from kvm_maglev.tokenization.gpt2 import generation_token_fields, load_research_tokenizer

# where a converted checkpoint's pad/bos/eos token ids come from
TOKEN_IDS_RESEARCH = "config.json `pad_token_id` / `bos_token_id` / `eos_token_id`"
# KVMConfig field -> the research `MixerConfig` field(s) `kvm_config_from_research` reads it from (the table in
# docs/conversion.md shows them); a field not named here is not read from the research config.
RESEARCH_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "d_qk_head / d_head",
    "value_head_dim": "d_v_head / d_head",
    "intermediate_size": "ffn_expansion",
    "rope_theta": "rope_theta",
    "rotary_dim": "rope_partial_dim",
    "chunk_size": "chunk_len",
    "window_chunks": "n_bswa_chunks",
    "sink_slots": "sink_len",
    "state_budget_mode": "state_budget_mode",
    "state_budget_min": "state_min_len",
    "state_budget_factor": "state_growth_factor",
    "state_budget_exponent": "state_growth_exponent",
    "state_budget_saturation": "state_saturation_n",
    "state_budget_round_to": "state_round_down",
    "state_max_chunks": "n_max_d_chunks",
    "merge_gate_keys": "kvm_use_merge_gate_keys",
    "merge_gate_values": "kvm_use_merge_gate_values",
    "merge_gate_appends": "kvm_apply_merge_gate_to_appends",
    "merge_gate_initial_state": "kvm_apply_merge_gate_to_initial_state",
    "merge_routing_dtype": "token_mixer_class_path",
    "head_temperatures": "kvm_use_head_temps",
    "state_value_norms": "kvm_use_vlens",
    "kvm_token_shift": "use_tokenshift_att + kvm_token_shift_mode",
    "ffn_token_shift": "use_tokenshift_ffn",
    "value_residual": "use_value_residual",
    "kvm_value_residual_mode": "kvm_value_residual_mode",
    "sliding_window_every": "alt_layer_every",
    "sliding_window": "swa_window_size",
    "sliding_window_rope_theta": "alt_rope_theta",
    "sliding_window_rotary_dim": "alt_rope_partial_dim",
    "sliding_window_token_shift": "use_tokenshift_att + swa_token_shift_mode",
    "sliding_window_value_residual_mode": "swa_value_residual_mode",
    "sliding_window_share_value_residual": "alt_share_v0",
    "block_lambdas": "use_block_lambdas",
    "residual_scale": "residual_scale",
    "logit_softcap": "logit_softcap",
    "pad_token_id": TOKEN_IDS_RESEARCH,
    "bos_token_id": TOKEN_IDS_RESEARCH,
    "eos_token_id": TOKEN_IDS_RESEARCH,
}
# Research `MixerConfig` fields with no KVMConfig field, and what the converter does with them.
RESEARCH_ONLY_FIELDS = (
    ("token_mixer", 'only "kvm" (rejected otherwise)'),
    ("alt_token_mixer", 'only "swa" (rejected otherwise)'),
    ("token_mixer_class_path / alt_token_mixer_class_path", "must be unset or the KVM/SWA mixers; the KVM ones "
     "(model.kvm_mixer, model.kvm_fp32_routing_reference) both become merge_routing_dtype='float32'"),
    ("use_skip_connections", "rejected when set (no published model uses it)"),
    ("use_l2wrap", "rejected when set (training-only gradient trick)"),
    ("param_dtype", "becomes `dtype`"),
    ("mup_base_dim, use_overflow_v_key_weighting, use_state_deltarule, use_state_decay, gptalpha_*, ovq_*, kda_*, "
     "gated_deltanet_*, lact_*", "not read by the KVM or SWA layers; ignored"),
)

# research fields that must have exactly these values (or be absent) for our model to be exact
_REQUIRED_VALUES = {
    "token_mixer": ("kvm",),
    "alt_token_mixer": ("swa",),
    "token_mixer_class_path": (None, "model.kvm_mixer.SequenceMixer", "model.kvm_fp32_routing_reference.SequenceMixer"),
    "alt_token_mixer_class_path": (None, "model.swa_mixer.SequenceMixer"),
    "use_skip_connections": (0, False),
    "use_l2wrap": (0, False),
    "model_class_path": ("model.rwkv7_backbone.RWKV7BackboneForCausalLM",),
}
_TOKEN_SHIFT_MODES = ("rwkv", "none")

# Research commits whose MixerConfig defaults differ, and those defaults (diff of model/rwkv7_backbone.py between
# recursal/KVM-paper 1932b9c and its continuation featherless-ai/KVM-paper 6bd7dfd). A YAML that omits one of
# these keys means what the commit that trained it defaulted to, which the YAML does not say.
RESEARCH_COMMITS = ("1932b9c", "6bd7dfd")
CHANGED_DEFAULTS = {
    "kvm_apply_merge_gate_to_appends": {"1932b9c": 1, "6bd7dfd": 0},
}
# keys only 6bd7dfd's MixerConfig declares: a YAML naming one was written for that commit
_NEWER_ONLY_KEYS = ("num_key_value_heads", "kvm_aotriton_forward_attention", "kvm_aotriton_precompiled_forward")
# a YAML comment stating the research commit, e.g. "# research code: github featherless-ai/KVM-paper, commit 6bd7dfd"
_COMMIT_COMMENT = re.compile(r"^#.*\bcommit\s+([0-9a-f]{7,40})\b", re.MULTILINE)

# research parameter names (inside transformer.h.N.) -> ours (inside model.layers.N.)
_LAYER_RENAMES = {
    "ln_attn": "input_layernorm",
    "ln_mlp": "post_attention_layernorm",
    "lambdas": "block_lambdas",
    "attn.c_q": "self_attn.q_proj",
    "attn.c_k": "self_attn.k_proj",
    "attn.c_v": "self_attn.v_proj",
    "attn.c_proj": "self_attn.o_proj",
    "attn.ln_q": "self_attn.q_norm",
    "attn.ln_k": "self_attn.k_norm",
    "attn.ln_s_k": "self_attn.state_key_norm",
    "attn.key_weighting": "self_attn.merge_gate_proj",
    "attn.front_head_temp": "self_attn.window_temperature",
    "attn.state_head_temp": "self_attn.state_temperature",
    "attn.x_q": "self_attn.q_shift",
    "attn.x_k": "self_attn.k_shift",
    "attn.x_v": "self_attn.v_shift",
    "attn.lamb": "self_attn.value_residual_lambda",
    "attn.v_gate0": "self_attn.value_gate_bias",
    "attn.v_gate1": "self_attn.value_gate_down",
    "attn.v_gate2": "self_attn.value_gate_up",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
    "mlp.x_k": "mlp.shift",
}
_TOP_RENAMES = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_emb.weight": "model.embed_norm.weight",
    "transformer.ln_emb.bias": "model.embed_norm.bias",
    "transformer.ln_head.weight": "model.norm.weight",
    "transformer.ln_head.bias": "model.norm.bias",
    "lm_head.weight": "lm_head.weight",
}


@dataclass
class ResearchCheckpoint:
    """A research checkpoint as read from disk: model fields, state dict and where they came from."""

    fields: dict
    state: dict[str, torch.Tensor]
    weights_files: list[Path]
    config_file: Path
    step: int | None = None
    research_commit: str | None = None  # as the YAML states it in a comment


def read_research_checkpoint(source: str | Path, config_path: str | Path | None = None) -> ResearchCheckpoint:
    """Read a .pt trainer checkpoint (+ its YAML) or a final folder; never runs pickled code."""
    source = Path(source)
    if source.is_dir():
        config_file = source / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{source} is not a research save_pretrained folder (no config.json)")
        fields = _read_json(config_file)
        if fields.get("model_type") != "rwkv7backbone":
            raise ValueError(f"{config_file}: model_type {fields.get('model_type')!r} is not 'rwkv7backbone'")
        state, files = _load_safetensors_folder(source)
        return ResearchCheckpoint(fields, state, files, config_file)
    if not source.is_file():
        raise ValueError(f"{source} does not exist")
    if config_path is None:
        raise ValueError("a research .pt checkpoint needs --config pointing at its research YAML")
    config_file = Path(config_path)
    try:
        text = config_file.read_text(encoding="utf-8")
        document = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read the research YAML {config_file}: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("model"), dict):
        raise ValueError(f"{config_path}: expected a research YAML with a top-level 'model:' mapping")
    checkpoint = load_torch_file(source)
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{source}: expected a trainer checkpoint dict with a 'model' state dict")
    state = {key.replace("_orig_mod.", ""): value for key, value in state.items()}
    step = checkpoint.get("step") if isinstance(checkpoint.get("step"), int) else _step_from_name(source)
    return ResearchCheckpoint(dict(document["model"]), state, [source], config_file, step, stated_commit(text))


def stated_commit(yaml_text: str) -> str | None:
    """The research commit (one of RESEARCH_COMMITS) a YAML comment names, or None."""
    for sha in _COMMIT_COMMENT.findall(yaml_text):
        for commit in RESEARCH_COMMITS:
            if sha.startswith(commit) or commit.startswith(sha):
                return commit
    return None


def load_research_checkpoint(source: str | Path, config_path: str | Path | None = None) -> tuple[dict, dict]:
    """Return (research model fields, research state dict) from a .pt checkpoint or a final folder."""
    checkpoint = read_research_checkpoint(source, config_path)
    return checkpoint.fields, checkpoint.state


def _step_from_name(path: Path) -> int | None:
    match = re.search(r"step_?(\d+)", path.name)
    return int(match.group(1)) if match else None


def _read_json(path: Path) -> dict:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return document


def _load_safetensors_folder(folder: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """model.safetensors, or every shard named by model.safetensors.index.json."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_safetensors_file(single), [single]
    if not index.is_file():
        raise ValueError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map")
    state, files = {}, sorted({folder / shard for shard in weight_map.values()})
    for shard in files:
        state.update(load_safetensors_file(shard))
    return state, files


def _check_supported(fields: dict) -> None:
    for name, allowed in _REQUIRED_VALUES.items():
        if name in fields and fields[name] not in allowed:
            raise ValueError(f"research field {name}={fields[name]!r} is not supported: allowed {allowed}")
    for name in ("kvm_token_shift_mode", "swa_token_shift_mode"):
        if fields.get(name, "rwkv") not in _TOKEN_SHIFT_MODES:
            raise ValueError(f"research field {name}={fields[name]!r} is not supported: allowed {_TOKEN_SHIFT_MODES}")


def research_commit_of(fields: dict) -> str | None:
    """The research commit a checkpoint's fields show they were written by, or None when they do not say."""
    return "6bd7dfd" if any(key in fields for key in _NEWER_ONLY_KEYS) else None


def _changed_default_matters(key: str, fields: dict) -> bool:
    """Whether an omitted key in CHANGED_DEFAULTS changes the model: the append gate only when gated slots are
    appended, i.e. a gate exists and the state grows past its first chunk."""
    config = _config_from_fields({**fields, **{k: 0 for k in CHANGED_DEFAULTS}}, {})
    gated = config.merge_gate_keys or config.merge_gate_values
    return gated and not config.state_stays_one_chunk


def resolve_changed_defaults(fields: dict, research_commit: str | None = None) -> dict:
    """`fields` with every key whose default changed between research commits spelled out: from the fields
    themselves, else from `research_commit` (given, or shown by the fields); raises ValueError naming the key
    and how to state it when neither says and the value matters."""
    if research_commit is not None and research_commit not in RESEARCH_COMMITS:
        raise ValueError(f"research commit {research_commit!r} is not one of {RESEARCH_COMMITS}")
    shown = research_commit_of(fields)
    if research_commit is not None and shown is not None and shown != research_commit:
        raise ValueError(f"--research-commit {research_commit} contradicts the checkpoint, whose config names "
                         f"keys only {shown} knows ({', '.join(k for k in _NEWER_ONLY_KEYS if k in fields)})")
    commit = research_commit or shown
    resolved = dict(fields)
    for key, defaults in CHANGED_DEFAULTS.items():
        if key in fields:
            continue
        if commit is not None:
            resolved[key] = defaults[commit]
        elif _changed_default_matters(key, fields):
            choices = ", ".join(f"{value} at {c}" for c, value in defaults.items())
            raise ValueError(
                f"the research config omits {key}, whose default changed between research commits ({choices}) "
                f"and which changes this model; say which commit trained it with --research-commit "
                f"{{{','.join(RESEARCH_COMMITS)}}} (research_commit= in Python), or add {key}: 0 or 1 to its YAML")
    return resolved


def kvm_config_from_research(fields: dict, research_commit: str | None = None, **overrides: Any) -> KVMConfig:
    """Map research MixerConfig fields (`RESEARCH_NAMES`) to a KVMConfig;
    keys whose default changed between research commits are resolved first (`resolve_changed_defaults`)."""
    return _config_from_fields(resolve_changed_defaults(fields, research_commit), overrides)


def _config_from_fields(fields: dict, overrides: dict) -> KVMConfig:
    _check_supported(fields)
    get = fields.get
    hidden, heads = int(get("hidden_size", 768)), int(get("num_attention_heads", 6))
    alt_every = int(get("alt_layer_every", -1) or 0)
    token_shift_att = bool(get("use_tokenshift_att", 0))
    dtype = get("param_dtype") or get("dtype") or get("torch_dtype")
    kwargs = dict(
        vocab_size=int(get("vocab_size", 50304)),
        hidden_size=hidden,
        num_hidden_layers=int(get("num_hidden_layers", 12)),
        num_attention_heads=heads,
        num_key_value_heads=None if get("num_key_value_heads") is None else int(get("num_key_value_heads")),
        head_dim=get("d_qk_head") or get("d_head"),
        value_head_dim=get("d_v_head") or get("d_head"),
        intermediate_size=int(float(get("ffn_expansion", 4.0)) * hidden) // 32 * 32,
        rope_theta=float(get("rope_theta", 10000.0)),
        rotary_dim=int(get("rope_partial_dim", 64)),
        chunk_size=int(get("chunk_len", 256)),
        window_chunks=int(get("n_bswa_chunks", 2)),
        sink_slots=int(get("sink_len", 1)),
        state_budget_mode=get("state_budget_mode", "fixed"),
        state_budget_min=int(get("state_min_len", -1)),
        state_budget_factor=float(get("state_growth_factor", 1.0)),
        state_budget_exponent=float(get("state_growth_exponent", 0.5)),
        state_budget_saturation=None if get("state_saturation_n") is None else int(get("state_saturation_n")),
        state_budget_round_to=max(int(get("state_round_down", 1)), 1),
        state_max_chunks=int(get("n_max_d_chunks", 1)),
        merge_gate_keys=bool(get("kvm_use_merge_gate_keys", 1)),
        merge_gate_values=bool(get("kvm_use_merge_gate_values", 1)),
        # the default of our config when absent: resolve_changed_defaults made sure it does not matter then
        merge_gate_appends=bool(get("kvm_apply_merge_gate_to_appends", 1)),
        merge_gate_initial_state=bool(get("kvm_apply_merge_gate_to_initial_state", 0)),
        # both research mixers convert to float32 routing, which this model's float32 state under half precision
        # has always had; merge_routing_dtype="model" follows kvm_mixer's bfloat16 scoring instead
        merge_routing_dtype="float32",
        head_temperatures=bool(get("kvm_use_head_temps", 1)),
        state_value_norms=bool(get("kvm_use_vlens", 1)),
        kvm_token_shift=token_shift_att and get("kvm_token_shift_mode", "rwkv") == "rwkv",
        ffn_token_shift=bool(get("use_tokenshift_ffn", 0)),
        value_residual=bool(get("use_value_residual", 1)),
        kvm_value_residual_mode=get("kvm_value_residual_mode", "rwkv"),
        sliding_window_every=alt_every if alt_every > 0 else 0,
        sliding_window=int(get("swa_window_size", -1)),
        sliding_window_rope_theta=float(get("alt_rope_theta", 10000.0)),
        sliding_window_rotary_dim=int(get("alt_rope_partial_dim", 64)) if alt_every > 0 else None,
        sliding_window_token_shift=token_shift_att and get("swa_token_shift_mode", "rwkv") == "rwkv",
        sliding_window_value_residual_mode=get("swa_value_residual_mode", "rwkv"),
        sliding_window_share_value_residual=bool(get("alt_share_v0", 0)),
        block_lambdas=bool(get("use_block_lambdas", 0)),
        residual_scale=float(get("residual_scale") or 1.0),
        logit_softcap=float(get("logit_softcap") or 0.0),
        max_position_embeddings=int(get("max_position_embeddings", 1 << 30)),
        tie_word_embeddings=False,
    )
    if kwargs["sliding_window"] <= 0:
        kwargs["sliding_window"] = kwargs["chunk_size"]
    if dtype in ("bfloat16", "float16", "float32"):
        kwargs["dtype"] = dtype
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if get(name) is not None:
            kwargs[name] = get(name)
    kwargs.update(overrides)
    return KVMConfig(**kwargs)


def convert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename research parameters to ours; unknown names are an error, never dropped."""
    converted = {}
    for key, value in state.items():
        key = key.replace("_orig_mod.", "")
        if key in _TOP_RENAMES:
            converted[_TOP_RENAMES[key]] = value
            continue
        match = re.fullmatch(r"transformer\.h\.(\d+)\.(.+?)((?:\.weight|\.bias)?)", key)
        if match and match.group(2) in _LAYER_RENAMES:
            converted[f"model.layers.{match.group(1)}.{_LAYER_RENAMES[match.group(2)]}{match.group(3)}"] = value
            continue
        raise ValueError(f"research parameter {key!r} has no KVM counterpart (unsupported switch?)")
    return converted


def build_model(config: KVMConfig, state: dict[str, torch.Tensor]) -> KVMForCausalLM:
    """Instantiate KVMForCausalLM and load the weights; every missing, unexpected or misshapen key is one error."""
    model = KVMForCausalLM(config)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        model = model.to(dtype)
    check_state_dict(expected_shapes(model), state)
    model.load_state_dict(state, strict=True)
    return model.eval()


def find_research_tokenizer(source: str | Path, explicit: str | Path | None = None) -> Path | None:
    """Folder holding the run's tokenizer.json: `explicit`, else SOURCE (final folder) or the .pt's folder."""
    if explicit is not None:
        folder = Path(explicit)
        folder = folder.parent if folder.is_file() else folder
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {explicit}: no tokenizer.json there "
                             "(give the research run's tokenizer folder)")
        return folder
    source = Path(source)
    folder = source if source.is_dir() else source.parent
    return folder if (folder / "tokenizer.json").is_file() else None


def convert(source: str | Path, out: str | Path, config_path: str | Path | None = None, overwrite: bool = False, *,
            tokenizer: str | Path | None = None, require_tokenizer: bool = False, options: ExportOptions | None = None,
            revision: str | None = None, research_commit: str | None = None, **overrides: Any) -> Path:
    """Whole conversion: research checkpoint at `source` -> checked Hub folder at `out`.

    The tokenizer comes from `tokenizer` or is found beside `source` (none written when absent,
    unless `require_tokenizer`). `options` sets dtype, shards, card metadata and dry run;
    without it `overwrite` alone applies. `overrides` are KVMConfig fields. `source` may be a Hub
    repo id (at `revision`): its files are downloaded, its code never run, and the card's base_model names it.
    `research_commit` ("1932b9c" or "6bd7dfd") says which research code trained it, for the defaults that
    changed between them (needed only when its config omits one that matters; see CHANGED_DEFAULTS).
    """
    options = options or ExportOptions(overwrite=overwrite)
    out = check_out_dir(out, options.overwrite)
    resolved = resolve_source(source, revision, "kvm")
    source = resolved.path
    check_source_kind(source, "kvm", shown=resolved.name)
    if resolved.repo_id and not options.base_model:
        options = replace(options, base_model=[resolved.repo_id])
    tokenizer_dir = find_research_tokenizer(source, tokenizer)
    if tokenizer_dir is None and require_tokenizer:
        raise ValueError(
            f"no tokenizer.json beside {source} (trainer checkpoints do not carry one); pass --tokenizer DIR "
            "with the research run's tokenizer folder (its final save_pretrained folder has the files)"
        )
    stages = options.stages(READ_STAGES)
    try:
        stages.start("read checkpoint")
        checkpoint = read_research_checkpoint(source, config_path)
        stages.start("check weights")
        if research_commit and checkpoint.research_commit and research_commit != checkpoint.research_commit:
            raise ValueError(f"--research-commit {research_commit} contradicts {checkpoint.config_file}, "
                             f"which names commit {checkpoint.research_commit}")
        config = kvm_config_from_research(checkpoint.fields, research_commit or checkpoint.research_commit,
                                          **overrides)
        try:
            model = build_model(config, convert_state_dict(checkpoint.state))
        except ValueError as error:
            raise ValueError(
                f"the weights in {source} do not fit the config from {checkpoint.config_file}: {error}"
            ) from error
        stages.start("tokenizer")
        tokenizer_object = load_research_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        fields = generation_token_fields(tokenizer_object, config.vocab_size) if tokenizer_object is not None else {}
        shown = checkpoint.weights_files[0] if len(checkpoint.weights_files) == 1 else Path(source)
        provenance = source_provenance(checkpoint.weights_files, resolved.reference(shown), checkpoint.step)
        dtype = options.dtype or source_dtype(checkpoint.state)
        return export_model(model, out, architecture="kvm", tokenizer=tokenizer_object, generation_fields=fields,
                            provenance=provenance, options=replace(options, dtype=dtype), stages=stages)
    finally:
        stages.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="research model_stepNNNNNN.pt or final save_pretrained folder, "
                                       "or the Hub repo id of a final folder")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a Hub SOURCE")
    parser.add_argument("out", help="output folder (must not exist unless --overwrite)")
    parser.add_argument("--config", help="research YAML of a .pt checkpoint (its 'model:' section is read)")
    parser.add_argument("--research-commit", choices=RESEARCH_COMMITS, default=None,
                        help="research commit that trained the checkpoint (recursal/KVM-paper 1932b9c or "
                             "featherless-ai/KVM-paper 6bd7dfd): needed when its YAML omits a key whose default "
                             f"changed between them ({', '.join(CHANGED_DEFAULTS)})")
    add_output_arguments(parser, tokenizer_help="folder with the run's tokenizer.json (needed for a .pt trainer "
                                                "checkpoint; a final folder carries its own)")


def run(args: argparse.Namespace) -> int:
    return run_conversion(args, lambda: convert(args.source, args.out, config_path=args.config, tokenizer=args.tokenizer,
                                                require_tokenizer=True, options=ExportOptions.from_args(args),
                                                revision=args.revision, research_commit=args.research_commit))
