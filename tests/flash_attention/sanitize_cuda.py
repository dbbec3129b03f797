"""Small-shape runs of every CUDA flash attention path (forward on the Hopper and mma.sync
kernels, backward in both modes), for compute-sanitizer memcheck and racecheck."""

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.flash_attention import config_candidates, normalize
from ejkernel.modules import flash_attention

rng = np.random.default_rng()


def normal(*shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape), dtype)


calls = 0
# 40, 80 and 232 run on the kernels of 64, 96 and 256, their columns past the head dim unread
# and unwritten in global memory.
for head_dim, seq_q, seq_k in ((64, 37, 45), (96, 75, 130), (128, 131, 200), (192, 66, 140), (256, 70, 135),
                               (40, 37, 45), (80, 75, 130), (232, 70, 135)):
    q, k, v = normal(2, seq_q, 4, head_dim), normal(2, seq_k, 2, head_dim), normal(2, seq_k, 2, head_dim)
    bias = normal(1, 4, seq_q, seq_k, dtype=jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, seq_q, seq_k)) > 0.2)
    aux = normal(4, dtype=jnp.float32)
    runs = [
        dict(),  # Hopper kernel where it runs
        dict(causal=True, sliding_window=(7, 0), logits_soft_cap=20.0, softmax_aux=aux),
        dict(bias=bias, attention_mask=mask, softmax_aux=aux, dropout_prob=0.2, dropout_seed=3),
        dict(causal=True, bias=bias, deterministic=True),
        dict(deterministic=True),  # the Hopper backward's ordered dQ, unmasked and windowed
        dict(causal=True, sliding_window=(40, 5), deterministic=True),
        dict(dropout_prob=0.2, dropout_seed=5),  # the Hopper kernels' dropout
        dict(causal=True, logits_soft_cap=20.0, dropout_prob=0.3, dropout_seed=6, deterministic=True),
    ]
    for kwargs in runs:
        def loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v, platform="cuda", **kwargs).astype(jnp.float32) ** 2)

        jax.block_until_ready(flash_attention(q, k, v, platform="cuda", return_lse=True, **kwargs))
        jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
        calls += 2

    # Packed sequences with padding rows and keys; query tiles shared by the sequences.
    cu = jnp.array([0, 0, 1, 20, seq_q - 5], jnp.int32)
    cu_k = jnp.array([0, 3, 3, 25, seq_k - 5], jnp.int32)

    for deterministic, dropout in ((False, 0.0), (True, 0.0), (False, 0.25)):
        def varlen_loss(q, k, v):
            out = flash_attention(q, k, v, causal=True, softmax_aux=aux, cum_seqlens_q=cu, cum_seqlens_k=cu_k,
                                  deterministic=deterministic, dropout_prob=dropout, dropout_seed=7,
                                  platform="cuda")
            return jnp.sum(out.astype(jnp.float32) ** 2)

        jax.block_until_ready(jax.grad(varlen_loss, argnums=(0, 1, 2))(q[:1], k[:1], v[:1]))
        calls += 1

    # Segment ids (the Hopper segment kernels), with and without a causal mask, with dropout.
    q_ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, seq_q)), axis=1), jnp.int32)
    kv_ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, seq_k)), axis=1), jnp.int32)
    for causal, dropout in ((False, 0.0), (True, 0.0), (True, 0.2)):
        segments = dict(causal=causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids, dropout_prob=dropout,
                        dropout_seed=8, platform="cuda")

        def segments_loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v, **segments).astype(jnp.float32) ** 2)

        jax.block_until_ready(flash_attention(q, k, v, return_lse=True, **segments))
        jax.block_until_ready(jax.grad(segments_loss, argnums=(0, 1, 2))(q, k, v))
        calls += 2
# Banded and causal forwards with more query tiles than an H100 has multiprocessors, so that
# persistent blocks take several tiles (short causal ones in pairs, 9 per head at d128: one
# alone) and reuse their Q slots (O leaves through them).
for batch, head_dim, seq, window in ((4, 64, 2000, (64, 0)), (9, 64, 1000, None), (4, 128, 1100, (64, 0)),
                                     (4, 128, 1100, (250, 0)), (4, 128, 1100, None), (4, 96, 1100, (250, 0)),
                                     (9, 96, 1000, None)):
    q, k, v = (normal(batch, seq, 8, head_dim) for _ in range(3))
    jax.block_until_ready(flash_attention(q, k, v, causal=True, sliding_window=window, platform="cuda",
                                          return_lse=True))
    calls += 1
# Packed causal forwards, one block per tile in sections of 1024 / head_dim heads: two whole
# sections and a partial one, sequences of one block and of several, padding rows after them.
for head_dim in (64, 128, 256):
    q, k, v = (normal(1, 700, 2 * 1024 // head_dim + 3, head_dim) for _ in range(3))
    cu = jnp.array([0, 130, 131, 600], jnp.int32)
    jax.block_until_ready(flash_attention(q, k, v, causal=True, cum_seqlens_q=cu, cum_seqlens_k=cu, platform="cuda",
                                          return_lse=True))
    calls += 1
# A bias or a mask on the Hopper kernels, broadcast or not, causal or not, soft-capped or not,
# deterministic or not; gradients of q, k and v, and of the bias (the Hopper backward; at d192
# and d256 the forward's 64-key tiles and the backward's tile in the P^T buffer). Keys a
# multiple of 16, then not (the operand folded into rows padded to 8 elements). A bias of
# another dtype (the forward's float32 tile): float32 with a mask (folded per batch row), and
# float16 with bf16 inputs (converted); float32 in deterministic mode (d64: the warpgroups' dQ
# halves exchanged through shared memory). Dropout with a bias, and with a mask.
for head_dim, seq_q, seq_k in ((64, 70, 144), (96, 200, 96), (128, 131, 160), (64, 77, 77), (128, 50, 200),
                               (192, 70, 144), (256, 131, 200)):
    q, k, v = normal(2, seq_q, 4, head_dim), normal(2, seq_k, 2, head_dim), normal(2, seq_k, 2, head_dim)
    bias = normal(2, 1, seq_q, seq_k)
    mask = jnp.asarray(rng.random((1, 4, seq_q, seq_k)) > 0.2)
    for dense in (dict(bias=bias), dict(attention_mask=mask, causal=True), dict(bias=bias, logits_soft_cap=5.0),
                  dict(bias=bias, causal=True, deterministic=True), dict(attention_mask=mask, deterministic=True),
                  dict(bias=bias.astype(jnp.float32), attention_mask=mask, causal=True),
                  dict(bias=bias.astype(jnp.float32), causal=True, deterministic=True),
                  dict(bias=bias.astype(jnp.float16), logits_soft_cap=5.0),
                  dict(bias=bias, dropout_prob=0.2, dropout_seed=11),
                  dict(bias=bias.astype(jnp.float32), causal=True, dropout_prob=0.2, dropout_seed=13),
                  dict(attention_mask=mask, causal=True, dropout_prob=0.3, dropout_seed=12, deterministic=True)):
        def dense_loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v, platform="cuda", **dense).astype(jnp.float32) ** 2)

        jax.block_until_ready(flash_attention(q, k, v, platform="cuda", return_lse=True, **dense))
        jax.block_until_ready(jax.grad(dense_loss, argnums=(0, 1, 2))(q, k, v))
        calls += 2

    def bias_loss(q, k, v, bias):
        return jnp.sum(flash_attention(q, k, v, bias=bias, platform="cuda").astype(jnp.float32) ** 2)

    jax.block_until_ready(jax.grad(bias_loss, argnums=(0, 1, 2, 3))(q, k, v, bias))
    jax.block_until_ready(jax.grad(bias_loss, argnums=(0, 1, 2, 3))(q, k, v, bias.astype(jnp.float32)))
    calls += 2

    # A bias with a plane per (batch, head): its gradient stored once per element in its own
    # dtype, without zeroing first where no causal mask lets blocks skip query tiles, with
    # dropout too.
    bias_bh = normal(2, 4, seq_q, seq_k)
    for extra in (dict(), dict(causal=True), dict(dropout_prob=0.2, dropout_seed=3)):
        def own_dtype_loss(q, k, v, bias):
            out = flash_attention(q, k, v, bias=bias, platform="cuda", **extra)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        jax.block_until_ready(jax.grad(own_dtype_loss, argnums=(0, 1, 2, 3))(q, k, v, bias_bh))
        calls += 1

    # The same in the other 16-bit dtype: read as float32 (folded), its gradient in float16.
    def other_dtype_loss(q, k, v, bias):
        return jnp.sum(flash_attention(q, k, v, bias=bias, causal=True, platform="cuda").astype(jnp.float32) ** 2)

    jax.block_until_ready(jax.grad(other_dtype_loss, argnums=(0, 1, 2, 3))(q, k, v, bias_bh.astype(jnp.float16)))
    calls += 1

    # A bias and a mask folded into one bias: the mask within the bias's broadcast shape (at
    # once), then crossed broadcasts ([2, 1] with [1, 4]: per batch row).
    for both_mask in (jnp.asarray(rng.random((2, 1, seq_q, seq_k)) > 0.2), mask):
        def bias_mask_loss(q, k, v, bias):
            out = flash_attention(q, k, v, bias=bias, attention_mask=both_mask, causal=True, platform="cuda")
            return jnp.sum(out.astype(jnp.float32) ** 2)

        jax.block_until_ready(jax.grad(bias_mask_loss, argnums=(0, 1, 2, 3))(q, k, v, bias))
        calls += 1

    # With segment ids too (at d64 with a bias the backward reads the query ids from global
    # memory).
    ids = dict(q_segment_ids=jnp.asarray(np.sort(rng.integers(0, 3, (2, seq_q)), axis=1), jnp.int32),
               kv_segment_ids=jnp.asarray(np.sort(rng.integers(0, 3, (2, seq_k)), axis=1), jnp.int32))

    def segments_dense_loss(q, k, v, bias):
        return jnp.sum(flash_attention(q, k, v, bias=bias, platform="cuda", **ids).astype(jnp.float32) ** 2)

    jax.block_until_ready(flash_attention(q, k, v, attention_mask=mask, causal=True, platform="cuda", **ids))
    jax.block_until_ready(jax.grad(segments_dense_loss, argnums=(0, 1, 2, 3))(q, k, v, bias))
    jax.block_until_ready(jax.grad(segments_dense_loss, argnums=(0, 1, 2, 3))(q, k, v, bias.astype(jnp.float32)))
    calls += 3
# Deterministic mode with the gradient of a bias broadcast over the batch, one batch row at a
# time (a row's grid, 66 kv heads x 2 key blocks, fills the H100's 132 multiprocessors), with
# and without dropout.
q, k, v = normal(2, 64, 66, 64), normal(2, 200, 66, 64), normal(2, 200, 66, 64)
for dropout in (0.0, 0.2):
    def row_summed_loss(q, k, v, bias):
        out = flash_attention(q, k, v, bias=bias, deterministic=True, dropout_prob=dropout, dropout_seed=9,
                              platform="cuda")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    jax.block_until_ready(jax.grad(row_summed_loss, argnums=(0, 1, 2, 3))(q, k, v, normal(1, 66, 64, 200)))
    calls += 1
# A key padding mask (run as segment ids): key tiles of one id skip the per-key test. Then with
# a bias (its gradient too) and dropout: the kernels with segment ids, a bias and dropout.
for head_dim in (64, 128):
    q, k, v = (normal(2, 300, 4, head_dim) for _ in range(3))
    padding = jnp.asarray(np.arange(300)[None, None, None, :] < np.array([300, 170])[:, None, None, None])
    for bias, dropout in ((None, 0.0), (normal(1, 4, 300, 300), 0.2)):
        def padded_loss(q, k, v, bias):
            out = flash_attention(q, k, v, bias=bias, attention_mask=padding, dropout_prob=dropout, dropout_seed=4,
                                  platform="cuda")
            return jnp.sum(out.astype(jnp.float32) ** 2)

        argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
        jax.block_until_ready(jax.grad(padded_loss, argnums=argnums)(q, k, v, bias))
        calls += 1
# Not causal with more than 1024 keys: the 176-key d96 and d128 kernels (shorter calls take
# 128-key tiles).
for head_dim in (96, 128):
    q, k, v = (normal(2, 1100, 4, head_dim) for _ in range(3))
    jax.block_until_ready(flash_attention(q, k, v, platform="cuda", return_lse=True))
    calls += 1
# The forward's other tiles, which a config names (autotuning's candidates), each on a call
# whose default tile is another: on the Hopper kernels two consumer warpgroups at d64 (in pairs
# or not) and three, 128-key tiles on long unmasked d96/d128 calls and 176-key on short ones.
for head_dim, seq, causal in ((64, 300, True), (64, 1100, True), (64, 300, False), (96, 300, False),
                              (128, 1100, False)):
    q, k, v = (normal(2, seq, 4, head_dim) for _ in range(3))
    for cfg in config_candidates("cuda", normalize(q, k, v, causal=causal))[1:]:
        jax.block_until_ready(flash_attention(q, k, v, causal=causal, cfg=cfg, platform="cuda", return_lse=True))
        calls += 1
print("sanitize_cuda: ran", calls, "calls")
