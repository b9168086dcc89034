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
