"""A development build that leaves CUDA features out (CMake option EJKERNEL_CUDA_FEATURES):
calls that need one run on XLA when the platform is chosen automatically (the debug log says
why), and name the missing feature when the CUDA platform is asked for. Runs on a GPU with
such a build; the full build has nothing left out."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import Platform
from ejkernel.kernels.flash_attention import native_features
from ejkernel.modules import flash_attention

ALL_BUILT = {"logits_soft_cap", "segment_ids"}

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" or not native_features("cuda"), reason="needs a GPU and the CUDA kernels"
)


def _qkv(rng, dtype=jnp.bfloat16, b=2, s=200, h=4, d=128):
    def normal():
        return jnp.asarray(rng.standard_normal((b, s, h, d), np.float32), dtype)

    return normal(), normal(), normal()


def _segment_ids(b=2, s=200):
    return jnp.asarray(np.repeat(np.arange(4), s // 4)[None].repeat(b, 0), jnp.int32)


CASES = {
    "logits_soft_cap": dict(logits_soft_cap=20.0),
    "segment_ids": dict(q_segment_ids=_segment_ids(), kv_segment_ids=_segment_ids()),
}


@pytest.mark.parametrize("feature", sorted(ALL_BUILT))
def test_left_out_feature_runs_on_xla(feature, rng, caplog):
    if feature in native_features("cuda"):
        pytest.skip(f"{feature} is built")
    q, k, v = _qkv(rng)
    kwargs = dict(causal=True, **CASES[feature])
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        out = flash_attention(q, k, v, **kwargs)
    ref = flash_attention(q, k, v, platform=Platform.XLA, **kwargs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=0)
    assert any("platform=xla" in r.getMessage() and feature in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=feature):
        flash_attention(q, k, v, platform=Platform.CUDA, **kwargs)


def test_float16_left_out_runs_on_xla(rng):
    q, k, v = _qkv(rng, jnp.float16)
    try:
        flash_attention(q, k, v, platform=Platform.CUDA)
    except ValueError as exc:
        assert "float16 is not built" in str(exc)
        out = flash_attention(q, k, v)
        ref = flash_attention(q, k, v, platform=Platform.XLA)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=0)
    else:
        pytest.skip("float16 is built")


def test_built_features_still_run_on_cuda(rng):
    q, k, v = _qkv(rng)
    out = flash_attention(q, k, v, causal=True, platform=Platform.CUDA)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    ref = flash_attention(q32, k32, v32, causal=True, platform=Platform.XLA)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    assert np.isfinite(err) and err < 3e-2
