"""`kvm-maglev convert maglev SOURCE OUT`: a nanochat / Maglev research checkpoint -> a Hub-ready transformers folder.

Small steps that a caller can compose: `load_checkpoint` (folder -> state dict + meta),
`build_config` (meta -> MaglevConfig), `convert_state_dict` (research keys -> ours),
`build_model` (checked against the config), then `export_model` (card, tokenizer, checked write).
"""

import argparse
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvm_maglev.convert.common import (
    READ_STAGES,
    ExportOptions,
    add_output_arguments,
    check_out_dir,
    export_model,
    load_torch_file,
    run_conversion,
    source_dtype,
    source_provenance,
)
from kvm_maglev.convert.export import check_state_dict, expected_shapes
from kvm_maglev.convert.hub_source import resolve_source
from kvm_maglev.convert.identify import check_source_kind
from kvm_maglev.package_only.classes import MaglevConfig, MaglevForCausalLM
from kvm_maglev.tokenization.gpt2 import padded_token_ids
from kvm_maglev.tokenization.nanochat import (
    find_nanochat_tokenizer,
    load_nanochat_tokenizer,
    nanochat_generation_token_fields,
)

COMPILE_PREFIX = "_orig_mod."

# Research (nanochat + Maglev) key -> our key; `{i}` stands for a layer index.
# The Maglev tensors follow the table in MAGLEV.md. Override with --key-map FILE.json.
BLOCK_KEY_MAP = {
    "attn.c_q.weight": "self_attn.q_proj.weight",
    "attn.c_k.weight": "self_attn.k_proj.weight",
    "attn.c_v.weight": "self_attn.v_proj.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "attn.ve_gate.weight": "self_attn.value_gate.weight",
    "attn.mem_k.weight": "self_attn.memory_k_proj.weight",
    "attn.mem_v.weight": "self_attn.memory_v_proj.weight",
    "attn.mem_gate.weight": "self_attn.memory_gate.weight",
    "mlp.c_fc.weight": "mlp.up_proj.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
DEFAULT_KEY_MAP = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "value_embeds.{i}.weight": "model.value_embeddings.{i}.weight",
    "resid_lambdas": "model.residual_lambdas",
    "x0_lambdas": "model.x0_lambdas",
    "smear_gate.weight": "model.smear_gate.weight",
    "smear_lambda": "model.smear_lambda",
    "backout_lambda": "model.backout_lambda",
    "memory_init": "model.memory_init",
    "memory_proj.weight": "model.memory_proj.weight",
    "memory_residual_proj.weight": "model.memory_residual_proj.weight",
    "prefiller_resid_lambdas": "model.prefiller_residual_lambdas",
    "prefiller_x0_lambdas": "model.prefiller_x0_lambdas",
    **{f"transformer.h.{{i}}.{k}": f"model.layers.{{i}}.{v}" for k, v in BLOCK_KEY_MAP.items()},
    **{f"prefiller.h.{{i}}.{k}": f"model.prefiller_layers.{{i}}.{v}" for k, v in BLOCK_KEY_MAP.items()},
}
PREFILLER_KEYS = re.compile(r"^(prefiller\.h\.|prefiller_resid_lambdas$|prefiller_x0_lambdas$)")
MAGLEV_META_FIELDS = ("sliding_window", "memory_gate_channels", "prefiller_window_pattern",
                      "prefiller_shares_blocks", "consistency_weight", "consistency_loss",
                      "consistency_detach_target", "memory_source_layer", "memory_projection",
                      "memory_residual_injection", "memory_self_feed_steps", "memory_self_feed_detach",
                      "memory_self_feed_mix", "memory_self_feed_mix_ramp_steps", "memory_noise_std",
                      "consistency_weight_final", "consistency_weight_ramp_steps",
                      "consistency_detach_target_after", "consistency_weight_after_detach")
SPECIAL_TOKENS = "the tokenizer's special tokens"
# MaglevConfig field -> where a nanochat checkpoint's meta json gives it (the tables in docs/conversion.md show them);
# `build_config` reads `model_config` (nanochat's GPT) by these names and takes the `maglev` mapping as it is
META_NAMES = {
    "vocab_size": "model_config.vocab_size",
    "hidden_size": "model_config.n_embd",
    "num_hidden_layers": "model_config.n_layer",
    "num_attention_heads": "model_config.n_head",
    "num_key_value_heads": "model_config.n_kv_head",
    "sequence_len": "model_config.sequence_len",
    "window_pattern": "model_config.window_pattern",
    "pad_token_id": SPECIAL_TOKENS,
    "bos_token_id": SPECIAL_TOKENS,
    "eos_token_id": SPECIAL_TOKENS,
    **{name: f"maglev.{name}" for name in MAGLEV_META_FIELDS},
}


# ----- reading ---------------------------------------------------------------------------------
def find_step(source: Path, step: int | None) -> int:
    """The requested step, or the newest `model_<step>.pt` in the folder."""
    steps = sorted(int(m.group(1)) for p in source.glob("model_*.pt")
                   if (m := re.fullmatch(r"model_(\d+)\.pt", p.name)))
    if not steps:
        raise FileNotFoundError(f"no model_<step>.pt checkpoint in {source}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {source} (steps: {steps})")
    return step


@dataclass
class NanochatCheckpoint:
    """`model_<step>.pt` as stored (dtypes kept) with its meta json."""

    state: dict[str, torch.Tensor]
    meta: dict
    step: int
    weights_file: Path
    meta_file: Path


def load_checkpoint(source: str | Path, step: int | None = None) -> NanochatCheckpoint:
    """Load `model_<step>.pt` (weights only, never pickled code) and `meta_<step>.json`."""
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"checkpoint folder {source} does not exist")
    step = find_step(source, step)
    meta_path, weights_path = source / f"meta_{step:06d}.json", source / f"model_{step:06d}.pt"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} is missing")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{meta_path} is not valid JSON: {error}") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object")
    state = load_torch_file(weights_path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{weights_path.name} is not a state dict of tensors")
    return NanochatCheckpoint(state, meta, step, weights_path, meta_path)


def read_checkpoint(source: str | Path, step: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(normalized state dict, meta) of `model_<step>.pt` / `meta_<step>.json` (newest step by default)."""
    checkpoint = load_checkpoint(source, step)
    return normalize_state_dict(checkpoint.state), checkpoint.meta


def normalize_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip torch.compile's `_orig_mod.` prefix and upcast bf16/fp16 tensors to float32."""
    return {key.removeprefix(COMPILE_PREFIX): (value.float() if value.is_floating_point() else value)
            for key, value in state.items()}


# ----- config ------------------------------------------------------------------------------------
# A converted model's usable context (`max_position_embeddings`, the tokenizer's model_max_length):
# any length, as for KVM, since windows and a fixed-size memory keep the cost per token flat.
# nanochat's training length is kept in `sequence_len`.
USABLE_CONTEXT = 1 << 30


def build_config(meta: dict, state: dict[str, torch.Tensor], keep_prefiller: bool = False) -> MaglevConfig:
    """MaglevConfig from nanochat's `model_config` (+ the `maglev` mapping); features that a
    checkpoint lacks (older nanochat: no smear, backout or value embeddings) are switched off."""
    if "model_config" not in meta:
        raise ValueError("meta json has no 'model_config'")
    nano = dict(meta["model_config"])
    nano.setdefault("window_pattern", "L")  # nanochat's patch for checkpoints older than sliding windows
    missing = [k for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd") if k not in nano]
    if missing:
        raise ValueError(f"meta json model_config lacks {missing}")
    maglev = meta.get("maglev")
    use_memory = maglev is not None or "memory_init" in state
    fields = {ours: nano[where.removeprefix("model_config.")] for ours, where in META_NAMES.items()
              if where.startswith("model_config.")}
    fields.update(
        max_position_embeddings=USABLE_CONTEXT,
        use_value_embeddings=any(k.startswith("value_embeds.") for k in state),
        use_smear="smear_gate.weight" in state,
        use_backout="backout_lambda" in state,
        use_memory=use_memory,
        sliding_window=None,
        has_prefiller=False,
    )
    if "transformer.wte.weight" in state:
        rows = state["transformer.wte.weight"].shape[0]
        fields["pad_vocab_size_to"] = 64 if rows != nano["vocab_size"] else 1
    up = state.get("transformer.h.0.mlp.c_fc.weight")
    if up is not None:
        fields["intermediate_size"] = up.shape[0]
    gate = next((v for k, v in state.items() if k.endswith("attn.ve_gate.weight")), None)
    if gate is not None:
        fields["value_embedding_gate_channels"] = gate.shape[1]
    if use_memory:
        if maglev is None:
            raise ValueError("checkpoint has Maglev tensors but meta json has no 'maglev' mapping")
        unknown = set(maglev) - set(MAGLEV_META_FIELDS)
        if unknown:
            raise ValueError(f"unknown fields in meta json 'maglev': {sorted(unknown)}")
        fields["memory_projection"] = "memory_proj.weight" in state
        fields["memory_residual_injection"] = "memory_residual_proj.weight" in state
        fields.update(maglev)
        fields["has_prefiller"] = keep_prefiller
    elif keep_prefiller:
        raise ValueError("--keep-prefiller needs a Maglev checkpoint (memory tensors and a 'maglev' meta mapping)")
    return MaglevConfig(**fields)


# ----- weights -------------------------------------------------------------------------------------
def compile_key_map(key_map: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    """Turn `{i}` patterns into regexes; a research key matches at most one pattern."""
    compiled = []
    for research, ours in key_map.items():
        pattern = re.escape(research).replace(re.escape("{i}"), r"(?P<i>\d+)")
        compiled.append((re.compile(f"^{pattern}$"), ours))
    return compiled


def rename_key(key: str, compiled: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, ours in compiled:
        match = pattern.match(key)
        if match:
            return ours.replace("{i}", match.group("i")) if "i" in match.groupdict() else ours
    return None


def patch_missing_scalars(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """nanochat's checkpoint_manager patch: old checkpoints lack the per-layer lambdas (identity values)."""
    state = dict(state)
    state.setdefault("resid_lambdas", torch.ones(num_layers))
    state.setdefault("x0_lambdas", torch.zeros(num_layers))
    return state


def convert_state_dict(
    state: dict[str, torch.Tensor],
    config: MaglevConfig,
    key_map: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Research state dict -> ours. Q's tensors are dropped unless `config.has_prefiller`."""
    compiled = compile_key_map(DEFAULT_KEY_MAP if key_map is None else key_map)
    state = patch_missing_scalars(state, config.num_hidden_layers)
    converted, unknown = {}, []
    for key, value in state.items():
        ours = rename_key(key, compiled)
        if ours is None:
            unknown.append(key)
        elif ours.startswith("model.prefiller_") and not config.has_prefiller:
            continue
        else:
            converted[ours] = value
    if unknown:
        raise ValueError(f"checkpoint keys with no mapping (use --key-map): {sorted(unknown)[:10]}")
    head = converted.get("lm_head.weight")
    if head is not None and not config.lm_head_padded and head.shape[0] > config.head_rows:
        # nanochat pads the head's rows; ours has exactly vocab_size (padded rows never get probability mass)
        converted["lm_head.weight"] = head[: config.head_rows]
    return converted


def build_model(config: MaglevConfig, state: dict[str, torch.Tensor]) -> MaglevForCausalLM:
    """Instantiate the model and load the weights; every missing, unexpected or misshapen key is one error."""
    model = MaglevForCausalLM(config)
    check_state_dict(expected_shapes(model), state)
    model.load_state_dict(state, strict=True)
    return model.eval()


# ----- writing ---------------------------------------------------------------------------------------
def find_tokenizer(source: str | Path, explicit: str | Path | None, required: bool) -> Path | None:
    """nanochat's tokenizer.pkl: `explicit`, else found in the nanochat base-folder layout (None if absent and optional)."""
    try:
        return find_nanochat_tokenizer(model_dir=source, explicit=explicit)
    except ValueError:
        if required or explicit is not None:
            raise
        return None


def generation_fields(tokenizer, config: MaglevConfig) -> dict:
    """bos/eos/pad as nanochat's Engine uses them; ids beyond the tokenizer's are never generated."""
    fields = nanochat_generation_token_fields(tokenizer)
    padded = padded_token_ids(len(tokenizer), config.vocab_size)
    if padded:
        fields["suppress_tokens"] = padded
    return fields


def convert(source: str | Path, out: str | Path, step: int | None = None, keep_prefiller: bool = False,
            key_map: dict[str, str] | None = None, overwrite: bool = False, *, tokenizer: str | Path | None = None,
            require_tokenizer: bool = False, options: ExportOptions | None = None, revision: str | None = None) -> Path:
    """The whole conversion: read -> config -> weights (checked) -> model -> card + tokenizer -> atomic write.

    The tokenizer is `tokenizer` (tokenizer.pkl or its folder) or found in the nanochat layout;
    without one nothing tokenizer-related is written unless `require_tokenizer`. `options` sets
    dtype, shards, card metadata and dry run; without it `overwrite` alone applies. `source` may be a
    Hub repo id (at `revision`): its files are downloaded, and the card's base_model names it.
    """
    options = options or ExportOptions(overwrite=overwrite)
    out = check_out_dir(out, options.overwrite)
    resolved = resolve_source(source, revision, "maglev", step)
    source = resolved.path
    check_source_kind(source, "maglev", shown=resolved.name)
    if resolved.repo_id and not options.base_model:
        options = replace(options, base_model=[resolved.repo_id])
    if tokenizer is None and (source / "tokenizer.pkl").is_file():  # a Hub repo keeps it at the top
        tokenizer = source
    tokenizer_path = find_tokenizer(source, tokenizer, required=require_tokenizer)
    stages = options.stages(READ_STAGES)
    try:
        stages.start("read checkpoint")
        checkpoint = load_checkpoint(source, step)
        stages.start("check weights")
        state = normalize_state_dict(checkpoint.state)
        try:
            config = build_config(checkpoint.meta, state, keep_prefiller)
            model = build_model(config, convert_state_dict(state, config, key_map))
        except ValueError as error:
            raise ValueError(
                f"the weights in {checkpoint.weights_file} do not fit {checkpoint.meta_file.name}: {error}"
            ) from error
        stages.start("tokenizer")
        tokenizer_object = fields = None
        if tokenizer_path is not None:
            tokenizer_object = load_nanochat_tokenizer(tokenizer_path, model_max_length=config.max_position_embeddings)
            fields = generation_fields(tokenizer_object, config)
        provenance = source_provenance([checkpoint.weights_file], resolved.reference(checkpoint.weights_file),
                                       checkpoint.step)
        dtype = options.dtype or source_dtype(checkpoint.state)
        return export_model(model, out, architecture="maglev", tokenizer=tokenizer_object,
                            generation_fields=fields or {},
                            provenance=provenance, options=replace(options, dtype=dtype), stages=stages)
    finally:
        stages.close()


def load_key_map(path: str | None) -> dict[str, str]:
    """The default mapping, updated with a user's JSON object `{research_pattern: our_pattern}`."""
    key_map = dict(DEFAULT_KEY_MAP)
    if path is None:
        return key_map
    user = json.loads(Path(path).read_text())
    if not isinstance(user, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in user.items()):
        raise ValueError(f"--key-map {path} must hold a JSON object of strings")
    key_map.update(user)
    return key_map


# ----- command line -----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="nanochat/Maglev checkpoint folder (model_<step>.pt, meta_<step>.json), "
                                       "or the Hub repo id of one")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a Hub SOURCE")
    parser.add_argument("out", help="output folder (written atomically; must not exist unless --overwrite)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument("--keep-prefiller", action="store_true", help="keep the prefiller Q (training, 'prefiller' prefill)")
    parser.add_argument("--key-map", default=None, help="JSON file {research_key_pattern: our_key_pattern} ({i} = layer)")
    add_output_arguments(parser, tokenizer_help="nanochat tokenizer.pkl or its folder (default: <base>/tokenizer/ "
                                                "of the nanochat layout <base>/base_checkpoints/<tag>/, "
                                                "then $NANOCHAT_BASE_DIR/tokenizer)")


def run(args: argparse.Namespace) -> int:
    return run_conversion(args, lambda: convert(
        args.source, args.out, step=args.step, keep_prefiller=args.keep_prefiller, key_map=load_key_map(args.key_map),
        tokenizer=args.tokenizer, require_tokenizer=True, options=ExportOptions.from_args(args), revision=args.revision,
    ))
