"""Paged (inference) attention, forward only, registered in `kernel_registry` under each
operation's own name: page_attention, ragged_page_attention (also as
ragged_page_attention_v2), ragged_page_attention_v3, ragged_decode_attention,
unified_attention and prefill_page_attention.

Every operation is a view of one core (csrc/paged_attention/params.h); `_validate` maps each
operation's arguments onto the core's (`PagedArgs`), and each platform runs the core:
- XLA (every device, TPU included): blocked online softmax over KV chunks gathered through
  the block tables, in pure JAX.
- native CPU / native CUDA: libejkernel's FFI handlers of the C++ registry entry
  "paged_attention", registered for every operation with that entry's priority.

Each registered callable takes the public arguments of its operation (see
`ejkernel.modules.paged_attention`) and a `cfg` (PagedAttentionConfig; None picks the
heuristic one). ragged_page_attention_v3 returns (out, (key_cache, value_cache)), every
other operation out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ... import _native
from ...registry import Backend, Platform, kernel_registry
from ._ffi import paged_attention_native, paged_kv_cache_update_native
from ._validate import OPERATIONS, PagedArgs, normalize
from ._xla import default_block_kv, paged_attention_xla, paged_kv_cache_update_xla, step_bytes_per_key

OP = "paged_attention"  # the native registry's name for the core every operation maps to
OP_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """params.h Config. num_splits: split-KV partitions per (sequence, kv head) for flash
    decoding (0 = the kernel's heuristic); block_kv: keys per inner tile (XLA: keys per
    gathered chunk); num_threads: native CPU threads (0 = all)."""

    num_splits: int = 0
    block_kv: int = 64
    num_threads: int = 0


def xla_heuristic(args: PagedArgs) -> PagedAttentionConfig:
    """Chunks as long as the step budget allows with every row in one token block."""
    t, hq, d = args.query.shape
    per_key = step_bytes_per_key(hq, args.num_kv_heads, d, args.key_cache.dtype, args.query.dtype)
    longest = args.block_tables.shape[1] * args.page_size
    return PagedAttentionConfig(block_kv=default_block_kv(t, longest, per_key))


def xla_candidates(args: PagedArgs) -> list[PagedAttentionConfig]:
    return [PagedAttentionConfig(block_kv=b) for b in (16, 32, 64, 128, 256, 512)]


def heuristic_config(platform: str, args: PagedArgs) -> PagedAttentionConfig:
    if platform == Platform.XLA.value:
        return xla_heuristic(args)
    found = _native.heuristic_config(OP, platform, args.signature())
    return PagedAttentionConfig(**found) if found else PagedAttentionConfig()


def config_candidates(platform: str, args: PagedArgs) -> list[PagedAttentionConfig]:
    if platform == Platform.XLA.value:
        return xla_candidates(args)
    return [PagedAttentionConfig(**c) for c in _native.config_candidates(OP, platform, args.signature())]


def native_features(platform: str) -> set[str]:
    """Features the best native implementation of `platform` supports (from C++)."""
    entries = [e for e in _native.registry_entries() if e["op"] == OP and e["platform"] == platform]
    if not entries:
        return set()
    return set(max(entries, key=lambda e: e["priority"])["features"])


def native_unsupported(platform: str, args: PagedArgs) -> list[str]:
    """What keeps the native `platform` implementation from serving this call: the core
    switched off (EJKERNEL_DISABLE_NATIVE=paged_attention turns off every operation), the
    features it lacks, then the C++ entry's own reason. Empty when it can."""
    if _native.native_disabled(OP):
        return [f"{OP} disabled by EJKERNEL_DISABLE_NATIVE"]
    missing = sorted(set(args.features()) - native_features(platform))
    reason = _native.unsupported_reason(OP, platform, args.signature())
    return missing + ([reason] if reason else [])


def run(platform: str, args: PagedArgs, cfg: PagedAttentionConfig | None = None) -> Any:
    """The core on `platform` for normalised arguments: out, or (out, (key_cache,
    value_cache)) when args carries new keys and values to write first."""
    update = args.new_keys is not None
    if platform == Platform.XLA.value:
        cfg = cfg or heuristic_config(platform, args)
        if update:
            caches = paged_kv_cache_update_xla(
                args.new_keys, args.new_values, args.key_cache, args.value_cache, args.kv_lens, args.block_tables,
                args.query_start_loc, args.num_seqs, kv_layout=args.kv_layout, k_scale=args.k_scale,
                v_scale=args.v_scale,
            )
            args = dataclasses.replace(args, key_cache=caches[0], value_cache=caches[1])
        out = paged_attention_xla(
            args.query, args.key_cache, args.value_cache, args.kv_lens, args.block_tables, args.query_start_loc,
            args.num_seqs, kv_starts=args.kv_starts, sinks=args.sinks, softmax_scale=args.softmax_scale,
            logits_soft_cap=args.logits_soft_cap, window_left=args.window_left, causal=args.causal,
            kv_layout=args.kv_layout, k_scale=args.k_scale, v_scale=args.v_scale, block_kv=cfg.block_kv,
        )
    else:
        missing = native_unsupported(platform, args)
        if missing:
            raise ValueError(f"paged attention on platform '{platform}' does not support: {', '.join(missing)}")
        if update:
            caches = paged_kv_cache_update_native(platform, args)
            args = dataclasses.replace(args, key_cache=caches[0], value_cache=caches[1])
        # num_splits 0: the heuristic's count for the shapes each device runs, which a call
        # split over devices (heads) makes smaller than args'.
        cfg = cfg or dataclasses.replace(heuristic_config(platform, args), num_splits=0)
        out = paged_attention_native(
            platform, args, num_splits=cfg.num_splits, block_kv=cfg.block_kv, num_threads=cfg.num_threads
        )
    return (out, (args.key_cache, args.value_cache)) if update else out


def _run_operation(operation: str, platform: str, *args: Any, cfg: PagedAttentionConfig | None = None, **kwargs):
    return run(platform, OPERATIONS[operation](*args, **kwargs), cfg)


def operation_args(operation: str, *args: Any, **kwargs: Any) -> PagedArgs:
    """The core's normalised arguments for a call of `operation` (validates everything)."""
    return OPERATIONS[operation](*args, **kwargs)


_NATIVE = [entry for entry in _native.registry_entries() if entry["op"] == OP]
for _operation in OPERATIONS:
    kernel_registry.register(_operation, Platform.XLA, Backend.ANY, priority=0)(
        functools.partial(_run_operation, _operation, Platform.XLA.value)
    )
    for _entry in _NATIVE:
        kernel_registry.register(
            _operation, Platform(_entry["platform"]), Backend(_entry["backend"]), priority=_entry["priority"]
        )(functools.partial(_run_operation, _operation, _entry["platform"]))

__all__ = [
    "OP",
    "OPERATIONS",
    "OP_VERSION",
    "PagedArgs",
    "PagedAttentionConfig",
    "config_candidates",
    "heuristic_config",
    "native_features",
    "native_unsupported",
    "normalize",
    "operation_args",
    "paged_attention_native",
    "paged_attention_xla",
    "paged_kv_cache_update_native",
    "paged_kv_cache_update_xla",
    "run",
]
