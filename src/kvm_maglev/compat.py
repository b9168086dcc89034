"""What differs between the supported transformers releases, in one place."""

import transformers
from packaging import version

# transformers 5.24 renamed the model keyword and output field `past_key_values` to `cache`.
CACHE_KEYWORD = "cache" if version.parse(transformers.__version__) >= version.parse("5.24") else "past_key_values"


def returned_cache(output):
    """The cache a forward returned (``cache`` on transformers >= 5.24, else ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
