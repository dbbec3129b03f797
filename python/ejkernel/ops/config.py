"""Where configs live between calls: parameter containers, the in-memory cache, scoped
overlays and the persistent on-disk cache (libejkernel's, shared with C++)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from .. import _native
from .utils import from_json, to_jsonable

Cfg = TypeVar("Cfg")

logger = logging.getLogger("ejkernel")


@dataclasses.dataclass(frozen=True)
class FwdParams:
    """Forward-pass tiling for attention-style kernels; None leaves a choice to the kernel."""

    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class BwdParams:
    """Backward-pass tiling for attention-style kernels; None leaves a choice to the kernel."""

    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


class ConfigCache:
    """Thread-safe in-memory configs keyed by an invocation's key string.

    A stored None is a real entry (kernels without tunables use None as their config), so
    membership is tested with `in`, not by comparing `get` with None.
    """

    def __init__(self, entries: Mapping[str, Any] | None = None) -> None:
        self._entries: dict[str, Any] = dict(entries or {})
        self._lock = threading.Lock()

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            return self._entries.get(key, default)

    def put(self, key: str, cfg: Any) -> None:
        with self._lock:
            self._entries[key] = cfg

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_overlays: contextvars.ContextVar[tuple[ConfigCache | Mapping[str, Any], ...]] = contextvars.ContextVar(
    "ejkernel_config_overlays", default=()
)


@contextlib.contextmanager
def overlay_cache(configs: ConfigCache | Mapping[str, Any]) -> Iterator[None]:
    """Within the block, configs from `configs` win over every cache and over autotuning.

    Keys are an invocation's key string (one exact call signature) or a kernel name (every
    call of that kernel). Overlays nest; the innermost one that has the key wins. The
    overlay is context-local, so threads and async tasks do not see each other's.
    """
    token = _overlays.set((*_overlays.get(), configs))
    try:
        yield
    finally:
        _overlays.reset(token)


def lookup_overlay(key: str, kernel_name: str) -> tuple[bool, Any]:
    """(found, config) from the active overlays; found tells a stored None from a miss."""
    for overlay in reversed(_overlays.get()):
        for candidate in (key, kernel_name):
            if candidate in overlay:
                return True, overlay.get(candidate)
    return False, None


class PersistentCache:
    """Tuned configs on disk, through libejkernel's cache so C++ and Python share entries.

    `path` is the cache directory (default: EJKERNEL_CACHE_DIR or ~/.cache/ejkernel, as
    resolved by the library). Without the library this is a no-op that warns once. A
    broken or stale entry is reported and treated as a miss: a cache must never make a
    kernel call fail.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path: str | None = os.path.expanduser(os.fspath(path)) if path is not None else None
        self._warned = False

    @property
    def directory(self) -> str:
        return self.path or _native.default_cache_dir()

    def _usable(self) -> bool:
        if _native.available():
            return True
        if not self._warned:
            self._warned = True
            logger.warning("persistent config cache disabled: the ejkernel native library is not loaded")
        return False

    def get(self, key: Mapping[str, Any], config_type: type[Cfg] | None = None) -> Cfg | Any | None:
        """The stored config for `key` (an Invocation.cache_key()), rebuilt as `config_type`."""
        if not self._usable():
            return None
        try:
            stored = _native.cache_lookup(dict(key), self.path)
            return None if stored is None else from_json(stored, config_type)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.warning("ignoring persistent config cache entry for %s: %s", key.get("op"), exc)
            return None

    def put(self, key: Mapping[str, Any], cfg: Any, timings_ms: Mapping[str, float] | None = None) -> None:
        """Stores `cfg` for `key` with the benchmark timings that chose it."""
        if not self._usable():
            return
        try:
            _native.cache_store(dict(key), to_jsonable(cfg), dict(timings_ms or {}), self.path)
        except (RuntimeError, TypeError) as exc:
            logger.warning("could not store config for %s in the persistent cache: %s", key.get("op"), exc)


__all__ = [
    "BwdParams",
    "ConfigCache",
    "FwdParams",
    "PersistentCache",
    "lookup_overlay",
    "overlay_cache",
]
