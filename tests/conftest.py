"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest


@pytest.fixture
def on_cpu() -> Iterator[None]:
    """JAX's default device set to the CPU: tests of CPU behaviour then hold on a machine whose
    default backend is a GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield
