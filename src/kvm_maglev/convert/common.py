"""What both converters share: safe reading of research files, the output options, and the command-line run.

A converter reads its research checkpoint, builds and checks the model, then hands it to
`export_model`, which renders the model card and writes the folder through `build_hub_folder`.
`run_conversion` turns every expected failure into one `error: ...` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvm_maglev.convert.cards import Provenance, file_sha256, render_model_card
from kvm_maglev.convert.export import DTYPES, WRITE_STAGES, Stages, build_hub_folder

# Failures a user can cause with their inputs; anything else is a bug and keeps its traceback.
CONVERSION_ERRORS = (ValueError, TypeError, OSError)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
READ_STAGES = ["read checkpoint", "check weights", "tokenizer"]


# ----- reading research files -------------------------------------------------------------------
def load_torch_file(path: str | Path):
    """torch.load with weights_only=True; a truncated file or pickled code becomes one clear ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        try:  # memory-mapped: optimizer states in a trainer checkpoint are never read into memory
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap can only be used" not in str(error):
                raise
            return torch.load(str(path), map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as error:
        refused = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                       str(error).splitlines()[0])
        raise ValueError(
            f"{path} holds pickled objects other than tensors, which could run code when loaded; refusing it "
            f"(torch.load(weights_only=True) said: {refused}). Re-save the checkpoint as plain tensors."
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path} is truncated or corrupted: torch.load cannot read it ({first_line})") from error


def load_safetensors_file(path: str | Path) -> dict[str, torch.Tensor]:
    """safetensors load_file; a truncated or corrupted file becomes one clear ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except SafetensorError as error:
        raise ValueError(f"{path} is truncated or corrupted: not a valid safetensors file ({error})") from error


def source_dtype(state: dict[str, torch.Tensor]) -> str | None:
    """Name of the checkpoint's floating-point dtype; float32 when it mixes dtypes (nothing is rounded)."""
    dtypes = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    if not dtypes:
        return None
    if len(dtypes) > 1:
        return "float32"
    name = str(next(iter(dtypes))).removeprefix("torch.")
    return name if name in DTYPES else "float32"


def check_out_dir(out: str | Path, overwrite: bool) -> Path:
    """Fail before any slow work when OUT exists (without overwrite) or cannot be created."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; refusing to replace it")
    return out


def parse_size(text: str | int) -> int:
    """'5GB' (10**9), '500MiB' (2**20) or a plain byte count -> bytes, as transformers reads max_shard_size."""
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        unit = match.group(2).upper() if match else None
        if unit not in _SIZE_UNITS:
            raise ValueError(f"size {text!r} is not a number of bytes with an optional unit such as 500MB or 2GiB")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


# ----- output options ---------------------------------------------------------------------------
@dataclass
class ExportOptions:
    """How the folder is written: dtype (None = the source dtype), sharding, card metadata, safety switches."""

    dtype: str | None = None
    max_shard_size: int | None = None
    overwrite: bool = False
    dry_run: bool = False
    license: str | None = None
    base_model: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    repo_id: str | None = None
    progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ExportOptions:
        return cls(
            dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite, dry_run=args.dry_run,
            license=args.license, base_model=_split_list(args.base_model), datasets=_split_list(args.datasets),
            repo_id=args.push_to_hub,
        )

    def stages(self, read_stages: list[str]) -> Stages:
        """One progress display over reading and writing (silent for a dry run)."""
        return Stages(read_stages + WRITE_STAGES, enabled=self.progress and not self.dry_run)


def _split_list(values: list[str] | None) -> list[str]:
    """Repeated flags and comma-separated values, in order, without duplicates."""
    items = [item.strip() for value in values or [] for item in value.split(",")]
    return list(dict.fromkeys(item for item in items if item))


def _size_argument(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_output_arguments(parser: argparse.ArgumentParser, tokenizer_help: str) -> None:
    """Flags every converter takes: output dtype and shards, card metadata, tokenizer, safety, Hub push."""
    parser.add_argument("--tokenizer", metavar="DIR", default=None, help=tokenizer_help)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the written weights (default: the source checkpoint's dtype)")
    parser.add_argument("--max-shard-size", type=_size_argument, default=None, metavar="SIZE",
                        help="split the weights into shards of at most SIZE (e.g. 2GB, 500MiB) with an index")
    parser.add_argument("--dry-run", action="store_true", help="check everything and print what would be written")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    parser.add_argument("--license", default=None, help="license id for the model card (e.g. apache-2.0, mit)")
    parser.add_argument("--base-model", action="append", default=None, metavar="REPO",
                        help="model card base_model (repeat or comma-separate for several)")
    parser.add_argument("--datasets", action="append", default=None, metavar="REPO",
                        help="model card datasets (repeat or comma-separate for several)")
    add_push_arguments(parser)


# ----- writing ----------------------------------------------------------------------------------
def source_provenance(weights_files: list[Path], shown_path: str | Path, step: int | None) -> Provenance:
    """Provenance for the card: one file's sha256, or for shards the sha256 of their bytes in name order.

    A local source is shown by its file name only: the card goes to the Hub, the user's folders do not.
    """
    shown_path = str(shown_path) if str(shown_path).startswith("hf://") else Path(shown_path).name
    if len(weights_files) == 1:
        return Provenance(shown_path, file_sha256(weights_files[0]), step)
    digest = hashlib.sha256()
    for path in sorted(weights_files):
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return Provenance(shown_path, digest.hexdigest(), step)


def export_model(model, out: str | Path, *, architecture: str, tokenizer, generation_fields: dict,
                 provenance: Provenance, options: ExportOptions, stages: Stages) -> Path:
    """Render the model card from the config and write the checked folder (or print the plan)."""
    dtype = options.dtype or str(model.dtype).removeprefix("torch.")
    card = render_model_card(
        model.config, architecture=architecture, num_parameters=model.num_parameters(),
        repo_id=options.repo_id or str(out), license=options.license, base_model=options.base_model or None,
        datasets=options.datasets or None, provenance=provenance, cache_dtype=DTYPES.get(dtype, torch.bfloat16),
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = generation_fields.get(key)
        if value is not None:
            setattr(model.config, key, value[0] if isinstance(value, list) else value)
    if not options.dry_run:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    return build_hub_folder(
        model, out, tokenizer=tokenizer, card_text=card, dtype=options.dtype, max_shard_size=options.max_shard_size,
        overwrite=options.overwrite, dry_run=options.dry_run, generation_fields=generation_fields, progress=stages,
    )


def run_conversion(args: argparse.Namespace, convert: Callable[[], Path]) -> int:
    """Run a converter for the command line: one error line and exit 2 on bad input. The optional push
    (`--push-to-hub`) follows in the `kvm-maglev` command (kvm_maglev.cli), which publishes what was written."""
    try:
        out = convert()
    except CONVERSION_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        if args.push_to_hub:
            print(f"dry run: would push {out} to {args.push_to_hub}")
        return 0
    print(f"wrote {out}")
    return 0


# ----- Hub options ------------------------------------------------------------------------------
def check_repo_id(repo_id: str) -> None:
    """Refuse a Hub repository id that is not ORG/NAME."""
    if not isinstance(repo_id, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo_id):
        raise ValueError(f"repo id must look like ORG/NAME (letters, digits, '-', '_', '.'), got {repo_id!r}")
    if ".." in repo_id or repo_id.endswith((".git", ".")) or len(repo_id.split("/")[1]) > 96:
        raise ValueError(f"invalid repo name: {repo_id!r}")


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--push-to-hub ORG/NAME [--private] [--push-revision BRANCH]` to a converter's parser
    (a converter's own `--revision` is the revision of a Hub SOURCE)."""
    parser.add_argument(
        "--push-to-hub", metavar="ORG/NAME", type=repo_id_argument, default=None, help="publish OUT to this Hub repo"
    )
    parser.add_argument("--private", action="store_true", help="make the repo private (also an existing public one)")
    parser.add_argument("--push-revision", metavar="BRANCH", default=None,
                        help="branch to push to (created from main)")


def repo_id_argument(value: str) -> str:
    """Checks the repo id while parsing, so a typo fails before a long conversion starts."""
    try:
        check_repo_id(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return value


