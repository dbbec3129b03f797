"""The public paged attention operations: each against the reference on every platform,
argument errors (shapes, dtypes, metadata values), jit with traced metadata, donation of the
v3 caches, registration and platform choice."""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel import Platform, _native, kernel_registry
from ejkernel.kernels.paged_attention import (
    OPERATIONS,
    PagedAttentionConfig,
    normalize,
    operation_args,
    paged_attention_native,
)
from ejkernel.modules import (
    page_attention,
    prefill_page_attention,
    ragged_decode_attention,
    ragged_page_attention,
    ragged_page_attention_v2,
    ragged_page_attention_v3,
    unified_attention,
)
from paged_impls import native_unavailable
from paged_reference import Spec, make_batch, paged_reference, scatter_reference, to_f64
from test_paged_attention import MIXED, assert_close, check_output, core_args

native_cpu = pytest.mark.skipif(native_unavailable("cpu", "cpu") is not None, reason="no native CPU paged attention")


def _cfg(impl) -> PagedAttentionConfig | None:
    if impl.name == "xla":
        return PagedAttentionConfig(block_kv=24)
    if impl.name == "cuda_split5":
        return PagedAttentionConfig(num_splits=5)
    return None


def _platform(impl) -> str:
    """The platform an implementation under test runs on ("cuda_split5" is CUDA with 5 splits)."""
    return impl.name.split("_")[0]


def _j(batch: dict, *names: str) -> list:
    return [None if batch[n] is None else jnp.asarray(batch[n]) for n in names]


RAGGED = ("query", "key_cache", "value_cache", "kv_lens", "block_tables", "query_start_loc", "num_seqs")


@pytest.mark.parametrize("kv_layout", ["head_major", "token_major"])
def test_page_attention(impl, kv_layout, rng):
    spec = Spec(((1, 37), (1, 1), (1, 64), (1, 90), (1, 16)), padding_seqs=0, padding_rows=0, kv_heads=1, sinks=True,
                window=29, soft_cap=7.0, kv_layout=kv_layout)
    batch = make_batch(spec, rng)
    impl.require(*core_args(batch).features())
    q, kc, vc, lens, tables, aux = _j(batch, "query", "key_cache", "value_cache", "kv_lens", "block_tables", "sinks")
    out = page_attention(q, kc, vc, lens, tables, softmax_aux=aux, sliding_window=30, logits_soft_cap=7.0,
                         kv_layout=kv_layout, platform=_platform(impl), cfg=_cfg(impl))
    check_output(out, batch, core_args(batch))


def test_ragged_page_attention_and_v2(impl, rng):
    batch = make_batch(Spec(MIXED, kv_layout="token_major", sinks=True, window=11, page_size=8), rng)
    impl.require(*core_args(batch).features())
    kwargs = dict(softmax_aux=jnp.asarray(batch["sinks"]), sliding_window=12, platform=_platform(impl), cfg=_cfg(impl))
    out = ragged_page_attention(*_j(batch, *RAGGED), **kwargs)
    check_output(out, batch, core_args(batch))
    np.testing.assert_array_equal(np.asarray(ragged_page_attention_v2(*_j(batch, *RAGGED), **kwargs)), np.asarray(out))


@pytest.mark.parametrize("cache_dtype", [None, "float8_e4m3fn"])
def test_ragged_page_attention_v3(impl, cache_dtype, rng):
    scales = dict(k_scale=0.05, v_scale=0.02) if cache_dtype else {}
    spec = Spec(MIXED, dtype="bfloat16", cache_dtype=cache_dtype, update=True, kv_layout="token_major", **scales)
    batch = make_batch(spec, rng)
    impl.require(*core_args(batch).features())
    q_scale = 0.5
    distribution = jnp.asarray([1, 3, len(MIXED)], jnp.int32)  # decode end, prefill end, all sequences
    q, keys, values, kc, vc, lens, tables, qsl = _j(batch, "query", "new_keys", "new_values", "key_cache",
                                                    "value_cache", "kv_lens", "block_tables", "query_start_loc")
    out, (key_cache, value_cache) = ragged_page_attention_v3(
        q, keys, values, kc, vc, lens, tables, qsl, distribution, q_scale=q_scale, platform=_platform(impl),
        cfg=_cfg(impl), **scales)
    meta = {k: batch[k] for k in ("kv_lens", "block_tables", "query_start_loc", "num_seqs", "kv_layout", "k_scale",
                                  "v_scale")}
    want_k, want_v = scatter_reference(batch["new_keys"], batch["new_values"], batch["key_cache"],
                                       batch["value_cache"], **meta)
    np.testing.assert_array_equal(np.asarray(key_cache).view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(value_cache).view(np.uint8), want_v.view(np.uint8))
    updated = {**batch, "key_cache": want_k, "value_cache": want_v, "softmax_scale": batch["softmax_scale"] * q_scale}
    check_output(out, updated, core_args(batch))


def test_v3_under_jit_donates_the_caches(impl, rng):
    batch = make_batch(Spec(MIXED, update=True, kv_layout="token_major"), rng)
    impl.require(*core_args(batch).features())
    names = ("query", "new_keys", "new_values", "key_cache", "value_cache", "kv_lens", "block_tables",
             "query_start_loc", "num_seqs")
    step = jax.jit(lambda *a: ragged_page_attention_v3(*a, platform=_platform(impl), cfg=_cfg(impl)), donate_argnums=(3, 4))
    inputs = _j(batch, *names)
    out, (key_cache, value_cache) = step(*inputs)
    assert inputs[3].is_deleted() and inputs[4].is_deleted(), "the donated caches were copied, not reused"
    meta = {k: batch[k] for k in ("kv_lens", "block_tables", "query_start_loc", "num_seqs", "kv_layout")}
    want_k, want_v = scatter_reference(batch["new_keys"], batch["new_values"], batch["key_cache"],
                                       batch["value_cache"], **meta)
    np.testing.assert_array_equal(np.asarray(key_cache), want_k)
    np.testing.assert_array_equal(np.asarray(value_cache), want_v)
    check_output(out, {**batch, "key_cache": want_k, "value_cache": want_v}, core_args(batch))


def _dense_decode_reference(q, k, v, starts, ends, *, softmax_scale, window_left, soft_cap, sinks):
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    b, hq, _ = q.shape
    group = hq // k.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        j = np.arange(k.shape[1])
        visible = (j >= starts[i]) & (j < ends[i])
        if window_left >= 0:
            visible &= j >= ends[i] - 1 - window_left
        keys, values = np.repeat(k[i][visible], group, 1), np.repeat(v[i][visible], group, 1)
        logits = np.einsum("hd,khd->hk", q[i], keys) * softmax_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        top = np.maximum(logits.max(-1, initial=-np.inf), sinks)
        weights = np.exp(logits - top[:, None])
        total = weights.sum(-1) + np.exp(sinks - top)
        out[i] = np.einsum("hk,khd->hd", weights / total[:, None], values)
    return out


def test_ragged_decode_attention(impl, rng):
    b, s, hq, hkv, d = 6, 70, 4, 2, 32
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32) for _ in range(2))
    ends = np.array([70, 1, 33, 50, 20, 64], np.int32)
    starts = np.array([0, 0, 5, 50, 19, 30], np.int32)  # sequence 3 is empty: only the sink
    sinks = rng.standard_normal(hq).astype(np.float32)
    args = normalize(q, k, v, ends, jnp.arange(b)[:, None], jnp.arange(b + 1), jnp.asarray([b]), kv_starts=starts,
                     sinks=sinks, kv_layout="token_major", window_left=24, logits_soft_cap=6.0)
    impl.require(*args.features())
    out = ragged_decode_attention(q, k, v, jnp.asarray(starts), jnp.asarray(ends), sliding_window=(24, 3),
                                  logits_soft_cap=6.0, softmax_aux=jnp.asarray(sinks), platform=_platform(impl),
                                  cfg=_cfg(impl))
    want = _dense_decode_reference(q, k, v, starts, ends, softmax_scale=d**-0.5, window_left=24, soft_cap=6.0,
                                   sinks=sinks.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_unified_attention(impl, causal, rng):
    spec = Spec(MIXED, kv_layout="token_major", padding_seqs=0, causal=causal, soft_cap=5.0, kv_heads=1,
                dtype="bfloat16")
    batch = make_batch(spec, rng)
    impl.require(*core_args(batch).features())
    out = unified_attention(*_j(batch, *RAGGED[:-1]), causal=causal, logits_soft_cap=5.0, platform=_platform(impl),
                            cfg=_cfg(impl))
    check_output(out, batch, core_args(batch))


@pytest.mark.parametrize("sequences", [1, 3])
def test_prefill_page_attention(impl, sequences, rng):
    seqs = ((13, 100), (20, 20), (7, 40))[:sequences]
    batch = make_batch(Spec(seqs, padding_seqs=0, padding_rows=0, sinks=True, page_size=8), rng)
    impl.require(*core_args(batch).features())
    q, kc, vc, lens, tables, qsl, aux = _j(batch, "query", "key_cache", "value_cache", "kv_lens", "block_tables",
                                           "query_start_loc", "sinks")
    if sequences == 1:
        out = prefill_page_attention(q, kc, vc, lens, tables[0], softmax_aux=aux, platform=_platform(impl), cfg=_cfg(impl))
    else:
        out = prefill_page_attention(q, kc, vc, lens, tables, query_start_loc=qsl, softmax_aux=aux,
                                     platform=_platform(impl), cfg=_cfg(impl))
    check_output(out, batch, core_args(batch))


def test_jit_with_traced_metadata(impl, rng):
    batch = make_batch(Spec(MIXED, kv_layout="token_major"), rng)
    impl.require(*core_args(batch).features())
    attend = jax.jit(lambda *a: ragged_page_attention(*a, platform=_platform(impl), cfg=_cfg(impl)))
    out = attend(*_j(batch, *RAGGED))
    check_output(out, batch, core_args(batch))
    fewer = {**batch, "num_seqs": np.array([2], np.int32)}
    check_output(attend(*_j(fewer, *RAGGED)), fewer, core_args(fewer))


# Argument errors: a ValueError or TypeError that names the argument, before anything runs.


@pytest.fixture(scope="module")
def base():
    batch = make_batch(Spec(MIXED, kv_layout="token_major", update=True), np.random.default_rng(0))
    for name in ("key_cache", "value_cache"):  # the new tokens' slots: data, as if already written
        batch[name] = np.nan_to_num(batch[name])
    return {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}


def _ragged_call(b, **change):
    kwargs = dict(queries=b["query"], key_cache=b["key_cache"], value_cache=b["value_cache"], kv_lens=b["kv_lens"],
                  block_tables=b["block_tables"], query_start_loc=b["query_start_loc"], num_seqs=b["num_seqs"])
    kwargs.update(change)
    return ragged_page_attention(**kwargs, platform="xla")


def _v3_call(b, **change):
    kwargs = dict(queries=b["query"], keys=b["new_keys"], values=b["new_values"], key_cache=b["key_cache"],
                  value_cache=b["value_cache"], kv_lens=b["kv_lens"], block_tables=b["block_tables"],
                  query_start_loc=b["query_start_loc"], num_seqs=b["num_seqs"])
    kwargs.update(change)
    return ragged_page_attention_v3(**kwargs, platform="xla")


def _decode_call(b, **change):
    q = b["query"][:4]
    k = jnp.zeros((4, 16, 2, 32), jnp.float32)
    kwargs = dict(query=q, key=k, value=k, sequence_start=jnp.zeros(4, jnp.int32),
                  sequence_end=jnp.full(4, 16, jnp.int32))
    kwargs.update(change)
    return ragged_decode_attention(**kwargs, platform="xla")


BAD_INPUTS = [
    ("queries rank", _ragged_call, lambda b: dict(queries=b["query"][0]), ValueError, "queries must have rank 3"),
    ("queries dtype", _ragged_call, lambda b: dict(queries=b["query"].astype(jnp.int32)), TypeError,
     "queries must be float32"),
    ("cache rank", _ragged_call, lambda b: dict(key_cache=b["key_cache"][0]), ValueError, "key_cache must have rank 4"),
    ("cache dtype", _ragged_call, lambda b: dict(key_cache=b["key_cache"].astype(jnp.int8),
                                                 value_cache=b["value_cache"].astype(jnp.int8)), TypeError,
     "key_cache must be float32, bfloat16, float16 or float8_e4m3fn"),
    ("k/v mismatch", _ragged_call, lambda b: dict(value_cache=b["value_cache"][:-1]), ValueError,
     "must have the same shape and dtype"),
    ("head dim", _ragged_call,
     lambda b: dict(key_cache=b["key_cache"][..., :16], value_cache=b["value_cache"][..., :16]), ValueError,
     "key_cache head_dim (16) must equal queries head_dim (32)"),
    ("heads", _ragged_call, lambda b: dict(key_cache=jnp.repeat(b["key_cache"][:, :, :1], 3, 2),
                                           value_cache=jnp.repeat(b["value_cache"][:, :, :1], 3, 2)), ValueError,
     "num_kv_heads (3) must divide num_q_heads (4)"),
    ("layout", _ragged_call, lambda b: dict(kv_layout="pages_first"), ValueError, "kv_layout must be"),
    ("kv_lens shape", _ragged_call, lambda b: dict(kv_lens=b["kv_lens"][:-1]), ValueError,
     "kv_lens must have shape [max_num_seqs=9]"),
    ("kv_lens dtype", _ragged_call, lambda b: dict(kv_lens=b["kv_lens"].astype(jnp.float32)), TypeError,
     "kv_lens must be an integer array"),
    ("tables rank", _ragged_call, lambda b: dict(block_tables=b["block_tables"][0]), ValueError,
     "block_tables must have rank 2"),
    ("qsl shape", _ragged_call, lambda b: dict(query_start_loc=b["query_start_loc"][:-1]), ValueError,
     "query_start_loc must have shape [max_num_seqs + 1 = 10]"),
    ("num_seqs shape", _ragged_call, lambda b: dict(num_seqs=jnp.zeros(2, jnp.int32)), ValueError,
     "num_seqs must have shape [1]"),
    ("sinks", _ragged_call, lambda b: dict(softmax_aux=jnp.ones(3)), ValueError,
     "softmax_aux must have shape [num_q_heads=4]"),
    ("soft cap", _ragged_call, lambda b: dict(logits_soft_cap=0.0), ValueError,
     "logits_soft_cap must be a finite float > 0"),
    ("window", _ragged_call, lambda b: dict(sliding_window=0), ValueError, "sliding_window must be an int >= 1"),
    ("scale", _ragged_call, lambda b: dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("k_scale", _ragged_call, lambda b: dict(k_scale=-1.0), ValueError, "k_scale must be a finite float > 0"),
    ("v3 keys", _v3_call, lambda b: dict(keys=b["new_keys"][:, :1]), ValueError,
     "keys must have shape [num_tokens=43, num_kv_heads=2, head_dim=32]"),
    ("v3 q_scale", _v3_call, lambda b: dict(q_scale=0.0), ValueError, "q_scale"),
    ("decode key rank", _decode_call, lambda b: dict(key=jnp.zeros((4, 16, 32))), ValueError, "key must have rank 4"),
    ("decode batch", _decode_call, lambda b: dict(query=b["query"][:3]), ValueError,
     "key batch (4) must equal query batch (3)"),
    ("decode window", _decode_call, lambda b: dict(sliding_window=(4, -3)), ValueError, "sliding_window sides"),
]


@pytest.mark.parametrize("name,call,change,error,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(base, name, call, change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call(base, **change(base))


def _set(b, name, index, value):
    return {name: b[name].at[index].set(value)}


BAD_VALUES = [
    ("page id", lambda b: _set(b, "block_tables", (3, 5), 99), r"block_tables\[3, 5\]=99 is not a page of key_cache"),
    ("negative page id", lambda b: _set(b, "block_tables", (0, 0), -1), r"block_tables\[0, 0\]=-1"),
    ("kv_lens too long", lambda b: _set(b, "kv_lens", 1, 10_000), r"kv_lens\[1\]=10000 must lie in"),
    ("kv_lens below q_len", lambda b: _set(b, "kv_lens", 1, 19), r"kv_lens\[1\]=19 must lie in \[query length 20"),
    ("qsl start", lambda b: _set(b, "query_start_loc", 0, 1), r"query_start_loc\[0\] must be 0"),
    ("qsl order", lambda b: _set(b, "query_start_loc", 2, 0), "non-decreasing"),
    ("qsl end", lambda b: _set(b, "query_start_loc", 7, 60), "exceeds the number of query rows 43"),
    ("num_seqs", lambda b: dict(num_seqs=jnp.asarray([10], jnp.int32)),
     r"num_seqs\[0\]=10 must lie in \[0, max_num_seqs=9\]"),
]


@pytest.mark.parametrize("name,change,message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_metadata_values(base, name, change, message):
    with pytest.raises(ValueError, match=message):
        _ragged_call(base, **change(base))


def test_bad_values_speak_each_operations_names(base):
    with pytest.raises(ValueError, match=r"context_lens\[0\]=0 must lie in \[query length 1"):
        page_attention(base["query"][:2], base["key_cache"], base["value_cache"], jnp.asarray([0, 5], jnp.int32),
                       base["block_tables"][:2], kv_layout="token_major", platform="xla")
    with pytest.raises(ValueError, match=r"sequence_start\[2\]=9 must lie in \[0, sequence_end\[2\]=8\]"):
        _decode_call(base, sequence_start=jnp.asarray([0, 0, 9, 0], jnp.int32),
                     sequence_end=jnp.asarray([16, 16, 8, 16], jnp.int32))
    with pytest.raises(ValueError, match=r"sequence_end\[0\]=17 must lie in"):
        _decode_call(base, sequence_end=jnp.asarray([17, 16, 16, 16], jnp.int32))
    with pytest.raises(ValueError, match=r"page_indices\[0, 1\]=-5 is not a page"):
        prefill_page_attention(base["query"][:5], base["key_cache"], base["value_cache"], jnp.asarray([30], jnp.int32),
                               jnp.asarray([0, -5, 2, 3], jnp.int32), kv_layout="token_major", platform="xla")
    with pytest.raises(ValueError, match="query_start_loc is required for 2 sequences"):
        prefill_page_attention(base["query"], base["key_cache"], base["value_cache"], jnp.asarray([30, 30], jnp.int32),
                               jnp.zeros((2, 4), jnp.int32), kv_layout="token_major", platform="xla")


def test_decode_operations_leave_query_start_loc_out(base):
    """page_attention and ragged_decode_attention build no [0, 1, ..., N] (a kernel launch per
    call on GPUs): sequence n owns query row n; a ragged call keeps its query_start_loc."""
    q, kc, vc = base["query"][:2], base["key_cache"], base["value_cache"]
    lens, tables = jnp.asarray([5, 7], jnp.int32), base["block_tables"][:2]
    args = operation_args("page_attention", q, kc, vc, lens, tables, kv_layout="token_major")
    assert args.query_start_loc is None and int(args.num_seqs[0]) == 2
    k = jnp.zeros((4, 16, 2, 32), jnp.float32)
    args = operation_args("ragged_decode_attention", base["query"][:4], k, k, jnp.zeros(4, jnp.int32),
                          jnp.full(4, 16, jnp.int32))
    assert args.query_start_loc is None
    args = operation_args("ragged_page_attention", *(base[n] for n in RAGGED))
    np.testing.assert_array_equal(np.asarray(args.query_start_loc), np.asarray(base["query_start_loc"]))
    with pytest.raises(ValueError, match=re.escape("block_tables must have one row per query (batch=2), got int32[9")):
        page_attention(q, kc, vc, base["kv_lens"], base["block_tables"], kv_layout="token_major", platform="xla")
    with pytest.raises(ValueError, match=re.escape("num_seqs[0]=3 exceeds the number of query rows 2 (one row per")):
        normalize(q, kc, vc, base["kv_lens"][:3], base["block_tables"][:3], None, jnp.asarray([3], jnp.int32),
                  kv_layout="token_major")


# Registration and platform choice.


def test_every_operation_is_registered():
    info = ejkernel.build_info()["operations"]
    for op in OPERATIONS:
        assert Platform.XLA in kernel_registry.platforms_for(op), op
        assert "xla" in info[op], op
    assert set(OPERATIONS) >= {"page_attention", "ragged_page_attention", "ragged_page_attention_v2",
                               "ragged_page_attention_v3", "ragged_decode_attention", "unified_attention",
                               "prefill_page_attention"}


def test_cuda_platform_without_gpu_is_an_error(base):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError):
        ragged_page_attention(*(base[n] for n in RAGGED), platform="cuda")


def test_cuda_rejects_more_splits_than_it_combines(base):
    if native_unavailable("cuda", "gpu") is not None:
        pytest.skip("no native CUDA paged attention here")
    with pytest.raises(Exception, match="num_splits must be at most 128"):
        jax.block_until_ready(ragged_page_attention(*(base[n] for n in RAGGED), platform="cuda",
                                                    cfg=PagedAttentionConfig(num_splits=129)))


def test_cuda_split_workspace_size():
    if native_unavailable("cuda", "gpu") is not None:
        pytest.skip("no native CUDA paged attention here")
    sig = {"num_tokens": 37, "num_q_heads": 8, "head_dim": 128}
    op = "paged_attention"
    # Partials (D floats), two softmax statistics per split and two counters per (token, head).
    assert _native.workspace_bytes(op, "cuda", "forward", {**sig, "num_splits": 5}) == 4 * 37 * 8 * (5 * 130 + 2)
    assert _native.workspace_bytes(op, "cuda", "forward", {**sig, "num_splits": 1}) == 0
    with pytest.raises(RuntimeError, match="num_splits"):
        _native.workspace_bytes(op, "cuda", "forward", {**sig, "num_splits": 0})


def test_cpu_takes_no_split_workspace():
    if not _native.available():
        pytest.skip("libejkernel not loaded")
    sig = {"num_tokens": 37, "num_q_heads": 8, "head_dim": 128, "num_splits": 5}
    assert _native.workspace_bytes("paged_attention", "cpu", "forward", sig) == 0


def test_default_platform_and_config(base):
    """Without a platform or config the call still runs (auto choice, heuristic config)."""
    out = ragged_page_attention(*(base[n] for n in RAGGED))
    assert out.shape == base["query"].shape and bool(jnp.isfinite(out).all())


@native_cpu
def test_auto_choice_is_native_cpu_and_logged(base, caplog):
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        ragged_page_attention(*(base[n] for n in RAGGED), kv_layout="token_major")
    assert any("platform=cpu" in r.getMessage() and "ragged_page_attention" in r.getMessage() for r in caplog.records)


@native_cpu
def test_disable_switch_falls_back_to_xla(base, caplog, monkeypatch):
    monkeypatch.setenv("EJKERNEL_DISABLE_NATIVE", "paged_attention")
    with caplog.at_level(logging.DEBUG, logger="ejkernel"):
        ragged_page_attention(*(base[n] for n in RAGGED), kv_layout="token_major")
    assert any("platform=xla" in r.getMessage() for r in caplog.records)


@native_cpu
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: dict(block_tables=a.block_tables.at[3, 5].set(99)), "block_tables"),
        (lambda a: dict(kv_lens=a.kv_lens.at[1].set(10_000)), "kv_lens"),
        (lambda a: dict(num_seqs=jnp.asarray([10], jnp.int32)), "num_seqs"),
        (lambda a: dict(softmax_scale=float("inf")), "softmax_scale"),
        (lambda a: dict(sinks=jnp.ones(3, jnp.float32)), "sinks"),
    ],
)
def test_cpp_validation_reaches_python(base, change, message):
    """The native CPU kernel validates again: a call past the Python checks gets an exception."""
    args = normalize(*(base[n] for n in RAGGED), kv_layout="token_major")
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(paged_attention_native("cpu", dataclasses.replace(args, **change(args))))


def test_reference_is_independent_of_jax_x64():
    """The reference computes in float64 NumPy; JAX's default dtype stays float32."""
    batch = make_batch(Spec(((1, 5),), padding_seqs=0), np.random.default_rng(1))
    out = paged_reference(**{k: v for k, v in batch.items()})
    assert out.dtype == np.float64 and jnp.asarray(1.0).dtype == jnp.float32
    assert_close("self", out, out, out)
