"""jax.vmap of flash_attention: the native call with the mapped axis folded into its batch,
against one call per mapped element (jax.lax.map) and one call over the same batch directly.

    python3 benchmarks/flash_attention_vmap.py          # cuda: 16 x [1, 1024, 16, 128] bf16
    python3 benchmarks/flash_attention_vmap.py cpu      # cpu: 8 x [1, 256, 4, 64] float32

Causal forward, and forward+backward of a sum of squares; then forward+backward with sinks
shared by the mapped elements (their gradient per element), with sinks of each element's own
(folded into the heads), and of packed sequences (three per element and some padding); the
forward of query sets over shared keys and values; best of three rounds of calls.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import flash_attention


def timed_ms(fn, *args, reps: int) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def main() -> None:
    platform = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    mapped, seq, heads, head_dim = (16, 1024, 16, 128) if platform == "cuda" else (8, 256, 4, 64)
    dtype = jnp.bfloat16 if platform == "cuda" else jnp.float32
    reps = 20 if platform == "cuda" else 3
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((mapped, 1, seq, heads, head_dim)), dtype) for _ in range(3))

    def attention(q, k, v):
        return flash_attention(q, k, v, causal=True, platform=platform)

    grads = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    for name, fn in (("forward", attention), ("forward+backward", grads)):
        folded = timed_ms(jax.vmap(fn), q, k, v, reps=reps)
        per_element = timed_ms(lambda q, k, v, fn=fn: jax.lax.map(lambda x: fn(*x), (q, k, v)), q, k, v, reps=reps)
        direct = timed_ms(fn, q[:, 0], k[:, 0], v[:, 0], reps=reps)
        print(f"{platform} {name} {mapped} x [1, {seq}, {heads}, {head_dim}]: vmap {folded:.3f} ms, "
              f"one call per element {per_element:.3f} ms, batch {mapped} directly {direct:.3f} ms", flush=True)

    sinks = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    sink_grads = jax.grad(lambda q, k, v, a: jnp.sum(flash_attention(
        q, k, v, causal=True, softmax_aux=a, platform=platform).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3))
    folded = timed_ms(jax.vmap(sink_grads, (0, 0, 0, None)), q, k, v, sinks, reps=reps)
    per_element = timed_ms(lambda q, k, v, a: jax.lax.map(lambda x: sink_grads(*x, a), (q, k, v)), q, k, v, sinks,
                           reps=reps)
    print(f"{platform} forward+backward, shared sinks: vmap {folded:.3f} ms, one call per element "
          f"{per_element:.3f} ms", flush=True)

    # Sinks of their own per element: the mapped axis folds into the heads.
    mapped_sinks = jnp.asarray(rng.standard_normal((mapped, heads)), jnp.float32)
    folded = timed_ms(jax.vmap(sink_grads), q, k, v, mapped_sinks, reps=reps)
    per_element = timed_ms(lambda *args: jax.lax.map(lambda x: sink_grads(*x), args), q, k, v, mapped_sinks,
                           reps=reps)
    print(f"{platform} forward+backward, mapped sinks: vmap {folded:.3f} ms, one call per element "
          f"{per_element:.3f} ms", flush=True)

    # Query sets mapped over keys and values the elements share: the forward folds the
    # elements' q heads into each key/value head's group, against the batch fold that the same
    # call gets with the keys broadcast (copied per element).
    def shared_kv(q):
        return attention(q, k[0], v[0])

    def copied_kv(q):
        return jax.vmap(attention)(q, jnp.broadcast_to(k[0], k.shape), jnp.broadcast_to(v[0], v.shape))

    folded = timed_ms(jax.vmap(shared_kv), q, reps=reps)
    copied = timed_ms(copied_kv, q, reps=reps)
    per_element = timed_ms(lambda q: jax.lax.map(shared_kv, q), q, reps=reps)
    print(f"{platform} forward, shared keys and values: vmap {folded:.3f} ms, keys copied per element {copied:.3f} ms, "
          f"one call per element {per_element:.3f} ms", flush=True)

    cu = jnp.asarray([0, seq * 3 // 8, seq * 5 // 8, seq * 15 // 16], jnp.int32)
    packed_grads = jax.grad(lambda q, k, v: jnp.sum(flash_attention(
        q, k, v, causal=True, cum_seqlens_q=cu, cum_seqlens_k=cu, platform=platform).astype(jnp.float32) ** 2),
        argnums=(0, 1, 2))
    folded = timed_ms(jax.vmap(packed_grads), q, k, v, reps=reps)
    per_element = timed_ms(lambda q, k, v: jax.lax.map(lambda x: packed_grads(*x), (q, k, v)), q, k, v, reps=reps)
    print(f"{platform} forward+backward, packed sequences: vmap {folded:.3f} ms, one call per element "
          f"{per_element:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
