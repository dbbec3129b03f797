"""Flash attention in pure JAX: the implementation every device can run.

Blocked online softmax with O(N) memory: a loop over query blocks, and inside it a loop
over the key blocks that the causal/window masks and the packed sequences leave visible.
The backward (FA2) recomputes the probabilities from the saved log-sum-exp, block by block.
Every formula is the one in csrc/flash_attention/semantics.h, so the native kernels and this
implementation agree to rounding, dropout mask included.

Internally queries are laid out [q_blocks, batch, kv_heads, group, block_q, head_dim] and
keys/values [k_blocks, batch, kv_heads, block_k, head_dim]: each query head h attends with
kv head h // group, and K/V are never repeated per query head.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jaxtyping import Array, Bool, Float, Int, UInt32

_F32 = jnp.float32
# Full float32 products: on GPUs the default precision rounds float32 operands to TF32.
_EXACT = jax.lax.Precision.HIGHEST
_DROPOUT_SALT = np.uint32(0x9E3779B9)


@dataclasses.dataclass(frozen=True)
class _Static:
    """The hashable options of one call."""

    softmax_scale: float
    causal: bool
    window_left: int  # < 0: unbounded
    window_right: int  # < 0: unbounded
    logits_soft_cap: float | None
    dropout_prob: float
    seq_k: int  # keys at or past this index are padding
    mask_key_padding: bool  # False when the packed-sequence ids already hide padding keys


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _block_size(block: int, seq: int) -> int:
    """The requested block, shrunk to the sequence (a multiple of 8) when that is shorter."""
    return max(1, min(block, max(8, _round_up(seq, 8))))


def _at(x: Array, i: Array) -> Array:
    return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _fmix32(x: Array) -> Array:
    """MurmurHash3's 32-bit finaliser (semantics.h Fmix32), wrapping uint32 arithmetic."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _dropout_row_keys(seed: Array, qi: Array, batch: int, kv_heads: int, group: int, block_q: int) -> Array:
    """DropoutRowKey(seed, b * num_q_heads + h, i) for the rows of query block qi: [b, kv, g, bq]."""
    heads = jnp.arange(batch, dtype=jnp.uint32)[:, None, None] * np.uint32(kv_heads * group)
    heads = heads + jnp.arange(kv_heads * group, dtype=jnp.uint32).reshape(kv_heads, group)
    head_keys = _fmix32(heads ^ _fmix32(seed.astype(jnp.uint32) ^ _DROPOUT_SALT))
    rows = (qi * block_q + jnp.arange(block_q, dtype=jnp.int32)).astype(jnp.uint32)
    return _fmix32(rows ^ head_keys[..., None])


def _dropout_multiplier(st: _Static, row_keys: Array, kj: Array, block_k: int, meta: dict) -> Array:
    """1 / (1 - p) where DropoutKeep holds for (row, key), 0 where the element is dropped."""
    threshold = np.uint32(int(float(np.float32(st.dropout_prob)) * 2**16))
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(st.dropout_prob))
    # Keys by their index in their sequence; DropoutDraw: keys j and j + 8 of each group of 16
    # share a hash, j % 16 < 8 its low half.
    if meta["k_local"] is not None:
        cols = _at(meta["k_local"], kj).astype(jnp.uint32)
    else:
        cols = (kj * block_k + jnp.arange(block_k, dtype=jnp.int32)).astype(jnp.uint32)
    draws = (_fmix32((cols & ~np.uint32(8)) ^ row_keys[..., None]) >> ((cols & 8) << 1)) & 0xFFFF
    keep = draws >= threshold
    return jnp.where(keep, scale, np.float32(0.0))


def _tile(x: Array, qi: Array, kj: Array, shape: tuple[int, ...]) -> Array:
    """Block (qi, kj) of a [Bx, Hx, Sq, Sk] bias or mask, as [Bx, kv, g, bq, bk] or [Bx, 1, 1, bq, bk]."""
    _, kv_heads, group, block_q, block_k = shape
    bx, hx = x.shape[:2]
    tile = lax.dynamic_slice(x, (0, 0, qi * block_q, kj * block_k), (bx, hx, block_q, block_k))
    heads = (kv_heads, group) if hx == kv_heads * group else (1, 1)
    return tile.reshape(bx, *heads, block_q, block_k)


def _visible(st: _Static, qi: Array, kj: Array, shape: tuple[int, ...], mask: Any, meta: dict) -> Array | None:
    """Which logits of block (qi, kj) are visible (broadcastable to shape), None if all are."""
    block_k = shape[-1]
    cols = kj * block_k + jnp.arange(block_k, dtype=jnp.int32)
    terms = []
    if st.mask_key_padding:
        terms.append(cols < st.seq_k)
    if meta["diag"] is not None:
        diag = _at(meta["diag"], qi)[:, None]
        if st.causal:
            terms.append(cols <= diag)
        if st.window_left >= 0:
            terms.append(cols >= diag - st.window_left)
        if st.window_right >= 0:
            terms.append(cols <= diag + st.window_right)
    if meta["q_seq"] is not None:
        terms.append(_at(meta["q_seq"], qi)[:, None] == _at(meta["k_seq"], kj)[None, :])
    if meta["q_seg"] is not None:
        same = _at(meta["q_seg"], qi)[:, :, None] == _at(meta["kv_seg"], kj)[:, None, :]
        terms.append(same[:, None, None])
    if mask is not None:
        terms.append(_tile(mask, qi, kj, shape))
    return functools.reduce(operator.and_, terms) if terms else None


def _logits(st: _Static, qb: Array, kb: Array, qi: Array, kj: Array, bias: Any, mask: Any, meta: dict):
    """Logits of block (qi, kj) in f32 with hidden ones at -inf, and tanh(logit / cap) (None without cap)."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qb, kb, preferred_element_type=_F32, precision=_EXACT) * np.float32(st.softmax_scale)
    shape = s.shape
    tanh = None
    if st.logits_soft_cap is not None:
        cap = np.float32(st.logits_soft_cap)
        tanh = jnp.tanh(s / cap)
        s = cap * tanh
    if bias is not None:
        s = s + _tile(bias, qi, kj, shape).astype(_F32)
    visible = _visible(st, qi, kj, shape, mask, meta)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    return s, tanh


def _varying(values: Any, *operands: Any) -> Any:
    """`values` plus a zero computed from every operand, so that inside shard_map they vary
    over every mesh axis some operand varies over. Loop carries must keep the type their
    body gives them, and the custom VJP's cotangents must have their primal's type; making
    the primals uniformly varying first lets autodiff insert the psums for invariant ones."""
    zero = sum(jnp.sum(x.reshape(-1)[:0], dtype=_F32) for x in jax.tree.leaves(operands))
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), values)


def _loop_bounds(bounds: Array | None, i: Array, n: int) -> tuple[Any, Any]:
    return (0, n) if bounds is None else (bounds[0, i], bounds[1, i])


def _forward(st: _Static, q, k, v, bias, aux, mask, meta, seed):
    nq, batch, kv_heads, group, block_q, _ = q.shape
    nk, block_k = k.shape[0], k.shape[3]

    def query_block(qi):
        qb = _at(q, qi)
        rows = (batch, kv_heads, group, block_q)
        row_keys = _dropout_row_keys(seed, qi, batch, kv_heads, group, block_q) if st.dropout_prob > 0 else None
        if aux is None:
            m0, l0 = jnp.full(rows, -jnp.inf, _F32), jnp.zeros(rows, _F32)
        else:
            # The sink enters as a logit that is always visible and carries no value.
            m0, l0 = jnp.broadcast_to(aux[:, :, None], rows), jnp.ones(rows, _F32)
            if meta["q_seq"] is not None:  # rows outside every sequence have no sink
                real = _at(meta["q_seq"], qi) >= 0
                m0, l0 = jnp.where(real, m0, -jnp.inf), jnp.where(real, l0, 0.0)

        def key_block(kj, carry):
            m, l, acc = carry
            s, _ = _logits(st, qb, _at(k, kj), qi, kj, bias, mask, meta)
            m_new = jnp.maximum(m, s.max(-1))
            m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # keeps exp() NaN-free in empty rows
            p = jnp.exp(s - m_ref[..., None])
            alpha = jnp.exp(m - m_ref)
            l = alpha * l + p.sum(-1)
            if row_keys is not None:
                p = p * _dropout_multiplier(st, row_keys, kj, block_k, meta)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), _at(v, kj), preferred_element_type=_F32, precision=_EXACT)
            return m_new, l, alpha[..., None] * acc + pv

        start, stop = _loop_bounds(meta["k_blocks"], qi, nk)
        init = _varying((m0, l0, jnp.zeros(qb.shape, _F32)), q)
        m, l, acc = lax.fori_loop(start, stop, key_block, init)
        some = l > 0
        l_safe = jnp.where(some, l, 1.0)
        lse = jnp.where(some, m + jnp.log(l_safe), -jnp.inf)
        return (acc / l_safe[..., None]).astype(q.dtype), lse

    return lax.map(query_block, jnp.arange(nq, dtype=jnp.int32))


def _reduce_to_bias(ds: Array, bias_shape: tuple[int, ...]) -> Array:
    """Sums a [b, kv, g, bq, bk] block over the dims the bias broadcasts along."""
    batch, kv_heads, group, block_q, block_k = ds.shape
    ds = ds.reshape(batch, kv_heads * group, block_q, block_k)
    if bias_shape[1] == 1:
        ds = ds.sum(1, keepdims=True)
    if bias_shape[0] == 1:
        ds = ds.sum(0, keepdims=True)
    return ds


def _backward(st: _Static, q, k, v, bias, aux, mask, meta, seed, out, lse, dout, dlse, bias_grad: bool):
    nq, batch, kv_heads, group, block_q, _ = q.shape
    nk, block_k = k.shape[0], k.shape[3]
    # d lse_i / d logit_ij = P_ij, so lse's cotangent enters through delta.
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1) - dlse
    lse_ref = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # empty rows: P = exp(s - inf) = 0
    dtype = q.dtype
    scale = np.float32(st.softmax_scale)

    def key_block(dq, kj):
        kb, vb = _at(k, kj), _at(v, kj)

        def query_block(qi, carry):
            dk, dv, dq, dbias = carry
            qb, dob = _at(q, qi), _at(dout, qi)
            s, tanh = _logits(st, qb, kb, qi, kj, bias, mask, meta)
            p = jnp.exp(s - _at(lse_ref, qi)[..., None])
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", dob, vb, preferred_element_type=_F32, precision=_EXACT)
            p_dropped = p
            if st.dropout_prob > 0:
                z = _dropout_multiplier(st, _dropout_row_keys(seed, qi, batch, kv_heads, group, block_q), kj, block_k,
                                     meta)
                p_dropped, dp = p * z, dp * z
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p_dropped.astype(dtype), dob, preferred_element_type=_F32, precision=_EXACT)
            ds = p * (dp - _at(delta, qi)[..., None])  # d loss / d logit (after soft cap and bias)
            if bias_grad:
                dbias = lax.dynamic_update_index_in_dim(dbias, _reduce_to_bias(ds, bias.shape), qi, 0)
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            ds = (ds * scale).astype(dtype)
            dq_block = _at(dq, qi) + jnp.einsum("bhgqk,bhkd->bhgqd", ds, kb, preferred_element_type=_F32, precision=_EXACT)
            dq = lax.dynamic_update_index_in_dim(dq, dq_block, qi, 0)
            dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds, qb, preferred_element_type=_F32, precision=_EXACT)
            return dk, dv, dq, dbias

        dbias0 = None
        if bias_grad:
            dbias0 = jnp.zeros((nq, bias.shape[0], bias.shape[1], block_q, block_k), _F32)
        start, stop = _loop_bounds(meta["q_blocks"], kj, nq)
        init = (jnp.zeros(kb.shape, _F32), jnp.zeros(vb.shape, _F32), dq, dbias0)
        init = _varying(init, q)
        dk, dv, dq, dbias = lax.fori_loop(start, stop, query_block, init)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype), dbias)

    dq0 = _varying(jnp.zeros(q.shape, _F32), q)
    dq, (dk, dv, dbias) = lax.scan(key_block, dq0, jnp.arange(nk, dtype=jnp.int32))
    if bias_grad:
        # [nk, nq, Bb, Hb, bq, bk] -> [Bb, Hb, nq * bq, nk * bk]
        dbias = dbias.transpose(2, 3, 1, 4, 0, 5).reshape(bias.shape).astype(bias.dtype)
    daux = None
    if aux is not None:
        # d lse_i / d aux = exp(aux - lse_i), and out_i's normaliser moves with it: -exp(aux - lse_i) * delta_i.
        weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(aux[:, :, None] - lse_ref))
        daux = -jnp.sum(weight * delta, axis=(0, 1, 4))
    return dq.astype(dtype), dk, dv, dbias, daux


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, bias, aux, mask, meta, seed):
    return _forward(st, q, k, v, bias, aux, mask, meta, seed)


# Symbolic zeros: a bias that nothing differentiates gets no dbias (its per-block partial sums
# are the backward's largest buffer), and an unused out or lse needs no cotangent array.
def _attention_fwd(st: _Static, *primals):
    q, k, v, bias, aux, mask, meta, seed = jax.tree.map(
        lambda p: p.value, primals, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    out, lse = _forward(st, q, k, v, bias, aux, mask, meta, seed)
    # The flag travels as the residuals' structure (None or an empty array).
    bias_grad = None if bias is None or not primals[3].perturbed else jnp.zeros((0,), jnp.int8)
    return (out, lse), (q, k, v, bias, aux, mask, meta, seed, out, lse, bias_grad)


def _attention_bwd(st: _Static, residuals, cotangents):
    *inputs, out, lse, bias_grad = residuals
    dout, dlse = cotangents
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    if isinstance(dlse, SymbolicZero):
        dlse = jnp.zeros(lse.shape, lse.dtype)
    dq, dk, dv, dbias, daux = _backward(st, *inputs, out, lse, dout, dlse, bias_grad is not None)
    return dq, dk, dv, dbias, daux, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _block_bounds(lo: Array, hi: Array, real: Array, n: int, block: int, other_block: int) -> Array:
    """[2, n] (start, stop) block indices covering [lo, hi) of every real element of each block."""
    real = (real & (hi > lo)).reshape(n, block)
    lo, hi = lo.reshape(n, block), hi.reshape(n, block)
    some = real.any(axis=1)
    start = jnp.where(real, lo, jnp.iinfo(jnp.int32).max).min(axis=1) // other_block
    stop = -(-jnp.where(real, hi, 0).max(axis=1) // other_block)
    return jnp.stack([jnp.where(some, start, 0), jnp.where(some, stop, 0)]).astype(jnp.int32)


def _metadata(st: _Static, sq: int, sq_pad: int, sk_pad: int, block_q: int, block_k: int,
              cu_q, cu_k, q_segment_ids, kv_segment_ids) -> dict:
    """Per-row and per-key integer data the blocks need, and the key (query) blocks each
    query (key) block must visit. All O(Sq + Sk)."""
    sk = st.seq_k
    nq, nk = sq_pad // block_q, sk_pad // block_k
    rows = jnp.arange(sq_pad, dtype=jnp.int32)
    cols = jnp.arange(sk_pad, dtype=jnp.int32)
    meta = {name: None for name in ("diag", "q_seq", "k_seq", "k_local", "q_seg", "kv_seg", "k_blocks", "q_blocks")}
    positional = st.causal or st.window_left >= 0 or st.window_right >= 0
    if cu_q is not None:
        n = cu_q.shape[0] - 1
        q_seq = jnp.searchsorted(cu_q, rows, side="right").astype(jnp.int32) - 1
        k_seq = jnp.searchsorted(cu_k, cols, side="right").astype(jnp.int32) - 1
        q_seq = jnp.where(q_seq < n, q_seq, -1)  # padding rows and keys: ids that never match
        k_seq = jnp.where(k_seq < n, k_seq, -2)
        meta["q_seq"], meta["k_seq"] = q_seq.reshape(nq, block_q), k_seq.reshape(nk, block_k)
        qs, ks = jnp.clip(q_seq, 0, n - 1), jnp.clip(k_seq, 0, n - 1)
        meta["k_local"] = (cols - cu_k[ks]).reshape(nk, block_k)
        # Bottom-right alignment per sequence: the diagonal key of row i is i + (end_k - end_q).
        q_offset, k_offset = cu_k[qs + 1] - cu_q[qs + 1], cu_k[ks + 1] - cu_q[ks + 1]
        key_lo, key_hi, row_lo, row_hi = cu_k[qs], cu_k[qs + 1], cu_q[ks], cu_q[ks + 1]
        row_real, key_real = q_seq >= 0, k_seq >= 0
    else:
        q_offset = k_offset = sk - sq
        key_lo, key_hi, row_lo, row_hi = 0, sk, 0, sq
        row_real, key_real = rows < sq, cols < sk
    diag = rows + q_offset
    if positional:
        meta["diag"] = diag.reshape(nq, block_q)
    if positional or cu_q is not None:
        key_diag = cols - k_offset  # the row whose diagonal is this key
        key_lo, key_hi = jnp.broadcast_to(key_lo, rows.shape), jnp.broadcast_to(key_hi, rows.shape)
        row_lo, row_hi = jnp.broadcast_to(row_lo, cols.shape), jnp.broadcast_to(row_hi, cols.shape)
        if st.causal:
            key_hi, row_lo = jnp.minimum(key_hi, diag + 1), jnp.maximum(row_lo, key_diag)
        if st.window_left >= 0:
            key_lo = jnp.maximum(key_lo, diag - st.window_left)
            row_hi = jnp.minimum(row_hi, key_diag + st.window_left + 1)
        if st.window_right >= 0:
            key_hi = jnp.minimum(key_hi, diag + st.window_right + 1)
            row_lo = jnp.maximum(row_lo, key_diag - st.window_right)
        meta["k_blocks"] = _block_bounds(key_lo, key_hi, row_real, nq, block_q, block_k)
        meta["q_blocks"] = _block_bounds(row_lo, row_hi, key_real, nk, block_k, block_q)
    if q_segment_ids is not None:
        batch = q_segment_ids.shape[0]
        seg_q = jnp.pad(q_segment_ids, ((0, 0), (0, sq_pad - sq)))
        seg_kv = jnp.pad(kv_segment_ids, ((0, 0), (0, sk_pad - sk)))
        meta["q_seg"] = seg_q.reshape(batch, nq, block_q).transpose(1, 0, 2)
        meta["kv_seg"] = seg_kv.reshape(batch, nk, block_k).transpose(1, 0, 2)
    return meta


def _pad_to(x: Array, axis: int, size: int, value: Any = 0) -> Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def flash_attention_xla(
    query: Float[Array, "batch seq_q q_heads head_dim"],
    key: Float[Array, "batch seq_k kv_heads head_dim"],
    value: Float[Array, "batch seq_k kv_heads head_dim"],
    *,
    bias: Float[Array, "bias_batch bias_heads seq_q seq_k"] | None = None,
    attention_mask: Bool[Array, "mask_batch mask_heads seq_q seq_k"] | None = None,
    softmax_aux: Float[Array, " q_heads"] | None = None,
    cum_seqlens_q: Int[Array, " num_seqs_plus_1"] | None = None,
    cum_seqlens_k: Int[Array, " num_seqs_plus_1"] | None = None,
    q_segment_ids: Int[Array, "batch seq_q"] | None = None,
    kv_segment_ids: Int[Array, "batch seq_k"] | None = None,
    softmax_scale: float,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: UInt32[Array, ""] | None = None,
    block_q: int = 128,
    block_k: int = 128,
    deterministic: bool = False,
) -> tuple[Float[Array, "batch seq_q q_heads head_dim"], Float[Array, "batch q_heads seq_q"]]:
    """Attention with the semantics of csrc/flash_attention/semantics.h; returns (out, lse).

    `deterministic` is accepted for a uniform signature: this backward has no atomics.

    Arguments are the normalised ones of `_validate.normalize`. `out` has the query's dtype,
    `lse` (natural log, -inf for rows that see nothing) is float32. Differentiable in query,
    key, value, bias and softmax_aux; memory is O(block_q * block_k + Sq + Sk) per batch and
    head besides the inputs. block_q/block_k shrink to short sequences.
    """
    batch, sq, q_heads, head_dim = query.shape
    sk, kv_heads = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    bq, bk = _block_size(block_q, sq), _block_size(block_k, sk)
    # At least one block each, so empty sequences need no special case.
    sq_pad, sk_pad = max(bq, _round_up(sq, bq)), max(bk, _round_up(sk, bk))
    nq, nk = sq_pad // bq, sk_pad // bk
    window_left, window_right = sliding_window if sliding_window is not None else (-1, -1)
    st = _Static(
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        window_left=int(window_left),
        window_right=int(window_right),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        dropout_prob=float(dropout_prob),
        seq_k=sk,
        mask_key_padding=cum_seqlens_q is None and sk_pad > sk,
    )
    q = _pad_to(query, 1, sq_pad).reshape(batch, nq, bq, kv_heads, group, head_dim).transpose(1, 0, 3, 4, 2, 5)
    k = _pad_to(key, 1, sk_pad).reshape(batch, nk, bk, kv_heads, head_dim).transpose(1, 0, 3, 2, 4)
    v = _pad_to(value, 1, sk_pad).reshape(batch, nk, bk, kv_heads, head_dim).transpose(1, 0, 3, 2, 4)
    if bias is not None:
        bias = _pad_to(_pad_to(bias, 2, sq_pad), 3, sk_pad)
    if attention_mask is not None:
        attention_mask = _pad_to(_pad_to(attention_mask, 2, sq_pad, False), 3, sk_pad, False)
    aux = None if softmax_aux is None else softmax_aux.astype(_F32).reshape(kv_heads, group)
    meta = _metadata(st, sq, sq_pad, sk_pad, bq, bk, cum_seqlens_q, cum_seqlens_k, q_segment_ids, kv_segment_ids)
    seed = dropout_seed if st.dropout_prob > 0 else None
    q, k, v, bias, aux = _varying((q, k, v, bias, aux), q, k, v, bias, aux, attention_mask, meta, seed)
    out, lse = _attention(st, q, k, v, bias, aux, attention_mask, meta, seed)
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, sq_pad, q_heads, head_dim)[:, :sq]
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(batch, q_heads, sq_pad)[:, :, :sq]
    return out, lse
