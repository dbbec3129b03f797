"""The public paged (inference) attention API, forward only: one Kernel class and one
function per operation, all served by the paged attention core (csrc/paged_attention/params.h).

Common rules. Queries are aligned to the end of their sequence's context: the q_len query
rows of a sequence with kv_len keys sit at key positions kv_len - q_len .. kv_len - 1, and
(causal) a query sees the keys at or before its position. GQA/MQA: q head h reads kv head
h // (num_q_heads // num_kv_heads). softmax_scale defaults to 1/sqrt(head_dim);
logits_soft_cap c maps logits to c * tanh(logits / c); softmax_aux holds one sink logit per
q head, which joins the softmax denominator and adds no value. A query that sees no key (and
has no sink) gets 0, and so does every row no present sequence owns.

Caches are [num_pages, num_kv_heads, page_size, head_dim] for kv_layout="head_major" and
[num_pages, page_size, num_kv_heads, head_dim] for "token_major"; key position j of a
sequence lives in slot j % page_size of page block_tables[seq, j // page_size]. Caches may
be float8_e4m3fn: k_scale/v_scale dequantise them (stored value * scale = real value).

Metadata may be traced (jit): lengths and counts are data. Concrete metadata are checked
before launch (ValueError naming the argument); traced ones are clamped by every
implementation, so bad values give wrong numbers for their sequence, never an out-of-bounds
access. Entries past num_seqs are padding and are never read as data.

platform: "cuda", "cpu" or "xla"; default: the native kernel of the arrays' device when it
supports the call's features, else XLA. cfg: an explicit PagedAttentionConfig; default:
cached, tuned or heuristic.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Float, Int

from ..kernels.paged_attention import (
    OP_VERSION,
    PagedAttentionConfig,
    config_candidates,
    heuristic_config,
    native_unsupported,
    operation_args,
)
from ..ops import Executor, Invocation, Kernel, Platform
from ..registry import kernel_registry

_DEFAULT_EXECUTOR: Executor | None = None


def _default_executor() -> Executor:
    global _DEFAULT_EXECUTOR
    if _DEFAULT_EXECUTOR is None:
        from .flash_attention import create_default_executor

        _DEFAULT_EXECUTOR = create_default_executor()
    return _DEFAULT_EXECUTOR


class PagedAttentionKernel(Kernel[PagedAttentionConfig, Any]):
    """A paged attention operation; subclasses name it. Every platform runs the shared core."""

    op_version = OP_VERSION
    operation = ""

    def __init__(self) -> None:
        super().__init__(self.operation)

    def run(self, *args: Any, cfg: PagedAttentionConfig, platform: Platform, **kwargs: Any) -> Any:
        return kernel_registry.get(self.name, platform=platform)(*args, cfg=cfg, **kwargs)

    def _args(self, inv: Invocation) -> Any:
        return operation_args(self.name, *inv.args, **inv.kwargs)

    def heuristic_cfg(self, inv: Invocation) -> PagedAttentionConfig:
        return heuristic_config(inv.platform.value, self._args(inv))

    def candidate_cfgs(self, inv: Invocation) -> list[PagedAttentionConfig]:
        return config_candidates(inv.platform.value, self._args(inv))

    def unsupported_features(self, inv: Invocation, platform: Platform) -> list[str]:
        if platform == Platform.XLA:
            return []
        return native_unsupported(platform.value, self._args(inv))


class PageAttention(PagedAttentionKernel):
    """Decode over a paged cache, one query per sequence (see `page_attention`)."""

    operation = "page_attention"


class RaggedPageAttention(PagedAttentionKernel):
    """Mixed prefill and decode over a paged cache (see `ragged_page_attention`)."""

    operation = "ragged_page_attention"


class RaggedPageAttentionV2(RaggedPageAttention):
    """`ragged_page_attention` under its versioned name."""

    operation = "ragged_page_attention_v2"


class RaggedPageAttentionV3(PagedAttentionKernel):
    """Writes the step's keys and values into the cache, then attends (see `ragged_page_attention_v3`)."""

    operation = "ragged_page_attention_v3"


class RaggedDecodeAttention(PagedAttentionKernel):
    """Decode over contiguous per-sequence K/V ranges (see `ragged_decode_attention`)."""

    operation = "ragged_decode_attention"


class UnifiedAttention(PagedAttentionKernel):
    """vLLM-style unified attention over a paged cache (see `unified_attention`)."""

    operation = "unified_attention"


class PrefillPageAttention(PagedAttentionKernel):
    """Chunked prefill against a paged history (see `prefill_page_attention`)."""

    operation = "prefill_page_attention"


_KERNELS = {k.operation: k() for k in (PageAttention, RaggedPageAttention, RaggedPageAttentionV2,
                                       RaggedPageAttentionV3, RaggedDecodeAttention, UnifiedAttention,
                                       PrefillPageAttention)}


def _call(operation: str, args: tuple[Any, ...], kwargs: dict[str, Any], platform, cfg, executor) -> Any:
    executor = executor or _default_executor()
    return executor(_KERNELS[operation], *args, platform=platform, cfg=cfg, **kwargs)


def page_attention(
    query: Float[Array, "num_seqs num_q_heads head_dim"],
    key_cache: Float[Array, "num_pages num_kv_heads page_size head_dim"],
    value_cache: Float[Array, "num_pages num_kv_heads page_size head_dim"],
    context_lens: Int[Array, "num_seqs"],
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    kv_layout: str = "head_major",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    platform: Platform | str | None = None,
    cfg: PagedAttentionConfig | None = None,
    executor: Executor | None = None,
) -> Float[Array, "num_seqs num_q_heads head_dim"]:
    """Decode attention: one query token per sequence over a paged KV cache.

    Args:
      query: [num_seqs, num_q_heads, head_dim], float32/bfloat16/float16; row b is the newest
        token of sequence b.
      key_cache, value_cache: [num_pages, num_kv_heads, page_size, head_dim] (kv_layout
        "head_major", the default) or [num_pages, page_size, num_kv_heads, head_dim]
        ("token_major"); float32/bfloat16/float16/float8_e4m3fn.
      context_lens: int [num_seqs], keys of each sequence, its query's own key included
        (>= 1; the query sits at position context_lens[b] - 1).
      block_tables: int [num_seqs, pages_per_seq], page ids of each sequence; entries past
        ceil(context_lens[b] / page_size) are not read.
      softmax_scale, logits_soft_cap, softmax_aux [num_q_heads]: see the module notes.
      sliding_window: W >= 1: each query sees only its W most recent keys (itself included).
      k_scale, v_scale: dequantisation scales of the caches.

    Returns: [num_seqs, num_q_heads, head_dim] in the query's dtype.
    """
    kwargs = dict(softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                  softmax_aux=softmax_aux, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)
    return _call("page_attention", (query, key_cache, value_cache, context_lens, block_tables), kwargs, platform, cfg,
                 executor)


def _ragged(operation: str, queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs,
            platform, cfg, executor, **kwargs) -> Any:
    args = (queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    return _call(operation, args, kwargs, platform, cfg, executor)


def ragged_page_attention(
    queries: Float[Array, "total_tokens num_q_heads head_dim"],
    key_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    value_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    kv_lens: Int[Array, "max_num_seqs"],
    block_tables: Int[Array, "max_num_seqs pages_per_seq"],
    query_start_loc: Int[Array, "max_num_seqs_plus_1"],
    num_seqs: Int[Array, "1"] | int,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    kv_layout: str = "token_major",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    platform: Platform | str | None = None,
    cfg: PagedAttentionConfig | None = None,
    executor: Executor | None = None,
) -> Float[Array, "total_tokens num_q_heads head_dim"]:
    """Ragged paged attention (v2 semantics): a packed batch mixing prefill and decode.

    Args:
      queries: [total_tokens, num_q_heads, head_dim]; sequence n's queries are rows
        query_start_loc[n] .. query_start_loc[n + 1] - 1; rows past
        query_start_loc[num_seqs] are padding (output 0).
      key_cache, value_cache: [num_pages, page_size, num_kv_heads, head_dim] (kv_layout
        "token_major", the default) or [num_pages, num_kv_heads, page_size, head_dim]
        ("head_major"); float32/bfloat16/float16/float8_e4m3fn.
      kv_lens: int [max_num_seqs], keys of each sequence, its new queries' keys included
        (q_len <= kv_lens[n] <= pages_per_seq * page_size).
      block_tables: int [max_num_seqs, pages_per_seq], page ids of each sequence.
      query_start_loc: int [max_num_seqs + 1], starts at 0, non-decreasing up to
        query_start_loc[num_seqs] <= total_tokens.
      num_seqs: int [1] (or an int, or a vLLM-TPU distribution [3] whose last entry is the
        count): sequences present; entries of the arrays above past it are padding.
      sliding_window: W >= 1: each query sees only its W most recent keys (itself included).
      softmax_scale, logits_soft_cap, softmax_aux [num_q_heads], k_scale, v_scale: see the
        module notes.

    Returns: [total_tokens, num_q_heads, head_dim] in the queries' dtype.
    """
    return _ragged("ragged_page_attention", queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc,
                   num_seqs, platform, cfg, executor, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
                   sliding_window=sliding_window, softmax_aux=softmax_aux, kv_layout=kv_layout, k_scale=k_scale,
                   v_scale=v_scale)


def ragged_page_attention_v2(
    queries: Float[Array, "total_tokens num_q_heads head_dim"],
    key_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    value_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    kv_lens: Int[Array, "max_num_seqs"],
    block_tables: Int[Array, "max_num_seqs pages_per_seq"],
    query_start_loc: Int[Array, "max_num_seqs_plus_1"],
    num_seqs: Int[Array, "1"] | int,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    kv_layout: str = "token_major",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    platform: Platform | str | None = None,
    cfg: PagedAttentionConfig | None = None,
    executor: Executor | None = None,
) -> Float[Array, "total_tokens num_q_heads head_dim"]:
    """`ragged_page_attention` (same arguments and semantics) under its versioned name."""
    return _ragged("ragged_page_attention_v2", queries, key_cache, value_cache, kv_lens, block_tables,
                   query_start_loc, num_seqs, platform, cfg, executor, softmax_scale=softmax_scale,
                   logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, softmax_aux=softmax_aux,
                   kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)


def ragged_page_attention_v3(
    queries: Float[Array, "total_tokens num_q_heads head_dim"],
    keys: Float[Array, "total_tokens num_kv_heads head_dim"],
    values: Float[Array, "total_tokens num_kv_heads head_dim"],
    key_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    value_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    kv_lens: Int[Array, "max_num_seqs"],
    block_tables: Int[Array, "max_num_seqs pages_per_seq"],
    query_start_loc: Int[Array, "max_num_seqs_plus_1"],
    num_seqs: Int[Array, "1"] | int,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    kv_layout: str = "token_major",
    platform: Platform | str | None = None,
    cfg: PagedAttentionConfig | None = None,
    executor: Executor | None = None,
) -> tuple[Float[Array, "total_tokens num_q_heads head_dim"], tuple[Array, Array]]:
    """Ragged paged attention that first writes the step's keys and values into the cache.

    Row r of sequence n (query_start_loc[n] <= r < query_start_loc[n + 1]) is the token at
    key position kv_lens[n] - q_len + (r - query_start_loc[n]): its key and value are
    written there (page block_tables[n, pos // page_size], slot pos % page_size), as
    value / scale saturated at +-448 into a float8_e4m3fn cache and as the value itself,
    rounded, into other caches; the attention, as in `ragged_page_attention`, sees them.
    Padding rows write nothing.

    The update is in place where the caller lets XLA reuse the cache buffers: call it under
    jax.jit with the caches donated (donate_argnums), and use the returned caches from then
    on. The native platforms alias the cache operands to their results; XLA scatters.

    Args:
      queries: [total_tokens, num_q_heads, head_dim].
      keys, values: [total_tokens, num_kv_heads, head_dim], any float dtype: the new tokens.
      key_cache, value_cache: [num_pages, page_size, num_kv_heads, head_dim] ("token_major",
        the default) or [num_pages, num_kv_heads, page_size, head_dim] ("head_major").
      kv_lens, block_tables, query_start_loc, num_seqs, sliding_window, softmax_aux: as in
        `ragged_page_attention`; kv_lens counts the new tokens.
      q_scale: the queries' scale (stored * q_scale = real), folded into softmax_scale.
      k_scale, v_scale: the caches' scales (None = 1): every read multiplies by them, an
        fp8 write divides by them.

    Returns: (out [total_tokens, num_q_heads, head_dim] in the queries' dtype,
      (key_cache, value_cache) updated, shapes and dtypes unchanged).
    """
    args = (queries, keys, values, key_cache, value_cache, kv_lens, block_tables, query_start_loc, num_seqs)
    kwargs = dict(softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                  softmax_aux=softmax_aux, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout)
    return _call("ragged_page_attention_v3", args, kwargs, platform, cfg, executor)


def ragged_decode_attention(
    query: Float[Array, "batch num_q_heads head_dim"],
    key: Float[Array, "batch seq_len num_kv_heads head_dim"],
    value: Float[Array, "batch seq_len num_kv_heads head_dim"],
    sequence_start: Int[Array, "batch"],
    sequence_end: Int[Array, "batch"],
    softmax_scale: float | None = None,
    sliding_window: int | tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    *,
    platform: Platform | str | None = None,
    cfg: PagedAttentionConfig | None = None,
    executor: Executor | None = None,
) -> Float[Array, "batch num_q_heads head_dim"]:
    """Decode attention over contiguous per-sequence K/V: query b sees the keys
    sequence_start[b] <= j < sequence_end[b] of key[b] and sits at position
    sequence_end[b] - 1.

    Args:
      query: [batch, num_q_heads, head_dim], float32/bfloat16/float16.
      key, value: [batch, seq_len, num_kv_heads, head_dim] (float32/bfloat16/float16/
        float8_e4m3fn), used in place as a token-major cache of `batch` pages of seq_len.
      sequence_start, sequence_end: int [batch], 0 <= start <= end <= seq_len, end >= 1.
      sliding_window: w or (left, right): keys j >= (end - 1) - left; the right side has no
        effect (no key lies after the query).
      softmax_scale, logits_soft_cap, softmax_aux [num_q_heads]: see the module notes.

    Returns: [batch, num_q_heads, head_dim] in the query's dtype.
    """
    kwargs = dict(softmax_scale=softmax_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                  softmax_aux=softmax_aux)
    return _call("ragged_decode_attention", (query, key, value, sequence_start, sequence_end), kwargs, platform, cfg,
                 executor)


def unified_attention(
    queries: Float[Array, "total_tokens num_q_heads head_dim"],
    key_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    value_cache: Float[Array, "num_pages page_size num_kv_heads head_dim"],
    kv_lens: Int[Array, "num_seqs"],
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    query_start_loc: Int[Array, "num_seqs_plus_1"],
    *,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    num_seqs: Int[Array, "1"] | int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_layout: str = "token_major",
    platform: Platform | str | None = None,
    cfg: PagedAttentionConfig | None = None,
    executor: Executor | None = None,
) -> Float[Array, "total_tokens num_q_heads head_dim"]:
    """vLLM-style unified attention: a packed batch of prefill and decode queries over a
    paged cache, token-major by default as vLLM lays it out.

    Args:
      queries: [total_tokens, num_q_heads, head_dim].
      key_cache, value_cache: [num_pages, page_size, num_kv_heads, head_dim] (or head-major
        with kv_layout="head_major"); float32/bfloat16/float16/float8_e4m3fn.
      kv_lens: int [num_seqs], each sequence's keys (vLLM's seq_lens), new tokens included.
      block_tables: int [num_seqs, pages_per_seq] (vLLM's block_table).
      query_start_loc: int [num_seqs + 1].
      num_seqs: sequences present (int or int [1]); default: all of them.
      causal: False lets every query see all of its sequence's keys.
      sliding_window: W >= 1: each query sees only its W most recent keys (itself included).
      softmax_aux [num_q_heads], softmax_scale, logits_soft_cap, k_scale, v_scale: see the
        module notes.

    Returns: [total_tokens, num_q_heads, head_dim] in the queries' dtype.
    """
    kwargs = dict(num_seqs=num_seqs, softmax_aux=softmax_aux, softmax_scale=softmax_scale, causal=causal,
                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                  kv_layout=kv_layout)
    args = (queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc)
    return _call("unified_attention", args, kwargs, platform, cfg, executor)


def prefill_page_attention(
    query: Float[Array, "chunk_size num_q_heads head_dim"],
    key_cache: Float[Array, "num_pages num_kv_heads page_size head_dim"],
    value_cache: Float[Array, "num_pages num_kv_heads page_size head_dim"],
    context_len: Int[Array, "num_seqs"],
    page_indices: Int[Array, "pages_per_seq"] | Int[Array, "num_seqs pages_per_seq"],
    *,
    query_start_loc: Int[Array, "num_seqs_plus_1"] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    softmax_aux: Float[Array, "num_q_heads"] | None = None,
    kv_layout: str = "head_major",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    platform: Platform | str | None = None,
    cfg: PagedAttentionConfig | None = None,
    executor: Executor | None = None,
) -> Float[Array, "chunk_size num_q_heads head_dim"]:
    """Chunked prefill: new tokens of one or more sequences, causally against their paged
    history (whose pages must already hold the new tokens' keys and values).

    Args:
      query: [chunk_size, num_q_heads, head_dim]: the new tokens, packed.
      key_cache, value_cache: [num_pages, num_kv_heads, page_size, head_dim] (kv_layout
        "head_major", the default) or [num_pages, page_size, num_kv_heads, head_dim].
      context_len: int [num_seqs] (one sequence: [1]), keys of each sequence including its
        new tokens: sequence n's queries sit at positions context_len[n] - q_len .. - 1.
      page_indices: int [pages_per_seq] for one sequence, [num_seqs, pages_per_seq] for several.
      query_start_loc: int [num_seqs + 1]; default for one sequence: [0, chunk_size].
      sliding_window: W >= 1: each query sees only its W most recent keys (itself included).
      softmax_scale, logits_soft_cap, softmax_aux [num_q_heads], k_scale, v_scale: see the
        module notes.

    Returns: [chunk_size, num_q_heads, head_dim] in the query's dtype.
    """
    kwargs = dict(query_start_loc=query_start_loc, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
                  sliding_window=sliding_window, softmax_aux=softmax_aux, kv_layout=kv_layout, k_scale=k_scale,
                  v_scale=v_scale)
    return _call("prefill_page_attention", (query, key_cache, value_cache, context_len, page_indices), kwargs,
                 platform, cfg, executor)


__all__ = [
    "PageAttention",
    "PagedAttentionConfig",
    "PagedAttentionKernel",
    "PrefillPageAttention",
    "RaggedDecodeAttention",
    "RaggedPageAttention",
    "RaggedPageAttentionV2",
    "RaggedPageAttentionV3",
    "UnifiedAttention",
    "page_attention",
    "prefill_page_attention",
    "ragged_decode_attention",
    "ragged_page_attention",
    "ragged_page_attention_v2",
    "ragged_page_attention_v3",
    "unified_attention",
]
