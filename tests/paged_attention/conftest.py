"""Paged attention test fixtures: the implementations under test and seeded random generators."""

from __future__ import annotations

import os

# The jit-over-sharded-arrays tests need several CPU devices; XLA reads this once, when jax is
# first imported.
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}=4".strip()

import dataclasses  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from paged_impls import IMPLEMENTATIONS  # noqa: E402


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
