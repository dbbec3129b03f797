"""Device identification and JSON (de)serialisation of configs and cache keys.

Config caches must give the same key for the same call in every process, and the on-disk
cache is shared with the C++ side, so keys are canonical JSON and configs are plain JSON
objects that map field by field onto the kernel's config dataclass.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from enum import Enum
from typing import Any, TypeVar

import jax
import numpy as np

from .. import _native
from ..registry import Backend, Platform

T = TypeVar("T")

_GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def backend_of(device_platform: str) -> Backend:
    """Maps a JAX device platform name ("cpu", "gpu", "cuda", "tpu", ...) to a Backend."""
    name = device_platform.lower()
    if name in _GPU_PLATFORMS:
        return Backend.GPU
    if name == "tpu":
        return Backend.TPU
    if name == "cpu":
        return Backend.CPU
    raise ValueError(f"unsupported JAX device platform '{device_platform}'")


def default_device(backend: str | None = None) -> jax.Device | None:
    """The device JAX places uncommitted computations on: `jax.default_device`'s when set
    (and of `backend`, if one is named), else the first device of `backend` (None: JAX's
    default backend); None if there is no such device."""
    configured = jax.config.jax_default_device
    try:
        if isinstance(configured, str):  # jax.default_device also takes a platform name
            configured = jax.devices(configured)[0]
        if configured is not None and (backend is None or backend_of(configured.platform) is backend_of(backend)):
            return configured
        return jax.devices(backend)[0]
    except RuntimeError:
        return None


def default_platform() -> str:
    """The JAX platform name ("cpu", "gpu", ...) of the default device (`default_device`)."""
    device = default_device()
    return device.platform if device is not None else jax.default_backend()


def device_kind(device: jax.Device | None = None) -> str:
    """ "gpu", "tpu" or "cpu": the kind of `device`, or of the default device (`default_device`)."""
    return backend_of(device.platform if device is not None else default_platform()).value


def get_device_platform(device: jax.Device | None = None) -> Platform:
    """The platform that natively serves `device` (default: JAX's default device), else XLA."""
    backend = Backend(device_kind(device))
    for platform in (Platform.CUDA, Platform.CPU):
        if not platform.serves(backend) or not _native.available():
            continue
        if any(entry["platform"] == platform.value for entry in _native.registry_entries()):
            return platform
    return Platform.XLA


def platform_device(platform: Platform) -> jax.Device | None:
    """The device a call on `platform` runs on when no argument says: the default device, of
    the platform's backend for native platforms."""
    return default_device({Platform.CUDA: "gpu", Platform.CPU: "cpu"}.get(platform))


def device_fingerprint(platform: Platform | str | None = None, device: jax.Device | None = None) -> dict[str, Any]:
    """{"platform", "key", "fields"} identifying the hardware that tuned configs are valid for.

    Native platforms use libejkernel's fingerprint (the one C++ caches use); XLA, or a
    process without the library, falls back to JAX's view of the device.
    """
    platform = Platform.XLA if platform is None else Platform(platform)
    device = device if device is not None else platform_device(platform)
    if platform.native:
        index = getattr(device, "local_hardware_id", None) if device is not None else None
        native = _native.device_fingerprint(platform.value, index if isinstance(index, int) else 0)
        if native is not None:
            return native
    backend = device.platform if device is not None else "none"
    kind = device.device_kind if device is not None else "none"
    return {
        "platform": platform.value,
        "key": f"{platform.value}/{backend}/{kind}",
        "fields": {"backend": backend, "device_kind": kind, "jax": jax.__version__},
    }


def to_jsonable(obj: Any, *, strict: bool = True) -> Any:
    """Plain JSON data for configs, keys and options.

    strict: unknown types raise TypeError (configs must round-trip); otherwise they become
    their repr, which is good enough for identifying static options in a key.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Enum):
        return to_jsonable(obj.value, strict=strict)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name), strict=strict) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, strict=strict) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, strict=strict) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if strict:
        raise TypeError(f"{type(obj).__qualname__} is not JSON-serialisable as a config value")
    if isinstance(obj, np.dtype):
        return obj.name
    if isinstance(obj, type):
        if issubclass(obj, np.generic):
            return np.dtype(obj).name
        scalar_dtype = getattr(obj, "dtype", None)  # jnp.float32 and friends
        return scalar_dtype.name if isinstance(scalar_dtype, np.dtype) else obj.__qualname__
    return repr(obj)


def stable_json(obj: Any) -> str:
    """Canonical JSON (sorted keys, no whitespace) so equal values give equal cache keys."""
    return json.dumps(to_jsonable(obj, strict=False), sort_keys=True, separators=(",", ":"))


def to_json(cfg: Any) -> str:
    """A config as JSON; dataclasses become objects keyed by field name."""
    return json.dumps(to_jsonable(cfg), sort_keys=True)


def from_json(data: str | bytes | Any, cls: type[T] | None = None) -> T | Any:
    """Rebuilds a config of type `cls` from JSON text or already-parsed JSON data.

    Nested dataclasses, tuples, enums and optionals are restored from `cls`'s annotations;
    unknown or missing fields raise TypeError, so a stale cache entry is never half-applied.
    """
    parsed = json.loads(data) if isinstance(data, (str, bytes)) else data
    return parsed if cls is None else _restore(parsed, cls)


def _restore(data: Any, tp: Any) -> Any:
    if tp is Any or data is None:
        return data
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return _restore(data, options[0]) if len(options) == 1 else data
    if origin is tuple:
        items = typing.get_args(tp)
        if len(items) == 2 and items[1] is Ellipsis:
            return tuple(_restore(v, items[0]) for v in data)
        return tuple(_restore(v, t) for v, t in zip(data, items, strict=True)) if items else tuple(data)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return [_restore(v, item) for v in data]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object for {tp.__qualname__}, got {type(data).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise TypeError(f"{tp.__qualname__} has no field(s) {', '.join(unknown)}")
        return tp(**{name: _restore(value, hints.get(name, Any)) for name, value in data.items()})
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(data)
    if tp is tuple:
        return tuple(data)
    return data


__all__ = [
    "backend_of",
    "device_fingerprint",
    "device_kind",
    "from_json",
    "get_device_platform",
    "stable_json",
    "to_json",
    "to_jsonable",
]
