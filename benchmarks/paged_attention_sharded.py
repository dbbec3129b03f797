"""Paged attention under jax.jit over a KV cache sharded by heads across every local device
(tensor parallelism): the native call split over the devices' heads, against the same call
under jax.shard_map, XLA's implementation on the same sharded arrays (which XLA partitions
itself), and the native call on replicated arrays (every device computing every head, as an
unpartitioned call does after gathering its operands).

    python3 benchmarks/paged_attention_sharded.py        # cuda: decode and a ragged batch, bf16
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 benchmarks/paged_attention_sharded.py cpu

Best of three rounds of calls, ms.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ejkernel.modules import page_attention, ragged_page_attention
from flash_attention_vmap import timed_ms  # jits the function, best of three rounds


def main() -> None:
    platform = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    devices = jax.device_count()
    q_heads, kv_heads, head_dim, page = (32, 8, 128, 16) if platform == "cuda" else (8, 4, 64, 16)
    dtype = jnp.bfloat16 if platform == "cuda" else jnp.float32
    reps = 20 if platform == "cuda" else 2
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)

    def sharded_arrays(arrays, specs):
        return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]

    # (name, kv layout, tokens per sequence, context per sequence, sequences)
    cases = [("decode", "head_major", 1, 4096, 64), ("ragged prefill+decode", "token_major", None, 2048, 36)]
    if platform != "cuda":
        cases = [("decode", "head_major", 1, 512, 8), ("ragged prefill+decode", "token_major", None, 256, 6)]
    print(f"{platform}, {devices} devices, {q_heads}/{kv_heads} heads, d{head_dim}, page {page}, "
          f"{jnp.dtype(dtype).name}, pages in random order", flush=True)
    for name, layout, q_len, context, seqs in cases:
        pages_per_seq = -(-context // page)
        num_pages = seqs * pages_per_seq
        cache_shape = (num_pages, kv_heads, page, head_dim) if layout == "head_major" else (
            num_pages, page, kv_heads, head_dim)
        tables = jnp.asarray(rng.permutation(num_pages).reshape(seqs, pages_per_seq), jnp.int32)
        lens = jnp.full((seqs,), context, jnp.int32)
        caches = [jnp.asarray(rng.standard_normal(cache_shape), dtype) for _ in range(2)]
        heads_spec = P(None, None, "x") if layout == "token_major" else P(None, "x")
        if q_len == 1:
            q = jnp.asarray(rng.standard_normal((seqs, q_heads, head_dim)), dtype)
            metadata = [lens, tables]

            def attention(q, k, v, lens, tables, platform):
                return page_attention(q, k, v, lens, tables, platform=platform)
        else:  # every 9th sequence a prefill of its whole context, the others decode
            q_lens = np.where(np.arange(seqs) % 9 == 0, context, 1)
            starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
            q = jnp.asarray(rng.standard_normal((int(q_lens.sum()), q_heads, head_dim)), dtype)
            metadata = [lens, tables, starts, jnp.asarray([seqs], jnp.int32)]

            def attention(q, k, v, lens, tables, starts, num_seqs, platform):
                return ragged_page_attention(q, k, v, lens, tables, starts, num_seqs, kv_layout="token_major",
                                             platform=platform)
        arrays = [q, *caches, *metadata]
        specs = [P(None, "x"), heads_spec, heads_spec] + [P()] * len(metadata)
        sharded = sharded_arrays(arrays, specs)
        replicated = sharded_arrays(arrays, [P()] * len(arrays))

        def ours(*a):
            return attention(*a, platform=platform)

        def xla(*a):
            return attention(*a, platform="xla")

        rows = {
            "jit": timed_ms(ours, *sharded, reps=reps),
            "shard_map": timed_ms(jax.shard_map(ours, mesh=mesh, in_specs=tuple(specs), out_specs=P(None, "x")),
                                  *sharded, reps=reps),
            "replicated": timed_ms(ours, *replicated, reps=reps),
            "xla, jit": timed_ms(xla, *sharded, reps=reps),
        }
        print(f"{name} ({seqs} sequences x {context} keys, {q.shape[0]} query tokens, {layout}): "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
