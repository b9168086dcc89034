"""Shared pytest setup: test data location, and one CPU thread (the test models are tiny: threads cost more than they give)."""

from pathlib import Path

import pytest
import torch

DATA_DIR = Path(__file__).parent / "data"

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Folder with the research reference fixtures copied into the project."""
    return DATA_DIR


@pytest.fixture(scope="module")
def package_auto_classes():
    """The package's classes registered with transformers' Auto classes for one test module, then unregistered:
    registration makes the package's code win over a folder's own, so it must not leak into remote-code tests
    (xdist workers import every test module)."""
    from transformers.models.auto import configuration_auto, modeling_auto, tokenization_auto

    import kvm_maglev

    mappings = [configuration_auto.CONFIG_MAPPING, modeling_auto.MODEL_MAPPING,
                modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, tokenization_auto.TOKENIZER_MAPPING]
    saved = [dict(mapping._extra_content) for mapping in mappings]
    kvm_maglev.register_auto_classes()
    yield
    for mapping, content in zip(mappings, saved):
        mapping._extra_content.clear()
        mapping._extra_content.update(content)
