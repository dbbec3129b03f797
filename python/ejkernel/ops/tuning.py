"""Autotuning: time every candidate config of a call and keep the fastest.

Candidates are compiled with jax.jit and timed after a warm-up, so compilation never counts.
Under jax.jit the call's arguments are tracers without values; candidates are then timed
on stand-in arrays of the same shapes and dtypes (normal floats, zero integers, True
booleans), which keeps index-like inputs in range.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ..registry import Platform
from .core import Invocation, Kernel, call_platform, choose_platform, is_array
from .utils import stable_json

Cfg = TypeVar("Cfg")

logger = logging.getLogger("ejkernel")


class AutotuneError(RuntimeError):
    """Every candidate config failed."""


def benchmark(fn: Callable[..., PyTree], *args: PyTree, num_warmup: int = 3, num_iters: int = 10) -> float:
    """Median wall time of `fn(*args)` in milliseconds, waiting for the results each time."""
    for _ in range(num_warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(max(1, num_iters)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _stand_in(leaf: Any, key: jax.Array) -> Any:
    if not isinstance(leaf, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return leaf
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
        return jax.random.normal(key, shape, dtype)
    if dtype == np.bool_:
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)


def concrete_stand_ins(tree: PyTree, seed: int = 0) -> PyTree:
    """`tree` with every tracer or ShapeDtypeStruct replaced by a concrete array."""
    leaves, treedef = jax.tree.flatten(tree)
    with jax.ensure_compile_time_eval():  # under jit, eager ops would otherwise be staged
        keys = jax.random.split(jax.random.PRNGKey(seed), max(1, len(leaves)))[: len(leaves)]
        stand_ins = [_stand_in(leaf, key) for leaf, key in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, stand_ins)


@dataclasses.dataclass(frozen=True)
class TuningResult:
    """The winner, the median time of every candidate that ran, and why the others failed."""

    best: Any
    timings_ms: dict[str, float]
    failures: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Autotuner:
    """Times candidate configs of one invocation; the fastest median wins."""

    num_warmup: int = 3
    num_iters: int = 10

    def tune(self, inv: Invocation[Cfg, Any], configs: Sequence[Cfg]) -> TuningResult:
        if not configs:
            raise AutotuneError(f"{inv.kernel.name}: no candidate configs to tune")
        args, kwargs = inv.args, dict(inv.kwargs)
        if inv.is_abstract:
            args, kwargs = concrete_stand_ins((args, kwargs))
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic_at = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
        dynamic = [leaves[i] for i in dynamic_at]

        def compiled(cfg: Cfg) -> Callable[..., Any]:
            def run(*values: Any) -> Any:
                merged = list(leaves)
                for position, value in zip(dynamic_at, values, strict=True):
                    merged[position] = value
                call_args, call_kwargs = jax.tree.unflatten(treedef, merged)
                return call_platform(inv.kernel, inv.platform, call_args, call_kwargs, cfg)

            return jax.jit(run)

        timings: dict[str, float] = {}
        failures: dict[str, str] = {}
        best: tuple[float, Cfg] | None = None
        for cfg in configs:
            label = stable_json(cfg)
            try:
                fn = compiled(cfg)
                with jax.ensure_compile_time_eval():
                    jax.block_until_ready(fn(*dynamic))
                    elapsed = benchmark(fn, *dynamic, num_warmup=self.num_warmup, num_iters=self.num_iters)
            except Exception as exc:  # a candidate that cannot run is simply not a winner
                failures[label] = f"{type(exc).__name__}: {exc}"
                logger.debug("autotune %s: candidate %s failed: %s", inv.kernel.name, label, failures[label])
                continue
            timings[label] = elapsed
            logger.debug("autotune %s: candidate %s took %.4f ms", inv.kernel.name, label, elapsed)
            if best is None or elapsed < best[0]:
                best = (elapsed, cfg)
        if best is None:
            detail = "; ".join(f"{k}: {v}" for k, v in failures.items())
            raise AutotuneError(f"{inv.kernel.name}: every candidate config failed ({detail})")
        return TuningResult(best=best[1], timings_ms=timings, failures=failures)


def autotune(
    kernel: Kernel[Cfg, Any],
    *args: PyTree,
    configs: Sequence[Cfg],
    num_warmup: int = 3,
    num_iters: int = 10,
    platform: Platform | str | None = None,
    **kwargs: Any,
) -> Cfg:
    """The fastest of `configs` for `kernel(*args, **kwargs)` on `platform` (None: as the
    executor would choose). Raises AutotuneError if every candidate fails."""
    inv, _ = choose_platform(Invocation(kernel, tuple(args), kwargs), platform)
    return Autotuner(num_warmup=num_warmup, num_iters=num_iters).tune(inv, list(configs)).best


__all__ = ["AutotuneError", "Autotuner", "TuningResult", "autotune", "benchmark", "concrete_stand_ins"]
