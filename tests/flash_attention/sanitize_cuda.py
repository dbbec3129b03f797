"""Small-shape run of every CUDA flash attention path, for compute-sanitizer."""

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import flash_attention

rng = np.random.default_rng()
q = jnp.asarray(rng.standard_normal((2, 37, 4, 64)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((2, 45, 2, 64)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((2, 45, 2, 64)), jnp.bfloat16)
bias = jnp.asarray(rng.standard_normal((1, 4, 37, 45)), jnp.float32)
mask = jnp.asarray(rng.random((2, 1, 37, 45)) > 0.2)
aux = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
runs = [
    dict(),
    dict(causal=True, sliding_window=(7, 0), logits_soft_cap=20.0),
    dict(bias=bias, attention_mask=mask, softmax_aux=aux, dropout_prob=0.2, dropout_seed=3),
]
for kwargs in runs:
    jax.block_until_ready(flash_attention(q, k, v, platform="cuda", return_lse=True, **kwargs))
cu = jnp.array([0, 0, 1, 20, 30], jnp.int32)
cu_k = jnp.array([0, 3, 3, 25, 40], jnp.int32)
jax.block_until_ready(
    flash_attention(q[:1, :31], k[:1, :40], v[:1, :40], causal=True, cum_seqlens_q=cu, cum_seqlens_k=cu_k, platform="cuda")
)
print("sanitize_cuda: ran", len(runs) + 1, "calls")
