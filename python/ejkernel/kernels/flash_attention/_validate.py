"""Argument checks and normalisation for flash attention, before anything is traced.

Every platform receives the same normalised arguments (see `AttentionArgs`); errors name
the argument and show the shapes involved. The C++ kernels check the same things again
and return FFI errors, so a call that bypasses this layer still cannot read out of bounds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._args import as_array as _array
from .._args import describe as _shape

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
    """Normalised flash attention arguments: arrays plus hashable static options."""

    query: Any
    key: Any
    value: Any
    bias: Any = None
    attention_mask: Any = None
    softmax_aux: Any = None
    cum_seqlens_q: Any = None
    cum_seqlens_k: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    dropout_seed: Any = None  # uint32 scalar array when dropout_prob > 0
    softmax_scale: float = 1.0
    causal: bool = False
    sliding_window: tuple[int, int] | None = None  # (left, right); -1 = unbounded side
    logits_soft_cap: float | None = None
    dropout_prob: float = 0.0
    deterministic: bool = False  # backward without floating-point atomics (bit-reproducible)

    def features(self) -> list[str]:
        """The optional features this call uses, by the names the native registry lists."""
        used = []
        flags = {
            "causal": self.causal,
            "sliding_window": self.sliding_window is not None,
            "logits_soft_cap": self.logits_soft_cap is not None,
            "softmax_aux": self.softmax_aux is not None,
            "bias": self.bias is not None,
            "attention_mask": self.attention_mask is not None,
            "cum_seqlens": self.cum_seqlens_q is not None,
            "segment_ids": self.q_segment_ids is not None,
            "dropout": self.dropout_prob > 0.0,
            "gqa": self.query.shape[2] != self.key.shape[2],
            "deterministic_backward": self.deterministic,
        }
        used.extend(name for name, on in flags.items() if on)
        return used

    def signature(self) -> dict[str, Any]:
        """What a native implementation's heuristic, candidates and support depend on: shapes,
        dtype, the features() names, the window's sides (-1: unbounded), the bias dtype and the
        bias's and mask's shapes."""
        left, right = self.sliding_window or (-1, -1)
        signature = {
            **signature_of(self.query, self.key),
            "features": self.features(),
            "window_left": left,
            "window_right": right,
        }
        if self.bias is not None:
            signature["bias_dtype"] = jnp.dtype(self.bias.dtype).name
            signature["bias_shape"] = list(self.bias.shape)
        if self.attention_mask is not None:
            signature["mask_shape"] = list(self.attention_mask.shape)
        return signature


def signature_of(query: Any, key: Any) -> dict[str, Any]:
    """The registry signature of a call with these query and key arrays (or avals)."""
    b, sq, hq, d = query.shape
    return {
        "batch": b,
        "seqlen_q": sq,
        "seqlen_k": key.shape[1],
        "num_q_heads": hq,
        "num_kv_heads": key.shape[2],
        "head_dim": d,
        "dtype": jnp.dtype(query.dtype).name,
    }


def _dense_operand(x: Any, name: str, b: int, hq: int, sq: int, sk: int) -> Any:
    """A bias or mask as [batch|1, num_q_heads|1, Sq|1, Sk|1]: NumPy broadcasting to
    [B, Hq, Sq, Sk], leading dims of 1 added where the rank is below 4."""
    if x.ndim > 4:
        raise ValueError(f"{name} must have rank at most 4 (broadcast to [batch, num_q_heads, seq_len_q, "
                         f"seq_len_k]), got {_shape(x)}")
    full = (b, hq, sq, sk)
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    if any(have not in (1, want) for have, want in zip(shape, full)):
        raise ValueError(f"{name} {_shape(x)} must broadcast to [batch={b}, num_q_heads={hq}, seq_len_q={sq}, "
                         f"seq_len_k={sk}]")
    return x.reshape(shape)


def _mask_as_segment_ids(mask: Any, b: int, sq: int, sk: int) -> tuple[Any, Any]:
    """A mask [batch|1, 1, Sq, 1] or [batch|1, 1, 1, Sk] (which queries see every key, or which
    keys every query sees: padding) as the equal segment ids, [B, Sq] and [B, Sk]: hidden
    queries or keys get id 1, the rest 0."""
    if mask.shape[3] == 1:
        q_ids = jnp.where(mask[:, 0, :, 0], 0, 1)
        kv_ids = jnp.zeros((1, sk), jnp.int32)
    else:
        q_ids = jnp.zeros((1, sq), jnp.int32)
        kv_ids = jnp.where(mask[:, 0, 0, :], 0, 1)
    return (jnp.broadcast_to(q_ids, (b, sq)).astype(jnp.int32), jnp.broadcast_to(kv_ids, (b, sk)).astype(jnp.int32))


def _concrete(x: Any) -> np.ndarray | None:
    """The value of a concrete array, None for tracers (checked again in C++ at run time)."""
    try:
        return np.asarray(jax.device_get(x))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


def _check_cu_seqlens(cu: Any, name: str, total: int) -> None:
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must have shape [num_sequences + 1] with at least 2 entries, got {_shape(cu)}")
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {_shape(cu)}")
    values = _concrete(cu)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(values[0])}")
    steps = np.diff(values.astype(np.int64))
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}]={int(values[i + 1])} < {name}[{i}]={int(values[i])}")
    if values[-1] > total:
        raise ValueError(f"{name}[-1]={int(values[-1])} exceeds the packed length {total}")


def _window(sliding_window: Any) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool):
        sides = (int(sliding_window), int(sliding_window))
        if sides[0] < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        return sides
    if isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2:
        sides = []
        for side in sliding_window:
            if side is None:
                sides.append(-1)
            elif isinstance(side, (int, np.integer)) and not isinstance(side, bool) and side >= -1:
                sides.append(int(side))
            else:
                raise ValueError(
                    f"sliding_window sides must be ints >= 0 (or None/-1 for unbounded), got {sliding_window!r}"
                )
        return (sides[0], sides[1]) if sides != [-1, -1] else None
    raise ValueError(f"sliding_window must be an int or a (left, right) pair, got {sliding_window!r}")


def normalize(
    query: Any,
    key: Any,
    value: Any,
    *,
    bias: Any = None,
    attention_mask: Any = None,
    softmax_aux: Any = None,
    cum_seqlens_q: Any = None,
    cum_seqlens_k: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
    deterministic: bool = False,
) -> AttentionArgs:
    """Validates every argument and returns the normalised form all platforms take."""
    query, key, value = (_array(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    for x, n in ((query, "query"), (key, "key"), (value, "value")):
        if x.ndim != 4:
            raise ValueError(f"{n} must have rank 4 [batch, seq_len, num_heads, head_dim], got {_shape(x)}")
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
            raise TypeError(f"{n} must be float32, bfloat16 or float16, got {_shape(x)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
        )
    b, sq, hq, d = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key {_shape(key)} and value {_shape(value)} must have the same shape")
    kb, sk, hkv, kd = key.shape
    if kb != b:
        raise ValueError(f"key batch ({kb}) must equal query batch ({b}); query {_shape(query)}, key {_shape(key)}")
    if kd != d:
        raise ValueError(f"key head_dim ({kd}) must equal query head_dim ({d}); query {_shape(query)}, key {_shape(key)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"key: num_kv_heads ({hkv}) must divide num_q_heads ({hq}); query {_shape(query)}, key {_shape(key)}"
        )
    if d == 0:
        raise ValueError(f"query head_dim must be positive, got {_shape(query)}")

    bias = _array(bias, "bias")
    if bias is not None:
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a float array, got {_shape(bias)}")
        bias = _dense_operand(bias, "bias", b, hq, sq, sk)
    attention_mask = _array(attention_mask, "attention_mask")
    if attention_mask is not None:
        if attention_mask.dtype != jnp.bool_:
            raise TypeError(f"attention_mask must be a bool array (True = attend), got {_shape(attention_mask)}")
        attention_mask = _dense_operand(attention_mask, "attention_mask", b, hq, sq, sk)
    softmax_aux = _array(softmax_aux, "softmax_aux")
    if softmax_aux is not None:
        if softmax_aux.shape != (hq,):
            raise ValueError(f"softmax_aux must have shape [num_q_heads={hq}], got {_shape(softmax_aux)}")
        if not jnp.issubdtype(softmax_aux.dtype, jnp.floating):
            raise TypeError(f"softmax_aux must be a float array, got {_shape(softmax_aux)}")

    cum_seqlens_q, cum_seqlens_k = _array(cum_seqlens_q, "cum_seqlens_q"), _array(cum_seqlens_k, "cum_seqlens_k")
    if (cum_seqlens_q is None) != (cum_seqlens_k is None):
        raise ValueError("cum_seqlens_q and cum_seqlens_k must be given together")
    if cum_seqlens_q is not None:
        if b != 1:
            raise ValueError(f"with cum_seqlens_q/k the sequences are packed along axis 1, so batch must be 1; query {_shape(query)}")
        _check_cu_seqlens(cum_seqlens_q, "cum_seqlens_q", sq)
        _check_cu_seqlens(cum_seqlens_k, "cum_seqlens_k", sk)
        if cum_seqlens_q.shape != cum_seqlens_k.shape:
            raise ValueError(
                f"cum_seqlens_q {_shape(cum_seqlens_q)} and cum_seqlens_k {_shape(cum_seqlens_k)} must have the same length"
            )
        cum_seqlens_q, cum_seqlens_k = cum_seqlens_q.astype(jnp.int32), cum_seqlens_k.astype(jnp.int32)

    q_segment_ids, kv_segment_ids = _array(q_segment_ids, "q_segment_ids"), _array(kv_segment_ids, "kv_segment_ids")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is not None:
        if cum_seqlens_q is not None:
            raise ValueError("use either cum_seqlens_q/k or q/kv_segment_ids, not both")
        for x, n, s in ((q_segment_ids, "q_segment_ids", sq), (kv_segment_ids, "kv_segment_ids", sk)):
            if x.shape != (b, s):
                raise ValueError(f"{n} must have shape [batch={b}, {s}], got {_shape(x)}")
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{n} must be an integer array, got {_shape(x)}")
        q_segment_ids, kv_segment_ids = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)

    # The kernels read a bias or mask of full [Sq, Sk] planes (batch and heads may broadcast). A
    # mask over queries alone or keys alone, the same for every head (padding), becomes segment
    # ids where the call has none: the kernels then read no mask and skip the hidden key tiles.
    # Any other dimension of 1 is materialised; a bias's gradient is summed back by autodiff.
    if (attention_mask is not None and attention_mask.shape[1] == 1 and 1 in attention_mask.shape[2:]
            and q_segment_ids is None and cum_seqlens_q is None):
        q_segment_ids, kv_segment_ids = _mask_as_segment_ids(attention_mask, b, sq, sk)
        attention_mask = None
    if attention_mask is not None:
        attention_mask = jnp.broadcast_to(attention_mask, (*attention_mask.shape[:2], sq, sk))
    if bias is not None:
        bias = jnp.broadcast_to(bias, (*bias.shape[:2], sq, sk))

    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if not isinstance(softmax_scale, (int, float, np.floating)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if logits_soft_cap is not None and (
        not isinstance(logits_soft_cap, (int, float, np.floating))
        or not math.isfinite(logits_soft_cap)
        or logits_soft_cap <= 0
    ):
        raise ValueError(f"logits_soft_cap must be a finite float > 0 (or None), got {logits_soft_cap!r}")
    if not isinstance(dropout_prob, (int, float, np.floating)) or not 0.0 <= dropout_prob < 1.0:
        raise ValueError(f"dropout_prob must be in [0, 1), got {dropout_prob!r}")
    seed = None
    if dropout_prob > 0.0:
        seed_value = 0 if dropout_seed is None else dropout_seed
        if isinstance(seed_value, (int, np.integer)):
            seed = jnp.asarray(np.uint32(int(seed_value) & 0xFFFFFFFF))
        else:
            seed = _array(seed_value, "dropout_seed")
            if seed.shape not in ((), (1,)) or not jnp.issubdtype(seed.dtype, jnp.integer):
                raise TypeError(f"dropout_seed must be an int or an integer scalar array, got {_shape(seed)}")
            seed = seed.reshape(()).astype(jnp.uint32)

    return AttentionArgs(
        query=query,
        key=key,
        value=value,
        bias=bias,
        attention_mask=attention_mask,
        softmax_aux=softmax_aux,
        cum_seqlens_q=cum_seqlens_q,
        cum_seqlens_k=cum_seqlens_k,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        dropout_seed=seed,
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        sliding_window=_window(sliding_window),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        dropout_prob=float(dropout_prob),
        deterministic=bool(deterministic),
    )


def normalize_shapes(query: Any, key: Any, value: Any, **kwargs: Any) -> AttentionArgs:
    """normalize's checks and result with every array as a jax.ShapeDtypeStruct, doing no
    array work (a broadcast mask, converted ids): what choosing a platform and a config needs.
    Checks of concrete values (cum_seqlens) wait for normalize itself."""
    arrays = {name: x for name, x in kwargs.items() if hasattr(x, "shape") and hasattr(x, "dtype")}
    options = {name: x for name, x in kwargs.items() if name not in arrays}
    traced: list[AttentionArgs] = []

    def fields(query, key, value, arrays):
        traced.append(normalize(query, key, value, **arrays, **options))
        return {f.name: getattr(traced[0], f.name) for f in dataclasses.fields(AttentionArgs)
                if hasattr(getattr(traced[0], f.name), "shape")}

    shapes = jax.eval_shape(fields, query, key, value, arrays)
    return dataclasses.replace(traced[0], **shapes)
