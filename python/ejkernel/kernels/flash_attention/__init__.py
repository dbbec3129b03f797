"""Flash attention implementations, registered in `kernel_registry` under "flash_attention".

- XLA (every device): blocked online softmax in pure JAX, O(N) memory, custom VJP.
- native CPU / native CUDA: libejkernel's FFI handlers, registered from the library's own
  registry (its priorities and feature lists are the C++ ones).

Each registered callable takes the public arguments of `ejkernel.modules.flash_attention`
and a `cfg` (FlashAttentionConfig; None picks the heuristic one).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ... import _native
from ...registry import Backend, Platform, kernel_registry
from ._ffi import flash_attention_native, native_signature
from ._validate import AttentionArgs, normalize, normalize_shapes
from ._xla import flash_attention_xla

OP = "flash_attention"
OP_VERSION = 3


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Tile sizes. block_q/block_k: query rows and keys per tile; num_threads: native CPU
    threads (0 = all); num_warps/num_stages: CUDA warps per block and K/V pipeline depth
    (0 = any). On CUDA a config names one of the forward's tiles for the call
    (config_candidates); one that names none runs the default tile."""

    block_q: int = 64
    block_k: int = 128
    num_threads: int = 0
    num_warps: int = 0
    num_stages: int = 0


def xla_heuristic(args: AttentionArgs) -> FlashAttentionConfig:
    """Tiles big enough to keep XLA's matmuls efficient, small enough to bound memory."""
    return FlashAttentionConfig(block_q=128, block_k=512 if args.query.shape[-1] <= 128 else 256)


def xla_candidates(args: AttentionArgs) -> list[FlashAttentionConfig]:
    return [FlashAttentionConfig(block_q=q, block_k=k) for q in (64, 128, 256) for k in (128, 256, 512, 1024)]


def heuristic_config(platform: str, args: AttentionArgs) -> FlashAttentionConfig:
    if platform == Platform.XLA.value:
        return xla_heuristic(args)
    found = _native.heuristic_config(OP, platform, native_signature(platform, args))
    return FlashAttentionConfig(**found) if found else FlashAttentionConfig()


def config_candidates(platform: str, args: AttentionArgs) -> list[FlashAttentionConfig]:
    if platform == Platform.XLA.value:
        return xla_candidates(args)
    signature = native_signature(platform, args)
    return [FlashAttentionConfig(**c) for c in _native.config_candidates(OP, platform, signature)]


def native_features(platform: str) -> set[str]:
    """Features the best native implementation of `platform` supports (from C++)."""
    entries = [e for e in _native.registry_entries() if e["op"] == OP and e["platform"] == platform]
    if not entries:
        return set()
    return set(max(entries, key=lambda e: e["priority"])["features"])


def native_unsupported(platform: str, args: AttentionArgs) -> list[str]:
    """What keeps the native `platform` implementation from serving this call: features it
    lacks, then the C++ entry's own reason (dtype, head dim, ...). Empty when it can."""
    missing = sorted(set(args.features()) - native_features(platform))
    reason = _native.unsupported_reason(OP, platform, native_signature(platform, args))
    return missing + ([reason] if reason else [])


def _split(kwargs: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    return bool(kwargs.pop("return_lse", False)), kwargs


def _run(platform: str, query, key, value, attention_mask=None, bias=None, softmax_aux=None, *, cfg=None, **kwargs):
    return_lse, kwargs = _split(dict(kwargs))
    args = normalize(query, key, value, attention_mask=attention_mask, bias=bias, softmax_aux=softmax_aux, **kwargs)
    cfg = cfg or heuristic_config(platform, args)
    if platform == Platform.XLA.value:
        out, lse = flash_attention_xla(
            args.query,
            args.key,
            args.value,
            bias=args.bias,
            attention_mask=args.attention_mask,
            softmax_aux=args.softmax_aux,
            cum_seqlens_q=args.cum_seqlens_q,
            cum_seqlens_k=args.cum_seqlens_k,
            q_segment_ids=args.q_segment_ids,
            kv_segment_ids=args.kv_segment_ids,
            softmax_scale=args.softmax_scale,
            causal=args.causal,
            sliding_window=args.sliding_window,
            logits_soft_cap=args.logits_soft_cap,
            dropout_prob=args.dropout_prob,
            dropout_seed=args.dropout_seed,
            block_q=cfg.block_q,
            block_k=cfg.block_k,
        )
    else:
        missing = native_unsupported(platform, args)
        if missing:
            raise ValueError(f"flash_attention on platform '{platform}' does not support: {', '.join(missing)}")
        out, lse = flash_attention_native(
            platform,
            args,
            block_q=cfg.block_q,
            block_k=cfg.block_k,
            num_threads=cfg.num_threads,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            backward="backward" in native_features(platform),
        )
    return (out, lse) if return_lse else out


kernel_registry.register(OP, Platform.XLA, Backend.ANY, priority=0)(functools.partial(_run, Platform.XLA.value))
for _entry in _native.registry_entries():
    if _entry["op"] == OP:
        kernel_registry.register(
            OP, Platform(_entry["platform"]), Backend(_entry["backend"]), priority=_entry["priority"]
        )(functools.partial(_run, _entry["platform"]))

__all__ = [
    "FlashAttentionConfig",
    "AttentionArgs",
    "config_candidates",
    "flash_attention_native",
    "flash_attention_xla",
    "heuristic_config",
    "native_features",
    "native_signature",
    "native_unsupported",
    "normalize",
    "normalize_shapes",
]
