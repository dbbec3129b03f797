"""The kernel registry: every implementation of every algorithm, by platform and backend.

A *platform* is how a kernel is implemented (native CUDA C++, native C++ CPU, or pure JAX);
a *backend* is the kind of device it runs on. Native platforms exist only when libejkernel
is loaded and not switched off with EJKERNEL_DISABLE_NATIVE, so lookups skip them otherwise
and the pure-JAX (XLA) implementations stay the universal fallback.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar, overload

from . import _native

F = TypeVar("F", bound=Callable[..., Any])


class Platform(str, Enum):
    """How an implementation is built."""

    CUDA = "cuda"
    """Native CUDA C++ from libejkernel (NVIDIA GPUs)."""
    CPU = "cpu"
    """Native C++ from libejkernel (host CPU)."""
    XLA = "xla"
    """Pure JAX, compiled by XLA for whatever device the arrays live on."""

    @property
    def native(self) -> bool:
        return self is not Platform.XLA

    def serves(self, backend: Backend | str) -> bool:
        """Whether this platform can run on `backend` (XLA runs everywhere)."""
        backend = Backend(backend)
        if self is Platform.XLA or backend is Backend.ANY:
            return True
        return backend is (Backend.GPU if self is Platform.CUDA else Backend.CPU)


class Backend(str, Enum):
    """The kind of device an implementation runs on; ANY matches every request."""

    GPU = "gpu"
    CPU = "cpu"
    TPU = "tpu"
    ANY = "any"


def unavailable_reason(algorithm: str, platform: Platform | str) -> str | None:
    """Why `platform` cannot run `algorithm` in this process, or None when it can."""
    platform = Platform(platform)
    if not platform.native:
        return None
    if not _native.available():
        return "native library not loaded"
    if _native.native_disabled(algorithm):
        return "disabled by EJKERNEL_DISABLE_NATIVE"
    return None


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered implementation."""

    algorithm: str
    platform: Platform
    backend: Backend
    priority: int
    func: Callable[..., Any]

    def available(self) -> bool:
        return unavailable_reason(self.algorithm, self.platform) is None

    def matches(self, platform: Platform | None, backend: Backend | None) -> bool:
        if platform is not None and self.platform is not platform:
            return False
        if backend is None or backend is Backend.ANY or self.backend is Backend.ANY:
            return True
        return self.backend is backend


class KernelRegistry:
    """Implementations keyed by (algorithm, platform, backend); the highest priority wins.

    Registering the same (algorithm, platform, backend) again replaces the earlier entry,
    so re-importing a kernel module cannot leave duplicates behind.
    """

    def __init__(self) -> None:
        self._entries: dict[str, list[Entry]] = {}
        self._lock = threading.Lock()

    @overload
    def register(
        self, algorithm: str, platform: Platform | str, backend: Backend | str, priority: int = 0
    ) -> Callable[[F], F]: ...

    @overload
    def register(
        self, algorithm: str, platform: Platform | str, backend: Backend | str, priority: int = 0, *, func: F
    ) -> F: ...

    def register(
        self,
        algorithm: str,
        platform: Platform | str,
        backend: Backend | str,
        priority: int = 0,
        *,
        func: Callable[..., Any] | None = None,
    ) -> Any:
        """Registers `func`, or returns a decorator that registers the function it wraps."""
        platform, backend = Platform(platform), Backend(backend)

        def add(fn: F) -> F:
            entry = Entry(algorithm, platform, backend, int(priority), fn)
            with self._lock:
                kept = [e for e in self._entries.get(algorithm, []) if (e.platform, e.backend) != (platform, backend)]
                # Stable sort: among equal priorities the earlier registration stays first.
                self._entries[algorithm] = sorted([*kept, entry], key=lambda e: -e.priority)
            return fn

        return add if func is None else add(func)

    def algorithms(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def implementations(self, algorithm: str) -> list[Entry]:
        """Every registered implementation of `algorithm`, available or not, best first."""
        with self._lock:
            return list(self._entries.get(algorithm, []))

    def platforms_for(
        self, algorithm: str, backend: Backend | str | None = None, *, available_only: bool = True
    ) -> list[Platform]:
        """Platforms that implement `algorithm` for `backend` (None: any), best first."""
        wanted = None if backend is None else Backend(backend)
        platforms: list[Platform] = []
        for entry in self.implementations(algorithm):
            if not entry.matches(None, wanted) or entry.platform in platforms:
                continue
            if available_only and not entry.available():
                continue
            platforms.append(entry.platform)
        return platforms

    def get(
        self,
        algorithm: str,
        platform: Platform | str | None = None,
        backend: Backend | str | None = None,
    ) -> Callable[..., Any]:
        """The best available implementation; None for platform or backend means any."""
        wanted_platform = None if platform is None else Platform(platform)
        wanted_backend = None if backend is None else Backend(backend)
        entries = self.implementations(algorithm)
        if not entries:
            known = ", ".join(self.algorithms()) or "none"
            raise ValueError(f"no kernel registered for algorithm '{algorithm}' (registered: {known})")
        for entry in entries:
            if entry.matches(wanted_platform, wanted_backend) and entry.available():
                return entry.func
        listing = "; ".join(_describe(e) for e in entries)
        request = f"platform={wanted_platform.value if wanted_platform else 'any'}, " + (
            f"backend={wanted_backend.value if wanted_backend else 'any'}"
        )
        raise ValueError(f"no usable '{algorithm}' implementation for {request}; registered: {listing}")


def _describe(entry: Entry) -> str:
    reason = unavailable_reason(entry.algorithm, entry.platform)
    text = f"{entry.platform.value}/{entry.backend.value} priority {entry.priority}"
    return text if reason is None else f"{text} ({reason})"


kernel_registry = KernelRegistry()
"""The process-wide registry that kernel modules register into and the executor reads."""

__all__ = ["Backend", "Entry", "KernelRegistry", "Platform", "kernel_registry", "unavailable_reason"]
