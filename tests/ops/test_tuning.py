"""Autotuning: the fastest candidate wins, failing ones are skipped, tracers get stand-ins."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.ops import (
    AutotuneError,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
    Platform,
    autotune,
    benchmark,
)
from ejkernel.ops.tuning import Autotuner, concrete_stand_ins


@dataclasses.dataclass(frozen=True)
class SleepConfig:
    delay_s: float
    fail: bool = False


class SleepKernel(Kernel[SleepConfig, jax.Array]):
    """Sleeps `delay_s` at run time (a host callback, so it also happens inside jit)."""

    def __init__(self, delays: tuple[float, ...] = (0.02, 0.002, 0.01)) -> None:
        super().__init__("sleep")
        self.delays = delays
        self.seen: list[Any] = []

    def run(self, x: jax.Array, *, cfg: SleepConfig, platform: Platform, **kwargs: Any) -> jax.Array:
        if cfg.fail:
            raise ValueError("this candidate cannot run")

        def host(value: np.ndarray) -> np.ndarray:
            self.seen.append(np.asarray(value))
            time.sleep(cfg.delay_s)
            return value

        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def heuristic_cfg(self, inv: Invocation) -> SleepConfig:
        return SleepConfig(delay_s=0.0)

    def candidate_cfgs(self, inv: Invocation) -> list[SleepConfig]:
        return [SleepConfig(delay_s=d) for d in self.delays]


def test_autotune_picks_fastest_and_skips_failures() -> None:
    kernel = SleepKernel()
    configs = [SleepConfig(0.02), SleepConfig(0.0, fail=True), SleepConfig(0.002), SleepConfig(0.01)]
    best = autotune(kernel, jnp.ones(4), configs=configs, num_warmup=1, num_iters=3)
    assert best == SleepConfig(0.002)


def test_autotuner_reports_timings_and_failures() -> None:
    kernel = SleepKernel()
    inv = Invocation(kernel, (jnp.ones(4),), {}, Platform.XLA)
    configs = [SleepConfig(0.015), SleepConfig(0.0, fail=True), SleepConfig(0.001)]
    result = Autotuner(num_warmup=1, num_iters=3).tune(inv, configs)
    assert result.best == SleepConfig(0.001)
    assert len(result.timings_ms) == 2 and len(result.failures) == 1
    slow = result.timings_ms['{"delay_s":0.015,"fail":false}']
    fast = result.timings_ms['{"delay_s":0.001,"fail":false}']
    assert slow > 10 and fast < slow
    assert "this candidate cannot run" in next(iter(result.failures.values()))


def test_all_failing_raises() -> None:
    with pytest.raises(AutotuneError, match="every candidate config failed"):
        autotune(SleepKernel(), jnp.ones(2), configs=[SleepConfig(0.0, fail=True)], num_warmup=0, num_iters=1)
    with pytest.raises(AutotuneError, match="no candidate configs"):
        autotune(SleepKernel(), jnp.ones(2), configs=[])


def test_autotune_under_jit_times_stand_ins() -> None:
    kernel = SleepKernel(delays=(0.01, 0.0))
    executor = Executor(ConfigSelectorChain(persistent=False, autotune=True, autotuner=Autotuner(0, 1)))
    out = jax.jit(lambda x: executor(kernel, x))(jnp.full(3, 5.0))
    np.testing.assert_allclose(out, 5.0)
    # Tuning ran on normal-distributed stand-ins (never all 5.0), then the real call on 5.0s.
    assert any(not np.allclose(v, 5.0) for v in kernel.seen)
    assert np.allclose(kernel.seen[-1], 5.0)


def test_autotune_on_real_arrays_outside_jit() -> None:
    kernel = SleepKernel(delays=(0.0,))
    executor = Executor(ConfigSelectorChain(persistent=False, autotune=True, autotuner=Autotuner(0, 1)))
    executor(kernel, jnp.full(3, 5.0))
    assert all(np.allclose(v, 5.0) for v in kernel.seen)


def test_stand_ins_match_shapes_and_dtypes() -> None:
    tree = (
        jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),
        {"idx": jax.ShapeDtypeStruct((4,), jnp.int32), "mask": jax.ShapeDtypeStruct((4,), jnp.bool_)},
        None,
        1.5,
    )
    x, d, none, scalar = concrete_stand_ins(tree)
    assert x.shape == (2, 3) and x.dtype == jnp.bfloat16
    assert d["idx"].dtype == jnp.int32 and not d["idx"].any()
    assert d["mask"].all()
    assert none is None and scalar == 1.5


def test_benchmark_returns_median_milliseconds() -> None:
    calls = []

    def fn(x: jax.Array) -> jax.Array:
        calls.append(1)
        time.sleep(0.005)
        return x

    elapsed = benchmark(fn, jnp.ones(2), num_warmup=2, num_iters=3)
    assert len(calls) == 5
    assert 4.5 < elapsed < 500
