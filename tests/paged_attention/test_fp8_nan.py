"""A NaN in an fp8 (e4m3fn) cache: the outputs that use it are NaN, every other output is as
without it. e4m3fn has no infinities, and its NaN pattern (magnitude bits all ones) sits
where a finite value would be in a wider format, so a widening by bit shifts must not turn
it into a number."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.paged_attention import normalize
from paged_reference import STATIC, Spec, make_batch, to_f64


def _attention(impl, batch: dict) -> np.ndarray:
    arrays = {k: (None if v is None else jnp.asarray(v)) for k, v in batch.items() if k not in STATIC}
    args = normalize(**arrays, **{k: batch[k] for k in STATIC})
    impl.require(*args.features())
    return to_f64(impl.attention(args))


def test_fp8_nan_propagates(impl, rng):
    # head_dim 64 takes the CUDA tensor-core path, which widens fp8 pairs with integer ops.
    spec = Spec(((1, 40), (1, 33), (6, 70)), q_heads=4, kv_heads=2, head_dim=64, dtype="bfloat16",
                cache_dtype="float8_e4m3fn", k_scale=0.05, v_scale=0.02)
    batch = make_batch(spec, rng)
    clean = _attention(impl, batch)
    assert np.isfinite(clean[:8]).all()

    tables, s = batch["block_tables"], spec.page_size
    # Key 3 of sequence 0 (token 0), kv head 1 (q heads 2, 3): whole rows become NaN.
    batch["key_cache"][tables[0, 0], 1, 3, 5] = np.nan
    # Value of key 10 of sequence 2 (tokens 2..7, all see it), kv head 0: column 7 of q heads 0, 1.
    batch["value_cache"][tables[2, 10 // s], 0, 10 % s, 7] = np.nan
    out = _attention(impl, batch)

    nan = np.zeros(out.shape, bool)
    nan[0, 2:4, :] = True
    nan[2:8, 0:2, 7] = True
    assert np.isnan(out[nan]).all(), f"finite where NaN was expected: {np.argwhere(~np.isnan(out) & nan)[:5]}"
    np.testing.assert_array_equal(out[~nan], clean[~nan])
