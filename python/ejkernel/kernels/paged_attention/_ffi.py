"""Paged attention through libejkernel's FFI handlers (native CPU and CUDA), forward only.

The operand, result and attribute layouts are those of csrc/paged_attention/params.h (bound
in ffi_common.h). Absent optional operands travel as zero-element placeholders and the
`operands` bit mask tells the handler which are real; query_start_loc needs no bit, since a
zero-element one means one query row per sequence (a real one has N + 1 >= 1 entries). The
cache update aliases its cache operands to its results, so under jit with donated caches it
writes in place.

Under jit with the query and caches sharded over heads (tensor parallelism), each device runs
the kernels on its own heads (kernels/_partition.py); the metadata go to every device whole.
Tokens never split, since a device needs every row of the sequences it serves: a query split
over tokens has the call split over heads instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import _native
from .. import _partition
from .._partition import HEADS, SEQUENCE, WHOLE, Kind
from ..flash_attention._ffi import _map_sequentially, _vary_like
from ._validate import LAYOUTS, PagedArgs

OP = "paged_attention"

# Bits of the `operands` attribute (csrc/paged_attention/ffi_common.h OperandFlag).
_HAS_KV_STARTS, _HAS_SINKS = 1, 2

# How operands' and results' dims follow the heads when a call is split over devices.
_TOKENS = Kind((SEQUENCE, HEADS, None))  # query, out, new keys and values [tokens, heads, head_dim]
_CACHE = {
    "head_major": Kind((None, HEADS, None, None)),  # [pages, kv heads, page_size, head_dim]
    "token_major": Kind((None, None, HEADS, None)),  # [pages, page_size, kv heads, head_dim]
}
_PER_HEAD = Kind((HEADS,))  # sinks [q heads]
_ARRAYS = ("query", "key_cache", "value_cache", "kv_lens", "block_tables", "query_start_loc", "num_seqs",
           "kv_starts", "sinks", "new_keys", "new_values")


def _placeholder(x: Any, dtype: Any) -> Any:
    return jnp.zeros((0,), dtype) if x is None else x


def _static(args: PagedArgs) -> PagedArgs:
    """args without its arrays (a hashable key for the call's function); whether kv_starts
    and sinks are present travels in the operand bits."""
    return dataclasses.replace(args, **dict.fromkeys(_ARRAYS))


def _sequential_vmap(call):
    """`call` under jax.vmap: once per mapped element (custom_partitioning has no batching
    rule of its own)."""
    call = jax.custom_batching.custom_vmap(call)

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *args):
        return _map_sequentially(call, axis_size, list(in_batched), list(args))

    return call


@functools.lru_cache(maxsize=256)
def _attention_call(platform: str, static: PagedArgs, operands: int, num_splits: int, block_kv: int,
                    num_threads: int):
    def kernel(q, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs, kv_starts, sinks):
        # The shapes this device runs (a partitioned call's local ones).
        signature = dataclasses.replace(static, query=q, key_cache=key_cache, block_tables=block_tables).signature()
        splits = num_splits or (_native.heuristic_config(OP, platform, signature) or {}).get("num_splits") or 1
        # Partials, softmax statistics and two counters per (token, q head) (params.h).
        workspace = _native.workspace_bytes(OP, platform, "forward", {**signature, "num_splits": splits})
        out, _ = jax.ffi.ffi_call(
            f"ejkernel_paged_attention_{platform}",
            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((workspace,), jnp.uint8)),
        )(
            q, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs, kv_starts, sinks,
            softmax_scale=np.float32(static.softmax_scale),
            logits_soft_cap=np.float32(static.logits_soft_cap or 0.0),
            window_left=np.int64(static.window_left),
            causal=bool(static.causal),
            kv_layout=np.int64(LAYOUTS[static.kv_layout]),
            k_scale=np.float32(static.k_scale),
            v_scale=np.float32(static.v_scale),
            operands=np.int64(operands),
            num_splits=np.int64(splits),
            block_kv=np.int64(block_kv),
            num_threads=np.int64(num_threads),
        )
        return (out,)

    cache = _CACHE[static.kv_layout]
    kinds = [_TOKENS, cache, cache, WHOLE, WHOLE, WHOLE, WHOLE, WHOLE, _PER_HEAD]
    return _sequential_vmap(_partition.partitioned(kernel, kinds, [_TOKENS]))


def paged_attention_native(
    platform: str, args: PagedArgs, *, num_splits: int = 0, block_kv: int = 64, num_threads: int = 0
) -> jax.Array:
    """Runs target ejkernel_paged_attention_<platform> ("cpu" or "cuda"); returns out [T, Hq, D].

    num_splits: split-KV partitions per (sequence, kv head); 0 takes the registry heuristic's
    count for the shapes each device runs (the split workspace is sized from it)."""
    _native.ensure_ffi_targets(OP, platform)
    operands = (_HAS_KV_STARTS if args.kv_starts is not None else 0) | (_HAS_SINKS if args.sinks is not None else 0)
    inputs = (
        args.query,
        args.key_cache,
        args.value_cache,
        args.kv_lens,
        args.block_tables,
        _placeholder(args.query_start_loc, jnp.int32),
        args.num_seqs,
        _placeholder(args.kv_starts, jnp.int32),
        _placeholder(args.sinks, jnp.float32),
    )
    call = _attention_call(platform, _static(args), operands, num_splits, block_kv, num_threads)
    (out,) = call(*inputs)
    return _vary_like(out, *inputs)


@functools.lru_cache(maxsize=256)
def _update_call(platform: str, kv_layout: str, k_scale: float, v_scale: float):
    def kernel(new_keys, new_values, key_cache, value_cache, *metadata):
        return jax.ffi.ffi_call(
            f"ejkernel_paged_kv_cache_update_{platform}",
            (jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
             jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype)),
            input_output_aliases={2: 0, 3: 1},
        )(new_keys, new_values, key_cache, value_cache, *metadata, kv_layout=np.int64(LAYOUTS[kv_layout]),
          k_scale=np.float32(k_scale), v_scale=np.float32(v_scale))

    cache = _CACHE[kv_layout]
    kinds = [_TOKENS, _TOKENS, cache, cache, WHOLE, WHOLE, WHOLE, WHOLE]
    return _sequential_vmap(_partition.partitioned(kernel, kinds, [cache, cache]))


def paged_kv_cache_update_native(platform: str, args: PagedArgs) -> tuple[jax.Array, jax.Array]:
    """Runs target ejkernel_paged_kv_cache_update_<platform>: writes args.new_keys/new_values
    into the caches; returns the updated (key_cache, value_cache), aliased to the inputs."""
    _native.ensure_ffi_targets(OP, platform)
    inputs = (args.new_keys, args.new_values, args.key_cache, args.value_cache, args.kv_lens, args.block_tables,
              _placeholder(args.query_start_loc, jnp.int32), args.num_seqs)
    key_cache, value_cache = _update_call(platform, args.kv_layout, args.k_scale, args.v_scale)(*inputs)
    return _vary_like(key_cache, *inputs), _vary_like(value_cache, *inputs)
