"""Materialised flash attention reference, written straight from csrc/flash_attention/semantics.h.

It builds the full score matrix, so it is only for test sizes. By default it computes in
float64 (x64 is switched on only inside these functions); `compute_dtype` evaluates the same
formulas in a lower precision, which tells the tests how much error that precision alone
brings. Masks and the dropout hash are computed in NumPy, independently of the
implementations under test.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DROPOUT_SALT = 0x9E3779B9


def fmix32(x: Any) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser on uint32 arrays (wrapping)."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x85EBCA6B)
        x = x ^ (x >> np.uint32(13))
        x = x * np.uint32(0xC2B2AE35)
        x = x ^ (x >> np.uint32(16))
    return x


def dropout_threshold(dropout_prob: float) -> int:
    return int(float(np.float32(dropout_prob)) * 2**16)


def dropout_scale(dropout_prob: float) -> float:
    """1 / (1 - p), evaluated in float32 as the kernels do."""
    return float(np.float32(1.0) / (np.float32(1.0) - np.float32(dropout_prob)))


def dropout_keep_mask(seed: int, batch: int, num_q_heads: int, seqlen_q: int, seqlen_k: int,
                      dropout_prob: float, cum_seqlens_k=None) -> np.ndarray:
    """bool [batch, num_q_heads, seqlen_q, seqlen_k]: which probabilities dropout keeps. Keys
    are hashed by their index in their sequence (cum_seqlens_k: packed sequences); keys j and
    j + 8 of each group of 16 share a hash, j its low 16 bits."""
    seed = np.uint32(int(seed) & 0xFFFFFFFF)
    batch_head = np.arange(batch * num_q_heads, dtype=np.uint32).reshape(batch, num_q_heads, 1, 1)
    i = np.arange(seqlen_q, dtype=np.uint32).reshape(1, 1, seqlen_q, 1)
    j = np.arange(seqlen_k, dtype=np.int64)
    if cum_seqlens_k is not None:
        starts = np.asarray(cum_seqlens_k, np.int64)
        j = j - starts[np.clip(np.searchsorted(starts, j, side="right") - 1, 0, len(starts) - 1)]
    j = j.astype(np.uint32).reshape(1, 1, 1, seqlen_k)
    row_key = fmix32(i ^ fmix32(batch_head ^ fmix32(seed ^ np.uint32(DROPOUT_SALT))))
    eight = np.uint32(8)
    draw = (fmix32((j & ~eight) ^ row_key) >> ((j & eight) << np.uint32(1))) & np.uint32(0xFFFF)
    return draw >= np.uint32(dropout_threshold(dropout_prob))


def visibility(batch: int, num_q_heads: int, seqlen_q: int, seqlen_k: int, *, attention_mask=None,
               cum_seqlens_q=None, cum_seqlens_k=None, q_segment_ids=None, kv_segment_ids=None,
               causal: bool = False, sliding_window: tuple[int, int] | None = None):
    """(visible bool [B, Hq, Sq, Sk], in_sequence bool [Sq]: rows that belong to a sequence)."""
    left, right = sliding_window if sliding_window is not None else (-1, -1)
    if cum_seqlens_q is not None:
        cu_q, cu_k = np.asarray(cum_seqlens_q), np.asarray(cum_seqlens_k)
        spans = [(cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]) for n in range(len(cu_q) - 1)]
    else:
        spans = [(0, seqlen_q, 0, seqlen_k)]
    visible = np.zeros((seqlen_q, seqlen_k), dtype=bool)
    in_sequence = np.zeros(seqlen_q, dtype=bool)
    for q_begin, q_end, k_begin, k_end in spans:
        len_q, len_k = int(q_end - q_begin), int(k_end - k_begin)
        i = np.arange(len_q)[:, None]
        j = np.arange(len_k)[None, :]
        diagonal = i + (len_k - len_q)  # bottom-right aligned
        ok = np.ones((len_q, len_k), dtype=bool)
        if causal:
            ok &= j <= diagonal
        if left >= 0:
            ok &= j >= diagonal - left
        if right >= 0:
            ok &= j <= diagonal + right
        visible[q_begin:q_end, k_begin:k_end] = ok
        in_sequence[q_begin:q_end] = True
    visible = np.broadcast_to(visible, (batch, num_q_heads, seqlen_q, seqlen_k)).copy()
    if attention_mask is not None:
        visible &= np.asarray(attention_mask, dtype=bool)
    if q_segment_ids is not None:
        seg_q, seg_kv = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
        visible &= seg_q[:, None, :, None] == seg_kv[:, None, None, :]
    return visible, in_sequence


def _products(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k)


@jax.custom_vjp
def _products_spread(q, k):
    """q . k, whose vjp gives each gradient element the root sum of squares of the terms it
    sums instead of their sum: the spread of independent errors in the cotangents."""
    return _products(q, k)


def _products_spread_fwd(q, k):
    return _products(q, k), (q, k)


def _products_spread_bwd(residuals, g):
    q, k = residuals
    return (jnp.sqrt(jnp.einsum("bhqk,bkhd->bqhd", g * g, k * k)),
            jnp.sqrt(jnp.einsum("bhqk,bqhd->bkhd", g * g, q * q)))


_products_spread.defvjp(_products_spread_fwd, _products_spread_bwd)


def _attention(q, k, v, bias, aux, *, visible, in_sequence, keep, softmax_scale, logits_soft_cap,
               products=_products):
    """out [B, Sq, Hq, D], lse [B, Hq, Sq] in the dtype of q; keep is the dropout multiplier or None."""
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    logits = products(q, k) * softmax_scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if bias is not None:
        logits = logits + bias
    logits = jnp.where(visible, logits, 0)  # hidden logits never reach exp, so no inf * 0 in grads
    row_max = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=-1)
    if aux is not None:
        sink = jnp.where(in_sequence[None, None, :], aux[None, :, None], -jnp.inf)
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0))
    weights = jnp.where(visible, jnp.exp(logits - row_max[..., None]), 0)
    total = weights.sum(axis=-1)
    if aux is not None:
        total = total + jnp.exp(sink - row_max)
    nonempty = total > 0
    total_safe = jnp.where(nonempty, total, 1)
    lse = jnp.where(nonempty, row_max + jnp.log(total_safe), -jnp.inf)
    probs = weights / total_safe[..., None]
    if keep is not None:
        probs = probs * keep
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse


def _prepare(query, key, value, bias, softmax_aux, attention_mask, cum_seqlens_q, cum_seqlens_k,
             q_segment_ids, kv_segment_ids, causal, sliding_window, dropout_prob, dropout_seed,
             compute_dtype):
    batch, seqlen_q, num_q_heads, _ = query.shape
    seqlen_k = key.shape[1]
    visible, in_sequence = visibility(
        batch, num_q_heads, seqlen_q, seqlen_k, attention_mask=attention_mask, cum_seqlens_q=cum_seqlens_q,
        cum_seqlens_k=cum_seqlens_k, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        causal=causal, sliding_window=sliding_window)
    keep = None
    if dropout_prob > 0:
        kept = dropout_keep_mask(int(np.asarray(dropout_seed)), batch, num_q_heads, seqlen_q, seqlen_k, dropout_prob,
                                 None if cum_seqlens_k is None else np.asarray(cum_seqlens_k))
        keep = jnp.asarray(np.where(kept, dropout_scale(dropout_prob), 0.0), compute_dtype)

    def cast(x):
        return None if x is None else jnp.asarray(np.asarray(x, dtype=np.float64), compute_dtype)

    arrays = tuple(cast(x) for x in (query, key, value, bias, softmax_aux))
    static = {"visible": jnp.asarray(visible), "in_sequence": jnp.asarray(in_sequence), "keep": keep}
    return arrays, static


def attention_reference(query, key, value, *, bias=None, attention_mask=None, softmax_aux=None,
                        cum_seqlens_q=None, cum_seqlens_k=None, q_segment_ids=None, kv_segment_ids=None,
                        softmax_scale: float, causal: bool = False, sliding_window=None,
                        logits_soft_cap: float | None = None, dropout_prob: float = 0.0, dropout_seed=None,
                        return_lse: bool = True, compute_dtype=np.float64, deterministic: bool = False):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]) as NumPy arrays of compute_dtype (just out
    without return_lse). Bias broadcasts from [Bb, Hb, Sq, Sk] like the kernels'.
    `deterministic` (a kernel option) changes nothing here."""
    with jax.enable_x64(True):
        (q, k, v, b, aux), static = _prepare(
            query, key, value, bias, softmax_aux, attention_mask, cum_seqlens_q, cum_seqlens_k,
            q_segment_ids, kv_segment_ids, causal, sliding_window, dropout_prob, dropout_seed, compute_dtype)
        out, lse = jax.jit(lambda *a: _attention(*a, **static, softmax_scale=softmax_scale,
                                                 logits_soft_cap=logits_soft_cap))(q, k, v, b, aux)
        out, lse = np.asarray(out), np.asarray(lse)
    return (out, lse) if return_lse else out


def reference_grads(query, key, value, *, dout, dlse=None, bias=None, attention_mask=None, softmax_aux=None,
                    cum_seqlens_q=None, cum_seqlens_k=None, q_segment_ids=None, kv_segment_ids=None,
                    softmax_scale: float, causal: bool = False, sliding_window=None,
                    logits_soft_cap: float | None = None, dropout_prob: float = 0.0, dropout_seed=None,
                    return_outputs: bool = False, compute_dtype=np.float64, deterministic: bool = False,
                    delta_error: float | None = None):
    """Gradients of <out, dout> + <lse, dlse> for query, key, value and, when given, bias
    (in its broadcast shape) and softmax_aux, by autodiff of the reference: a dict keyed by
    argument name. With return_outputs, (out, lse, grads) from the same evaluation.

    With delta_error (a dtype's epsilon), one more dict, last: per element, how far each
    gradient moves when the flash backward's delta_i = sum_d dout_id out_id is off by
    delta_error * ||dout_i * out_i||_2. A flash backward computes dS = P (dP - delta) with
    delta from the output in its dtype, summed in another order than dP; an error in delta
    enters every gradient as an error in the lse cotangent does. Where a row's softmax is
    nearly one-hot (one visible key, the first row of a causal sequence) dP - delta cancels
    almost entirely and that error outweighs the same-dtype reference's."""
    with jax.enable_x64(True):
        (q, k, v, b, aux), static = _prepare(
            query, key, value, bias, softmax_aux, attention_mask, cum_seqlens_q, cum_seqlens_k,
            q_segment_ids, kv_segment_ids, causal, sliding_window, dropout_prob, dropout_seed, compute_dtype)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        cotangents = (jnp.asarray(np.asarray(dout, np.float64), compute_dtype),
                      jnp.zeros(lse_shape, compute_dtype) if dlse is None
                      else jnp.asarray(np.asarray(dlse, np.float64), compute_dtype))

        def outputs_and_grads(q, k, v, b, aux, cotangents):
            def fn(q, k, v, b, aux, products=_products):
                return _attention(q, k, v, b, aux, **static, softmax_scale=softmax_scale,
                                  logits_soft_cap=logits_soft_cap, products=products)

            outputs, vjp = jax.vjp(fn, q, k, v, b, aux)
            if delta_error is None:
                return outputs, vjp(cotangents), None
            out = outputs[0]
            slack = (jnp.zeros_like(out),
                     delta_error * jnp.sqrt(jnp.sum(jnp.square(cotangents[0] * out), axis=-1)).transpose(0, 2, 1))
            # The rows' delta errors have independent signs: a dquery or dkey element moves by
            # about the root sum of squares of its rows' terms, and the signed sum alone can
            # cancel by chance.
            _, vjp_spread = jax.vjp(functools.partial(fn, products=_products_spread), q, k, v, b, aux)
            moved = jax.tree.map(lambda signed, spread: jnp.maximum(jnp.abs(signed), spread),
                                 vjp(slack), vjp_spread(slack))
            return outputs, vjp(cotangents), moved

        def by_name(dq, dk, dv, db, daux):
            named = {"query": np.asarray(dq), "key": np.asarray(dk), "value": np.asarray(dv)}
            if bias is not None:
                named["bias"] = np.asarray(db)
            if softmax_aux is not None:
                named["softmax_aux"] = np.asarray(daux)
            return named

        (out, lse), raw_grads, raw_moved = jax.jit(outputs_and_grads)(q, k, v, b, aux, cotangents)
        grads = by_name(*raw_grads)
        out, lse = np.asarray(out), np.asarray(lse)
    result = (out, lse, grads) if return_outputs else grads
    if delta_error is None:
        return result
    moved = {name: np.abs(m) for name, m in by_name(*raw_moved).items()}
    return (*result, moved) if return_outputs else (grads, moved)
