"""The cache a model output carries, under the field name of the installed transformers (5.24 renamed it)."""

from kvm_maglev.models.common.model_inputs import CACHE_NAME


def returned_cache(output):
    """`output.cache` on transformers >= 5.24, `output.past_key_values` before."""
    return getattr(output, CACHE_NAME)
