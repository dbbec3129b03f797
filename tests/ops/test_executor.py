"""Executor: platform choice, the run/run_<platform> rule, custom VJP, jit, vmap, logging."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import _native, registry
from ejkernel.ops import (
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
    Platform,
    choose_platform,
    vmap_with_config,
)
from ejkernel.registry import Backend, KernelRegistry


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    factor: float = 1.0


class ScaleKernel(Kernel[ScaleConfig, jax.Array]):
    """x * factor; the native CPU path adds 100 so tests can tell which platform ran."""

    def __init__(self, name: str = "scale") -> None:
        super().__init__(name)
        self.calls: list[str] = []

    def run_cpu(self, x: jax.Array, *, cfg: ScaleConfig, **kwargs: Any) -> jax.Array:
        self.calls.append("run_cpu")
        return x * cfg.factor + 100.0

    def run(self, x: jax.Array, *, cfg: ScaleConfig, platform: Platform, **kwargs: Any) -> jax.Array:
        self.calls.append(f"run[{platform.value}]")
        return x * cfg.factor

    def heuristic_cfg(self, inv: Invocation) -> ScaleConfig:
        return ScaleConfig(factor=2.0)

    def unsupported_features(self, inv: Invocation, platform: Platform) -> list[str]:
        if platform is Platform.CPU and inv.kwargs.get("fancy"):
            return ["fancy"]
        return []


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> KernelRegistry:
    reg = KernelRegistry()
    monkeypatch.setattr(registry, "kernel_registry", reg)
    monkeypatch.delenv("EJKERNEL_DISABLE_NATIVE", raising=False)
    monkeypatch.delenv("EJKERNEL_AUTOTUNE", raising=False)
    return reg


@pytest.fixture
def native_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "available", lambda: True)
    monkeypatch.setattr(_native, "device_fingerprint", lambda platform, device=0: None)


@pytest.fixture
def scale(fresh_registry: KernelRegistry) -> ScaleKernel:
    fresh_registry.register("scale", Platform.CPU, Backend.CPU, priority=10, func=lambda *a, **k: None)
    fresh_registry.register("scale", Platform.CUDA, Backend.GPU, priority=20, func=lambda *a, **k: None)
    fresh_registry.register("scale", Platform.XLA, Backend.ANY, priority=0, func=lambda *a, **k: None)
    return ScaleKernel()


@pytest.fixture
def executor() -> Executor:
    return Executor(ConfigSelectorChain(persistent=False, autotune=False))


def test_native_cpu_preferred_when_available(native_loaded: None, scale: ScaleKernel, executor: Executor) -> None:
    out = executor(scale, jnp.ones(3))
    np.testing.assert_allclose(out, 102.0)
    assert scale.calls == ["run_cpu"]


def test_falls_back_to_xla_without_library(
    monkeypatch: pytest.MonkeyPatch, scale: ScaleKernel, executor: Executor, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_native, "available", lambda: False)
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        out = executor(scale, jnp.ones(3))
    np.testing.assert_allclose(out, 2.0)
    assert scale.calls == ["run[xla]"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ejkernel"]
    assert "op=scale platform=xla" in line
    assert "auto: device cpu, skipped cpu (native library not loaded)" in line
    assert "cuda" not in line  # CUDA does not serve a CPU array, so it is not even a candidate
    assert "cfg=ScaleConfig(factor=2.0) source=heuristic" in line


def test_disabled_native_is_skipped(
    monkeypatch: pytest.MonkeyPatch, native_loaded: None, scale: ScaleKernel, executor: Executor
) -> None:
    monkeypatch.setenv("EJKERNEL_DISABLE_NATIVE", "scale")
    inv, why = choose_platform(Invocation(scale, (jnp.ones(3),), {}))
    assert inv.platform is Platform.XLA
    assert "skipped cpu (disabled by EJKERNEL_DISABLE_NATIVE)" in why


def test_unsupported_features_skip_platform_automatically(
    native_loaded: None, scale: ScaleKernel, executor: Executor
) -> None:
    inv, why = choose_platform(Invocation(scale, (jnp.ones(3),), {"fancy": True}))
    assert inv.platform is Platform.XLA
    assert "skipped cpu (unsupported: fancy)" in why


def test_explicit_platform_is_honoured(native_loaded: None, scale: ScaleKernel, executor: Executor) -> None:
    np.testing.assert_allclose(executor(scale, jnp.ones(3), platform="xla"), 2.0)
    np.testing.assert_allclose(executor(scale, jnp.ones(3), platform=Platform.CPU), 102.0)
    assert scale.calls == ["run[xla]", "run_cpu"]


def test_explicit_platform_with_unsupported_feature_names_it(
    native_loaded: None, scale: ScaleKernel, executor: Executor
) -> None:
    with pytest.raises(ValueError, match=r"scale on platform 'cpu' does not support: fancy"):
        executor(scale, jnp.ones(3), platform="cpu", fancy=True)


def test_explicit_platform_errors(monkeypatch: pytest.MonkeyPatch, executor: Executor) -> None:
    lonely = ScaleKernel("lonely")  # not registered: XLA only
    with pytest.raises(ValueError, match=r"unknown platform 'triton'"):
        executor(lonely, jnp.ones(3), platform="triton")
    with pytest.raises(ValueError, match=r"lonely has no 'cuda' platform \(it has: xla\)"):
        executor(lonely, jnp.ones(3), platform="cuda")
    monkeypatch.setattr(_native, "available", lambda: False)
    registry.kernel_registry.register("lonely", Platform.CPU, Backend.CPU, func=lambda: None)
    with pytest.raises(ValueError, match=r"platform 'cpu' is unavailable for lonely: native library not loaded"):
        executor(lonely, jnp.ones(3), platform="cpu")


def test_no_platform_left_is_an_error(native_loaded: None, fresh_registry: KernelRegistry, executor: Executor) -> None:
    class CpuOnly(ScaleKernel):
        def platforms(self) -> list[Platform]:
            return [Platform.CPU]

    kernel = CpuOnly("cpu_only")
    with pytest.raises(ValueError, match=r"no platform of cpu_only can run on device cpu: cpu \(unsupported: fancy\)"):
        executor(kernel, jnp.ones(3), fancy=True)


def test_unregistered_kernel_runs_on_xla(executor: Executor) -> None:
    kernel = ScaleKernel("unregistered")
    assert kernel.platforms() == [Platform.XLA]
    np.testing.assert_allclose(executor(kernel, jnp.ones(2)), 2.0)


def test_xla_is_the_last_resort_of_registered_kernels(
    native_loaded: None, fresh_registry: KernelRegistry, executor: Executor
) -> None:
    fresh_registry.register("native_only", Platform.CPU, Backend.CPU, func=lambda: None)
    kernel = ScaleKernel("native_only")
    assert kernel.platforms() == [Platform.CPU, Platform.XLA]
    np.testing.assert_allclose(executor(kernel, jnp.ones(2), fancy=True), 2.0)


def test_run_without_platform_method_or_run_fails_clearly(executor: Executor) -> None:
    class Bare(Kernel[None, jax.Array]):
        def heuristic_cfg(self, inv: Invocation) -> None:
            return None

    with pytest.raises(NotImplementedError, match="bare defines neither run_xla nor run"):
        executor(Bare("bare"), jnp.ones(2))


def test_run_xla_preferred_over_run(executor: Executor) -> None:
    class WithXla(ScaleKernel):
        def run_xla(self, x: jax.Array, *, cfg: ScaleConfig, **kwargs: Any) -> jax.Array:
            self.calls.append("run_xla")
            return -x

    kernel = WithXla("with_xla")
    np.testing.assert_allclose(executor(kernel, jnp.ones(2)), -1.0)
    assert kernel.calls == ["run_xla"]


def test_traced_arguments_take_the_default_device(
    monkeypatch: pytest.MonkeyPatch, native_loaded: None, scale: ScaleKernel, executor: Executor
) -> None:
    """Under jit the arguments have no device yet: the choice follows jax.default_device (set to
    the CPU for these tests), not JAX's default backend, which is a GPU's on a GPU machine."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    seen: list[str] = []

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        seen.append(choose_platform(Invocation(scale, (x,), {}))[0].platform.value)
        return executor(scale, x)

    np.testing.assert_allclose(f(jnp.ones(2)), 102.0)
    assert seen == ["cpu"] and scale.calls == ["run_cpu"]
    with jax.default_device("cpu"):  # a platform name works too
        assert choose_platform(Invocation(scale, (jax.ShapeDtypeStruct((2,), jnp.float32),), {}))[0].platform is Platform.CPU


def test_jit_compatible(native_loaded: None, scale: ScaleKernel, executor: Executor) -> None:
    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        return executor(scale, x, offset=None) * 3

    np.testing.assert_allclose(f(jnp.ones(4)), 306.0)
    np.testing.assert_allclose(f(2 * jnp.ones(4)), 312.0)
    assert scale.calls == ["run_cpu"]  # traced once
    np.testing.assert_allclose(jax.jit(lambda x: executor(scale, x, platform="xla"))(jnp.ones(2)), 2.0)


def test_explicit_cfg_is_used(executor: Executor, scale: ScaleKernel) -> None:
    np.testing.assert_allclose(executor(scale, jnp.ones(2), cfg=ScaleConfig(5.0), platform="xla"), 5.0)


class CubeKernel(Kernel[ScaleConfig, jax.Array]):
    """y = factor * x**3 * w, with a deliberately recognisable custom gradient: the VJP
    returns the true gradient plus `bump` so the test can tell the hook was used."""

    bump = 1000.0

    def __init__(self) -> None:
        super().__init__("cube")

    def run(
        self,
        x: jax.Array,
        w: jax.Array,
        bias: None,
        power: int,
        *,
        cfg: ScaleConfig,
        platform: Platform,
        mask: jax.Array | None = None,
        **kw: Any,
    ) -> jax.Array:
        y = cfg.factor * x**power * w
        return y if mask is None else jnp.where(mask, y, 0.0)

    def fwd_with_residuals(self, x, w, bias, power, *, cfg, platform, mask=None, **kw):
        assert isinstance(power, int) and bias is None  # static values arrive untouched
        return self.run(x, w, bias, power, cfg=cfg, platform=platform, mask=mask), (x, w)

    def vjp(self, residuals, cotangent, *, cfg, platform, mask=None, **kw):
        x, w = residuals
        ct = cotangent if mask is None else jnp.where(mask, cotangent, 0.0)
        dx = cfg.factor * 3 * x**2 * w * ct + self.bump
        dw = cfg.factor * x**3 * ct
        return dx, dw, None, None

    def heuristic_cfg(self, inv: Invocation) -> ScaleConfig:
        return ScaleConfig(factor=2.0)


def test_custom_vjp_hooks_give_the_gradient(executor: Executor) -> None:
    kernel = CubeKernel()
    x, w = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    mask = jnp.array([True, False])

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        return executor(kernel, x, w, None, 3, mask=mask, label="static").sum()

    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dx, 2 * 3 * x**2 * w * mask + kernel.bump)
    np.testing.assert_allclose(dw, 2 * x**3 * mask)
    jdx, jdw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(jdx, dx)
    np.testing.assert_allclose(jdw, dw)
    np.testing.assert_allclose(loss(x, w), 2 * 1 * 3)


def test_vjp_with_wrong_arity_is_reported(executor: Executor) -> None:
    class Short(CubeKernel):
        def vjp(self, residuals, cotangent, **kw):
            return (cotangent,)

    with pytest.raises(ValueError, match="returned 1 gradients for 4 positional arguments"):
        jax.grad(lambda x: executor(Short(), x, x, None, 2).sum())(jnp.ones(2))


def test_vmap_with_config_selects_once(executor: Executor, scale: ScaleKernel) -> None:
    seen: list[tuple[int, ...]] = []

    class Recording(ScaleKernel):
        def run(self, x: jax.Array, y: jax.Array, *, cfg: ScaleConfig, platform: Platform) -> jax.Array:
            return x * y * cfg.factor

        def heuristic_cfg(self, inv: Invocation) -> ScaleConfig:
            seen.append(inv.args[0].shape)
            return ScaleConfig(factor=3.0)

    batched = vmap_with_config(Recording("recording"), in_axes=(0, None), executor=executor)
    out = batched(jnp.ones((5, 4)), jnp.float32(1.0))
    np.testing.assert_allclose(out, 3.0)
    assert out.shape == (5, 4)
    assert seen == [(4,)]
    np.testing.assert_allclose(batched(jnp.ones((5, 4)), jnp.float32(1.0), cfg=ScaleConfig(7.0)), 7.0)
    jitted = jax.jit(lambda x: batched(x, jnp.float32(1.0)))
    np.testing.assert_allclose(jitted(jnp.ones((2, 4))), 3.0)
    assert seen == [(4,)]  # same per-example signature: answered from memory
