"""The executor: platform choice, config selection and the run, in that order, for one call.

Everything happens at trace time under jax.jit (selection only needs shapes and dtypes), so
a jitted call pays for selection once per compilation, not per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jaxtyping import PyTree

from ..registry import Platform
from .core import Invocation, Kernel, choose_platform, is_array, run_invocation
from .selection import ConfigSelectorChain

Cfg = TypeVar("Cfg")
Out = TypeVar("Out")

logger = logging.getLogger("ejkernel")


class Executor:
    """Runs kernels: picks the platform, selects the config through `selector`, dispatches.

    The default selector has its own in-memory cache and uses libejkernel's persistent
    cache; autotuning follows EJKERNEL_AUTOTUNE unless a policy_override() is active.
    """

    def __init__(self, selector: ConfigSelectorChain | None = None) -> None:
        self.selector = selector if selector is not None else ConfigSelectorChain()

    def prepare(
        self,
        kernel: Kernel[Cfg, Out],
        args: Sequence[PyTree],
        kwargs: dict[str, Any],
        *,
        cfg: Cfg | None = None,
        platform: Platform | str | None = None,
    ) -> tuple[Invocation[Cfg, Out], Cfg]:
        """The invocation on its chosen platform and its config, logged at DEBUG."""
        inv, why = choose_platform(Invocation(kernel, tuple(args), kwargs, cfg=cfg), platform)
        chosen, source = self.selector.select(inv)
        logger.debug("op=%s platform=%s why=%s cfg=%r source=%s", kernel.name, inv.platform.value, why, chosen, source)
        return inv, chosen

    def __call__(
        self,
        kernel: Kernel[Cfg, Out],
        *args: PyTree,
        cfg: Cfg | None = None,
        platform: Platform | str | None = None,
        **kwargs: Any,
    ) -> Out:
        inv, chosen = self.prepare(kernel, args, kwargs, cfg=cfg, platform=platform)
        return run_invocation(inv, chosen)


def _one_example(x: Any, axis: int | None) -> Any:
    """The first example of a mapped array: a real slice when concrete (so its device and
    values stay available), its shape otherwise."""
    if axis is None or not is_array(x):
        return x
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return jax.lax.index_in_dim(x, 0, axis, keepdims=False)
    shape = list(x.shape)
    del shape[axis]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def vmap_with_config(
    kernel: Kernel[Cfg, Out],
    in_axes: int | None | Sequence[int | None] = 0,
    out_axes: PyTree = 0,
    *,
    executor: Executor | None = None,
    platform: Platform | str | None = None,
) -> Callable[..., Out]:
    """jax.vmap of `kernel` whose config is selected once, for the per-example shapes.

    Selecting inside the vmapped function would key caches by batched tracers and could
    tune per call; here the config and platform are fixed before mapping, and every
    example runs with them. `in_axes` is one axis for all positional arguments or one
    per argument (None: not mapped); keyword arguments are broadcast.
    """
    runner = executor if executor is not None else Executor()

    def batched(*args: PyTree, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        axes = list(in_axes) if isinstance(in_axes, Sequence) else [in_axes] * len(args)
        if len(axes) != len(args):
            raise ValueError(f"in_axes has {len(axes)} entries for {len(args)} positional arguments")
        per_example = tuple(
            jax.tree.map(lambda x, a=axis: _one_example(x, a), arg) for arg, axis in zip(args, axes, strict=True)
        )
        inv, chosen = runner.prepare(kernel, per_example, kwargs, cfg=cfg, platform=platform)

        def run_one(*example: PyTree) -> Out:
            return run_invocation(Invocation(kernel, example, kwargs, inv.platform), chosen)

        return jax.vmap(run_one, in_axes=tuple(axes), out_axes=out_axes)(*args)

    return batched


__all__ = ["Executor", "vmap_with_config"]
