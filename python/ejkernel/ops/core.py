"""Kernel (what an operation can do) and Invocation (one call of it), plus the two rules
every caller shares: which platform runs a call and which method runs it there.

Dispatch rule: on platform P the executor calls `kernel.run_<P>(*args, cfg=cfg, **kwargs)`
when the kernel defines that method (run_cuda, run_cpu, run_xla), and otherwise
`kernel.run(*args, cfg=cfg, platform=P, **kwargs)`; a single `run` therefore always learns
which platform it serves. Custom-VJP hooks receive `platform=P` the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from jaxtyping import PyTree

from .. import registry as _registry
from ..registry import Backend, Platform
from .utils import backend_of, default_platform, device_fingerprint, platform_device, stable_json

Cfg = TypeVar("Cfg")
Out = TypeVar("Out")


def is_array(x: Any) -> bool:
    """Arrays (concrete, traced or abstract) carry data; everything else in a call is static."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _is_abstract(x: Any) -> bool:
    return isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct))


def _contains_array(tree: Any) -> bool:
    return any(is_array(leaf) for leaf in jax.tree.leaves(tree))


def _abstractify(x: Any) -> Any:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if is_array(x) else x


def _describe(x: Any) -> Any:
    """Shape/dtype for arrays, the value for Python scalars, structure for containers."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if is_array(x):
        return f"{np.dtype(x.dtype).name}[{','.join(str(d) for d in np.shape(x))}]"
    if isinstance(x, (list, tuple)):
        return [_describe(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _describe(v) for k, v in x.items()}
    leaves = jax.tree.leaves(x)
    if len(leaves) == 1 and leaves[0] is x:
        return x
    return {"tree": type(x).__qualname__, "leaves": [_describe(v) for v in leaves]}


class Kernel(Generic[Cfg, Out]):
    """An operation with tunable configs of type Cfg and outputs of type Out.

    Subclasses implement `run_<platform>(*args, cfg, **kwargs)` for platforms that need
    their own code and/or `run(*args, cfg, platform, **kwargs)`, which serves every
    platform without a method of its own; `heuristic_cfg` for a good default config; and
    optionally `candidate_cfgs` (alias `config_space`) for autotuning and
    `unsupported_features` to refuse calls a platform cannot serve. Defining both
    `fwd_with_residuals(*args, cfg, platform, **kw) -> (out, residuals)` and
    `vjp(residuals, cotangent, cfg, platform, **kw) -> one gradient per positional
    argument` makes the executor wrap the call in jax.custom_vjp; keyword arguments and
    non-array positionals are static and get no gradient.
    """

    op_version: int = 1
    """Bump when the kernel changes so that configs tuned for the old one are not reused."""

    config_type: type | None = None
    """The config class; None resolves it from the `Kernel[Cfg, Out]` base of the subclass."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def run(self, *args: Any, cfg: Cfg, platform: Platform, **kwargs: Any) -> Out:
        raise NotImplementedError(f"{self.name} defines neither run_{platform.value} nor run")

    def heuristic_cfg(self, inv: Invocation[Cfg, Out]) -> Cfg:
        raise NotImplementedError(f"{self.name} has no heuristic config")

    def candidate_cfgs(self, inv: Invocation[Cfg, Out]) -> list[Cfg]:
        """Configs autotuning compares; either this or `config_space` may be overridden."""
        if type(self).config_space is not Kernel.config_space:
            return list(self.config_space(inv))
        return []

    def config_space(self, inv: Invocation[Cfg, Out]) -> list[Cfg]:
        if type(self).candidate_cfgs is not Kernel.candidate_cfgs:
            return list(self.candidate_cfgs(inv))
        return []

    def unsupported_features(self, inv: Invocation[Cfg, Out], platform: Platform) -> list[str]:
        """Features of this call that `platform` cannot serve; non-empty rules it out."""
        return []

    def platforms(self) -> list[Platform]:
        """Platforms this kernel has, best first: the registry's entries for its name, with XLA
        (the pure-JAX path every kernel has) last if the registry does not place it."""
        found = _registry.kernel_registry.platforms_for(self.name, available_only=False)
        return found if Platform.XLA in found else [*found, Platform.XLA]

    @property
    def has_custom_vjp(self) -> bool:
        return callable(getattr(self, "fwd_with_residuals", None)) and callable(getattr(self, "vjp", None))

    def resolved_config_type(self) -> type | None:
        """The class that persistent-cache entries (plain JSON) are rebuilt as; None keeps dicts."""
        if self.config_type is not None:
            return self.config_type
        for klass in type(self).__mro__:
            for base in getattr(klass, "__orig_bases__", ()):
                if typing.get_origin(base) is Kernel:
                    cfg_type = typing.get_args(base)[0]
                    return cfg_type if isinstance(cfg_type, type) else None
        return None


@dataclasses.dataclass(eq=False)
class Invocation(Generic[Cfg, Out]):
    """One call of a kernel: its arguments, the platform it runs on, an explicit config if
    the caller gave one, and everything derived from them that keys the config caches."""

    kernel: Kernel[Cfg, Out]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    platform: Platform = Platform.XLA
    cfg: Cfg | None = None

    def with_platform(self, platform: Platform) -> Invocation[Cfg, Out]:
        return dataclasses.replace(self, platform=platform)

    @functools.cached_property
    def abstract_args(self) -> tuple[Any, ...]:
        """The positional arguments with arrays replaced by jax.ShapeDtypeStruct."""
        return jax.tree.map(_abstractify, self.args)

    @property
    def is_abstract(self) -> bool:
        """True when some array argument is a tracer or shape-only, i.e. has no values."""
        return any(_is_abstract(leaf) for leaf in jax.tree.leaves((self.args, dict(self.kwargs))))

    def signature(self) -> str:
        """Shapes and dtypes of the array arguments (None where an optional one is absent)."""
        array_kwargs = {k: v for k, v in self.kwargs.items() if _contains_array(v)}
        return stable_json({"args": _describe(self.args), "kwargs": _describe(array_kwargs)})

    def static_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.kwargs.items() if not _contains_array(v)}

    def options(self) -> str:
        """The static keyword arguments (no arrays), canonically ordered."""
        return stable_json(self.static_kwargs())

    @property
    def device(self) -> jax.Device | None:
        """The device of the first concrete array argument, else the platform's default device."""
        for leaf in jax.tree.leaves((self.args, dict(self.kwargs))):
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
                return min(leaf.devices(), key=lambda d: d.id)
        return platform_device(self.platform)

    @functools.cached_property
    def device_fingerprint(self) -> dict[str, Any]:
        return device_fingerprint(self.platform, self.device)

    def cache_key(self) -> dict[str, Any]:
        """The key libejkernel's persistent cache uses (all strings except op_version)."""
        return {
            "op": self.kernel.name,
            "op_version": int(self.kernel.op_version),
            "signature": self.signature(),
            "options": stable_json({"platform": self.platform.value, "kwargs": self.static_kwargs()}),
            "device": str(self.device_fingerprint["key"]),
        }

    def key_string(self) -> str:
        """cache_key() as one canonical string: the in-memory and overlay cache key."""
        return stable_json(self.cache_key())


def call_platform(
    kernel: Kernel[Cfg, Out], platform: Platform, args: Sequence[Any], kwargs: Mapping[str, Any], cfg: Cfg
) -> Out:
    """Runs `kernel` on `platform` by the module's dispatch rule (no custom VJP)."""
    method = getattr(kernel, f"run_{platform.value}", None)
    if callable(method):
        return method(*args, cfg=cfg, **kwargs)
    return kernel.run(*args, cfg=cfg, platform=platform, **kwargs)


def call_with_custom_vjp(
    kernel: Kernel[Cfg, Out], platform: Platform, args: Sequence[Any], kwargs: Mapping[str, Any], cfg: Cfg
) -> Out:
    """Runs `kernel` under jax.custom_vjp built from its fwd_with_residuals/vjp hooks.

    Only array leaves are traced through custom_vjp; Python values stay static so kernels
    see them exactly as passed. Array keyword arguments ride along in the residuals and
    get zero cotangents.
    """
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    dynamic_at = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    arg_treedefs = [jax.tree.structure(a) for a in args]

    def rebuild(dynamic: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        merged = list(leaves)
        for position, value in zip(dynamic_at, dynamic, strict=True):
            merged[position] = value
        return jax.tree.unflatten(treedef, merged)

    @jax.custom_vjp
    def call(*dynamic: Any) -> Out:
        call_args, call_kwargs = rebuild(dynamic)
        return call_platform(kernel, platform, call_args, call_kwargs, cfg)

    def forward(*dynamic: Any) -> tuple[Out, Any]:
        call_args, call_kwargs = rebuild(dynamic)
        out, residuals = kernel.fwd_with_residuals(*call_args, cfg=cfg, platform=platform, **call_kwargs)
        array_kwargs = {k: v for k, v in call_kwargs.items() if _contains_array(v)}
        return out, (residuals, array_kwargs)

    def backward(saved: tuple[Any, dict[str, Any]], cotangent: Any) -> tuple[Any, ...]:
        residuals, array_kwargs = saved
        static_kwargs = {k: v for k, v in kwargs.items() if not _contains_array(v)}
        grads = tuple(kernel.vjp(residuals, cotangent, cfg=cfg, platform=platform, **static_kwargs, **array_kwargs))
        if len(grads) != len(args):
            raise ValueError(f"{kernel.name}.vjp returned {len(grads)} gradients for {len(args)} positional arguments")
        per_leaf: list[Any] = []
        for grad, arg_treedef in zip(grads, arg_treedefs, strict=True):
            per_leaf.extend([None] * arg_treedef.num_leaves if grad is None else arg_treedef.flatten_up_to(grad))
        per_leaf.extend([None] * (len(leaves) - len(per_leaf)))
        return tuple(per_leaf[i] for i in dynamic_at)

    call.defvjp(forward, backward)
    return call(*(leaves[i] for i in dynamic_at))


def run_invocation(inv: Invocation[Cfg, Out], cfg: Cfg) -> Out:
    """Runs `inv` on its platform with `cfg`, through the custom VJP when the kernel has one."""
    runner = call_with_custom_vjp if inv.kernel.has_custom_vjp else call_platform
    return runner(inv.kernel, inv.platform, inv.args, inv.kwargs, cfg)


def _args_backend(args: PyTree) -> tuple[Backend, str]:
    for leaf in jax.tree.leaves(args):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            device_platform = next(iter(leaf.devices())).platform
            return backend_of(device_platform), device_platform
    # Traced or no arrays: where JAX places the computation (jax.default_device, if set).
    device_platform = default_platform()
    return backend_of(device_platform), device_platform


def choose_platform(
    inv: Invocation[Cfg, Out], requested: Platform | str | None = None
) -> tuple[Invocation[Cfg, Out], str]:
    """The invocation on the platform that should run it, and why (for the debug log).

    An explicit platform is honoured or refused with ValueError. Otherwise the kernel's
    platforms that serve the arguments' device are tried best first, skipping natives that
    are missing or switched off and platforms that cannot serve this call's features.
    """
    kernel = inv.kernel
    if requested is not None:
        try:
            platform = Platform(requested)
        except ValueError:
            names = ", ".join(p.value for p in Platform)
            raise ValueError(f"unknown platform {requested!r} for {kernel.name}; expected one of {names}") from None
        if platform not in kernel.platforms():
            have = ", ".join(p.value for p in kernel.platforms())
            raise ValueError(f"{kernel.name} has no '{platform.value}' platform (it has: {have})")
        reason = _registry.unavailable_reason(kernel.name, platform)
        if reason is not None:
            raise ValueError(f"platform '{platform.value}' is unavailable for {kernel.name}: {reason}")
        backend, device_platform = _args_backend((inv.args, dict(inv.kwargs)))
        if not platform.serves(backend):
            raise ValueError(
                f"platform '{platform.value}' of {kernel.name} cannot run on the arguments' device ({device_platform})"
            )
        chosen = inv.with_platform(platform)
        missing = list(kernel.unsupported_features(chosen, platform))
        if missing:
            raise ValueError(f"{kernel.name} on platform '{platform.value}' does not support: {', '.join(missing)}")
        return chosen, "explicit"

    backend, device_platform = _args_backend((inv.args, dict(inv.kwargs)))
    skipped: list[str] = []
    for platform in kernel.platforms():
        if not platform.serves(backend):
            continue
        reason = _registry.unavailable_reason(kernel.name, platform)
        if reason is None:
            candidate = inv.with_platform(platform)
            missing = list(kernel.unsupported_features(candidate, platform))
            if not missing:
                why = f"auto: device {device_platform}"
                return candidate, why + "".join(f", skipped {s}" for s in skipped)
            reason = "unsupported: " + ", ".join(missing)
        skipped.append(f"{platform.value} ({reason})")
    detail = "; ".join(skipped) or "none of its platforms serve this device"
    raise ValueError(f"no platform of {kernel.name} can run on device {device_platform}: {detail}")


__all__ = [
    "Cfg",
    "Invocation",
    "Kernel",
    "Out",
    "call_platform",
    "call_with_custom_vjp",
    "choose_platform",
    "is_array",
    "run_invocation",
]
