"""The public flash attention API: the FlashAttention kernel and `flash_attention(...)`."""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Bool, Float, Int

from ..kernels.flash_attention import (
    OP,
    OP_VERSION,
    FlashAttentionConfig,
    config_candidates,
    heuristic_config,
    native_unsupported,
    normalize_shapes,
)
from ..ops import Executor, Invocation, Kernel, Platform
from ..registry import kernel_registry

_ATTENTION_KWARGS = (
    "causal",
    "softmax_scale",
    "dropout_prob",
    "dropout_seed",
    "sliding_window",
    "logits_soft_cap",
    "cum_seqlens_q",
    "cum_seqlens_k",
    "q_segment_ids",
    "kv_segment_ids",
    "deterministic",
)


class FlashAttention(Kernel[FlashAttentionConfig, Any]):
    """Exact attention with O(N) memory on every platform (see `flash_attention`)."""

    op_version = OP_VERSION

    def __init__(self) -> None:
        super().__init__(OP)

    def run(self, *args: Any, cfg: FlashAttentionConfig, platform: Platform, **kwargs: Any) -> Any:
        return kernel_registry.get(OP, platform=platform)(*args, cfg=cfg, **kwargs)

    @staticmethod
    def _args(inv: Invocation) -> Any:
        names = ("attention_mask", "bias", "softmax_aux")
        positional = dict(zip(names, inv.args[3:]))
        kwargs = {k: v for k, v in inv.kwargs.items() if k in _ATTENTION_KWARGS or k in names}
        return normalize_shapes(*inv.args[:3], **positional, **kwargs)

    def heuristic_cfg(self, inv: Invocation) -> FlashAttentionConfig:
        return heuristic_config(inv.platform.value, self._args(inv))

    def candidate_cfgs(self, inv: Invocation) -> list[FlashAttentionConfig]:
        return config_candidates(inv.platform.value, self._args(inv))

    def unsupported_features(self, inv: Invocation, platform: Platform) -> list[str]:
        if platform == Platform.XLA:
            return []
        return native_unsupported(platform.value, self._args(inv))


_KERNEL = FlashAttention()
_DEFAULT_EXECUTOR: Executor | None = None


def create_default_executor() -> Executor:
    """An executor with in-memory and persistent config caches (autotuning per
    EJKERNEL_AUTOTUNE, off by default)."""
    from ..ops import ConfigCache, ConfigSelectorChain, PersistentCache

    return Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=PersistentCache()))


def _default_executor() -> Executor:
    global _DEFAULT_EXECUTOR
    if _DEFAULT_EXECUTOR is None:
        _DEFAULT_EXECUTOR = create_default_executor()
    return _DEFAULT_EXECUTOR


def flash_attention(
    query: Float[Array, "batch seq_len_q num_q_heads head_dim"],
    key: Float[Array, "batch seq_len_k num_kv_heads head_dim"],
    value: Float[Array, "batch seq_len_k num_kv_heads head_dim"],
    attention_mask: Bool[Array, "..."] | None = None,
    bias: Float[Array, "..."] | None = None,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | Int[Array, ""] | None = None,
    sliding_window: int | tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    cum_seqlens_q: Int[Array, "num_seqs_plus_1"] | None = None,
    cum_seqlens_k: Int[Array, "num_seqs_plus_1"] | None = None,
    q_segment_ids: Int[Array, "batch seq_len_q"] | None = None,
    kv_segment_ids: Int[Array, "batch seq_len_k"] | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    platform: Platform | str | None = None,
    cfg: FlashAttentionConfig | None = None,
    executor: Executor | None = None,
) -> Float[Array, "batch seq_len_q num_q_heads head_dim"] | tuple[Array, Float[Array, "batch num_q_heads seq_len_q"]]:
    """Exact softmax attention with O(N) memory, differentiable in query, key, value, bias
    and softmax_aux.

    Layout [batch, seq, heads, head_dim]; key/value may have fewer heads than query (GQA/MQA:
    q head h reads kv head h // (num_q_heads // num_kv_heads)).

    Args:
      attention_mask: bool, True = attend; broadcasts to [batch, num_q_heads, seq_len_q,
        seq_len_k] as in NumPy (e.g. [batch, 1, 1, seq_len_k] for key padding). A mask over
        queries alone or keys alone, shared by the heads, runs as segment ids (where none are
        given); other dims of 1 over queries or keys are materialised.
      bias: additive logits bias, same broadcasting (materialised over queries and keys, its
        gradient summed back); added after the soft cap.
      softmax_aux: one sink logit per q head: joins the softmax denominator, adds no value.
      causal: query i sees keys j <= i + (seq_len_k - seq_len_q) (bottom-right aligned).
      softmax_scale: defaults to 1/sqrt(head_dim).
      dropout_prob, dropout_seed: dropout on the attention probabilities; the mask is a pure
        function of (seed, batch, head, i, j), identical in forward and backward and across
        platforms.
      sliding_window: w or (left, right): query i sees keys within [i' - left, i' + right],
        i' = i + seq_len_k - seq_len_q; None or -1 on a side means unbounded.
      logits_soft_cap: c > 0 maps logits to c * tanh(logits / c).
      cum_seqlens_q/k: packed variable-length sequences ([num_seqs + 1] offsets, batch 1);
        causal and window positions are local to each sequence; rows past the last offset
        are padding (output 0).
      q_segment_ids/kv_segment_ids: attend only within equal ids.
      deterministic: make the backward bit-reproducible (no floating-point atomics; the
        CUDA backward then computes dQ in a separate pass, somewhat slower).
      return_lse: also return the log-sum-exp [batch, num_q_heads, seq_len_q] (float32).
      platform: "cuda", "cpu" or "xla"; default: the native kernel of the arrays' device
        when it supports the requested features, else XLA.
      cfg: an explicit FlashAttentionConfig; default: cached, tuned or heuristic.
    """
    executor = executor or _default_executor()
    return executor(
        _KERNEL,
        query,
        key,
        value,
        attention_mask,
        bias,
        softmax_aux,
        causal=causal,
        softmax_scale=softmax_scale,
        dropout_prob=dropout_prob,
        dropout_seed=dropout_seed,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        cum_seqlens_q=cum_seqlens_q,
        cum_seqlens_k=cum_seqlens_k,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        deterministic=deterministic,
        return_lse=return_lse,
        platform=platform,
        cfg=cfg,
    )
