"""The executor, registry, selection and tuning tests describe CPU calls, wherever they run."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _default_device_cpu(on_cpu: None) -> None:
    """Every test here runs with JAX's default device on the CPU (see tests/conftest.py)."""
