"""KernelRegistry: priority order, platform/backend filters, native availability, errors."""

from __future__ import annotations

import pytest

from ejkernel import _native
from ejkernel.registry import Backend, KernelRegistry, Platform, unavailable_reason


@pytest.fixture
def native_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "available", lambda: True)
    monkeypatch.delenv("EJKERNEL_DISABLE_NATIVE", raising=False)


@pytest.fixture
def registry() -> KernelRegistry:
    reg = KernelRegistry()
    reg.register("attn", Platform.XLA, Backend.ANY, priority=0, func=lambda: "xla")
    reg.register("attn", Platform.CPU, Backend.CPU, priority=50, func=lambda: "cpu")
    reg.register("attn", Platform.CUDA, Backend.GPU, priority=100, func=lambda: "cuda")
    return reg


def test_decorator_returns_the_function_and_registers_it() -> None:
    reg = KernelRegistry()

    @reg.register("op", Platform.XLA, Backend.ANY)
    def impl() -> str:
        return "impl"

    assert impl() == "impl"
    assert reg.get("op") is impl
    assert reg.algorithms() == ["op"]


def test_highest_priority_available_wins(registry: KernelRegistry, native_loaded: None) -> None:
    assert registry.get("attn")() == "cuda"
    assert registry.get("attn", backend=Backend.CPU)() == "cpu"
    assert registry.get("attn", backend="gpu")() == "cuda"
    assert registry.get("attn", backend=Backend.TPU)() == "xla"  # only the ANY entry matches TPU


def test_platform_filter(registry: KernelRegistry, native_loaded: None) -> None:
    assert registry.get("attn", platform=Platform.XLA)() == "xla"
    assert registry.get("attn", platform="cpu", backend=Backend.CPU)() == "cpu"
    with pytest.raises(ValueError, match="platform=cuda, backend=cpu"):
        registry.get("attn", platform=Platform.CUDA, backend=Backend.CPU)


def test_natives_skipped_without_library(registry: KernelRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "available", lambda: False)
    assert registry.get("attn")() == "xla"
    assert registry.platforms_for("attn") == [Platform.XLA]
    assert registry.platforms_for("attn", available_only=False) == [Platform.CUDA, Platform.CPU, Platform.XLA]
    with pytest.raises(ValueError, match=r"cpu/cpu priority 50 \(native library not loaded\)"):
        registry.get("attn", platform=Platform.CPU)


@pytest.mark.parametrize("setting", ["all", "attn", "other, attn"])
def test_disable_switch(
    registry: KernelRegistry, native_loaded: None, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.setenv("EJKERNEL_DISABLE_NATIVE", setting)
    assert registry.get("attn")() == "xla"
    assert unavailable_reason("attn", Platform.CUDA) == "disabled by EJKERNEL_DISABLE_NATIVE"
    assert unavailable_reason("attn", Platform.XLA) is None


def test_disable_switch_names_other_ops_only(
    registry: KernelRegistry, native_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EJKERNEL_DISABLE_NATIVE", "page_attention")
    assert registry.get("attn")() == "cuda"


def test_unknown_algorithm_lists_registered(registry: KernelRegistry) -> None:
    with pytest.raises(ValueError, match=r"'nope'.*registered: attn"):
        registry.get("nope")


def test_implementations_and_platforms_for_are_priority_ordered(registry: KernelRegistry, native_loaded: None) -> None:
    entries = registry.implementations("attn")
    assert [e.priority for e in entries] == [100, 50, 0]
    assert [e.platform for e in entries] == [Platform.CUDA, Platform.CPU, Platform.XLA]
    assert all(e.algorithm == "attn" and e.available() for e in entries)
    assert registry.platforms_for("attn", Backend.GPU) == [Platform.CUDA, Platform.XLA]
    assert registry.platforms_for("attn", Backend.CPU) == [Platform.CPU, Platform.XLA]
    assert registry.implementations("missing") == []


def test_reregistering_replaces(registry: KernelRegistry) -> None:
    registry.register("attn", Platform.XLA, Backend.ANY, priority=500, func=lambda: "new xla")
    assert len(registry.implementations("attn")) == 3
    assert registry.get("attn")() == "new xla"


def test_equal_priority_keeps_registration_order() -> None:
    reg = KernelRegistry()
    reg.register("op", Platform.XLA, Backend.GPU, func=lambda: "first")
    reg.register("op", Platform.XLA, Backend.ANY, func=lambda: "second")
    assert reg.get("op")() == "first"


def test_platform_serves() -> None:
    assert Platform.XLA.serves(Backend.TPU)
    assert Platform.CUDA.serves("gpu") and not Platform.CUDA.serves(Backend.CPU)
    assert Platform.CPU.serves(Backend.CPU) and not Platform.CPU.serves(Backend.TPU)
    assert Platform.CPU.native and not Platform.XLA.native
