"""Argument helpers shared by every operation's validation."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def describe(x: Any) -> str:
    """An array's dtype and shape as error messages show them: "bfloat16[2, 128, 8, 64]"."""
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def as_array(x: Any, name: str) -> Any:
    """x as an array (None stays None); TypeError naming `name` when it cannot be one."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        try:
            x = jnp.asarray(x)
        except TypeError as exc:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}") from exc
    return x
