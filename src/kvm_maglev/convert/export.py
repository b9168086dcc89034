"""Build a complete Hub model folder, checked first and moved into place only when whole.

`build_hub_folder` is the one place a Hub folder is made (converters, `kvm-maglev push`, the demo):
weights and config come from a model or a saved folder, and our architectures' two code files are
generated from the package's model modules with `auto_map` set, so a folder always carries the
package's current code. Everything is written to a temporary folder beside OUT and renamed at the
end, so a failure at any stage (a bad tensor, a full disk, an interrupt) never leaves a
half-written OUT behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from kvm_maglev.models.hub_code import CLASS_PREFIXES, hub_code_files, hub_code_names, write_hub_code

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_INDEX = "model.safetensors.index.json"
WRITE_STAGES = ["cast", "check logits", "weights", "tokenizer", "card", "verify", "move into place"]
FOLDER_STAGES = ["copy files", "tokenizer", "card", "verify", "move into place"]
# Large files are hard-linked into the staging folder when possible; small ones are copied, so
# editing them there (config.json's auto_map) never touches the source folder.
_LINKED_SUFFIXES = (".safetensors", ".bin")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """'bfloat16' / torch.bfloat16 -> torch.bfloat16; None stays None (keep the source dtype)."""
    if dtype is None or dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the model's state dict holds (what a converted state dict must match)."""
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_state_dict(expected: Mapping[str, Iterable[int]], got: Mapping[str, torch.Tensor]) -> None:
    """Raise one ValueError listing every missing, unexpected and wrongly shaped key."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong_shape = [
        f"{name}: expected {list(expected[name])}, got {list(got[name].shape)}"
        for name in sorted(set(expected) & set(got))
        if tuple(got[name].shape) != tuple(expected[name])
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: " + ", ".join(missing))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: " + ", ".join(unexpected))
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} wrongly shaped: " + "; ".join(wrong_shape))
    if problems:
        raise ValueError("state dict does not match the config:\n  " + "\n  ".join(problems))


class Stages:
    """Progress over named stages: a tqdm bar when tqdm is installed, else one line per stage on stderr."""

    def __init__(self, names: list[str], enabled: bool = True):
        self.names = names
        self.index = 0
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=len(names), desc="export", unit="stage", file=sys.stderr)

    def start(self, name: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=not self.index)
            if self.index:
                self.bar.update(1)  # the previous stage is done
        else:
            print(f"[{self.index + 1}/{len(self.names)}] {name}", file=sys.stderr, flush=True)
        self.index += 1

    def close(self) -> None:
        """End the display (full when every stage ran); safe to call twice."""
        if self.bar is not None:
            if self.index == len(self.names):  # completed; after a failure the bar stays at the failing stage
                self.bar.update(len(self.names) - self.bar.n)
            self.bar.close()
            self.bar = None


def is_package_architecture(model_type: str | None) -> bool:
    """True for the architectures whose code this package ships (their folders get our code files)."""
    return model_type in CLASS_PREFIXES


def package_code_files(model_type: str) -> dict[str, str]:
    """The code files a Hub folder of one of our architectures carries (name -> text): its configuration and
    modeling files, generated from the package's modules (`kvm_maglev.models.hub_code`)."""
    if not is_package_architecture(model_type):
        raise ValueError(f"no model code in this package for model_type {model_type!r}; expected one of "
                         f"{sorted(CLASS_PREFIXES)}")
    return hub_code_files(model_type)


def lacks_package_code(folder: str | os.PathLike) -> bool:
    """True when `folder` holds one of our architectures without the code files it needs to load."""
    model_type = _read_config(Path(folder)).get("model_type")
    if not is_package_architecture(model_type):
        return False
    return any(not (Path(folder) / name).is_file() for name in hub_code_names(model_type))


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _add_package_code(folder: Path, model_type: str) -> None:
    """Write the package's code files into `folder` with config.json's auto_map pointing at them, and make the
    folder decode with its cache (`_decode_with_cache`)."""
    write_hub_code(folder, model_type)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["use_cache"] = True
    _write_json(config_file, config)
    _decode_with_cache(folder, config)


def _decode_with_cache(folder: Path, config: dict) -> None:
    """generate() on the folder uses the model's cache: a generation_config.json with `use_cache` true (without
    one, transformers derives it from config.json, which a training run may have saved with it off)."""
    from transformers import GenerationConfig

    path = folder / "generation_config.json"
    if path.is_file():
        generation = json.loads(path.read_text(encoding="utf-8"))
        generation["use_cache"] = True
        _write_json(path, generation)
        return
    ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(key) is not None}
    GenerationConfig(use_cache=True, **ids).save_pretrained(folder)


def _write_json(path: Path, data: dict) -> None:
    """Write `data` as a fresh file: never through a hard link to the source folder."""
    path.unlink(missing_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _check_auto_map(model) -> None:
    """Custom models must have register_for_auto_class called so config.json gets an auto_map
    (our own architectures get theirs from the package)."""
    if type(model).__module__.startswith("transformers.") or is_package_architecture(model.config.model_type):
        return
    missing = [
        name for name, cls in (("model", type(model)), ("config", type(model.config)))
        if getattr(cls, "_auto_class", None) is None
    ]
    if missing:
        raise ValueError(
            f"{type(model).__name__}: call register_for_auto_class() on the {' and '.join(missing)} class(es) "
            "first, so that config.json's auto_map lets AutoModelForCausalLM load the folder with trust_remote_code"
        )


def _sample_ids(model, tokenizer, num_tokens: int = 8) -> torch.Tensor:
    vocab_size = int(model.config.vocab_size)
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False) if tokenizer is not None else []
    ids = [i for i in ids if 0 <= i < vocab_size][:num_tokens]
    if len(ids) < 2:
        ids = [i % vocab_size for i in range(1, num_tokens + 1)]
    return torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)


@torch.no_grad()
def check_finite_logits(model, tokenizer=None) -> None:
    """Run the model on a few tokens; raise ValueError unless every logit is finite."""
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=_sample_ids(model, tokenizer)).logits
    finally:
        model.train(was_training)
    if not torch.isfinite(logits).all():
        bad = (~torch.isfinite(logits)).sum().item()
        raise ValueError(f"the converted model gives {bad} non-finite logits on a few test tokens; refusing to write it")


def _generation_fields(tokenizer, generation_fields: Mapping | None) -> dict:
    fields = {}
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                fields[key] = value
    fields.update(generation_fields or {})
    return fields


def _parameter_bytes(model, dtype: torch.dtype | None) -> int:
    total = 0
    for tensor in model.state_dict().values():
        element = torch.empty((), dtype=dtype).element_size() if dtype and tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * element
    return total


def _planned_files(model, tokenizer, card_text, dtype, max_shard_size, extra_files) -> list[str]:
    weights_bytes = _parameter_bytes(model, dtype)
    sharding = f", sharded at {max_shard_size} with {_SAFETENSORS_INDEX}" if max_shard_size else ""
    custom = getattr(type(model), "_auto_class", None) or is_package_architecture(model.config.model_type)
    files = [
        "config.json" + (" (+ the model's code files from auto_map)" if custom else ""),
        f"model.safetensors: about {weights_bytes / 2**20:.2f} MiB in {dtype or 'the source dtype'}{sharding}",
        "generation_config.json",
    ]
    return files + _planned_extras(tokenizer, card_text, extra_files)


def _planned_folder_files(source: Path, tokenizer, card_text, extra_files) -> list[str]:
    model_type = _read_config(source).get("model_type")
    files = [f"{path.name} (from {source})" for path in sorted(source.iterdir()) if path.is_file()]
    if is_package_architecture(model_type):
        files.append(f"{', '.join(hub_code_names(model_type))} (the package's code)")
    return files + _planned_extras(tokenizer, card_text, extra_files)


def _planned_extras(tokenizer, card_text, extra_files) -> list[str]:
    files = []
    if tokenizer is not None:
        files.append(f"tokenizer files ({type(tokenizer).__name__}: tokenizer.json, tokenizer_config.json, ...)")
    if card_text is not None:
        files.append(f"README.md ({len(card_text)} characters)")
    files.extend(f"{name} (extra file)" for name in (extra_files or {}))
    return files


def _write_extra_files(folder: Path, extra_files: Mapping) -> None:
    for name, content in extra_files.items():
        target = (folder / name).resolve()
        if folder.resolve() not in target.parents:
            raise ValueError(f"extra file name {name!r} points outside the output folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        elif isinstance(content, str):
            target.write_text(content, encoding="utf-8")
        elif isinstance(content, os.PathLike):
            shutil.copyfile(content, target)
        else:
            raise TypeError(f"extra file {name!r}: expected str, bytes or a path, got {type(content).__name__}")


def _check_written(folder: Path, needs_tokenizer: bool, custom_code: bool, needs_generation_config: bool = True) -> None:
    """The folder holds a config (with auto_map for custom code), every weight shard its index names,
    a generation config (when written from a model) and the tokenizer."""
    if not (folder / "config.json").is_file():
        raise ValueError("save_pretrained wrote no config.json")
    auto_map = json.loads((folder / "config.json").read_text()).get("auto_map", {})
    if custom_code and not {"AutoConfig", "AutoModelForCausalLM"} <= set(auto_map):
        raise ValueError(f"config.json's auto_map lacks AutoConfig/AutoModelForCausalLM (got {sorted(auto_map)})")
    index = folder / _SAFETENSORS_INDEX
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            raise ValueError(f"weight shards named in {_SAFETENSORS_INDEX} were not written: {absent}")
    elif not (folder / "model.safetensors").is_file():
        raise ValueError("save_pretrained wrote no model.safetensors")
    if needs_generation_config and not (folder / "generation_config.json").is_file():
        raise ValueError("no generation_config.json was written")
    if needs_tokenizer and not (folder / "tokenizer_config.json").is_file():
        raise ValueError("the tokenizer wrote no tokenizer_config.json")


def folder_mode() -> int:
    """Permissions of a new folder under the user's umask (as mkdir would make it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o777 & ~umask


def move_into_place(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished folder to OUT; an old OUT (overwrite) is set aside first and removed last."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    if not overwrite:
        raise ValueError(f"{out_dir} already exists; pass overwrite=True (--overwrite) to replace it")
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except BaseException:
        old.rename(out_dir)
        raise
    shutil.rmtree(old) if old.is_dir() else old.unlink()


def _check_source_folder(source: Path, **model_only) -> Path:
    """A saved folder to build from: config.json and safetensors weights; model-only options refused."""
    given = sorted(name for name, value in model_only.items() if value is not None)
    if given:
        raise ValueError(f"{', '.join(given)} apply to a model, not to a saved folder ({source})")
    if not (source / "config.json").is_file():
        raise ValueError(f"{source} has no config.json: not a saved model folder")
    if not any(source.glob("*.safetensors")):
        raise ValueError(f"{source} holds no safetensors weights")
    return source


def _copy_folder(source: Path, staging: Path) -> None:
    """The source folder's files (not subfolders); weights hard-linked when the file system allows."""
    for path in sorted(source.iterdir()):
        if not path.is_file():
            continue
        if path.name.endswith(_LINKED_SUFFIXES):
            try:
                os.link(path, staging / path.name)
                continue
            except OSError:
                pass  # another file system, or links not allowed: copy instead
        shutil.copyfile(path, staging / path.name)


def _save_model(model, staging: Path, tokenizer, generation_fields, max_shard_size) -> None:
    """Config, generation config and safetensors weights of `model`, as save_pretrained writes them."""
    for key, value in _generation_fields(tokenizer, generation_fields).items():
        setattr(model.generation_config, key, value)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(staging, **save_kwargs)
    if not (staging / "generation_config.json").is_file():
        model.generation_config.save_pretrained(staging)


def build_hub_folder(
    source,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    card_text: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    extra_files: Mapping[str, str | bytes | os.PathLike] | None = None,
    generation_fields: Mapping | None = None,
    progress: bool | Stages = True,
) -> Path:
    """Write a checked Hub folder at OUT: code files, config, weights, tokenizer, card and extra files.

    `source` is a model, or a saved folder (config.json + safetensors, copied as it is). Our
    architectures get the package's code files and auto_map, so the folder loads with
    trust_remote_code. A model is cast to `dtype` in place (None keeps its dtype), must give finite
    logits on a few tokens, and is saved as safetensors (sharded when `max_shard_size` is given);
    `generation_fields` (e.g. eos lists, suppress_tokens) go into generation_config.json on top of
    the tokenizer's bos/eos/pad ids. With `dry_run` the checks run and the plan is printed; nothing
    is written. `progress` shows the stages (a converter passes its own Stages to continue its display).
    """
    out_dir = Path(out_dir)
    from_folder = isinstance(source, (str, os.PathLike))
    target_dtype = None if from_folder else resolve_dtype(dtype)
    if out_dir.exists() and not overwrite:
        raise ValueError(f"{out_dir} already exists; pass overwrite=True (--overwrite) to replace it")
    if not dry_run and not out_dir.parent.is_dir():
        raise ValueError(f"the parent folder of {out_dir} does not exist")
    if from_folder:
        source = _check_source_folder(Path(source), dtype=dtype, max_shard_size=max_shard_size,
                                      generation_fields=generation_fields)
    else:
        _check_auto_map(source)
    if isinstance(progress, Stages):
        stages = progress  # a converter's display, already counting its reading stages
    else:
        stages = Stages(FOLDER_STAGES if from_folder else WRITE_STAGES, enabled=progress and not dry_run)
    try:
        if dry_run:
            if from_folder:
                lines = _planned_folder_files(source, tokenizer, card_text, extra_files)
            else:
                check_finite_logits(source, tokenizer)
                lines = _planned_files(source, tokenizer, card_text, target_dtype, max_shard_size, extra_files)
            print(f"dry run: would write {out_dir}" + (" (replacing it)" if out_dir.exists() else "") + ":")
            for line in lines:
                print(f"  {line}")
            return out_dir
        if not from_folder:
            stages.start("cast")
            if target_dtype is not None:
                source.to(target_dtype)
            stages.start("check logits")
            check_finite_logits(source, tokenizer)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            if from_folder:
                stages.start("copy files")
                _copy_folder(source, staging)
            else:
                stages.start("weights")
                _save_model(source, staging, tokenizer, generation_fields, max_shard_size)
            model_type = _read_config(staging).get("model_type")
            if is_package_architecture(model_type):
                _add_package_code(staging, model_type)
            stages.start("tokenizer")
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            stages.start("card")
            if card_text is not None:
                (staging / "README.md").write_text(card_text, encoding="utf-8")
            _write_extra_files(staging, extra_files or {})
            stages.start("verify")
            custom_code = is_package_architecture(model_type) or (
                not from_folder and not type(source).__module__.startswith("transformers."))
            _check_written(staging, tokenizer is not None, custom_code,
                           needs_generation_config=not from_folder or is_package_architecture(model_type))
            stages.start("move into place")
            os.chmod(staging, folder_mode())  # mkdtemp made it 0700
            move_into_place(staging, out_dir, overwrite)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        stages.close()
    return out_dir


# The name the writer had before build_hub_folder also took saved folders; kept for existing callers.
write_model_folder = build_hub_folder
