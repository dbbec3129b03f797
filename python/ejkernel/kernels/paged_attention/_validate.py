"""Argument checks and normalisation for paged attention, before anything is traced.

Every public operation (page_attention, ragged_page_attention v2/v3, ragged_decode_attention,
unified_attention, prefill_page_attention) is a view of one core, described in
csrc/paged_attention/params.h: a packed ragged batch of query rows attending, causally, to
their sequence's keys in a paged KV cache. The functions at the end of this module map each
operation's arguments onto that core's normalised arguments (`PagedArgs`); every platform
then receives the same thing.

Shape and dtype errors name the argument (by the caller's name for it) and show its shape.
When the metadata arrays are concrete, their values are checked too (the rules of
ValidateMetadataValues in params.h); under jit they are data, and the implementations clamp
them instead, so bad values give wrong numbers for their sequence but never read out of
bounds. Entries past num_seqs are padding: never checked, never read as data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._args import as_array as _array
from .._args import describe as _shape

FLOAT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
CACHE_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)
LAYOUTS = {"head_major": 0, "token_major": 1}  # csrc/paged_attention/params.h KvLayout


@dataclasses.dataclass(frozen=True)
class PagedArgs:
    """Normalised arguments of the paged attention core (params.h Params).

    query [T, Hq, D]; key_cache/value_cache [P, Hkv, S, D] (head_major) or [P, S, Hkv, D]
    (token_major); kv_lens [N], block_tables [N, M], query_start_loc [N + 1], num_seqs [1]
    and kv_starts [N] int32; sinks [Hq] float; new_keys/new_values [T, Hkv, D] (the cache
    update of ragged_page_attention_v3, written before attention). softmax_scale already
    includes any query scale; window_left < 0 means unbounded.

    query_start_loc None means one query row per sequence (row n is sequence n's, so
    num_seqs <= T): the decode operations pass None rather than an arange, which would cost
    a kernel launch per call on GPUs. The native handlers receive it as int32[0].
    """

    query: Any
    key_cache: Any
    value_cache: Any
    kv_lens: Any
    block_tables: Any
    query_start_loc: Any  # None: one query row per sequence
    num_seqs: Any
    kv_starts: Any = None
    sinks: Any = None
    new_keys: Any = None
    new_values: Any = None
    softmax_scale: float = 1.0
    logits_soft_cap: float | None = None
    window_left: int = -1
    causal: bool = True
    kv_layout: str = "head_major"
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def token_major(self) -> bool:
        return self.kv_layout == "token_major"

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2 if self.token_major else 1]

    @property
    def page_size(self) -> int:
        return self.key_cache.shape[1 if self.token_major else 2]

    def features(self) -> list[str]:
        """The optional features this call uses, by the names the native registry lists."""
        flags = {
            "sinks": self.sinks is not None,
            "sliding_window": self.window_left >= 0,
            "logits_soft_cap": self.logits_soft_cap is not None,
            "kv_starts": self.kv_starts is not None,
            "fp8_cache": jnp.dtype(self.key_cache.dtype) == FP8_DTYPE,
            "cache_update": self.new_keys is not None,
            self.kv_layout: True,
            "gqa": self.query.shape[1] != self.num_kv_heads,
        }
        return [name for name, on in flags.items() if on]

    def signature(self) -> dict[str, Any]:
        """Shapes and dtypes that configs depend on (params.h Dims, plus dtypes and layout)."""
        t, hq, d = self.query.shape
        n, m = self.block_tables.shape
        return {
            "num_tokens": t,
            "num_q_heads": hq,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": d,
            "num_pages": self.key_cache.shape[0],
            "page_size": self.page_size,
            "max_seqs": n,
            "max_pages_per_seq": m,
            "dtype": jnp.dtype(self.query.dtype).name,
            "cache_dtype": jnp.dtype(self.key_cache.dtype).name,
            "kv_layout": self.kv_layout,
        }


def _concrete(x: Any) -> np.ndarray | None:
    """The value of a concrete array, None for tracers (the kernels clamp those instead)."""
    try:
        return np.asarray(jax.device_get(x))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


def _int_array(x: Any, name: str, shape: tuple[int, ...], spelled: str) -> Any:
    x = _array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {_shape(x)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {spelled}, got {_shape(x)}")
    return x.astype(jnp.int32)


def _float(value: Any, name: str, *, positive: bool = False, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a Python float (it is a static attribute), got a traced value")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number) or (positive and number <= 0):
        raise ValueError(f"{name} must be a finite float{' > 0' if positive else ''}, got {value!r}")
    return number


def _names(names: Mapping[str, str] | None) -> dict[str, str]:
    base = {n: n for n in ("query", "key_cache", "value_cache", "kv_lens", "block_tables", "query_start_loc",
                           "num_seqs", "kv_starts", "sinks", "new_keys", "new_values")}
    return {**base, **(names or {})}


def normalize(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    kv_lens: Any,
    block_tables: Any,
    query_start_loc: Any,
    num_seqs: Any,
    *,
    kv_starts: Any = None,
    sinks: Any = None,
    new_keys: Any = None,
    new_values: Any = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window_left: int = -1,
    causal: bool = True,
    kv_layout: str = "head_major",
    k_scale: float | None = 1.0,
    v_scale: float | None = 1.0,
    names: Mapping[str, str] | None = None,
) -> PagedArgs:
    """Validates the core's arguments and returns their normalised form (query_start_loc
    may be None: one query row per sequence, see `PagedArgs`).

    `names` maps core argument names to the caller's (e.g. kv_lens -> "context_lens"), so
    errors speak the language of the operation that was called.
    """
    nm = _names(names)
    query = _array(query, nm["query"])
    if query.ndim != 3:
        raise ValueError(f"{nm['query']} must have rank 3 [num_tokens, num_q_heads, head_dim], got {_shape(query)}")
    if jnp.dtype(query.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{nm['query']} must be float32, bfloat16 or float16, got {_shape(query)}")
    t, hq, d = query.shape
    if hq == 0 or d == 0:
        raise ValueError(f"{nm['query']} must have num_q_heads > 0 and head_dim > 0, got {_shape(query)}")

    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be 'head_major' or 'token_major', got {kv_layout!r}")
    spelled = "[num_pages, page_size, num_kv_heads, head_dim]" if kv_layout == "token_major" else (
        "[num_pages, num_kv_heads, page_size, head_dim]")
    key_cache, value_cache = _array(key_cache, nm["key_cache"]), _array(value_cache, nm["value_cache"])
    for x, n in ((key_cache, nm["key_cache"]), (value_cache, nm["value_cache"])):
        if x.ndim != 4:
            raise ValueError(f"{n} must have rank 4 {spelled} (kv_layout={kv_layout!r}), got {_shape(x)}")
        if jnp.dtype(x.dtype) not in CACHE_DTYPES:
            raise TypeError(f"{n} must be float32, bfloat16, float16 or float8_e4m3fn, got {_shape(x)}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"{nm['key_cache']} {_shape(key_cache)} and {nm['value_cache']} {_shape(value_cache)} must have the "
            "same shape and dtype"
        )
    hkv, s = (key_cache.shape[2], key_cache.shape[1]) if kv_layout == "token_major" else key_cache.shape[1:3]
    if key_cache.shape[3] != d:
        raise ValueError(
            f"{nm['key_cache']} head_dim ({key_cache.shape[3]}) must equal {nm['query']} head_dim ({d}); "
            f"{nm['query']} {_shape(query)}, {nm['key_cache']} {_shape(key_cache)}"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"{nm['key_cache']}: num_kv_heads ({hkv}) must divide num_q_heads ({hq}); {nm['query']} {_shape(query)}, "
            f"{nm['key_cache']} {_shape(key_cache)} (kv_layout={kv_layout!r})"
        )
    if s == 0:
        raise ValueError(
            f"{nm['key_cache']} must have page_size > 0, got {_shape(key_cache)} (kv_layout={kv_layout!r})"
        )

    block_tables = _array(block_tables, nm["block_tables"])
    if block_tables.ndim != 2:
        raise ValueError(
            f"{nm['block_tables']} must have rank 2 [max_num_seqs, pages_per_seq], got {_shape(block_tables)}"
        )
    n, m = block_tables.shape
    block_tables = _int_array(block_tables, nm["block_tables"], (n, m), f"[{n}, {m}]")
    kv_lens = _int_array(kv_lens, nm["kv_lens"], (n,), f"[max_num_seqs={n}] (rows of {nm['block_tables']})")
    if query_start_loc is not None:
        query_start_loc = _int_array(query_start_loc, nm["query_start_loc"], (n + 1,), f"[max_num_seqs + 1 = {n + 1}]")
    num_seqs = _int_array(num_seqs, nm["num_seqs"], (1,), "[1]")
    if kv_starts is not None:
        kv_starts = _int_array(kv_starts, nm["kv_starts"], (n,), f"[max_num_seqs={n}]")
    sinks = _array(sinks, nm["sinks"])
    if sinks is not None:
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"{nm['sinks']} must be a float array, got {_shape(sinks)}")
        if sinks.shape != (hq,):
            raise ValueError(f"{nm['sinks']} must have shape [num_q_heads={hq}], got {_shape(sinks)}")

    new_keys, new_values = _array(new_keys, nm["new_keys"]), _array(new_values, nm["new_values"])
    if (new_keys is None) != (new_values is None):
        raise ValueError(f"{nm['new_keys']} and {nm['new_values']} must be given together")
    for x, name in ((new_keys, nm["new_keys"]), (new_values, nm["new_values"])):
        if x is None:
            continue
        if x.shape != (t, hkv, d):
            raise ValueError(
                f"{name} must have shape [num_tokens={t}, num_kv_heads={hkv}, head_dim={d}], got {_shape(x)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {_shape(x)}")

    softmax_scale = 1.0 / math.sqrt(d) if softmax_scale is None else _float(softmax_scale, "softmax_scale")
    logits_soft_cap = _float(logits_soft_cap, "logits_soft_cap", positive=True, allow_none=True)
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"window_left must be an int, got {window_left!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    k_scale = 1.0 if k_scale is None else _float(k_scale, "k_scale", positive=True)
    v_scale = 1.0 if v_scale is None else _float(v_scale, "v_scale", positive=True)

    args = PagedArgs(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        kv_lens=kv_lens,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        num_seqs=num_seqs,
        kv_starts=kv_starts,
        sinks=sinks,
        new_keys=new_keys,
        new_values=new_values,
        softmax_scale=float(softmax_scale),
        logits_soft_cap=logits_soft_cap,
        window_left=max(-1, int(window_left)),
        causal=bool(causal),
        kv_layout=kv_layout,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    check_metadata_values(args, nm)
    return args


def check_metadata_values(args: PagedArgs, names: Mapping[str, str] | None = None) -> None:
    """The rules of params.h ValidateMetadataValues, for concrete metadata (tracers skip).

    Only present sequences (n < num_seqs) are checked; without query_start_loc each owns one
    row, so num_seqs must not exceed the query rows. The page ids checked are those of
    the pages a sequence's visible keys lie in: none for a sequence without queries, and
    from the first key its earliest query can see (kv_starts, sliding window) to kv_lens.
    """
    nm = _names(names)
    values = [_concrete(x) for x in (args.num_seqs, args.kv_lens, args.block_tables)]
    qsl, starts = (None if x is None else _concrete(x) for x in (args.query_start_loc, args.kv_starts))
    if (any(v is None for v in values) or (args.query_start_loc is not None and qsl is None)
            or (args.kv_starts is not None and starts is None)):
        return
    num_seqs, kv_lens, tables = (v.astype(np.int64) for v in values)
    t = args.query.shape[0]
    n_max, m = tables.shape
    p, s = args.key_cache.shape[0], args.page_size
    ns = int(num_seqs[0])
    if not 0 <= ns <= n_max:
        raise ValueError(f"{nm['num_seqs']}[0]={ns} must lie in [0, max_num_seqs={n_max}]")
    if qsl is None:
        if ns > t:
            raise ValueError(f"{nm['num_seqs']}[0]={ns} exceeds the number of query rows {t} (one row per sequence)")
        qsl = np.arange(n_max + 1, dtype=np.int64)
    qsl = qsl.astype(np.int64)
    if qsl[0] != 0:
        raise ValueError(f"{nm['query_start_loc']}[0] must be 0, got {int(qsl[0])}")
    steps = np.diff(qsl[: ns + 1])
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(
            f"{nm['query_start_loc']} must be non-decreasing: {nm['query_start_loc']}[{i + 1}]={int(qsl[i + 1])} < "
            f"{nm['query_start_loc']}[{i}]={int(qsl[i])}"
        )
    if qsl[ns] > t:
        raise ValueError(f"{nm['query_start_loc']}[{ns}]={int(qsl[ns])} exceeds the number of query rows {t}")
    for i in range(ns):
        q_len, kv_len = int(qsl[i + 1] - qsl[i]), int(kv_lens[i])
        if kv_len < q_len or kv_len > m * s:
            raise ValueError(
                f"{nm['kv_lens']}[{i}]={kv_len} must lie in [query length {q_len}, pages_per_seq * page_size = "
                f"{m} * {s}]"
            )
        first = 0
        if starts is not None:
            first = int(starts[i])
            if not 0 <= first <= kv_len:
                raise ValueError(f"{nm['kv_starts']}[{i}]={first} must lie in [0, {nm['kv_lens']}[{i}]={kv_len}]")
        if q_len == 0 or first >= kv_len:
            continue
        if args.window_left >= 0:
            first = max(first, kv_len - q_len - args.window_left)
        used = tables[i, first // s : -(-kv_len // s)]
        bad = (used < 0) | (used >= p)
        if bad.any():
            j = first // s + int(np.argmax(bad))
            raise ValueError(
                f"{nm['block_tables']}[{i}, {j}]={int(tables[i, j])} is not a page of {nm['key_cache']} "
                f"(num_pages={p}); sequence {i} reads keys up to {kv_len}"
            )


# The operations, each mapped onto the core.


def window_from_size(sliding_window: Any) -> int:
    """A window of W keys (the query's own position and the W - 1 before it, as in vLLM and
    the TPU ragged paged attention) as the core's window_left = W - 1; None: unbounded."""
    if sliding_window is None:
        return -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) or sliding_window < 1:
        raise ValueError(f"sliding_window must be an int >= 1 (keys each query sees) or None, got {sliding_window!r}")
    return int(sliding_window) - 1


def window_from_pair(sliding_window: Any) -> int:
    """Flash-attention style window, w or (left, right): keys j >= pos - left. The right side
    is accepted and has no effect, since no key lies after a decoding query."""
    if sliding_window is None:
        return -1
    sides = sliding_window if isinstance(sliding_window, (tuple, list)) else (sliding_window, sliding_window)
    if len(sides) != 2:
        raise ValueError(f"sliding_window must be an int or a (left, right) pair, got {sliding_window!r}")
    out = []
    for side in sides:
        if side is None:
            out.append(-1)
        elif isinstance(side, (int, np.integer)) and not isinstance(side, bool) and side >= -1:
            out.append(int(side))
        else:
            raise ValueError(
                f"sliding_window sides must be ints >= 0 (or None/-1 for unbounded), got {sliding_window!r}"
            )
    return out[0]


def _count(x: Any, name: str) -> Any:
    """num_seqs as the core's int32 [1]: from an int, a [1] array, or a [3] distribution
    (vLLM TPU's decode/prefill/mixed ends, whose last entry counts every sequence)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return jnp.asarray([int(x)], jnp.int32)
    x = _array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int or an integer array, got {_shape(x)}")
    if x.shape not in ((), (1,), (3,)):
        raise ValueError(f"{name} must have shape [1] (or be an int, or a [3] distribution), got {_shape(x)}")
    return x.reshape(-1)[-1:].astype(jnp.int32)


def page_attention_args(
    query, key_cache, value_cache, context_lens, block_tables, *, softmax_scale=None, logits_soft_cap=None,
    sliding_window=None, softmax_aux=None, kv_layout="head_major", k_scale=1.0, v_scale=1.0,
) -> PagedArgs:
    query = _array(query, "query")
    b = query.shape[0] if query.ndim == 3 else 0
    tables = _array(block_tables, "block_tables")
    if tables.ndim == 2 and tables.shape[0] != b:  # query row n is sequence n's
        raise ValueError(f"block_tables must have one row per query (batch={b}), got {_shape(tables)}")
    return normalize(
        query, key_cache, value_cache, context_lens, block_tables, None, jnp.asarray([b], jnp.int32),
        sinks=softmax_aux, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_from_size(sliding_window), kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
        names={"kv_lens": "context_lens", "sinks": "softmax_aux", "query_start_loc": "query rows",
               "num_seqs": "batch"},
    )


def ragged_page_attention_args(
    queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs, *, softmax_scale=None,
    logits_soft_cap=None, sliding_window=None, softmax_aux=None, kv_layout="token_major", k_scale=1.0,
    v_scale=1.0,
) -> PagedArgs:
    return normalize(
        queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc, _count(num_seqs, "num_seqs"),
        sinks=softmax_aux, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_from_size(sliding_window), kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
        names={"query": "queries", "sinks": "softmax_aux"},
    )


def ragged_page_attention_v3_args(
    queries, keys, values, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
    softmax_scale=None, logits_soft_cap=None, sliding_window=None, softmax_aux=None, q_scale=None, k_scale=None,
    v_scale=None, kv_layout="token_major",
) -> PagedArgs:
    q_scale = 1.0 if q_scale is None else _float(q_scale, "q_scale", positive=True)
    args = normalize(
        queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc, _count(num_seqs, "num_seqs"),
        sinks=softmax_aux, new_keys=keys, new_values=values, softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap, window_left=window_from_size(sliding_window), kv_layout=kv_layout,
        k_scale=k_scale, v_scale=v_scale,
        names={"query": "queries", "sinks": "softmax_aux", "new_keys": "keys", "new_values": "values"},
    )
    return dataclasses.replace(args, softmax_scale=args.softmax_scale * q_scale)


def ragged_decode_attention_args(
    query, key, value, sequence_start, sequence_end, *, softmax_scale=None, sliding_window=None,
    logits_soft_cap=None, softmax_aux=None,
) -> PagedArgs:
    """Contiguous [B, S, Hkv, D] caches are token-major caches of B pages of size S, page b
    holding sequence b; the query of sequence b sits at the end of [start, end)."""
    query, key, value = _array(query, "query"), _array(key, "key"), _array(value, "value")
    for x, name in ((key, "key"), (value, "value")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq_len, num_kv_heads, head_dim], got {_shape(x)}")
    if query.ndim == 3 and key.shape[0] != query.shape[0]:
        raise ValueError(f"key batch ({key.shape[0]}) must equal query batch ({query.shape[0]}); "
                         f"query {_shape(query)}, key {_shape(key)}")
    b = key.shape[0]
    return normalize(
        query, key, value, sequence_end, np.arange(b, dtype=np.int32)[:, None], None,
        jnp.asarray([b], jnp.int32), kv_starts=sequence_start,
        sinks=softmax_aux, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_from_pair(sliding_window), kv_layout="token_major",
        names={"key_cache": "key", "value_cache": "value", "kv_lens": "sequence_end", "kv_starts": "sequence_start",
               "sinks": "softmax_aux", "block_tables": "pages", "query_start_loc": "query rows",
               "num_seqs": "batch"},
    )


def unified_attention_args(
    queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc, *, num_seqs=None, softmax_aux=None,
    softmax_scale=None, causal=True, sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0,
    kv_layout="token_major",
) -> PagedArgs:
    if num_seqs is None:
        tables = _array(block_tables, "block_tables")
        num_seqs = tables.shape[0] if tables.ndim == 2 else 0
    return normalize(
        queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc, _count(num_seqs, "num_seqs"),
        sinks=softmax_aux, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_from_size(sliding_window), causal=causal, kv_layout=kv_layout, k_scale=k_scale,
        v_scale=v_scale, names={"query": "queries", "sinks": "softmax_aux"},
    )


def prefill_page_attention_args(
    query, key_cache, value_cache, context_len, page_indices, *, query_start_loc=None, softmax_scale=None,
    logits_soft_cap=None, sliding_window=None, softmax_aux=None, kv_layout="head_major", k_scale=1.0,
    v_scale=1.0,
) -> PagedArgs:
    """One sequence (context_len [1], page_indices [M]) or several (context_len [N],
    page_indices [N, M], query_start_loc [N + 1]); every sequence present."""
    query = _array(query, "query")
    context_len, page_indices = _array(context_len, "context_len"), _array(page_indices, "page_indices")
    if page_indices.ndim == 1:
        page_indices = page_indices[None, :]
    n = page_indices.shape[0] if page_indices.ndim == 2 else 0
    if query_start_loc is None:
        if n != 1:
            raise ValueError(f"query_start_loc is required for {n} sequences (page_indices {_shape(page_indices)})")
        query_start_loc = jnp.asarray([0, query.shape[0]], jnp.int32)
    return normalize(
        query, key_cache, value_cache, context_len, page_indices, query_start_loc, jnp.asarray([n], jnp.int32),
        sinks=softmax_aux, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        window_left=window_from_size(sliding_window), kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
        names={"kv_lens": "context_len", "block_tables": "page_indices", "sinks": "softmax_aux",
               "num_seqs": "sequences"},
    )


# Operation name -> the adapter from its public arguments to the core's.
OPERATIONS = {
    "page_attention": page_attention_args,
    "ragged_page_attention": ragged_page_attention_args,
    "ragged_page_attention_v2": ragged_page_attention_args,
    "ragged_page_attention_v3": ragged_page_attention_v3_args,
    "ragged_decode_attention": ragged_decode_attention_args,
    "unified_attention": unified_attention_args,
    "prefill_page_attention": prefill_page_attention_args,
}
