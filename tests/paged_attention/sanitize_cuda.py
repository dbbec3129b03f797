"""Small-shape runs of every CUDA paged attention path (decode with and without split-KV,
a mixed prefill+decode batch with garbage padding metadata, fp8 cache, the cache update),
for compute-sanitizer memcheck and racecheck."""

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.paged_attention import PagedAttentionConfig
from ejkernel.modules import page_attention, ragged_page_attention, ragged_page_attention_v3

rng = np.random.default_rng()
page, num_pages, q_heads, kv_heads, head_dim = 16, 40, 8, 2, 128


def normal(*shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape), dtype)


calls = 0
for layout in ("head_major", "token_major"):
    shape = (num_pages, kv_heads, page, head_dim) if layout == "head_major" else (num_pages, page, kv_heads, head_dim)
    k_cache, v_cache = normal(*shape), normal(*shape)
    tables = jnp.asarray(rng.permutation(num_pages)[:36].reshape(4, 9), jnp.int32)
    lens = jnp.asarray([1, 37, 140, 97], jnp.int32)
    q = normal(4, q_heads, head_dim)
    for splits in (1, 3):
        jax.block_until_ready(page_attention(q, k_cache, v_cache, lens, tables, kv_layout=layout, platform="cuda",
                                             cfg=PagedAttentionConfig(num_splits=splits)))
        calls += 1
    # Mixed batch: decode, prefill, chunked prefill; the 4th sequence is padding (num_seqs 3).
    qsl = jnp.asarray([0, 1, 30, 47, 50], jnp.int32)
    queries = normal(52, q_heads, head_dim)
    jax.block_until_ready(ragged_page_attention(queries, k_cache, v_cache, jnp.asarray([37, 29, 140, 10**6], jnp.int32),
                                                tables, qsl, jnp.asarray([3], jnp.int32), kv_layout=layout,
                                                sliding_window=64, logits_soft_cap=30.0, platform="cuda"))
    calls += 1
    fp8 = [c.astype(jnp.float8_e4m3fn) for c in (k_cache, v_cache)]
    out, caches = ragged_page_attention_v3(queries, normal(52, kv_heads, head_dim), normal(52, kv_heads, head_dim),
                                           *fp8, jnp.asarray([37, 29, 140, 0], jnp.int32), tables, qsl,
                                           jnp.asarray([3], jnp.int32), k_scale=0.5, v_scale=0.25, kv_layout=layout,
                                           platform="cuda")
    jax.block_until_ready((out, caches))
    calls += 1
print("sanitize_cuda (paged): ran", calls, "calls")
