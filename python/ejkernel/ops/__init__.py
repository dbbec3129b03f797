"""ejkernel.ops: the kernel framework. A Kernel says how an operation runs on each platform
and which configs it has; the Executor picks the platform for the arguments' device, picks
the config (explicit, overlay, memory, persistent cache, autotuning, heuristic) and runs it.
"""

from __future__ import annotations

from ..registry import Backend, Platform
from .config import BwdParams, ConfigCache, FwdParams, PersistentCache, overlay_cache
from .core import Cfg, Invocation, Kernel, Out, choose_platform
from .executor import Executor, vmap_with_config
from .selection import AutotunePolicy, ConfigSelectorChain, NoConfigError, policy_override
from .tuning import AutotuneError, Autotuner, TuningResult, autotune, benchmark
from .utils import device_fingerprint, device_kind, from_json, get_device_platform, stable_json, to_json

__all__ = [
    "AutotuneError",
    "AutotunePolicy",
    "Autotuner",
    "Backend",
    "BwdParams",
    "Cfg",
    "ConfigCache",
    "ConfigSelectorChain",
    "Executor",
    "FwdParams",
    "Invocation",
    "Kernel",
    "NoConfigError",
    "Out",
    "PersistentCache",
    "Platform",
    "TuningResult",
    "autotune",
    "benchmark",
    "choose_platform",
    "device_fingerprint",
    "device_kind",
    "from_json",
    "get_device_platform",
    "overlay_cache",
    "policy_override",
    "stable_json",
    "to_json",
    "vmap_with_config",
]
