"""Flash attention test fixtures: the implementations under test and seeded random generators."""

from __future__ import annotations

import os

# shard_map tests need several CPU devices; XLA reads this once, when jax is first imported.
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}=4".strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ejkernel.kernels.flash_attention._xla import flash_attention_xla  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A flash attention under test.

    fn: flash_attention_xla's arguments without the block sizes; returns (out, lse).
    unavailable: why it cannot run here, or None.
    features: the optional features it supports (AttentionArgs.features() names, plus
    "backward"); None means all. Tests needing another feature are skipped.
    """

    fn: Callable
    unavailable: Callable[[], str | None] = lambda: None
    features: frozenset[str] | None = None
    low_precision_only: bool = False  # takes bf16/f16 only: float32 cases run in bf16/f16


def _native(platform: str, query, key, value, **kwargs):
    """A native implementation called with the normalised arguments the XLA one takes."""
    from ejkernel.kernels.flash_attention import AttentionArgs, flash_attention_native, native_features

    args = AttentionArgs(query, key, value, **kwargs)
    return flash_attention_native(
        platform, args, block_q=16, block_k=32, backward="backward" in native_features(platform)
    )


def _native_unavailable(platform: str, backend: str) -> str | None:
    import jax

    from ejkernel import _native as lib
    from ejkernel.kernels.flash_attention import native_features

    if not lib.available():
        return "libejkernel not loaded"
    if jax.default_backend() != backend:
        return f"the default device is {jax.default_backend()}, not {backend}"
    if not native_features(platform):
        return f"no native {platform} flash attention in this build"
    return None


def _native_features(platform: str) -> frozenset[str] | None:
    from ejkernel.kernels.flash_attention import native_features

    return frozenset(native_features(platform)) or None


# Tiles much smaller than the test sequences, so every test spans several, ragged ones.
IMPLEMENTATIONS: dict[str, Implementation] = {
    "xla": Implementation(functools.partial(flash_attention_xla, block_q=16, block_k=32)),
    "cpu": Implementation(
        functools.partial(_native, "cpu"),
        functools.partial(_native_unavailable, "cpu", "cpu"),
        _native_features("cpu"),
    ),
    "cuda": Implementation(
        functools.partial(_native, "cuda"),
        functools.partial(_native_unavailable, "cuda", "gpu"),
        _native_features("cuda"),
        low_precision_only=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class ImplUnderTest:
    name: str
    fn: Callable
    features: frozenset[str] | None
    low_precision_only: bool = False

    def adapt(self, case):
        """The case as it runs here: where only bf16/f16 run, float32 cases run in one of them
        (chosen by the case name, so each case keeps its dtype from run to run)."""
        if self.low_precision_only and case.dtype == "float32":
            return dataclasses.replace(case, dtype=("bfloat16", "float16")[sum(map(ord, case.name)) % 2])
        return case

    def supports(self, feature: str) -> bool:
        return self.features is None or feature in self.features

    def require(self, *features: str) -> None:
        """Skips the test unless this implementation supports every one of `features`."""
        missing = sorted(f for f in features if not self.supports(f))
        if missing:
            pytest.skip(f"{self.name} does not support {', '.join(missing)}")


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request) -> ImplUnderTest:
    entry = IMPLEMENTATIONS[request.param]
    reason = entry.unavailable()
    if reason:
        pytest.skip(f"{request.param} unavailable: {reason}")
    return ImplUnderTest(request.param, entry.fn, entry.features, entry.low_precision_only)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh generator per test; its seed is printed (shown on failure) and can be pinned
    with EJK_TEST_SEED to reproduce a run."""
    seed = int(os.environ.get("EJK_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{request.node.nodeid}: EJK_TEST_SEED={seed}")
    return np.random.default_rng(seed)
