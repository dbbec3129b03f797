"""What the C++ registry says about the GPU this runs on (the rules themselves are tested in
cuda_device_test.cc with described devices)."""

from __future__ import annotations

import jax
import pytest

import ejkernel
from ejkernel import _native


def _gpu_with_cuda_kernels() -> bool:
    return (
        _native.available()
        and _native.build_info().get("has_cuda", False)
        and any(d.platform == "gpu" for d in jax.devices())
    )


needs_cuda = pytest.mark.skipif(not _gpu_with_cuda_kernels(), reason="needs a GPU and CUDA kernels")


def test_cuda_hopper_kernels_reported_as_built():
    info = ejkernel.build_info()
    assert info["hopper_kernels"] == any(arch.startswith("90a") for arch in info["cuda_archs"])


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_kernels_serve_this_gpu(head_dim):
    flash = dict(batch=2, seqlen_q=300, seqlen_k=300, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype="bfloat16")
    assert _native.unsupported_reason("flash_attention", "cuda", flash) is None
    paged = dict(
        num_tokens=8, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, num_pages=16, page_size=16,
        max_seqs=2, max_pages_per_seq=8, dtype="bfloat16", cache_dtype="bfloat16", kv_layout="separate",
    )
    assert _native.unsupported_reason("paged_attention", "cuda", paged) is None
    # What no device serves still names its reason.
    reason = _native.unsupported_reason("flash_attention", "cuda", {**flash, "dtype": "float32"})
    assert reason is not None and "float32" in reason
