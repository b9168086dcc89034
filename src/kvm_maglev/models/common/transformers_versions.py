"""What differs between the transformers releases the models support, in one place: the oldest they run on (an older
one stops the import of a folder's code with the upgrade named, before anything else fails less helpfully), and the
names a release changed. Each configuration module imports it first: transformers imports a folder's configuration
file before its modeling file."""

from __future__ import annotations

import transformers

MIN_TRANSFORMERS = (5, 17)


def major_minor(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "5.25.0" or "5.18.0.dev0"."""
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


if major_minor(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(f"KVM and Maglev models need transformers >= 5.17 (installed: {transformers.__version__}); "
                      "upgrade with: pip install -U 'transformers>=5.17'")

# transformers 5.24 renamed `past_key_values` to `cache`: the models' keyword and their outputs' field
CACHE_NAME = "cache" if major_minor(transformers.__version__) >= (5, 24) else "past_key_values"
# the name under which generate() hands the cache to the model: the same rename, seen from generate's side
GENERATE_CACHE_KWARG = CACHE_NAME


def returned_cache(output):
    """The cache a forward returned: `output.cache` from transformers 5.24 on, `output.past_key_values` before."""
    return getattr(output, CACHE_NAME)
