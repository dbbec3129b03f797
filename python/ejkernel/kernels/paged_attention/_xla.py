"""Paged attention in pure JAX: the reference and the implementation every device runs
(TPU included), with the semantics of csrc/paged_attention/params.h.

Query rows are processed in blocks of `block_tokens` rows. Each row walks its own visible
key range [lo, hi) in chunks of `block_kv` keys, gathered from the cache through its
sequence's block table (key j lives in slot j % S of page block_tables[n, j // S]), with an
online softmax across chunks. A step holds the gathered [block_tokens, block_kv, Hkv, D]
keys and values and the [block_tokens, Hq, block_kv] logits, whatever the context lengths;
`block_tokens` defaults to what fits a fixed memory budget.

Metadata are data, never shapes: every index is clamped into range and rows outside the
present sequences see no key, so garbage in padding entries cannot leak, and the whole
computation jits with traced metadata (loop trip counts are data-dependent while loops).
GQA groups q heads: q head h reads kv head h // (Hq // Hkv), and K/V are never repeated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

_F32 = jnp.float32
# Full float32 products: on GPUs the default precision rounds float32 operands to TF32.
_EXACT = lax.Precision.HIGHEST
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FP8_MAX = 448.0  # largest finite float8_e4m3fn; quantisation saturates there
_STEP_BYTES = 32 << 20  # temporaries of one chunk step, across the rows of a token block


@dataclasses.dataclass(frozen=True)
class _Static:
    """The hashable options of one attention call."""

    logit_scale: float  # softmax_scale * k_scale
    logits_soft_cap: float | None
    window_left: int  # < 0: unbounded
    causal: bool
    token_major: bool
    v_scale: float
    block_kv: int
    block_tokens: int


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _compute_dtype(query_dtype: Any, cache_dtype: Any) -> Any:
    """fp8 caches are widened to the query's dtype (exactly); other mixes promote."""
    return jnp.dtype(query_dtype) if jnp.dtype(cache_dtype) == _FP8 else jnp.promote_types(query_dtype, cache_dtype)


def _row_metadata(kv_lens, block_tables, query_start_loc, num_seqs, num_rows: int, total_rows: int, page_size: int):
    """Per row r < total_rows: (seq, real, pos, kv_len). seq is clamped into [0, N); real says
    whether a present sequence owns the row (rows from num_rows on never are); pos is the
    row's key position, its query aligned to the end of the sequence's kv_lens keys.
    query_start_loc None: one row per sequence."""
    n, m = block_tables.shape
    if query_start_loc is None:
        query_start_loc = jnp.arange(n + 1, dtype=jnp.int32)
    ns = jnp.clip(num_seqs[0], 0, n)
    bounds = jnp.clip(query_start_loc, 0, num_rows)
    bounds = jnp.where(jnp.arange(n + 1) <= ns, bounds, bounds[ns])  # absent sequences own no rows
    rows = jnp.arange(total_rows, dtype=jnp.int32)
    # A compare-and-count rather than a search or a scan: as cheap to run for serving
    # batches, and far cheaper for XLA to compile.
    seq = jnp.sum(bounds[None, :] <= rows[:, None], axis=1, dtype=jnp.int32) - 1
    real = (seq >= 0) & (seq < ns)
    seq = jnp.clip(seq, 0, n - 1)
    real &= (bounds[seq] <= rows) & (rows < bounds[seq + 1])  # out-of-order bounds own no rows
    q_len = bounds[seq + 1] - bounds[seq]
    kv_len = jnp.clip(kv_lens[seq], 0, m * page_size)
    pos = kv_len - q_len + rows - bounds[seq]
    return seq, real, pos, kv_len


def _visible_ranges(st: _Static, kv_lens, block_tables, query_start_loc, num_seqs, kv_starts,
                    num_rows: int, total_rows: int, page_size: int):
    """Per row: (seq, real, lo, count): the row sees keys lo .. lo + count - 1."""
    seq, real, pos, kv_len = _row_metadata(kv_lens, block_tables, query_start_loc, num_seqs, num_rows, total_rows,
                                           page_size)
    hi = jnp.minimum(kv_len, pos + 1) if st.causal else kv_len
    lo = jnp.zeros_like(hi) if kv_starts is None else jnp.clip(kv_starts[seq], 0, kv_len)
    if st.window_left >= 0:
        lo = jnp.maximum(lo, pos - st.window_left)
    count = jnp.where(real, jnp.maximum(hi - lo, 0), 0)
    return seq, real, jnp.maximum(lo, 0), count


def _gather(cache: Array, token_major: bool, page: Array, slot: Array) -> Array:
    """cache entries (page, slot) for [rows, keys] index arrays: [rows, keys, Hkv, D]."""
    index = (page, slot) if token_major else (page, slice(None), slot)
    return cache.at[index].get(mode="promise_in_bounds")  # callers clamp every index


def _attend_block(st: _Static, key_cache, value_cache, block_tables, sinks, q, seq, real, lo, count):
    """One token block: q [bt, Hkv, G, D] and per-row metadata [bt] -> out [bt, Hkv, G, D] (f32)."""
    bt, kv_heads, group, _ = q.shape
    num_pages, m = key_cache.shape[0], block_tables.shape[1]
    page_size = key_cache.shape[1 if st.token_major else 2]
    chunk = st.block_kv
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    dtype = q.dtype
    if sinks is None:
        m0 = jnp.full((bt, kv_heads, group), -jnp.inf, _F32)
        l0 = jnp.zeros((bt, kv_heads, group), _F32)
    else:  # the sink is a logit every real row sees, with no value
        m0 = jnp.where(real[:, None, None], sinks[None], -jnp.inf)
        l0 = jnp.broadcast_to(jnp.where(real, 1.0, 0.0).astype(_F32)[:, None, None], m0.shape)

    def step(i, carry):
        m_run, l_run, acc = carry
        keys = lo[:, None] + i * chunk + offsets  # [bt, chunk]
        visible = keys < (lo + count)[:, None]
        column = jnp.clip(keys // page_size, 0, m - 1)
        page = block_tables.at[seq[:, None], column].get(mode="promise_in_bounds")
        page = jnp.clip(page, 0, num_pages - 1)
        slot = keys % page_size
        k = _gather(key_cache, st.token_major, page, slot).astype(dtype)
        v = _gather(value_cache, st.token_major, page, slot).astype(dtype)
        s = jnp.einsum("thgd,tchd->thgc", q, k, preferred_element_type=_F32, precision=_EXACT)
        s = s * jnp.float32(st.logit_scale)
        if st.logits_soft_cap is not None:
            cap = jnp.float32(st.logits_soft_cap)
            s = cap * jnp.tanh(s / cap)
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_run, s.max(-1))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # keeps exp() NaN-free in rows that see nothing yet
        p = jnp.exp(s - m_ref[..., None])
        alpha = jnp.exp(m_run - m_ref)
        # Hidden slots may hold anything (unwritten pages): zero them so that 0 * NaN cannot reach acc.
        v = jnp.where(visible[:, :, None, None], v, jnp.zeros((), dtype))
        pv = jnp.einsum("thgc,tchd->thgd", p.astype(dtype), v, preferred_element_type=_F32, precision=_EXACT)
        return m_new, alpha * l_run + p.sum(-1), alpha[..., None] * acc + pv

    steps = (count.max() + chunk - 1) // chunk
    _, l_run, acc = lax.fori_loop(0, steps, step, (m0, l0, jnp.zeros(q.shape, _F32)))
    return acc * (jnp.float32(st.v_scale) / jnp.where(l_run > 0, l_run, 1.0))[..., None]


@functools.partial(jax.jit, static_argnums=0)
def _attention(st: _Static, query, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs,
               kv_starts, sinks):
    t, hq, d = query.shape
    kv_heads = key_cache.shape[2 if st.token_major else 1]
    page_size = key_cache.shape[1 if st.token_major else 2]
    group = hq // kv_heads
    bt = st.block_tokens
    t_pad = _round_up(t, bt)
    seq, real, lo, count = _visible_ranges(st, kv_lens, block_tables, query_start_loc, num_seqs, kv_starts, t,
                                           t_pad, page_size)
    dtype = _compute_dtype(query.dtype, key_cache.dtype)
    q = jnp.pad(query.astype(dtype), ((0, t_pad - t), (0, 0), (0, 0))).reshape(t_pad // bt, bt, kv_heads, group, d)
    aux = None if sinks is None else sinks.astype(_F32).reshape(kv_heads, group)

    def block(xs):
        return _attend_block(st, key_cache, value_cache, block_tables, aux, *xs)

    blocks = (q, *(x.reshape(t_pad // bt, bt) for x in (seq, real, lo, count)))
    out = block([x[0] for x in blocks])[None] if t_pad == bt else lax.map(block, blocks)
    return out.reshape(t_pad, hq, d)[:t].astype(query.dtype)


def step_bytes_per_key(num_q_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: Any, query_dtype: Any) -> int:
    """Temporaries one (row, key) pair of a step holds: the gathered key and value in the
    cache dtype and widened, and the logits, probabilities and mask of every q head."""
    wide = jnp.dtype(_compute_dtype(query_dtype, cache_dtype)).itemsize
    return num_kv_heads * head_dim * 2 * (jnp.dtype(cache_dtype).itemsize + wide) + num_q_heads * 4 * 3


def default_block_kv(num_tokens: int, longest: int, per_key: int) -> int:
    """Keys per chunk: the longest power of two in [16, 512] with which all rows fit one
    step's budget (fewer chunks for few rows, e.g. decoding), never much past the longest
    possible context."""
    chunk = 512
    while chunk > 16 and num_tokens * chunk * per_key > _STEP_BYTES:
        chunk //= 2
    return max(8, min(chunk, -(-longest // 8) * 8))


def default_block_tokens(num_tokens: int, block_kv: int, per_key: int) -> int:
    """Rows per token block: as many as keep one step's temporaries within the budget,
    balanced so that the last block is not mostly padding."""
    most = max(1, _STEP_BYTES // (block_kv * per_key))
    blocks = -(-num_tokens // most)
    return max(1, -(-num_tokens // max(1, blocks)))


def paged_attention_xla(
    query: Float[Array, "num_tokens num_q_heads head_dim"],
    key_cache: Float[Array, "num_pages ..."],
    value_cache: Float[Array, "num_pages ..."],
    kv_lens: Int[Array, " max_num_seqs"],
    block_tables: Int[Array, "max_num_seqs pages_per_seq"],
    query_start_loc: Int[Array, " max_num_seqs_plus_1"] | None,
    num_seqs: Int[Array, " 1"],
    *,
    kv_starts: Int[Array, " max_num_seqs"] | None = None,
    sinks: Float[Array, " num_q_heads"] | None = None,
    softmax_scale: float,
    logits_soft_cap: float | None = None,
    window_left: int = -1,
    causal: bool = True,
    kv_layout: str = "head_major",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_kv: int = 64,
    block_tokens: int | None = None,
) -> Float[Array, "num_tokens num_q_heads head_dim"]:
    """The paged attention core (params.h) on normalised arguments (see `_validate.PagedArgs`).

    key_cache/value_cache are [P, Hkv, S, D] for kv_layout "head_major" and [P, S, Hkv, D]
    for "token_major"; query_start_loc None means one query row per sequence. Returns out
    [T, Hq, D] in the query's dtype; rows no present sequence owns, and rows that see no key
    and have no sink, are 0. block_kv: keys per chunk; block_tokens: rows per token block
    (None: from the memory budget).
    """
    token_major = kv_layout == "token_major"
    t, hq, d = query.shape
    kv_heads = key_cache.shape[2 if token_major else 1]
    if t == 0 or block_tables.shape[0] == 0 or block_tables.shape[1] == 0 or key_cache.shape[0] == 0:
        return jnp.zeros(query.shape, query.dtype)  # no row can see a key
    block_kv = max(1, int(block_kv))
    if block_tokens is None:
        per_key = step_bytes_per_key(hq, kv_heads, d, key_cache.dtype, query.dtype)
        block_tokens = default_block_tokens(t, block_kv, per_key)
    st = _Static(
        logit_scale=float(softmax_scale) * float(k_scale),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        window_left=int(window_left),
        causal=bool(causal),
        token_major=token_major,
        v_scale=float(v_scale),
        block_kv=block_kv,
        block_tokens=max(1, min(int(block_tokens), t)),
    )
    return _attention(st, query, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                      kv_starts, sinks)


def quantize(x: Array, scale: float, dtype: Any) -> Array:
    """x in the cache dtype, rounded to nearest even: for fp8, x / scale saturated at
    +-448; other dtypes store x itself (params.h CacheUpdateParams)."""
    y = x.astype(_F32)
    if jnp.dtype(dtype) == _FP8:
        y = jnp.clip(y / jnp.float32(scale), -_FP8_MAX, _FP8_MAX)  # NaN stays NaN
    return y.astype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _cache_update(token_major: bool, k_scale: float, v_scale: float, new_keys, new_values, key_cache, value_cache,
                  kv_lens, block_tables, query_start_loc, num_seqs):
    t = new_keys.shape[0]
    num_pages = key_cache.shape[0]
    page_size = key_cache.shape[1 if token_major else 2]
    m = block_tables.shape[1]
    seq, real, pos, _ = _row_metadata(kv_lens, block_tables, query_start_loc, num_seqs, t, t, page_size)
    page = block_tables[seq, jnp.clip(pos // page_size, 0, m - 1)]
    keep = real & (pos >= 0) & (pos < m * page_size) & (page >= 0) & (page < num_pages)
    page = jnp.where(keep, page, num_pages)  # an out-of-range page: the write is dropped
    slot = pos % page_size
    index = (page, slot) if token_major else (page, slice(None), slot)
    key_cache = key_cache.at[index].set(quantize(new_keys, k_scale, key_cache.dtype), mode="drop")
    value_cache = value_cache.at[index].set(quantize(new_values, v_scale, value_cache.dtype), mode="drop")
    return key_cache, value_cache


def paged_kv_cache_update_xla(
    new_keys: Float[Array, "num_tokens num_kv_heads head_dim"],
    new_values: Float[Array, "num_tokens num_kv_heads head_dim"],
    key_cache: Float[Array, "num_pages ..."],
    value_cache: Float[Array, "num_pages ..."],
    kv_lens: Int[Array, " max_num_seqs"],
    block_tables: Int[Array, "max_num_seqs pages_per_seq"],
    query_start_loc: Int[Array, " max_num_seqs_plus_1"] | None,
    num_seqs: Int[Array, " 1"],
    *,
    kv_layout: str = "head_major",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[Array, Array]:
    """Writes each present row's new key and value at its position (params.h
    CacheUpdateParams; query_start_loc None: one row per sequence): row r of sequence n
    goes to key kv_lens[n] - q_len + (r - qsl[n]), as value / scale into fp8 caches and as
    the value itself into others, rounded to nearest even. Rows of absent sequences, and rows
    whose position or page is out of range, write nothing. Returns the updated (key_cache,
    value_cache): a scatter that XLA performs in place when the caches are donated to the
    enclosing jit."""
    if new_keys.shape[0] == 0 or block_tables.shape[0] == 0 or block_tables.shape[1] == 0 or key_cache.shape[0] == 0:
        return key_cache, value_cache
    return _cache_update(kv_layout == "token_major", float(k_scale), float(v_scale), new_keys, new_values, key_cache,
                         value_cache, kv_lens, block_tables, query_start_loc, num_seqs)
