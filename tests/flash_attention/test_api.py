"""The public flash attention API: argument errors, platform choice, the seeds' quick start,
and C++ validation reaching Python when the Python checks are bypassed."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel import Backend, Platform, _native, kernel_registry
from ejkernel.kernels.flash_attention import FlashAttentionConfig, normalize
from ejkernel.kernels.flash_attention._ffi import flash_attention_native
from ejkernel.modules import FlashAttention, create_default_executor, flash_attention


def native_cpu(test):
    """A test of the native CPU kernel: skipped without the library; JAX's default device is the
    CPU, also on a machine with a GPU."""
    return pytest.mark.skipif(not _native.available(), reason="libejkernel not loaded")(pytest.mark.usefixtures("on_cpu")(test))


def _qkv(rng, b=2, sq=37, sk=41, hq=4, hkv=2, d=32, dtype=jnp.float32):
    q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
    return q, k, v


BAD_INPUTS = [
    ("query", lambda q, k, v: dict(query=q[0]), ValueError, "query must have rank 4"),
    ("query dtype", lambda q, k, v: dict(query=q.astype(jnp.int32)), TypeError, "query must be float32"),
    ("mixed dtypes", lambda q, k, v: dict(key=k.astype(jnp.bfloat16)), TypeError, "share a dtype"),
    ("heads", lambda q, k, v: dict(key=k[:, :, :1].repeat(3, 2), value=v[:, :, :1].repeat(3, 2)), ValueError, "num_kv_heads (3) must divide num_q_heads (4)"),
    ("head dim", lambda q, k, v: dict(key=k[..., :16], value=v[..., :16]), ValueError, "head_dim"),
    ("batch", lambda q, k, v: dict(key=k[:1], value=v[:1]), ValueError, "key batch"),
    ("k/v shapes", lambda q, k, v: dict(value=v[:, :5]), ValueError, "must have the same shape"),
    ("bias rank", lambda q, k, v: dict(bias=jnp.ones((1, 1, 1, 37, 41))), ValueError, "bias must have rank at most 4"),
    ("bias broadcast", lambda q, k, v: dict(bias=jnp.ones((1, 3, 37, 41))), ValueError, "bias float32[1, 3, 37, 41]"),
    ("mask broadcast", lambda q, k, v: dict(attention_mask=jnp.ones((2, 1, 5, 1), bool)), ValueError,
     "attention_mask bool[2, 1, 5, 1] must broadcast to [batch=2, num_q_heads=4, seq_len_q=37, seq_len_k=41]"),
    ("mask dtype", lambda q, k, v: dict(attention_mask=jnp.ones((1, 1, 37, 41))), TypeError, "attention_mask must be a bool"),
    ("softmax_aux", lambda q, k, v: dict(softmax_aux=jnp.ones((3,))), ValueError, "softmax_aux must have shape [num_q_heads=4]"),
    ("window", lambda q, k, v: dict(sliding_window=-2), ValueError, "sliding_window must be >= 0"),
    ("window pair", lambda q, k, v: dict(sliding_window=(4, -3)), ValueError, "sliding_window sides"),
    ("soft cap", lambda q, k, v: dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be a finite float > 0"),
    ("dropout", lambda q, k, v: dict(dropout_prob=1.0), ValueError, "dropout_prob must be in [0, 1)"),
    ("scale", lambda q, k, v: dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("cu together", lambda q, k, v: dict(cum_seqlens_q=jnp.array([0, 37])), ValueError, "given together"),
    ("segments together", lambda q, k, v: dict(q_segment_ids=jnp.zeros((2, 37), jnp.int32)), ValueError, "given together"),
    ("segment shape", lambda q, k, v: dict(q_segment_ids=jnp.zeros((2, 36), jnp.int32), kv_segment_ids=jnp.zeros((2, 41), jnp.int32)), ValueError, "q_segment_ids must have shape [batch=2, 37]"),
]


@pytest.mark.parametrize("name,change,error,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(name, change, error, message, rng):
    q, k, v = _qkv(rng)
    kwargs = dict(query=q, key=k, value=v)
    kwargs.update(change(q, k, v))
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        flash_attention(**kwargs)


@pytest.mark.parametrize(
    "cu_q,cu_k,message",
    [
        ([1, 5, 10], [0, 5, 10], r"cum_seqlens_q\[0\] must be 0"),
        ([0, 6, 5], [0, 5, 10], "non-decreasing"),
        ([0, 5, 10], [0, 5, 99], "exceeds the packed length"),
        ([0, 10], [0, 5, 10], "same length"),
        ([0, 10], [0, 10], "batch must be 1"),
    ],
)
def test_bad_cum_seqlens(cu_q, cu_k, message, rng):
    b = 2 if "batch" in message else 1
    q, k, v = _qkv(rng, b=b, sq=10, sk=10)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, cum_seqlens_q=jnp.array(cu_q, jnp.int32), cum_seqlens_k=jnp.array(cu_k, jnp.int32))


def test_unknown_platform_is_an_error(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="tpu|unknown|not"):
        flash_attention(q, k, v, platform="tpu")


def test_cuda_platform_without_gpu_is_an_error(rng):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError):
        flash_attention(q, k, v, platform=Platform.CUDA)


@native_cpu
def test_auto_choice_is_native_cpu_and_logged(rng, caplog):
    q, k, v = _qkv(rng)
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        out = flash_attention(q, k, v, causal=True)
    assert out.shape == q.shape
    assert any("platform=cpu" in r.getMessage() and "flash_attention" in r.getMessage() for r in caplog.records)


@native_cpu
def test_disable_switch_falls_back_to_xla(rng, caplog, monkeypatch):
    monkeypatch.setenv("EJKERNEL_DISABLE_NATIVE", "flash_attention")
    q, k, v = _qkv(rng)
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        flash_attention(q, k, v)
    assert any("platform=xla" in r.getMessage() for r in caplog.records)


@native_cpu
def test_platforms_agree(rng):
    q, k, v = _qkv(rng)
    ours = flash_attention(q, k, v, causal=True, platform="cpu")
    xla = flash_attention(q, k, v, causal=True, platform="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), atol=2e-5, rtol=2e-5)


@pytest.fixture
def cpu_kernels_for_head_dims(monkeypatch):
    """The native CPU entry as if it were built for head dims 64 and 128 only, as the CUDA
    kernels are built for a few: the C++ rule answers for the others with a head_dim reason."""
    from ejkernel.kernels.flash_attention import _ffi as fa

    real = _native.unsupported_reason

    def reason(op, platform, signature):
        if op == fa.OP and platform == "cpu" and signature["head_dim"] not in (64, 128):
            return f"head_dim {signature['head_dim']} is not built"
        return real(op, platform, signature)

    fa._padded_head_dim.cache_clear()
    monkeypatch.setattr(_native, "unsupported_reason", reason)
    yield
    fa._padded_head_dim.cache_clear()


@native_cpu
@pytest.mark.parametrize("head_dim, padded", [(40, 64), (80, 128)])
def test_head_dim_between_built_ones_runs_zero_padded(head_dim, padded, rng, caplog, cpu_kernels_for_head_dims):
    """A head dim the native kernels lack runs at the next one they have, query, key and value
    zero-padded: the same output, lse and gradients as XLA at the true head dim (whose
    1/sqrt(head_dim) stays the scale)."""
    q, k, v = _qkv(rng, d=head_dim)
    kwargs = dict(causal=True, bias=jnp.asarray(rng.standard_normal((1, 4, 37, 41)), jnp.float32))

    def loss(platform, q, k, v):
        out, lse = flash_attention(q, k, v, platform=platform, return_lse=True, **kwargs)
        return jnp.sum(out * out) + jnp.sum(jnp.sin(lse)), (out, lse)

    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("cpu", q, k, v)
    assert any(f"head_dim {head_dim} runs zero-padded to {padded}" in r.getMessage() for r in caplog.records)
    (_, (want, want_lse)), want_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("xla", q, k, v)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-5, rtol=2e-5)
    for got, ref in zip(grads, want_grads):
        assert got.shape == ref.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-4)
    # The automatic choice takes the native kernel (no reason left), and a head dim past every
    # built one still falls back.
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        caplog.clear()
        flash_attention(q, k, v)
    assert any("platform=cpu" in r.getMessage() for r in caplog.records)


@native_cpu
def test_zero_padded_head_dim_under_jit_and_vmap(rng, cpu_kernels_for_head_dims):
    q, k, v = (jnp.stack([x, x[::-1]]) for x in _qkv(rng, d=80))

    @jax.jit
    @jax.vmap
    def mapped(q, k, v):
        return flash_attention(q, k, v, causal=True, platform="cpu")

    got = mapped(q, k, v)
    assert got.shape == q.shape
    for i in range(2):
        want = flash_attention(q[i], k[i], v[i], causal=True, platform="xla")
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), atol=2e-5, rtol=2e-5)


@native_cpu
def test_head_dim_past_the_built_ones_is_not_padded(rng, cpu_kernels_for_head_dims):
    from ejkernel.kernels.flash_attention import native_unsupported

    q, k, v = _qkv(rng, d=136)
    assert native_unsupported("cpu", normalize(q, k, v)) == ["head_dim 136 is not built"]


def test_seed_quick_start(rng):
    executor = create_default_executor()
    attention = FlashAttention()
    batch, seq_len, num_heads, head_dim = 2, 256, 8, 64
    q = k = v = jax.random.normal(jax.random.PRNGKey(int(rng.integers(2**31))), (batch, seq_len, num_heads, head_dim))
    output = executor(attention, q, k, v, causal=True, dropout_prob=0.1)
    assert output.shape == q.shape and bool(jnp.isfinite(output).all())

    output = flash_attention(q, k, v, causal=True, sliding_window=128, logits_soft_cap=30.0)
    assert output.shape == q.shape

    impl = kernel_registry.get(algorithm="flash_attention", platform=Platform.XLA, backend=Backend.CPU)
    assert impl(q, k, v, causal=True).shape == q.shape


def test_return_lse_and_explicit_config(rng):
    q, k, v = _qkv(rng)
    out, lse = flash_attention(q, k, v, return_lse=True, cfg=FlashAttentionConfig(block_q=16, block_k=16))
    assert out.shape == q.shape and lse.shape == (2, 4, 37) and lse.dtype == jnp.float32


def test_native_signature_names_features_and_window(rng):
    """The native heuristics and candidates see what picks a tile: shapes, dtype, features and
    the window's sides."""
    q, k, v = _qkv(rng, dtype=jnp.bfloat16)
    sig = normalize(q, k, v, causal=True, sliding_window=(16, None), logits_soft_cap=5.0).signature()
    assert sig["seqlen_q"] == 37 and sig["seqlen_k"] == 41 and sig["dtype"] == "bfloat16" and sig["head_dim"] == 32
    assert {"causal", "sliding_window", "logits_soft_cap", "gqa"} <= set(sig["features"])
    assert (sig["window_left"], sig["window_right"]) == (16, -1)
    plain = normalize(q, k, v).signature()
    assert (plain["window_left"], plain["window_right"]) == (-1, -1) and "causal" not in plain["features"]


@pytest.mark.skipif(not _native.available(), reason="libejkernel not loaded")
def test_op_version_is_the_librarys():
    """Configs cached by Python and by C++ share keys: one version of the operation."""
    from ejkernel.kernels.flash_attention import OP, OP_VERSION

    versions = {e["op_version"] for e in _native.registry_entries() if e["op"] == OP}
    assert versions == {OP_VERSION}


def test_version_and_build_info():
    assert isinstance(ejkernel.__version__, str) and ejkernel.__version__
    info = ejkernel.build_info()
    assert "flash_attention" in info["operations"] and "xla" in info["operations"]["flash_attention"]
    assert info["cache_dir"]


@native_cpu
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: dict(key=a.key[:, :, :1].repeat(3, 2), value=a.value[:, :, :1].repeat(3, 2)), "key"),
        (lambda a: dict(value=a.value[:, :7]), "value"),
        (lambda a: dict(softmax_scale=float("inf")), "softmax_scale"),
        (lambda a: dict(sliding_window=(-5, 3)), "window"),
        (lambda a: dict(cum_seqlens_q=jnp.array([0, 50], jnp.int32), cum_seqlens_k=jnp.array([0, 41], jnp.int32)), "cum_seqlens_q"),
    ],
)
def test_cpp_validation_reaches_python(change, message, rng):
    """The native kernel validates again: a call past the Python checks gets an exception."""
    import dataclasses

    q, k, v = _qkv(rng, b=1)
    args = dataclasses.replace(normalize(q, k, v), **change(normalize(q, k, v)))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(flash_attention_native("cpu", args, block_q=16, block_k=16))


def test_import_without_the_library_warns_once_and_runs_on_xla(tmp_path):
    import subprocess
    import sys

    script = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import ejkernel\n"
        "    from ejkernel.modules import flash_attention\n"
        "import jax.numpy as jnp\n"
        "q = jnp.ones((1, 8, 2, 16))\n"
        "print(flash_attention(q, q, q).shape, sum('native kernels unavailable' in str(w.message) for w in caught))\n"
    )
    env = {**__import__("os").environ, "EJKERNEL_LIBRARY": str(tmp_path / "missing.so")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(1, 8, 2, 16) 1"


@native_cpu
def test_python_and_cpp_share_the_persistent_cache(tmp_path, rng, monkeypatch):
    """Autotuning from Python writes the C++ cache file; a fresh executor reads it back."""
    import json

    from ejkernel.ops import ConfigCache, ConfigSelectorChain, Executor, PersistentCache, policy_override

    q, k, v = _qkv(rng, sq=64, sk=64)
    tuned = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=PersistentCache(tmp_path)))
    with policy_override(autotune=True):
        inv, cfg = tuned.prepare(FlashAttention(), (q, k, v), {"causal": True})
    assert inv.platform == Platform.CPU
    files = list(tmp_path.glob("flash_attention.v*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["format"] == "ejkernel-config-cache" and len(stored["entries"]) == 1
    entry = next(iter(stored["entries"].values()))
    assert entry["timings_ms"] and entry["config"]["block_q"] == cfg.block_q

    fresh = ConfigSelectorChain(cache=ConfigCache(), persistent=PersistentCache(tmp_path))
    assert fresh.select(inv) == (cfg, "persistent")
    assert _native.cache_lookup(inv.cache_key(), str(tmp_path)) == entry["config"]


@pytest.mark.parametrize("implementation", ["native", "xla"])
def test_bias_gradient_only_when_differentiated(implementation, rng):
    """The backward computes dbias (a float32 sum over the broadcast dims, its costliest output)
    only when the bias is differentiated; dq, dk and dv are the same either way."""
    from ejkernel.kernels.flash_attention import native_features

    platform = "xla"
    if implementation == "native":
        platform = "cuda" if jax.default_backend() == "gpu" else "cpu"
        if not _native.available() or "bias_grad" not in native_features(platform):
            pytest.skip(f"no native {platform} kernel")
    dtype = jnp.bfloat16 if platform == "cuda" else jnp.float32
    q, k, v = _qkv(rng, d=64, dtype=dtype)
    bias = jnp.asarray(rng.standard_normal((1, 4, 37, 41)), dtype)

    def loss(q, k, v, bias):
        out = flash_attention(q, k, v, bias=bias, causal=True, platform=platform)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    inputs_only = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with_bias = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    if platform != "xla":
        def writes_dbias(fn) -> bool:
            text = fn.lower(q, k, v, bias).as_text()
            call = next(line for line in text.splitlines() if f"ejkernel_flash_attention_bwd_{platform}" in line)
            return "-> (" in call and "tensor<1x4x37x41xf32>" in call.split("-> (")[-1]

        assert not writes_dbias(inputs_only)
        assert writes_dbias(with_bias)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for got, want in zip(inputs_only(q, k, v, bias), with_bias(q, k, v, bias)[:3]):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tolerance,
                                   atol=tolerance)
