"""Paged attention through libejkernel's FFI handlers (native CPU and CUDA), forward only.

The operand, result and attribute layouts are those of csrc/paged_attention/params.h (bound
in ffi_common.h). Absent optional operands travel as zero-element placeholders and the
`operands` bit mask tells the handler which are real; query_start_loc needs no bit, since a
zero-element one means one query row per sequence (a real one has N + 1 >= 1 entries). The
cache update aliases its cache operands to its results, so under jit with donated caches it
writes in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import _native
from ..flash_attention._ffi import _vary_like
from ._validate import LAYOUTS, PagedArgs

OP = "paged_attention"

# Bits of the `operands` attribute (csrc/paged_attention/ffi_common.h OperandFlag).
_HAS_KV_STARTS, _HAS_SINKS = 1, 2


def _placeholder(x: Any, dtype: Any) -> Any:
    return jnp.zeros((0,), dtype) if x is None else x


def paged_attention_native(
    platform: str, args: PagedArgs, *, num_splits: int = 0, block_kv: int = 64, num_threads: int = 0
) -> jax.Array:
    """Runs target ejkernel_paged_attention_<platform> ("cpu" or "cuda"); returns out [T, Hq, D].

    num_splits must be resolved (>= 1): the split workspace (params.h) is sized from it, by
    the C++ registry entry."""
    _native.ensure_ffi_targets(OP, platform)
    q = args.query
    operands = (_HAS_KV_STARTS if args.kv_starts is not None else 0) | (_HAS_SINKS if args.sinks is not None else 0)
    # Partials, softmax statistics and two counters per (token, q head) (params.h).
    workspace = _native.workspace_bytes(OP, platform, "forward", {**args.signature(), "num_splits": num_splits})
    call = jax.ffi.ffi_call(
        f"ejkernel_paged_attention_{platform}",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((workspace,), jnp.uint8)),
        vmap_method="sequential",
    )
    inputs = (
        q,
        args.key_cache,
        args.value_cache,
        args.kv_lens,
        args.block_tables,
        _placeholder(args.query_start_loc, jnp.int32),
        args.num_seqs,
        _placeholder(args.kv_starts, jnp.int32),
        _placeholder(args.sinks, jnp.float32),
    )
    out, _ = call(
        *inputs,
        softmax_scale=np.float32(args.softmax_scale),
        logits_soft_cap=np.float32(args.logits_soft_cap or 0.0),
        window_left=np.int64(args.window_left),
        causal=bool(args.causal),
        kv_layout=np.int64(LAYOUTS[args.kv_layout]),
        k_scale=np.float32(args.k_scale),
        v_scale=np.float32(args.v_scale),
        operands=np.int64(operands),
        num_splits=np.int64(num_splits),
        block_kv=np.int64(block_kv),
        num_threads=np.int64(num_threads),
    )
    return _vary_like(out, *inputs)


def paged_kv_cache_update_native(platform: str, args: PagedArgs) -> tuple[jax.Array, jax.Array]:
    """Runs target ejkernel_paged_kv_cache_update_<platform>: writes args.new_keys/new_values
    into the caches; returns the updated (key_cache, value_cache), aliased to the inputs."""
    _native.ensure_ffi_targets(OP, platform)
    kc, vc = args.key_cache, args.value_cache
    call = jax.ffi.ffi_call(
        f"ejkernel_paged_kv_cache_update_{platform}",
        (jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype)),
        vmap_method="sequential",
        input_output_aliases={2: 0, 3: 1},
    )
    inputs = (args.new_keys, args.new_values, kc, vc, args.kv_lens, args.block_tables,
              _placeholder(args.query_start_loc, jnp.int32), args.num_seqs)
    key_cache, value_cache = call(
        *inputs,
        kv_layout=np.int64(LAYOUTS[args.kv_layout]),
        k_scale=np.float32(args.k_scale),
        v_scale=np.float32(args.v_scale),
    )
    return _vary_like(key_cache, *inputs), _vary_like(value_cache, *inputs)
