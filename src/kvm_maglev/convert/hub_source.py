"""A converter's SOURCE given as a Hub repo id: download the checkpoint files (never the repo's code).

huggingface_hub's `snapshot_download` does the work, so the token (HF_TOKEN, `hf auth login`), the
cache (HF_HOME, HF_HUB_CACHE) and offline mode (HF_HUB_OFFLINE) behave as everywhere else. Only
the files a converter reads are fetched: no `*.py` is downloaded, so no repo code can run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What each converter reads from a Hub repo (config.json and meta files also tell a repo's kind).
KVM_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "generation_config.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "meta_*.json"]
NANOCHAT_FILES = ["config.json", "meta_*.json", "tokenizer.pkl", "tokenizer/tokenizer.pkl"]
_META = re.compile(r"meta_(\d+)\.json")


@dataclass(frozen=True)
class Source:
    """Where a converter reads from: a local path, or a Hub repo's downloaded snapshot (repo id and commit)."""

    path: Path
    repo_id: str | None = None
    commit: str | None = None

    @property
    def name(self) -> str:
        """SOURCE as the user gave it (the repo id for a Hub source), for messages."""
        return self.repo_id or str(self.path)

    def reference(self, file: str | Path) -> str | Path:
        """A file of a Hub source as hf://ORG/NAME@COMMIT/FILE (the card's provenance); a local path as it is."""
        if self.repo_id is None:
            return file
        return f"hf://{self.repo_id}@{self.commit}/{Path(file).relative_to(self.path).as_posix()}"


def resolve_source(source: str | Path, revision: str | None, architecture: str, step: int | None = None) -> Source:
    """A local SOURCE as it is; else a repo id whose checkpoint files are downloaded (for `architecture`)."""
    if Path(source).exists():
        if revision is not None:
            raise ValueError(f"--revision picks a revision of a Hub repo, but {source} is a local path")
        return Source(Path(source))
    if not _REPO_ID.fullmatch(str(source)):
        raise ValueError(f"{source} does not exist")
    repo_id = str(source)
    if architecture == "kvm":
        path = _download(repo_id, revision, KVM_FILES)
    else:
        path = _download(repo_id, revision, NANOCHAT_FILES)
        step = step if step is not None else _newest_step(path)
        if step is not None:
            path = _download(repo_id, revision, NANOCHAT_FILES + [f"model_{step:06d}.pt"])
    return Source(path, repo_id, path.name)


def _newest_step(folder: Path) -> int | None:
    steps = [int(m.group(1)) for p in folder.glob("meta_*.json") if (m := _META.fullmatch(p.name))]
    return max(steps, default=None)


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """snapshot_download of `patterns`; each way it can fail becomes one ValueError naming the repo."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except RevisionNotFoundError as error:
        raise ValueError(f"the Hub repo {repo_id} has no revision {revision!r}") from error
    except RepositoryNotFoundError as error:
        raise ValueError(f"{repo_id} is not a local path, and the Hub has no model repo {repo_id} that you can "
                         "read (a private repo needs HF_TOKEN or `hf auth login`)") from error
    except LocalEntryNotFoundError as error:
        raise ValueError(f"{repo_id} is not a local path nor in the Hub cache, and the Hub cannot be reached "
                         "(offline mode, or no network)") from error
    except HfHubHTTPError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"downloading {repo_id} from the Hub failed: {first_line}") from error
