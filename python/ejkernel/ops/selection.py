"""Choosing the config of a call: explicit, overlay, memory, persistent, autotune, heuristic.

Each tier is cheaper or more authoritative than the next: an explicit or overlaid config is
the caller's decision; cached configs were already paid for; autotuning costs benchmarks
and runs only when the policy allows; the kernel's heuristic is the always-there default.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, Literal, TypeVar

from .config import ConfigCache, PersistentCache, lookup_overlay
from .core import Invocation
from .tuning import AutotuneError, Autotuner

Cfg = TypeVar("Cfg")

logger = logging.getLogger("ejkernel")

Source = Literal["explicit", "overlay", "memory", "persistent", "autotune", "heuristic"]


class AutotunePolicy(str, Enum):
    """When autotuning may run: never, for calls no cache knows, or anew once per process."""

    NEVER = "never"
    IF_MISSING = "if_missing"
    ALWAYS = "always"

    @classmethod
    def from_env(cls) -> AutotunePolicy:
        """EJKERNEL_AUTOTUNE as libejkernel reads it: unset/"0"/"never", "1"/"missing", "always"."""
        raw = os.environ.get("EJKERNEL_AUTOTUNE", "").strip().lower()
        if raw in ("", "0", "never"):
            return cls.NEVER
        if raw in ("1", "missing", "if_missing"):
            return cls.IF_MISSING
        if raw == "always":
            return cls.ALWAYS
        logger.warning("EJKERNEL_AUTOTUNE=%r is not one of 0, never, 1, missing, always; not autotuning", raw)
        return cls.NEVER

    @classmethod
    def coerce(cls, value: AutotunePolicy | bool | str) -> AutotunePolicy:
        """True means IF_MISSING and False NEVER, so `autotune=True` reads naturally."""
        if isinstance(value, bool):
            return cls.IF_MISSING if value else cls.NEVER
        return cls(value)


_policy_overrides: contextvars.ContextVar[AutotunePolicy | None] = contextvars.ContextVar(
    "ejkernel_autotune_policy", default=None
)


@contextlib.contextmanager
def policy_override(*, autotune: AutotunePolicy | bool | str) -> Iterator[None]:
    """Within the block every selector uses this autotune policy (context-local, nestable)."""
    token = _policy_overrides.set(AutotunePolicy.coerce(autotune))
    try:
        yield
    finally:
        _policy_overrides.reset(token)


class NoConfigError(LookupError):
    """No tier produced a config for a call."""


class ConfigSelectorChain:
    """Picks the config of an invocation and remembers it.

    cache: in-memory cache (default: a new one). persistent: on-disk cache (default: the
    library's, at its default location; False for none). autotune: policy, where
    policy_override() beats this argument and this argument beats EJKERNEL_AUTOTUNE
    (read at selection time). Under ALWAYS the persistent cache is not consulted and each
    call signature is tuned once per selector; later calls reuse that result from memory.
    Heuristic configs are remembered in memory only; tuned ones also go to disk.
    """

    def __init__(
        self,
        cache: ConfigCache | None = None,
        persistent: PersistentCache | Literal[False] | None = None,
        autotune: AutotunePolicy | bool | str | None = None,
        autotuner: Autotuner | None = None,
    ) -> None:
        self.cache = cache if cache is not None else ConfigCache()
        self.persistent: PersistentCache | None = (
            None if persistent is False else persistent if persistent is not None else PersistentCache()
        )
        self.autotune = None if autotune is None else AutotunePolicy.coerce(autotune)
        self.autotuner = autotuner if autotuner is not None else Autotuner()
        self._origins: dict[str, Source] = {}

    def policy(self) -> AutotunePolicy:
        override = _policy_overrides.get()
        if override is not None:
            return override
        return self.autotune if self.autotune is not None else AutotunePolicy.from_env()

    def select(self, inv: Invocation[Cfg, Any]) -> tuple[Cfg, Source]:
        """The config for `inv` and the tier that supplied it."""
        if inv.cfg is not None:
            return inv.cfg, "explicit"
        key = inv.key_string()
        found, overlaid = lookup_overlay(key, inv.kernel.name)
        if found:
            return overlaid, "overlay"

        policy = self.policy()
        origin = self._origins.get(key)
        candidates = functools.cache(lambda: inv.kernel.candidate_cfgs(inv))
        if key in self.cache and self._memory_answers(policy, origin, candidates):
            return self.cache.get(key), "memory"
        if self.persistent is not None and policy is not AutotunePolicy.ALWAYS and origin != "heuristic":
            stored = self.persistent.get(inv.cache_key(), inv.kernel.resolved_config_type())
            if stored is not None:
                self._remember(key, stored, "persistent")
                return stored, "persistent"

        if policy is not AutotunePolicy.NEVER and candidates():
            try:
                result = self.autotuner.tune(inv, candidates())
            except AutotuneError as exc:
                logger.warning("autotuning failed, using the heuristic config: %s", exc)
            else:
                self._remember(key, result.best, "autotune")
                if self.persistent is not None:
                    self.persistent.put(inv.cache_key(), result.best, result.timings_ms)
                return result.best, "autotune"

        try:
            cfg = inv.kernel.heuristic_cfg(inv)
        except NotImplementedError as exc:
            hint = "enable autotuning or " if candidates() else ""
            raise NoConfigError(
                f"no config for {inv.kernel.name} on platform '{inv.platform.value}' "
                f"({exc}); pass cfg=, {hint}give the kernel a heuristic_cfg"
            ) from None
        self._remember(key, cfg, "heuristic")
        return cfg, "heuristic"

    def _remember(self, key: str, cfg: Any, origin: Source) -> None:
        self.cache.put(key, cfg)
        self._origins[key] = origin

    @staticmethod
    def _memory_answers(policy: AutotunePolicy, origin: Source | None, candidates: Callable[[], list[Any]]) -> bool:
        """Whether a memory entry settles the call. Under IF_MISSING a heuristic guess does
        not stop tuning (entries others put into the cache do); under ALWAYS only this
        selector's own tuning results count. Kernels without candidates cannot be tuned,
        so for them any entry will do."""
        if policy is AutotunePolicy.NEVER:
            return True
        if policy is AutotunePolicy.ALWAYS:
            return origin == "autotune" or not candidates()
        return origin != "heuristic" or not candidates()


__all__ = ["AutotunePolicy", "ConfigSelectorChain", "NoConfigError", "Source", "policy_override"]
