"""Paged attention test fixtures: the implementations under test and seeded random generators."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
import pytest

from paged_impls import IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True)
class ImplUnderTest:
    name: str
    attention: Callable
    update: Callable
    features: frozenset[str] | None

    def require(self, *features: str) -> None:
        """Skips the test unless this implementation supports every one of `features`."""
        missing = sorted(f for f in features if self.features is not None and f not in self.features)
        if missing:
            pytest.skip(f"{self.name} does not support {', '.join(missing)}")


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request) -> ImplUnderTest:
    entry = IMPLEMENTATIONS[request.param]
    reason = entry.unavailable()
    if reason:
        pytest.skip(f"{request.param} unavailable: {reason}")
    return ImplUnderTest(request.param, entry.attention, entry.update, entry.features)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh generator per test; its seed is printed (shown on failure) and can be pinned
    with EJK_TEST_SEED to reproduce a run."""
    seed = int(os.environ.get("EJK_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{request.node.nodeid}: EJK_TEST_SEED={seed}")
    return np.random.default_rng(seed)
