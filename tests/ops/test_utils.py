"""JSON round trips of configs, canonical keys, device helpers."""

from __future__ import annotations

import dataclasses
import enum
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import _native
from ejkernel.ops import (
    BwdParams,
    FwdParams,
    Platform,
    device_fingerprint,
    device_kind,
    from_json,
    get_device_platform,
    stable_json,
    to_json,
)


class Layout(enum.Enum):
    ROW = "row"
    COL = "col"


@dataclasses.dataclass(frozen=True)
class NestedConfig:
    fwd: FwdParams
    bwd: BwdParams | None = None
    tiles: tuple[int, ...] = (1, 2)
    layout: Layout = Layout.ROW
    note: str = ""


def test_round_trip_nested_config() -> None:
    cfg = NestedConfig(
        fwd=FwdParams(q_blocksize=64, num_warps=4),
        bwd=BwdParams(kv_blocksize=32),
        tiles=(8, 16),
        layout=Layout.COL,
        note="x",
    )
    text = to_json(cfg)
    assert json.loads(text)["fwd"] == {"q_blocksize": 64, "kv_blocksize": None, "num_warps": 4, "num_stages": None}
    restored = from_json(text, NestedConfig)
    assert restored == cfg and isinstance(restored.tiles, tuple) and restored.layout is Layout.COL
    assert from_json(json.loads(text), NestedConfig) == cfg
    assert from_json(to_json(NestedConfig(fwd=FwdParams())), NestedConfig).bwd is None


def test_from_json_rejects_unknown_fields() -> None:
    with pytest.raises(TypeError, match="no field"):
        from_json('{"q_blocksize": 1, "block_z": 2}', FwdParams)


def test_from_json_without_type_returns_data() -> None:
    assert from_json('{"a": [1, 2]}') == {"a": [1, 2]}


def test_to_json_refuses_values_that_cannot_round_trip() -> None:
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        to_json({"fn": object()})


def test_stable_json_is_canonical() -> None:
    assert stable_json({"b": 1, "a": (1, 2)}) == stable_json({"a": [1, 2], "b": 1}) == '{"a":[1,2],"b":1}'
    assert stable_json({"dtype": jnp.float32, "np": np.dtype("int8"), "p": Platform.CUDA}) == (
        '{"dtype":"float32","np":"int8","p":"cuda"}'
    )
    assert stable_json(np.float32(0.5)) == "0.5"


def test_params_are_frozen_with_optional_fields() -> None:
    params = FwdParams()
    assert dataclasses.astuple(params) == (None, None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.q_blocksize = 3  # type: ignore[misc]


def test_device_helpers_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_kind() == "cpu"
    assert device_kind(jax.devices("cpu")[0]) == "cpu"
    monkeypatch.setattr(_native, "available", lambda: False)
    assert get_device_platform() is Platform.XLA
    monkeypatch.setattr(_native, "available", lambda: True)
    monkeypatch.setattr(_native, "registry_entries", lambda: [{"op": "x", "platform": "cpu", "backend": "cpu"}])
    assert get_device_platform() is Platform.CPU


def test_device_fingerprint_prefers_native(monkeypatch: pytest.MonkeyPatch) -> None:
    xla = device_fingerprint()
    assert xla["platform"] == "xla" and xla["key"] == f"xla/cpu/{jax.devices('cpu')[0].device_kind}"
    native = {"platform": "cpu", "key": "cpu:avx2:8c", "fields": {}}
    monkeypatch.setattr(_native, "device_fingerprint", lambda platform, device=0: native if platform == "cpu" else None)
    assert device_fingerprint(Platform.CPU) == native
    assert device_fingerprint("cuda")["key"].startswith("cuda/")  # no native answer: JAX's view
