"""The paged attention implementations under test: XLA, native CPU, native CUDA."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from ejkernel.kernels.paged_attention import (
    PagedArgs,
    heuristic_config,
    native_features,
    paged_attention_native,
    paged_attention_xla,
    paged_kv_cache_update_native,
    paged_kv_cache_update_xla,
)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A paged attention core under test.

    attention(args: PagedArgs) -> out; update(args) -> (key_cache, value_cache).
    unavailable: why it cannot run here, or None. features: the PagedArgs.features() names
    it supports; None means all. Tests needing another feature are skipped.
    """

    attention: Callable
    update: Callable
    unavailable: Callable[[], str | None] = lambda: None
    features: frozenset[str] | None = None


def _xla_attention(args: PagedArgs):
    # Chunks much shorter than the test contexts and unaligned with their pages, so every
    # test spans several (test_xla_block_sizes covers several token blocks).
    return paged_attention_xla(
        args.query, args.key_cache, args.value_cache, args.kv_lens, args.block_tables, args.query_start_loc,
        args.num_seqs, kv_starts=args.kv_starts, sinks=args.sinks, softmax_scale=args.softmax_scale,
        logits_soft_cap=args.logits_soft_cap, window_left=args.window_left, causal=args.causal,
        kv_layout=args.kv_layout, k_scale=args.k_scale, v_scale=args.v_scale, block_kv=24,
    )


def _xla_update(args: PagedArgs):
    return paged_kv_cache_update_xla(
        args.new_keys, args.new_values, args.key_cache, args.value_cache, args.kv_lens, args.block_tables,
        args.query_start_loc, args.num_seqs, kv_layout=args.kv_layout, k_scale=args.k_scale, v_scale=args.v_scale,
    )


def _native_attention(platform: str, args: PagedArgs, num_splits: int | None = None):
    cfg = heuristic_config(platform, args)
    return paged_attention_native(platform, args, num_splits=num_splits or cfg.num_splits, block_kv=cfg.block_kv,
                                  num_threads=cfg.num_threads)


def native_unavailable(platform: str, backend: str) -> str | None:
    import jax

    from ejkernel import _native as lib

    if not lib.available():
        return "libejkernel not loaded"
    if jax.default_backend() != backend:
        return f"the default device is {jax.default_backend()}, not {backend}"
    if not native_features(platform):
        return f"no native {platform} paged attention in this build"
    if lib.native_disabled("paged_attention"):
        return "disabled by EJKERNEL_DISABLE_NATIVE"
    return None


def _features(platform: str) -> frozenset[str] | None:
    return frozenset(native_features(platform)) or None


IMPLEMENTATIONS: dict[str, Implementation] = {
    "xla": Implementation(_xla_attention, _xla_update),
    "cpu": Implementation(
        functools.partial(_native_attention, "cpu"),
        functools.partial(paged_kv_cache_update_native, "cpu"),
        functools.partial(native_unavailable, "cpu", "cpu"),
        _features("cpu"),
    ),
    "cuda": Implementation(
        functools.partial(_native_attention, "cuda"),
        functools.partial(paged_kv_cache_update_native, "cuda"),
        functools.partial(native_unavailable, "cuda", "gpu"),
        _features("cuda"),
    ),
    # Split-KV (flash decoding) with a partial merge, which the test contexts are too short
    # for the heuristic to choose.
    "cuda_split5": Implementation(
        functools.partial(_native_attention, "cuda", num_splits=5),
        functools.partial(paged_kv_cache_update_native, "cuda"),
        functools.partial(native_unavailable, "cuda", "gpu"),
        _features("cuda"),
    ),
}
