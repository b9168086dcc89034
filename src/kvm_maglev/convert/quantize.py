"""Write a compressed-tensors checkpoint (W8A8 int8 or W4A16) of a saved model folder, data-free.

Weights are quantized from their own ranges with compressed-tensors' API (`calculate_qparams`, `ModelCompressor`):
W8A8 is int8 weights with one scale per output channel and int8 activations quantized per token at run time
(nothing to calibrate); W4A16 is int4 weights with one scale per group of input columns. The projections of the
decoder (every layer of exactly type nn.Linear) are quantized; kept in full precision are the model's declared
modules (`_keep_in_fp32_modules`: the gates), the head, embeddings and norms, and any layer the user names with
`--skip`. The folder loads with transformers' `from_pretrained` (it reads `quantization_config`) and serves on vLLM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

# scheme -> (compressed-tensors preset, the format its weights are stored in)
SCHEMES = {"W8A8": ("W8A8", "int-quantized"), "W4A16": ("W4A16", "pack-quantized")}
# files save_pretrained writes; every other file of the source folder (tokenizer, code, card) is copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
WRITTEN = {"config.json", "generation_config.json"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="a saved model folder (package save_pretrained or a Hub folder)")
    parser.add_argument("--scheme", required=True, choices=sorted(SCHEMES),
                        help="W8A8: int8 weights per channel, int8 activations per token (dynamic); "
                             "W4A16: int4 weights per group of input columns")
    parser.add_argument("--out", required=True, help="the folder to write (written whole or not at all)")
    parser.add_argument("--group-size", type=int, default=128, help="W4A16: input columns per scale (default 128)")
    parser.add_argument("--skip", action="append", default=[], metavar="NAME",
                        help="also keep layers whose name is NAME or ends with .NAME in full precision (repeatable)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")


def run(args: argparse.Namespace) -> int:
    try:
        out = quantize_folder(args.folder, args.scheme, args.out, group_size=args.group_size, skip=args.skip,
                              overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def kept_names(model: nn.Module, skip: list[str]) -> list[str]:
    """Full names of the linear layers kept in full precision: every linear that is not exactly nn.Linear (the
    declared gates are `FullPrecisionLinear`), the head, and those named by the model's `_keep_in_fp32_modules` or
    by `skip` (a name or its last components)."""
    declared = [name.removesuffix(".weight") for name in getattr(model, "_keep_in_fp32_modules", None) or []]
    suffixes = set(declared) | set(skip) | {"lm_head"}
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)
            and (type(module) is not nn.Linear or any(name == s or name.endswith(f".{s}") for s in suffixes))]


def check_group_size(model: nn.Module, kept: list[str], group_size: int) -> None:
    """Raise a ValueError naming every quantized layer whose input width `group_size` does not divide."""
    if group_size <= 0:
        raise ValueError(f"--group-size must be positive, got {group_size}")
    bad = [f"{name} ({module.in_features})" for name, module in model.named_modules()
           if type(module) is nn.Linear and name not in kept and module.in_features % group_size]
    if bad:
        raise ValueError(f"W4A16 group size {group_size} does not divide the input width of {', '.join(bad)}: pass "
                         "a --group-size that divides them, or --skip those layers")


def set_weight_qparams(module: nn.Module) -> None:
    """The weight's scale and zero point from its own range (per output channel, or per group of input columns):
    data-free, as a memoryless min-max observer sets them."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    weight = module.weight.detach()
    if args.group_size:
        weight = weight.reshape(weight.shape[0], -1, args.group_size)
        low, high = weight.amin(dim=-1), weight.amax(dim=-1)
    else:
        low, high = weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    with torch.no_grad():
        module.weight_scale.copy_(scale)
        module.weight_zero_point.copy_(zero_point)


def quantize_model(model: nn.Module, scheme: str, group_size: int = 128, skip: list[str] | None = None):
    """Quantize `model`'s projections in place to compressed-tensors `scheme` (SCHEMES) and compress them; returns
    the `ModelCompressor` that writes the folder's `quantization_config`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    preset, storage = SCHEMES[scheme]
    kept = kept_names(model, list(skip or []))
    quant_scheme = preset_name_to_scheme(preset, ["Linear"])
    if quant_scheme.weights.group_size:
        check_group_size(model, kept, group_size)
        quant_scheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": quant_scheme}, ignore=kept,
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    quantized = [module for module in model.modules() if getattr(module, "quantization_scheme", None) is not None]
    if not quantized:
        raise ValueError("no linear layer left to quantize: every one is kept in full precision")
    for module in quantized:
        set_weight_qparams(module)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=storage)
    compressor.quantization_config.ignore = kept  # every kept linear by name, as vLLM matches them
    compressor.compress_model(model)
    return compressor


def load_float_model(folder: Path) -> nn.Module:
    """The folder's model as saved (its dtype): the package's class for its own model types, else the folder's code.

    The package's classes are picked by model_type rather than registered with the Auto classes, because a
    registration is process-wide and would override every remote-code folder loaded afterwards."""
    import json

    from transformers import AutoModelForCausalLM

    import kvm_maglev

    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a saved model folder")
    config = json.loads((folder / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{folder} is already quantized ({method}); quantize a full-precision folder")
    package_class = {"kvm": kvm_maglev.KVMForCausalLM, "maglev": kvm_maglev.MaglevForCausalLM}.get(
        config.get("model_type"))
    if package_class is not None:
        return package_class.from_pretrained(folder, dtype="auto").eval()
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype="auto").eval()


def quantize_folder(folder: str | Path, scheme: str, out: str | Path, group_size: int = 128,
                    skip: list[str] | None = None, overwrite: bool = False) -> Path:
    """Write `out`, a compressed-tensors `scheme` checkpoint of `folder` (with its other files: tokenizer, code,
    card), atomically: built in a temporary sibling folder and renamed into place once complete."""
    from kvm_maglev.convert.common import check_out_dir
    from kvm_maglev.convert.export import folder_mode, move_into_place

    folder, out = Path(folder), check_out_dir(out, overwrite)
    if out.resolve() == folder.resolve():
        raise ValueError(f"--out {out} is the source folder; write the quantized folder elsewhere")
    model = load_float_model(folder)
    compressor = quantize_model(model, scheme, group_size, skip)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for path in folder.iterdir():
            if path.is_file() and path.name not in WRITTEN and not path.name.endswith(WEIGHT_SUFFIXES):
                shutil.copyfile(path, staging / path.name)
        model.save_pretrained(staging)
        compressor.update_config(str(staging))
        os.chmod(staging, folder_mode())  # mkdtemp made it 0700
        move_into_place(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
