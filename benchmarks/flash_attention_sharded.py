"""flash_attention under jax.jit over arrays sharded across every local device: the native call
split over the devices' batch rows or heads, or over heads when the arrays are split along
their sequence (one all-to-all per operand), or with one key/value head (MQA) along the
query's rows (the keys and values gathered), against the same call under jax.shard_map, cuDNN
(jax.nn.dot_product_attention, whose calls are partitioned too) on the same sharded arrays,
and the native call on replicated arrays (every device computing the whole batch, as an
unpartitioned call does after gathering its operands).

    python3 benchmarks/flash_attention_sharded.py        # cuda: [2 * devices, 4096, 16, 128] bf16, causal
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 benchmarks/flash_attention_sharded.py cpu

Forward, and forward+backward of a sum of squares, without and with dropout; best of three
rounds of calls, ms.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ejkernel.modules import flash_attention
from flash_attention_vmap import timed_ms  # jits the function, best of three rounds


def main() -> None:
    platform = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    devices = jax.device_count()
    per_device, seq, heads, head_dim = (2, 4096, 16, 128) if platform == "cuda" else (1, 256, 4, 64)
    dtype = jnp.bfloat16 if platform == "cuda" else jnp.float32
    reps = 10 if platform == "cuda" else 2
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    shape = (per_device * devices, seq, heads, head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))
    k_mqa, v_mqa = (x[:, :, :1] for x in (k, v))

    def ours(q, k, v):
        return flash_attention(q, k, v, causal=True, platform=platform)

    def ours_dropout(q, k, v):
        return flash_attention(q, k, v, causal=True, dropout_prob=0.1, dropout_seed=7, platform=platform)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def loss_grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))

    print(f"{platform}, {devices} devices, [{shape[0]}, {seq}, {heads}, {head_dim}] {jnp.dtype(dtype).name} causal",
          flush=True)
    for split, spec, kv in (("batch", P("x"), (k, v)), ("heads", P(None, None, "x"), (k, v)),
                            ("sequence", P(None, "x"), (k, v)), ("sequence, MQA", P(None, "x"), (k_mqa, v_mqa))):
        sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, *kv)]
        replicated = [jax.device_put(x, NamedSharding(mesh, P())) for x in (q, *kv)]
        # A shard_map over sequence blocks attends within blocks; JAX's cuDNN rule refuses a
        # sequence split.
        sequence_split = split.startswith("sequence")
        for part, wrap in (("forward", lambda fn: fn), ("forward+backward", loss_grads)):
            rows = {"jit": timed_ms(wrap(ours), *sharded, reps=reps)}
            if not sequence_split:
                rows["shard_map"] = timed_ms(
                    jax.shard_map(wrap(ours), mesh=mesh, in_specs=(spec,) * 3,
                                  out_specs=spec if part == "forward" else (spec,) * 3),
                    *sharded, reps=reps)
            rows["replicated"] = timed_ms(wrap(ours), *replicated, reps=reps)
            rows["jit with dropout 0.1"] = timed_ms(wrap(ours_dropout), *sharded, reps=reps)
            rows["replicated with dropout"] = timed_ms(wrap(ours_dropout), *replicated, reps=reps)
            if platform == "cuda" and not sequence_split:
                rows["cudnn jit"] = timed_ms(wrap(cudnn), *sharded, reps=reps)
            print(f"  split over {split}, {part}: " + ", ".join(f"{n} {ms:.3f}" for n, ms in rows.items()),
                  flush=True)


if __name__ == "__main__":
    main()
