"""The bridge to libejkernel: loads it with ctypes and registers its XLA FFI handlers.

libejkernel is a plain shared library (no CPython extension), so one build serves every
Python. Everything native is described by the library itself: its registry lists each
implementation with the FFI targets it exports, and the persistent config cache on disk
is the C++ one, reached through the C API below.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

_LIB_NAME = "libejkernel.so"
_FFI_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}


def _library_path() -> Path | None:
    override = os.environ.get("EJKERNEL_LIBRARY")
    if override:
        return Path(override)
    candidate = Path(__file__).resolve().parent / "lib" / _LIB_NAME
    return candidate if candidate.exists() else None


def _load() -> tuple[ctypes.CDLL | None, str]:
    path = _library_path()
    if path is None:
        return None, f"{_LIB_NAME} is not installed next to the ejkernel package"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"{path} could not be loaded: {exc}"
    string_fns = (
        "ejk_build_info_json",
        "ejk_registry_list_json",
        "ejk_device_fingerprint_json",
        "ejk_default_cache_dir",
        "ejk_cache_lookup",
        "ejk_op_heuristic_config",
        "ejk_op_config_candidates",
        "ejk_op_unsupported_reason",
    )
    for name in string_fns:
        getattr(lib, name).restype = ctypes.c_void_p
    lib.ejk_version.restype = ctypes.c_char_p
    lib.ejk_last_error.restype = ctypes.c_char_p
    lib.ejk_free.argtypes = [ctypes.c_void_p]
    lib.ejk_device_fingerprint_json.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.ejk_cache_lookup.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.ejk_cache_store.argtypes = [ctypes.c_char_p] * 4
    lib.ejk_cache_store.restype = ctypes.c_int
    lib.ejk_op_heuristic_config.argtypes = [ctypes.c_char_p] * 3
    lib.ejk_op_config_candidates.argtypes = [ctypes.c_char_p] * 3
    lib.ejk_op_unsupported_reason.argtypes = [ctypes.c_char_p] * 3
    lib.ejk_op_workspace_bytes.argtypes = [ctypes.c_char_p] * 4
    lib.ejk_op_workspace_bytes.restype = ctypes.c_int64
    return lib, str(path)


_LIB, _LOAD_NOTE = _load()
if _LIB is None:
    warnings.warn(
        f"ejkernel: native kernels unavailable ({_LOAD_NOTE}); every operation runs on the "
        "XLA platform. Reinstall with `pip install .` from a source checkout to build them.",
        RuntimeWarning,
        stacklevel=2,
    )


def available() -> bool:
    """Whether libejkernel is loaded."""
    return _LIB is not None


def library_path() -> str | None:
    return _LOAD_NOTE if _LIB is not None else None


def load_error() -> str | None:
    return None if _LIB is not None else _LOAD_NOTE


def native_disabled(op: str) -> bool:
    """EJKERNEL_DISABLE_NATIVE="all" or a comma-separated list of ops turns natives off."""
    value = os.environ.get("EJKERNEL_DISABLE_NATIVE", "")
    names = {name.strip() for name in value.split(",") if name.strip()}
    return "all" in names or op in names


def _take_string(ptr: int | None) -> str | None:
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        _LIB.ejk_free(ptr)


def _error() -> str:
    return _LIB.ejk_last_error().decode() if _LIB is not None else (_LOAD_NOTE or "")


def _require() -> ctypes.CDLL:
    if _LIB is None:
        raise RuntimeError(f"ejkernel native library unavailable: {_LOAD_NOTE}")
    return _LIB


def version() -> str | None:
    return _LIB.ejk_version().decode() if _LIB is not None else None


@functools.cache
def build_info() -> dict[str, Any]:
    if _LIB is None:
        return {}
    return json.loads(_take_string(_LIB.ejk_build_info_json()) or "{}")


@functools.cache
def _registry_entries() -> tuple[dict[str, Any], ...]:
    if _LIB is None:
        return ()
    return tuple(json.loads(_take_string(_LIB.ejk_registry_list_json()) or "[]"))


def registry_entries() -> list[dict[str, Any]]:
    """The native implementations the library holds, as its C++ registry lists them."""
    return [dict(entry) for entry in _registry_entries()]


@functools.cache
def device_fingerprint(platform: str, device: int = 0) -> dict[str, Any] | None:
    if _LIB is None:
        return None
    text = _take_string(_LIB.ejk_device_fingerprint_json(platform.encode(), device))
    return json.loads(text) if text else None


def default_cache_dir() -> str:
    if _LIB is not None:
        text = _take_string(_LIB.ejk_default_cache_dir())
        if text:
            return text
    if os.environ.get("EJKERNEL_CACHE_DIR"):
        return os.environ["EJKERNEL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ejkernel")


def _dir_arg(cache_dir: str | None) -> bytes | None:
    return os.fspath(cache_dir).encode() if cache_dir else None


def cache_lookup(key: dict[str, Any], cache_dir: str | None = None) -> dict[str, Any] | None:
    lib = _require()
    text = _take_string(lib.ejk_cache_lookup(_dir_arg(cache_dir), json.dumps(key).encode()))
    if text is None:
        err = _error()
        if err:
            raise RuntimeError(f"ejkernel config cache lookup failed: {err}")
        return None
    return json.loads(text)


def cache_store(
    key: dict[str, Any],
    config: dict[str, Any],
    timings_ms: dict[str, Any],
    cache_dir: str | None = None,
) -> None:
    lib = _require()
    rc = lib.ejk_cache_store(
        _dir_arg(cache_dir),
        json.dumps(key).encode(),
        json.dumps(config).encode(),
        json.dumps(timings_ms).encode(),
    )
    if rc != 0:
        raise RuntimeError(f"ejkernel config cache store failed: {_error()}")


def heuristic_config(op: str, platform: str, signature: dict[str, Any]) -> dict[str, Any] | None:
    if _LIB is None:
        return None
    text = _take_string(
        _LIB.ejk_op_heuristic_config(op.encode(), platform.encode(), json.dumps(signature).encode())
    )
    return json.loads(text) if text else None


def config_candidates(op: str, platform: str, signature: dict[str, Any]) -> list[dict[str, Any]]:
    if _LIB is None:
        return []
    text = _take_string(
        _LIB.ejk_op_config_candidates(op.encode(), platform.encode(), json.dumps(signature).encode())
    )
    return json.loads(text) if text else []


def unsupported_reason(op: str, platform: str, signature: dict[str, Any]) -> str | None:
    """Why the best native `op` on `platform` cannot serve `signature` (dtype, head_dim, ...),
    or None when it can. The rule lives in the C++ registry entry."""
    if _LIB is None:
        return "libejkernel not loaded"
    text = _take_string(
        _LIB.ejk_op_unsupported_reason(op.encode(), platform.encode(), json.dumps(signature).encode())
    )
    if text is None:
        return _error()
    return text or None


@functools.lru_cache(maxsize=4096)
def _workspace_bytes(op: str, platform: str, pass_: str, signature_json: str) -> int:
    lib = _require()
    nbytes = lib.ejk_op_workspace_bytes(op.encode(), platform.encode(), pass_.encode(), signature_json.encode())
    if nbytes < 0:
        raise RuntimeError(f"ejkernel: workspace size of {op} on {platform} ({pass_}): {_error()}")
    return int(nbytes)


def workspace_bytes(op: str, platform: str, pass_: str, signature: dict[str, Any]) -> int:
    """Bytes of workspace the native `op` on `platform` takes as its last result in `pass_`
    ("forward" or "backward") for a call with this signature; the rule is the C++ registry
    entry's."""
    return _workspace_bytes(op, platform, pass_, json.dumps(signature, sort_keys=True))


_registered: set[tuple[str, str]] = set()
_register_lock = threading.Lock()


def ensure_ffi_targets(op: str, platform: str) -> None:
    """Registers with XLA the FFI targets of `op` on `platform`, once, on first use."""
    import jax

    with _register_lock:
        if (op, platform) in _registered:
            return
        lib = _require()
        for entry in _registry_entries():
            if entry["op"] != op or entry["platform"] != platform:
                continue
            for target in entry["ffi_targets"]:
                handler = getattr(lib, target["symbol"])
                jax.ffi.register_ffi_target(
                    target["target"],
                    jax.ffi.pycapsule(handler),
                    platform=_FFI_PLATFORMS[platform],
                )
        _registered.add((op, platform))
