"""Config selection: each tier in order, overlays, policies, and the persistent cache through
a fake libejkernel (the real cache lives in C++ and is tested there)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import _native
from ejkernel.ops import (
    AutotunePolicy,
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    FwdParams,
    Invocation,
    Kernel,
    NoConfigError,
    PersistentCache,
    Platform,
    overlay_cache,
    policy_override,
)
from ejkernel.ops.tuning import Autotuner


@dataclasses.dataclass(frozen=True)
class TileConfig:
    tile: int
    fwd: FwdParams = FwdParams()


class TileKernel(Kernel[TileConfig, jax.Array]):
    """Returns x * tile, so the output shows which config ran."""

    def __init__(self, candidates: tuple[int, ...] = (8, 16)) -> None:
        super().__init__("tile")
        self.candidates = candidates
        self.heuristic_calls = 0

    def run(self, x: jax.Array, *, cfg: TileConfig, platform: Platform, **kwargs: Any) -> jax.Array:
        return x * cfg.tile

    def heuristic_cfg(self, inv: Invocation) -> TileConfig:
        self.heuristic_calls += 1
        return TileConfig(tile=1)

    def candidate_cfgs(self, inv: Invocation) -> list[TileConfig]:
        return [TileConfig(tile=t, fwd=FwdParams(q_blocksize=t)) for t in self.candidates]


class FakeNativeCache:
    """Stands in for libejkernel's cache: stores JSON exactly as the C API would receive it."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.stores: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], str | None]] = []
        self.lookups = 0

    def lookup(self, key: dict[str, Any], cache_dir: str | None = None) -> dict[str, Any] | None:
        self.lookups += 1
        return self.entries.get(json.dumps(key, sort_keys=True))

    def store(
        self, key: dict[str, Any], config: dict[str, Any], timings_ms: dict[str, Any], cache_dir: str | None = None
    ) -> None:
        json.dumps([key, config, timings_ms])  # what crosses the C API must be plain JSON
        self.stores.append((key, config, timings_ms, cache_dir))
        self.entries[json.dumps(key, sort_keys=True)] = config


@pytest.fixture(autouse=True)
def no_env_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EJKERNEL_AUTOTUNE", raising=False)


@pytest.fixture
def fake_native(monkeypatch: pytest.MonkeyPatch) -> FakeNativeCache:
    fake = FakeNativeCache()
    monkeypatch.setattr(_native, "available", lambda: True)
    monkeypatch.setattr(_native, "cache_lookup", fake.lookup)
    monkeypatch.setattr(_native, "cache_store", fake.store)
    monkeypatch.setattr(_native, "device_fingerprint", lambda platform, device=0: None)
    return fake


def invocation(kernel: Kernel, x: Any = None, **kwargs: Any) -> Invocation:
    return Invocation(kernel, (jnp.ones((2, 8)) if x is None else x,), kwargs, Platform.XLA)


def fast_tuner() -> Autotuner:
    return Autotuner(num_warmup=0, num_iters=1)


def test_tiers_in_order(fake_native: FakeNativeCache) -> None:
    kernel = TileKernel()
    selector = ConfigSelectorChain(persistent=PersistentCache("/tmp/ejk"), autotune=True, autotuner=fast_tuner())
    inv = invocation(kernel)

    cfg, source = selector.select(inv)
    assert source == "autotune" and cfg.tile in (8, 16)
    assert selector.select(inv) == (cfg, "memory")

    # A fresh process: memory empty, the persistent cache answers and refills memory.
    fresh = ConfigSelectorChain(persistent=PersistentCache("/tmp/ejk"), autotune=True, autotuner=fast_tuner())
    assert fresh.select(inv) == (cfg, "persistent")
    assert fresh.select(inv) == (cfg, "memory")

    with overlay_cache({inv.key_string(): TileConfig(tile=3)}):
        assert fresh.select(inv) == (TileConfig(tile=3), "overlay")
        explicit = dataclasses.replace(inv, cfg=TileConfig(tile=4))
        assert fresh.select(explicit) == (TileConfig(tile=4), "explicit")

    # Nothing cached and tuning off: the heuristic.
    never = ConfigSelectorChain(persistent=False, autotune=False)
    assert never.select(invocation(kernel, jnp.ones(3))) == (TileConfig(tile=1), "heuristic")


def test_autotune_winner_is_stored_with_timings(fake_native: FakeNativeCache) -> None:
    kernel = TileKernel()
    selector = ConfigSelectorChain(persistent=PersistentCache("~/cfgs"), autotune=True, autotuner=fast_tuner())
    inv = invocation(kernel, causal=True)
    cfg, _ = selector.select(inv)
    ((key, stored, timings, cache_dir),) = fake_native.stores
    assert key == inv.cache_key()
    assert set(key) == {"op", "op_version", "signature", "options", "device"}
    assert key["op"] == "tile" and key["op_version"] == 1
    assert json.loads(key["options"]) == {"platform": "xla", "kwargs": {"causal": True}}
    assert json.loads(key["signature"]) == {"args": ["float32[2,8]"], "kwargs": {}}
    assert stored == {
        "tile": cfg.tile,
        "fwd": {"q_blocksize": cfg.tile, "kv_blocksize": None, "num_warps": None, "num_stages": None},
    }
    assert len(timings) == 2 and all(t >= 0 for t in timings.values())
    assert not cache_dir.startswith("~")
    # Persistent hits come back as the kernel's own dataclasses.
    again = ConfigSelectorChain(persistent=PersistentCache("~/cfgs"), autotune=False).select(inv)
    assert again == (cfg, "persistent") and isinstance(again[0].fwd, FwdParams)


def test_heuristic_goes_to_memory_only(fake_native: FakeNativeCache) -> None:
    kernel = TileKernel()
    cache = ConfigCache()
    selector = ConfigSelectorChain(cache=cache, persistent=PersistentCache(), autotune=False)
    inv = invocation(kernel)
    assert selector.select(inv)[1] == "heuristic"
    assert inv.key_string() in cache
    assert fake_native.stores == []
    lookups = fake_native.lookups
    assert selector.select(inv)[1] == "memory"
    assert fake_native.lookups == lookups


def test_heuristic_memory_entry_does_not_block_tuning(fake_native: FakeNativeCache) -> None:
    kernel = TileKernel()
    selector = ConfigSelectorChain(persistent=False, autotune=False, autotuner=fast_tuner())
    inv = invocation(kernel)
    assert selector.select(inv)[1] == "heuristic"
    with policy_override(autotune=True):
        assert selector.select(inv)[1] == "autotune"
    assert selector.select(inv)[1] == "memory"


def test_entries_put_by_others_are_trusted() -> None:
    kernel = TileKernel()
    inv = invocation(kernel)
    cache = ConfigCache({inv.key_string(): TileConfig(tile=5)})
    selector = ConfigSelectorChain(cache=cache, persistent=False, autotune=True)
    assert selector.select(inv) == (TileConfig(tile=5), "memory")


def test_always_retunes_once_per_selector(fake_native: FakeNativeCache) -> None:
    kernel = TileKernel()
    inv = invocation(kernel)
    first = ConfigSelectorChain(persistent=PersistentCache(), autotune=True, autotuner=fast_tuner())
    first.select(inv)
    second = ConfigSelectorChain(persistent=PersistentCache(), autotune="always", autotuner=fast_tuner())
    assert second.select(inv)[1] == "autotune"  # the disk entry is not trusted under ALWAYS
    assert second.select(inv)[1] == "memory"
    assert len(fake_native.stores) == 2


def test_overlay_nesting_innermost_wins() -> None:
    kernel = TileKernel()
    selector = ConfigSelectorChain(persistent=False, autotune=False)
    inv = invocation(kernel)
    outer = ConfigCache()
    outer.put(inv.key_string(), TileConfig(tile=10))
    with overlay_cache(outer):
        with overlay_cache({"tile": TileConfig(tile=20)}):  # by kernel name
            assert selector.select(inv) == (TileConfig(tile=20), "overlay")
            with overlay_cache({"other_kernel": TileConfig(tile=30)}):
                assert selector.select(inv) == (TileConfig(tile=20), "overlay")  # falls through to outer ones
        assert selector.select(inv) == (TileConfig(tile=10), "overlay")
    assert selector.select(inv)[1] == "heuristic"


def test_overlay_applies_through_executor() -> None:
    executor = Executor(ConfigSelectorChain(persistent=False, autotune=False))
    with overlay_cache({"tile": TileConfig(tile=7)}):
        np.testing.assert_allclose(executor(TileKernel(), jnp.ones(2)), 7.0)
    np.testing.assert_allclose(executor(TileKernel(), jnp.ones(2)), 1.0)


def test_policy_override_nests_and_beats_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    selector = ConfigSelectorChain(persistent=False, autotune=False)
    assert selector.policy() is AutotunePolicy.NEVER
    with policy_override(autotune=True):
        assert selector.policy() is AutotunePolicy.IF_MISSING
        with policy_override(autotune=AutotunePolicy.ALWAYS):
            assert selector.policy() is AutotunePolicy.ALWAYS
        assert selector.policy() is AutotunePolicy.IF_MISSING
    assert selector.policy() is AutotunePolicy.NEVER
    monkeypatch.setenv("EJKERNEL_AUTOTUNE", "always")
    assert ConfigSelectorChain(persistent=False).policy() is AutotunePolicy.ALWAYS
    assert selector.policy() is AutotunePolicy.NEVER  # the constructor argument beats the env


@pytest.mark.parametrize(
    ("value", "policy"),
    [
        (None, "never"),
        ("0", "never"),
        ("never", "never"),
        ("1", "if_missing"),
        ("missing", "if_missing"),
        ("always", "always"),
        ("ALWAYS", "always"),
        ("bogus", "never"),
    ],
)
def test_policy_from_env(monkeypatch: pytest.MonkeyPatch, value: str | None, policy: str) -> None:
    if value is not None:
        monkeypatch.setenv("EJKERNEL_AUTOTUNE", value)
    assert AutotunePolicy.from_env() is AutotunePolicy(policy)


def test_failed_autotune_falls_back_to_heuristic(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(TileKernel):
        def run(self, x, *, cfg, platform, **kwargs):
            if cfg.tile != 1:
                raise ValueError("tile too big")
            return x

    selector = ConfigSelectorChain(persistent=False, autotune=True, autotuner=fast_tuner())
    with caplog.at_level(logging.WARNING, logger="ejkernel"):
        assert selector.select(invocation(Broken())) == (TileConfig(tile=1), "heuristic")
    assert "every candidate config failed" in caplog.text


def test_no_config_is_an_error() -> None:
    class NoHeuristic(Kernel[TileConfig, jax.Array]):
        def candidate_cfgs(self, inv: Invocation) -> list[TileConfig]:
            return [TileConfig(tile=2)]

    selector = ConfigSelectorChain(persistent=False, autotune=False)
    with pytest.raises(NoConfigError, match="no config for bare on platform 'xla'.*enable autotuning"):
        selector.select(invocation(NoHeuristic("bare")))


def test_persistent_cache_without_library_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_native, "available", lambda: False)
    cache = PersistentCache()
    inv = invocation(TileKernel())
    with caplog.at_level(logging.WARNING, logger="ejkernel"):
        assert cache.get(inv.cache_key(), TileConfig) is None
        cache.put(inv.cache_key(), TileConfig(tile=2), {"x": 1.0})
        assert cache.get(inv.cache_key(), TileConfig) is None
    assert [r.getMessage() for r in caplog.records].count(
        "persistent config cache disabled: the ejkernel native library is not loaded"
    ) == 1


def test_stale_persistent_entry_is_a_miss(fake_native: FakeNativeCache, caplog: pytest.LogCaptureFixture) -> None:
    inv = invocation(TileKernel())
    fake_native.entries[json.dumps(inv.cache_key(), sort_keys=True)] = {"tile": 4, "removed_field": 1}
    selector = ConfigSelectorChain(persistent=PersistentCache(), autotune=False)
    with caplog.at_level(logging.WARNING, logger="ejkernel"):
        assert selector.select(inv) == (TileConfig(tile=1), "heuristic")
    assert "removed_field" in caplog.text


def test_cache_key_tracks_shapes_options_and_platform() -> None:
    kernel = TileKernel()
    base = invocation(kernel, causal=True, mask=jnp.ones((2, 8), bool))
    assert json.loads(base.signature()) == {"args": ["float32[2,8]"], "kwargs": {"mask": "bool[2,8]"}}
    assert base.options() == '{"causal":true}'
    assert base.key_string() == invocation(kernel, causal=True, mask=jnp.zeros((2, 8), bool)).key_string()
    assert (
        base.key_string() != invocation(kernel, jnp.ones((2, 9)), causal=True, mask=jnp.ones((2, 8), bool)).key_string()
    )
    assert base.key_string() != invocation(kernel, causal=False, mask=jnp.ones((2, 8), bool)).key_string()
    assert base.key_string() != base.with_platform(Platform.CPU).key_string()
    with_none = Invocation(kernel, (jnp.ones(2), None, 3), {}, Platform.XLA)
    assert json.loads(with_none.signature())["args"] == ["float32[2]", None, 3]


def test_config_cache_holds_none_configs() -> None:
    cache = ConfigCache()
    cache.put("k", None)
    assert "k" in cache and len(cache) == 1 and cache.get("k", "default") is None
    cache.clear()
    assert "k" not in cache and cache.get("k", "default") == "default"
