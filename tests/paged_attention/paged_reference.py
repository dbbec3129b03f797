"""Paged attention reference and test batches, written from csrc/paged_attention/params.h.

The reference gathers each present sequence's pages into dense float64 K/V and evaluates
the formulas in NumPy. `round_to` evaluates the same formulas rounding every intermediate
(dequantised K/V, logits, weights, probabilities, output) to a low precision: the error
that precision alone brings, against which the implementations are judged.

`make_batch` builds a random paged batch: pages of every sequence drawn from a random
permutation, lengths that are not multiples of the page size, and garbage everywhere the
semantics say nothing is read: NaN query rows past the last sequence, NaN in every cache
slot outside the present sequences' keys, huge or negative metadata in padding entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0


def to_f64(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32).astype(np.float64) if x.dtype.itemsize <= 2 else x.astype(np.float64)


def dense_caches(key_cache, value_cache, kv_layout: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 caches as [P, S, Hkv, D]."""
    k, v = to_f64(key_cache), to_f64(value_cache)
    if kv_layout == "head_major":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return k, v


def paged_reference(
    query, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs, *, kv_starts=None, sinks=None,
    softmax_scale: float, logits_soft_cap: float | None = None, window_left: int = -1, causal: bool = True,
    kv_layout: str = "head_major", k_scale: float = 1.0, v_scale: float = 1.0, round_to: Any = None,
) -> np.ndarray:
    """out [T, Hq, D] in float64 (rounded to `round_to` along the way when given)."""

    def rnd(x):
        return x if round_to is None else np.asarray(x).astype(round_to).astype(np.float64)

    q = to_f64(query)
    t, hq, d = q.shape
    k_all, v_all = dense_caches(key_cache, value_cache, kv_layout)
    page_size, hkv = k_all.shape[1], k_all.shape[2]
    group = hq // hkv
    kv_lens, tables, qsl = (np.asarray(x, np.int64) for x in (kv_lens, block_tables, query_start_loc))
    out = np.zeros((t, hq, d))
    for n in range(int(np.asarray(num_seqs).reshape(-1)[-1])):
        q_begin, q_end, kv_len = int(qsl[n]), int(qsl[n + 1]), int(kv_lens[n])
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        pages = tables[n, : -(-kv_len // page_size)]
        k = rnd(k_all[pages].reshape(-1, hkv, d)[:kv_len] * k_scale)
        v = rnd(v_all[pages].reshape(-1, hkv, d)[:kv_len] * v_scale)
        pos = kv_len - q_len + np.arange(q_len)[:, None]
        j = np.arange(kv_len)[None, :]
        visible = np.ones((q_len, kv_len), bool)
        if kv_starts is not None:
            start = int(np.asarray(kv_starts)[n])
            visible &= j >= start
            k[:start], v[:start] = 0.0, 0.0  # invisible to every query; the cache may hold anything there
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        if causal:
            visible &= j <= pos
        if window_left >= 0:
            visible &= j >= pos - window_left
        logits = rnd(rnd(np.einsum("qhd,khd->hqk", q[q_begin:q_end], k)) * softmax_scale)
        if logits_soft_cap is not None:
            logits = rnd(logits_soft_cap * np.tanh(logits / logits_soft_cap))
        logits = np.where(visible[None], logits, -np.inf)
        top = logits.max(-1)
        sink = None if sinks is None else to_f64(sinks)[:, None]
        if sink is not None:
            top = np.maximum(top, sink)
        top = np.where(np.isfinite(top), top, 0.0)
        weights = rnd(np.where(visible[None], np.exp(logits - top[..., None]), 0.0))
        total = weights.sum(-1) + (0.0 if sink is None else np.exp(sink - top))
        probs = rnd(weights / np.where(total > 0, total, 1.0)[..., None])
        out[q_begin:q_end] = rnd(np.einsum("hqk,khd->qhd", probs, v))
    return out


def quantize(x: np.ndarray, scale: float, dtype: Any) -> np.ndarray:
    """x in `dtype` (params.h CacheUpdateParams): x / scale saturated at +-448 for
    float8_e4m3fn, x itself for other dtypes."""
    y = np.asarray(x, np.float32)
    if np.dtype(dtype) == FP8:
        y = np.clip(y / np.float32(scale), -FP8_MAX, FP8_MAX)
    return y.astype(dtype)


def scatter_reference(new_keys, new_values, key_cache, value_cache, kv_lens, block_tables, query_start_loc,
                      num_seqs, *, kv_layout: str, k_scale: float = 1.0, v_scale: float = 1.0):
    """The caches after the v3 update, in NumPy: each present row written at its position."""
    kc, vc = np.array(key_cache), np.array(value_cache)
    page_size = kc.shape[1 if kv_layout == "token_major" else 2]
    kq = quantize(to_f64(new_keys), k_scale, kc.dtype)
    vq = quantize(to_f64(new_values), v_scale, vc.dtype)
    kv_lens, tables, qsl = (np.asarray(x, np.int64) for x in (kv_lens, block_tables, query_start_loc))
    for n in range(int(np.asarray(num_seqs).reshape(-1)[-1])):
        q_len = int(qsl[n + 1] - qsl[n])
        for r in range(int(qsl[n]), int(qsl[n + 1])):
            pos = int(kv_lens[n]) - q_len + r - int(qsl[n])
            page, slot = tables[n, pos // page_size], pos % page_size
            if kv_layout == "token_major":
                kc[page, slot], vc[page, slot] = kq[r], vq[r]
            else:
                kc[page, :, slot], vc[page, :, slot] = kq[r], vq[r]
    return kc, vc


@dataclasses.dataclass(frozen=True)
class Spec:
    """A paged batch: seqs are (q_len, kv_len) pairs of the present sequences."""

    seqs: tuple[tuple[int, int], ...]
    page_size: int = 16
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    cache_dtype: str | None = None  # default: dtype
    kv_layout: str = "head_major"
    padding_seqs: int = 2
    padding_rows: int = 3
    extra_pages: int = 3
    soft_cap: float | None = None
    sinks: bool = False
    window: int = -1  # window_left
    kv_starts: bool = False
    causal: bool = True
    k_scale: float = 1.0
    v_scale: float = 1.0
    update: bool = False  # v3: new keys/values; their slots start as garbage


def make_batch(spec: Spec, rng: np.random.Generator) -> dict[str, Any]:
    """Core arguments (normalize's names) as NumPy arrays, plus the static options."""
    s, hq, hkv, d = spec.page_size, spec.q_heads, spec.kv_heads, spec.head_dim
    dtype = np.dtype(ml_dtypes.bfloat16) if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
    cache_dtype = dtype if spec.cache_dtype is None else (
        FP8 if spec.cache_dtype == "float8_e4m3fn" else np.dtype(spec.cache_dtype))
    ns = len(spec.seqs)
    n = ns + spec.padding_seqs
    pages_of = [-(-kv // s) for _, kv in spec.seqs]
    m = max([1, *pages_of]) + 1
    p = sum(pages_of) + spec.extra_pages
    perm = rng.permutation(p)
    garbage = np.array([-1, p, p + 7, 2**30, -(2**31)], np.int64)

    tables = rng.choice(garbage, (n, m)).astype(np.int32)
    kv_lens = rng.choice(garbage, n).astype(np.int32)
    q_lens = np.array([q for q, _ in spec.seqs], np.int64)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    t = int(qsl[-1]) + spec.padding_rows
    qsl = np.concatenate([qsl, rng.choice(np.array([0, t + 50, 2**30, -3]), spec.padding_seqs)]).astype(np.int32)
    kv_starts = rng.choice(garbage, n).astype(np.int32)

    # Cache slots start as NaN; each present sequence's keys get data (v3: its history only).
    real_k = np.full((p, s, hkv, d), np.nan, np.float32)
    real_v = np.full((p, s, hkv, d), np.nan, np.float32)
    used = 0
    for i, (q_len, kv_len) in enumerate(spec.seqs):
        pages = perm[used : used + pages_of[i]]
        used += pages_of[i]
        tables[i, : len(pages)] = pages
        kv_lens[i] = kv_len
        start = int(rng.integers(0, kv_len + 1)) if spec.kv_starts else 0
        if spec.kv_starts and kv_len > q_len and rng.random() < 0.8:
            start = int(rng.integers(0, kv_len - q_len + 1))  # mostly leave the queries some keys
        kv_starts[i] = start
        filled = kv_len - q_len if spec.update else kv_len
        for j in range(start, filled):
            real_k[pages[j // s], j % s] = rng.standard_normal((hkv, d))
            real_v[pages[j // s], j % s] = rng.standard_normal((hkv, d))

    def stored(real, scale):  # stored * scale = real
        return quantize(real, scale, cache_dtype) if cache_dtype == FP8 else (real / scale).astype(cache_dtype)

    key_cache, value_cache = stored(real_k, spec.k_scale), stored(real_v, spec.v_scale)
    if spec.kv_layout == "head_major":
        key_cache, value_cache = key_cache.transpose(0, 2, 1, 3).copy(), value_cache.transpose(0, 2, 1, 3).copy()

    query = (rng.standard_normal((t, hq, d)) * 1.5).astype(np.float32)
    query[qsl[ns]:] = np.nan
    batch = dict(
        query=query.astype(dtype), key_cache=key_cache, value_cache=value_cache, kv_lens=kv_lens,
        block_tables=tables, query_start_loc=qsl, num_seqs=np.array([ns], np.int32),
        kv_starts=kv_starts if spec.kv_starts else None,
        sinks=(rng.standard_normal(hq) * 2).astype(np.float32) if spec.sinks else None,
        softmax_scale=float(d**-0.5), logits_soft_cap=spec.soft_cap, window_left=spec.window, causal=spec.causal,
        kv_layout=spec.kv_layout, k_scale=spec.k_scale, v_scale=spec.v_scale,
    )
    if spec.update:
        for name in ("new_keys", "new_values"):
            new = rng.standard_normal((t, hkv, d)).astype(np.float32)
            new[qsl[ns]:] = np.nan
            batch[name] = new.astype(dtype)
    return batch


STATIC = ("softmax_scale", "logits_soft_cap", "window_left", "causal", "kv_layout", "k_scale", "v_scale")
