"""transformers' own `tests/test_modeling_common.py`, taken from the installed release's source distribution on
the package index at test time (never committed) and imported beside our stand-ins for the two test modules
that distribution lacks (`tests/generation/test_utils.py`, `tests/exporters/test_export.py`)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import sys
import tarfile
import tempfile
import types
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import pytest
import transformers

from . import transformers_stand_ins

PACKAGE = "_transformers_sdist_tests"  # the name the downloaded file is imported under
COMMON_FILE = "tests/test_modeling_common.py"
DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 60


class SdistUnavailable(RuntimeError):
    """The source distribution could not be fetched (offline, index unreachable, no sdist for the version)."""


def cache_dir(version: str) -> Path:
    """Where the extracted file is kept between runs: $KVM_MAGLEV_TEST_CACHE or the system temp folder."""
    root = os.environ.get("KVM_MAGLEV_TEST_CACHE") or Path(tempfile.gettempdir()) / "kvm_maglev_test_cache"
    return Path(root) / f"transformers-{version}-sdist-tests"


def sdist_url(version: str) -> tuple[str, str | None]:
    """(URL, sha256) of `transformers-<version>.tar.gz` from the simple index (PEP 691 JSON, or the HTML page)."""
    index = os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")
    request = urllib.request.Request(f"{index}/transformers/", headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        body = response.read().decode("utf-8")
        kind = response.headers.get("Content-Type", "")
    wanted = f"transformers-{version}.tar.gz"
    if "json" in kind:
        for entry in json.loads(body)["files"]:
            if entry["filename"] == wanted:
                return entry["url"], entry.get("hashes", {}).get("sha256")
    else:
        for href in re.findall(r'href="([^"]+)"', body):
            if href.split("#")[0].endswith("/" + wanted):
                url, _, fragment = href.partition("#sha256=")
                return urllib.parse.urljoin(f"{index}/transformers/", url), fragment or None
    raise SdistUnavailable(f"the package index {index} lists no {wanted}")


def fetch_common_tests(version: str) -> Path:
    """Folder holding `test_modeling_common.py` of transformers `version`, downloaded once into the cache."""
    folder = cache_dir(version)
    target = folder / "test_modeling_common.py"
    if target.is_file():
        return folder
    try:
        url, sha256 = sdist_url(version)
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            archive = response.read()
    except OSError as error:  # URLError, timeouts and refused connections are all OSErrors
        raise SdistUnavailable(f"cannot download the transformers {version} source distribution: {error}") from error
    if sha256 and hashlib.sha256(archive).hexdigest() != sha256:
        raise SdistUnavailable(f"the transformers {version} source distribution does not match its sha256")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        archive_path = Path(scratch) / "sdist.tar.gz"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            member = tar.getmember(f"transformers-{version}/{COMMON_FILE}")
            source = tar.extractfile(member).read()
        staged = Path(scratch) / target.name
        staged.write_bytes(source)
        os.replace(staged, target)  # atomic: a concurrent run sees the whole file or none
    return folder


def load_test_modeling_common() -> types.ModuleType:
    """Import the installed release's `test_modeling_common` as `_transformers_sdist_tests.test_modeling_common`,
    its relative imports of the generation and export test modules answered by our stand-ins."""
    name = f"{PACKAGE}.test_modeling_common"
    if name in sys.modules:
        return sys.modules[name]
    folder = fetch_common_tests(transformers.__version__)
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    sys.modules[PACKAGE] = package
    for sub, leaf in (("generation", "test_utils"), ("exporters", "test_export")):
        subpackage = types.ModuleType(f"{PACKAGE}.{sub}")
        subpackage.__path__ = []
        sys.modules[subpackage.__name__] = subpackage
        sys.modules[f"{PACKAGE}.{sub}.{leaf}"] = transformers_stand_ins
    with warnings.catch_warnings():  # its marks (flash_attn_test, ...) are registered by transformers' conftest only
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        return importlib.import_module(name)
