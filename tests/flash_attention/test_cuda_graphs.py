"""The CUDA flash attention inside XLA command buffers (CUDA graphs), and its workspace.

Both handlers are marked command-buffer compatible: their launches depend only on shapes and
attributes, and every byte they touch is an XLA buffer (the workspace is a result). XLA
records a captured call once and replays it, updating it when buffer addresses change, so a
call that allocated or read host state would go wrong only on replay: these tests replay.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from ejkernel import _native

OP = "flash_attention"


def _cuda_unavailable() -> str | None:
    from ejkernel.kernels.flash_attention import native_features

    if not _native.available():
        return "libejkernel not loaded"
    if jax.default_backend() != "gpu":
        return f"the default device is {jax.default_backend()}, not gpu"
    if not native_features("cuda"):
        return "no native cuda flash attention in this build"
    return None


needs_cuda = pytest.mark.skipif(_cuda_unavailable() is not None, reason=str(_cuda_unavailable()))

SIGNATURE = dict(batch=2, seqlen_q=300, seqlen_k=517, num_q_heads=4, num_kv_heads=2, head_dim=128)


def test_cpu_calls_take_no_workspace():
    if not _native.available():
        pytest.skip("libejkernel not loaded")
    for pass_ in ("forward", "backward"):
        assert _native.workspace_bytes(OP, "cpu", pass_, {**SIGNATURE, "segment_ids": True}) == 0


@needs_cuda
def test_cuda_workspace_follows_the_call():
    import ejkernel

    hopper = ejkernel.build_info().get("hopper_kernels", False) and (
        getattr(jax.devices()[0], "compute_capability", "") == "9.0")
    plain = dict(SIGNATURE, dtype="bfloat16", features=[], deterministic=False)

    def nbytes(pass_, **changes):
        return _native.workspace_bytes(OP, "cuda", pass_, {**plain, **changes})

    # The forward needs memory only on the Hopper kernels: to find the key tiles that segment
    # ids let it skip, and for a bias and a mask folded into one bias.
    assert nbytes("forward") == 0
    assert (nbytes("forward", features=["segment_ids"]) > 0) == hopper
    dense = dict(seqlen_k=520, features=["bias", "attention_mask"], bias_dtype="bfloat16",
                 bias_shape=[1, 4, 300, 520])
    folded = 2 * 4 * 300 * 520 * 2  # [B, H, Sq, Sk] in bf16
    assert nbytes("forward", **dense, mask_shape=[2, 4, 300, 520]) == (folded if hopper else 0)
    # Crossed broadcasts: folded one batch row at a time.
    assert nbytes("forward", **dense, mask_shape=[2, 1, 300, 520]) == (folded // 2 if hopper else 0)
    assert nbytes("forward", **dense, mask_shape=[1, 1, 300, 520]) == (folded // 2 if hopper else 0)
    # The backward's float32 dQ accumulator alone is B * Sq * Hq * D * 4 bytes.
    backward = nbytes("backward")
    assert backward >= 2 * 300 * 4 * 128 * 4
    assert nbytes("backward", seqlen_q=600) > backward
    if hopper:
        per_row = nbytes("backward", **dense, mask_shape=[2, 1, 300, 520])
        assert nbytes("backward", **dense, mask_shape=[2, 4, 300, 520]) > per_row > nbytes("backward", seqlen_k=520)
    with pytest.raises(RuntimeError, match="sideways"):
        _native.workspace_bytes(OP, "cuda", "sideways", plain)
    with pytest.raises(RuntimeError, match="seqlen_q"):
        _native.workspace_bytes(OP, "cuda", "forward", {"batch": 1})


@needs_cuda
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_cuda_workspace_too_small_is_an_error(pass_, monkeypatch, rng):
    """The handler checks the workspace it is given: a short one is an FFI error naming both
    sizes, never an out-of-bounds write."""
    import jax.numpy as jnp

    from ejkernel.kernels.flash_attention import _ffi
    from ejkernel.modules import flash_attention

    real = _native.workspace_bytes

    def short(op, platform, p, signature):
        nbytes = real(op, platform, p, signature)
        return nbytes - 256 if p == pass_ and nbytes > 0 else nbytes

    monkeypatch.setattr(_ffi._native, "workspace_bytes", short)
    # Executables compiled with another test's sizes (the other pass's, shortened) must not
    # be reused: JAX caches them by the traced function, whose workspace shapes it baked in.
    _ffi._attention_fn.cache_clear()
    jax.clear_caches()
    try:
        q, k, v = (jnp.asarray(rng.standard_normal((1, 200, 2, 128)), jnp.bfloat16) for _ in range(3))
        ids = jnp.asarray(np.repeat(np.arange(4), 50)[None], jnp.int32)

        def loss(q, k, v):
            out = flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, platform="cuda")
            return out.astype(jnp.float32).sum()

        with pytest.raises(Exception, match=f"flash attention {pass_}: workspace has .* bytes, the call needs"):
            jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    finally:
        _ffi._attention_fn.cache_clear()
        jax.clear_caches()


# Run in a process of its own: XLA reads its flags once. XLA's default command-buffer types
# (which include custom calls) with graphs of any size, and the thunk sequences dumped.
_CAPTURE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from ejkernel.modules import flash_attention

    def step(q, k, v, ids, platform):
        def loss(q, k, v):
            out = flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids,
                                  platform=platform)
            return (out.astype(jnp.float32) ** 2).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q * 1.5, k, v)

    @jax.jit
    def cuda_step(q, k, v, ids):
        return step(q, k, v, ids, "cuda")

    @jax.jit
    def reference_step(q, k, v, ids):
        f32 = lambda x: x.astype(jnp.float32)
        return step(f32(q), f32(k), f32(v), ids, "xla")

    rng = np.random.default_rng(int(sys.argv[1]))
    lengths = [37, 200, 1, 161]  # 399 tokens: tiles of several sizes, a one-token segment
    ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    shape = (1, sum(lengths), 4, 128)
    errors = []
    for _ in range(3):  # recorded, then replayed on new inputs in new buffers
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
        got = jax.tree.map(lambda x: np.asarray(x, np.float32), cuda_step(q, k, v, ids))
        want = jax.tree.map(np.asarray, reference_step(q, k, v, ids))
        errors.append([float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-30))
                       for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))])
    print(json.dumps(errors))
    """
)


@needs_cuda
def test_cuda_calls_are_captured_and_replayed(rng, tmp_path):
    flags = f"--xla_gpu_graph_min_graph_size=1 --xla_dump_to={tmp_path}"
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    result = subprocess.run(
        [sys.executable, "-c", _CAPTURE_SCRIPT, str(int(rng.integers(2**31)))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # The step's only custom calls are the two attention calls: after XLA's thunk passes,
    # both sit inside a command buffer (indented under a kCommandBuffer), none outside.
    (sequence,) = tmp_path.glob("*jit_cuda_step.thunk_sequence_after_thunk_passes.txt")
    lines = sequence.read_text().splitlines()
    outside = [line for line in lines if re.match(r"\d+: kCustomCall", line)]
    inside = [line for line in lines if re.match(r"\s+\d+: kCustomCall", line)]
    assert not outside and len(inside) == 2, "\n".join(lines)
    # bf16 against the float32 XLA reference; a stale buffer on replay would be off by O(1).
    for run, errors in enumerate(json.loads(result.stdout.strip().splitlines()[-1])):
        assert max(errors) < 0.05, (run, errors)
