"""Publish a converted model folder to the Hugging Face Hub.

`kvm-maglev push OUT ORG/NAME [--private] [--revision BRANCH]` creates the repo (and the
branch) when missing and commits the folder's files in one commit. A folder that would not load
(no model config, research code only) is refused, and so is training state (a Trainer
checkpoint's optimizer, scheduler, RNG states) unless `--include-training-state` asks for it. Re-running with an
unchanged folder makes no new commit. The token comes from HF_TOKEN or the file written by
`hf auth login` (or `token=` in Python); it is never printed, and a folder that contains it
is refused. A folder of our architectures without its code files (a kept demo model: config,
weights, task) is pushed as the Hub folder `build_hub_folder` makes of it, code and auto_map added.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePath

from kvm_maglev.convert.common import check_repo_id, repo_id_argument

# Remote files of these kinds that are absent from the folder are deleted by the push, so a
# re-converted model (say, with fewer shards) never leaves stale weights or code behind.
_MIRRORED_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.py"]
_IGNORED_PATTERNS = ["*__pycache__/*", "*.pyc"]
# Where a converted folder may record the checkpoint it came from.
_SOURCE_CONFIG_KEYS = ("source_checkpoint", "converted_from", "source_path", "source")
# "- source: `path`", "Source checkpoint: path", "| source | `path` |" or "converted from `path`"
_SOURCE_README_PATTERNS = (
    re.compile(
        r"(?im)^[\s>*|-]*\**(?:source(?:\s+checkpoint|\s+path)?|weights\s+from|converted\s+from)\**\s*[:|]"
        r"\s*\**[`\"']?(?P<source>[^`\"'|\n]+?)[`\"']?\s*\|?\s*$"
    ),
    re.compile(r"(?i)converted\s+from\s+`(?P<source>[^`\n]+)`"),
)
_TOKEN_SCAN_MAX_BYTES = 4 * 1024 * 1024
# Lines of our model cards that name where the folder is: rewritten for the repo pushed to.
_CARD_REPO_LINE = re.compile(r'(?m)^repo = "[^"\n]*"$')
_CARD_SOURCE_LINE = re.compile(r"(?m)^(- source: `)([^`\n]+)(`)$")
# What a Trainer checkpoint (or a DeepSpeed one) holds beside the model: never published unasked.
TRAINING_STATE_PATTERNS = ["optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state*.pth",
                           "training_args.bin", "trainer_state.json", "global_step*", "zero_to_fp32.py"]


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    include_training_state: bool = False,
) -> str:
    """Upload a converted model folder to `repo_id` (on branch `revision`); returns the commit id.

    The repo and branch are created when missing (`private` also turns an existing public repo
    private; a private repo is never made public); unchanged files are not re-uploaded and an
    unchanged folder makes no new commit (the current commit id is returned). A folder holding
    training state (a Trainer checkpoint's optimizer, scheduler, RNG states) is refused unless
    `include_training_state`.
    """
    from huggingface_hub import HfApi, get_token

    folder = _check_folder(folder)
    _check_training_state(folder, include_training_state)
    check_repo_id(repo_id)
    if revision is not None and not revision.strip():
        raise ValueError("--revision must be a non-empty branch name")
    token = token or get_token()
    if not token:
        raise ValueError(
            "No Hugging Face token found: set HF_TOKEN or run `hf auth login` (a write token is needed to push)."
        )
    _refuse_files_containing(folder, token)

    commit_message = commit_message or default_commit_message(folder)

    api = HfApi(token=token)
    with _upload_view(folder, repo_id) as upload:  # built before anything is sent
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if private and not api.repo_info(repo_id, repo_type="model").private:
            # asked for private but the repo already existed as public: never publish by surprise
            api.update_repo_settings(repo_id, private=True, repo_type="model")
        if revision is not None and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(upload),
            revision=revision,
            commit_message=commit_message,
            ignore_patterns=_IGNORED_PATTERNS + ([] if include_training_state else TRAINING_STATE_PATTERNS),
            delete_patterns=_MIRRORED_PATTERNS,
        )
    return commit.oid


@contextlib.contextmanager
def _with_package_code(folder: Path) -> Iterator[Path]:
    """`folder` itself, or where it lacks our architecture's code files, the Hub folder built from it."""
    from kvm_maglev.convert.export import build_hub_folder, lacks_package_code

    if not lacks_package_code(folder):
        yield folder
        return
    with _work_folder(folder) as path:
        yield build_hub_folder(folder, path / folder.name, progress=False)


@contextlib.contextmanager
def _upload_view(folder: Path, repo_id: str) -> Iterator[Path]:
    """What is uploaded: the folder with our code files, and our card naming `repo_id` and no local path."""
    with _with_package_code(folder) as upload:
        card = upload / "README.md"
        if not _is_package_folder(upload) or not card.is_file():
            yield upload
            return
        text = card.read_text(encoding="utf-8")
        published = card_for_repo(text, repo_id)
        if published == text:
            yield upload
            return
        if upload != folder:  # already a private staging copy
            _replace_file(card, published)
            yield upload
            return
        with _work_folder(folder) as path:
            staged = path / folder.name
            shutil.copytree(folder, staged, copy_function=_link_or_copy)
            _replace_file(staged / "README.md", published)
            yield staged


def card_for_repo(text: str, repo_id: str) -> str:
    """Our card as published to `repo_id`: its loading snippet names the repo, its source line no local folder."""
    text = _CARD_REPO_LINE.sub(lambda _: f'repo = "{repo_id}"', text)
    return _CARD_SOURCE_LINE.sub(lambda m: m.group(1) + public_source(m.group(2)) + m.group(3), text)


def public_source(source: str) -> str:
    """A recorded source as it may be published: a Hub reference (hf://...) as it is, a local path as its file name."""
    return source if source.startswith("hf://") else PurePath(source).name


def _is_package_folder(folder: Path) -> bool:
    from kvm_maglev.convert.export import is_package_architecture

    config = _read_json(folder / "config.json")
    return isinstance(config, dict) and is_package_architecture(config.get("model_type"))


@contextlib.contextmanager
def _work_folder(folder: Path) -> Iterator[Path]:
    """A temporary folder beside `folder` (so weights are hard-linked, not copied), else in the system's."""
    try:
        work = tempfile.TemporaryDirectory(prefix=f".{folder.name}.push-", dir=folder.resolve().parent)
    except OSError:
        work = tempfile.TemporaryDirectory(prefix=f"{folder.name}.push-")
    with work as path:
        yield Path(path)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _replace_file(path: Path, text: str) -> None:
    """Write a fresh file: never through a hard link into the user's folder."""
    path.unlink()
    path.write_text(text, encoding="utf-8")


def default_commit_message(folder: str | Path) -> str:
    """'Upload <model> converted from <source checkpoint>' (its file name or Hub reference, never a local
    path), or naming the folder when unrecorded."""
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    what = f"{model_type} model" if model_type else "model"
    source = find_source_checkpoint(folder)
    if source:
        return f"Upload {what} converted from {public_source(source)}"
    return f"Upload {what} from {folder.resolve().name}"


def find_source_checkpoint(folder: str | Path) -> str | None:
    """The source checkpoint recorded by the converter in config.json or the model card, if any."""
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    if isinstance(config, dict):
        for key in _SOURCE_CONFIG_KEYS:
            value = config.get(key)
            if isinstance(value, str) and value.strip():
                return value.strip()
    readme = folder / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
        for pattern in _SOURCE_README_PATTERNS:
            match = pattern.search(text)
            if match:
                return match.group("source").strip()
    return None


def _check_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: pass the output folder of `kvm-maglev convert`")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: it is not a converted model folder")
    _check_loadable_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set((_read_json(index) or {}).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if not shards or missing:
            raise ValueError(f"{index} lists shards that are missing: {missing or 'none listed'}")
    elif not (folder / "model.safetensors").is_file():
        raise ValueError(f"{folder} has no model.safetensors (or index): the conversion looks incomplete")
    return folder


def _check_loadable_config(folder: Path) -> None:
    """config.json must name a model_type that transformers (or the folder's auto_map, or our package) can load."""
    from transformers import CONFIG_MAPPING

    from kvm_maglev.convert.export import is_package_architecture

    config = _read_json(folder / "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{folder / 'config.json'} is not a model config (no model_type): not a loadable model folder")
    model_type = config["model_type"]
    if model_type == "rwkv7backbone":
        raise ValueError(f"{folder} is a KVM research folder (model_type rwkv7backbone), which loads only with the "
                         f"research code: convert it first with `kvm-maglev convert kvm {folder} OUT`")
    if model_type not in CONFIG_MAPPING and not is_package_architecture(model_type) and not config.get("auto_map"):
        raise ValueError(f"{folder}: transformers has no model_type {model_type!r} and config.json has no auto_map "
                         "naming code for it, so the pushed folder would not load")


def training_state_files(folder: str | Path) -> list[str]:
    """Names in `folder` that are training state (optimizer, scheduler, RNG, trainer arguments), sorted."""
    folder = Path(folder)
    return sorted({path.name for pattern in TRAINING_STATE_PATTERNS for path in folder.glob(pattern)})


def _check_training_state(folder: Path, include: bool) -> None:
    found = training_state_files(folder)
    if found and not include:
        raise ValueError(
            f"{folder} holds training state ({', '.join(found)}), as a Trainer checkpoint does; refusing to publish "
            "it: push the folder written by trainer.save_model() or model.save_pretrained(), or pass "
            "--include-training-state to upload the training state too"
        )


def _refuse_files_containing(folder: Path, token: str) -> None:
    """A token must never be published: refuse folders where any small file contains it."""
    needle = token.encode()
    for path in folder.rglob("*"):
        if path.is_file() and path.stat().st_size <= _TOKEN_SCAN_MAX_BYTES and needle in path.read_bytes():
            raise ValueError(f"{path} contains your Hugging Face token; remove it before pushing")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# --- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="converted model folder (the OUT of `kvm-maglev convert`)")
    parser.add_argument("repo_id", type=repo_id_argument, help="Hub repository, ORG/NAME")
    _add_repo_options(parser)
    parser.add_argument("--commit-message", default=None, help="defaults to naming the source checkpoint")
    parser.add_argument("--include-training-state", action="store_true",
                        help="also upload a Trainer checkpoint's optimizer, scheduler, RNG states and arguments")


def run(args: argparse.Namespace) -> int:
    from huggingface_hub.errors import HfHubHTTPError

    try:
        commit = push_folder(
            args.folder, args.repo_id, private=args.private, revision=args.revision, commit_message=args.commit_message,
            include_training_state=args.include_training_state,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except HfHubHTTPError as error:
        print(f"error: the Hub refused the push to {args.repo_id}: {str(error).strip()}", file=sys.stderr)
        return 1
    _report(args.repo_id, args.revision, commit)
    return 0


def push_after_convert(args: argparse.Namespace, out_dir: str | Path) -> str | None:
    """Pushes `out_dir` when the converter was given `--push-to-hub`; returns the commit id."""
    if not getattr(args, "push_to_hub", None):
        return None
    private, revision = getattr(args, "private", False), getattr(args, "push_revision", None)
    commit = push_folder(out_dir, args.push_to_hub, private=private, revision=revision)
    _report(args.push_to_hub, revision, commit)
    return commit


def _add_repo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--private", action="store_true", help="make the repo private (also an existing public one)")
    parser.add_argument("--revision", metavar="BRANCH", default=None, help="branch to commit to (created from main)")


def _report(repo_id: str, revision: str | None, commit: str) -> None:
    print(f"pushed to {repo_id}@{revision or 'main'}: commit {commit}")
