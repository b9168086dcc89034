"""Stop the import of a folder's code on a transformers too old for it, naming the upgrade, before anything else can
fail with a less helpful error. Each configuration module imports it first: transformers imports a folder's
configuration file before its modeling file, and the generated file runs this section before the others."""

from __future__ import annotations

import transformers

MIN_TRANSFORMERS = (5, 17)


def major_minor(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "5.25.0" or "5.18.0.dev0"."""
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


if major_minor(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(f"KVM and Maglev models need transformers >= 5.17 (installed: {transformers.__version__}); "
                      "upgrade with: pip install -U 'transformers>=5.17'")
