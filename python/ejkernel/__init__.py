"""ejkernel: high-performance deep-learning kernels for JAX, in C++ and CUDA C++ through XLA FFI."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version

from . import _native
from .registry import Backend, Platform, kernel_registry
from . import kernels  # noqa: E402,I001 - registers every operation's implementations
from .info import build_info, print_build_info

try:
    __version__ = _package_version("ejkernel")
except PackageNotFoundError:  # running from a source tree
    __version__ = _native.version() or "0+unknown"

__all__ = ["Backend", "Platform", "__version__", "build_info", "kernel_registry", "print_build_info"]
