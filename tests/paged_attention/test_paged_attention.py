"""The paged attention core of every implementation against the float64 reference.

Accuracy: an implementation's error (against float64) may be at most twice the error of the
reference evaluated with every intermediate rounded to the query's dtype, plus a floor of
about 1e-6 relative. Inputs are fresh random draws every run; the seed is printed for
reproduction. Every batch carries garbage where nothing may be read (see paged_reference).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ejkernel.kernels.paged_attention import PagedArgs, normalize, paged_attention_xla
from paged_reference import STATIC, Spec, make_batch, paged_reference, scatter_reference, to_f64

# Decode, prefill, empty, chunked prefill, length 1, history without queries, short.
MIXED = ((1, 37), (20, 20), (0, 0), (13, 100), (1, 1), (0, 9), (5, 61))

CASES = {
    "decode_f32_head_major": Spec(((1, 37), (1, 1), (1, 64), (1, 90)), padding_rows=0),
    "mixed_f32_token_major_s8_gqa4": Spec(MIXED, page_size=8, kv_heads=1, kv_layout="token_major"),
    "mixed_bf16_s32": Spec(MIXED, page_size=32, dtype="bfloat16"),
    "mixed_f16_token_major_s128_mha_d64": Spec(((1, 300), (37, 250), (0, 0), (1, 1), (4, 129)), page_size=128,
                                               q_heads=2, head_dim=64, dtype="float16", kv_layout="token_major"),
    "gqa_32_8_bf16_d16": Spec(((1, 40), (9, 33), (1, 1), (3, 17)), q_heads=32, kv_heads=8, head_dim=16,
                              dtype="bfloat16"),
    "d128_f32": Spec(((1, 50), (7, 30)), q_heads=2, kv_heads=1, head_dim=128),
    "soft_cap": Spec(MIXED, soft_cap=5.0),
    "sinks_bf16": Spec(MIXED, sinks=True, dtype="bfloat16"),
    "window_s8": Spec(MIXED, window=10, page_size=8),
    "kv_starts": Spec(MIXED, kv_starts=True),
    "non_causal": Spec(MIXED, causal=False, kv_layout="token_major"),
    "fp8_bf16": Spec(MIXED, dtype="bfloat16", cache_dtype="float8_e4m3fn", k_scale=0.05, v_scale=0.02),
    "fp8_f32_token_major": Spec(MIXED, cache_dtype="float8_e4m3fn", k_scale=0.1, v_scale=0.03,
                                kv_layout="token_major", kv_heads=1),
    "everything_bf16_token_major_s8": Spec(MIXED, dtype="bfloat16", page_size=8, kv_heads=1, kv_layout="token_major",
                                           soft_cap=6.0, sinks=True, window=17, kv_starts=True),
    # The tensor-core kernels (head dims 64/128/256): a sequence's first keys (kv_starts) lie
    # inside a 64-key block, their slots NaN; an f32 query and a query of another 16-bit dtype
    # than the cache, which take the fp32 kernel.
    "kv_starts_bf16_d128_s16": Spec(MIXED, dtype="bfloat16", head_dim=128, page_size=16, kv_starts=True),
    "kv_starts_fp8_f16_d64_window": Spec(MIXED, dtype="float16", cache_dtype="float8_e4m3fn", head_dim=64,
                                         kv_starts=True, window=30, k_scale=0.05, v_scale=0.02),
    "fp8_f32_d128": Spec(MIXED, cache_dtype="float8_e4m3fn", head_dim=128, k_scale=0.05, v_scale=0.02),
    "bf16_q_f16_cache_d64": Spec(MIXED, dtype="bfloat16", cache_dtype="float16", head_dim=64),
    "everything_fp8_f16_s32": Spec(MIXED, dtype="float16", cache_dtype="float8_e4m3fn", page_size=32,
                                   soft_cap=4.0, sinks=True, window=25, kv_starts=True, k_scale=0.04, v_scale=0.05),
}


def core_args(batch: dict) -> PagedArgs:
    arrays = {k: (None if v is None else jnp.asarray(v)) for k, v in batch.items() if k not in STATIC}
    return normalize(**arrays, **{k: batch[k] for k in STATIC})


def reference(batch: dict, round_to=None) -> np.ndarray:
    return paged_reference(**{k: v for k, v in batch.items() if k not in ("new_keys", "new_values")},
                           round_to=round_to)


def assert_close(name: str, got, want, same_dtype, terms: int = 1) -> None:
    """|got - want| <= 2 |same_dtype - want| + ~1e-6 relative (x sqrt(terms), the keys summed
    into each output, whose float32 rounding grows with their count), in max norm; no NaN."""
    got = to_f64(got)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN at {np.argwhere(np.isnan(got))[:5].tolist()}"
    err = np.abs(got - want).max(initial=0.0)
    ref_err = np.abs(same_dtype - want).max(initial=0.0)
    floor = 2.0**-20 * max(1.0, np.abs(want).max(initial=0.0)) * np.sqrt(terms)
    assert err <= 2 * ref_err + floor, (
        f"{name}: max error {err:.3g} > 2 x same-dtype reference error {ref_err:.3g} + {floor:.2g}"
    )


def check_output(out, batch: dict, args: PagedArgs) -> None:
    want = reference(batch)
    approx = reference(batch, round_to=np.asarray(batch["query"]).dtype)
    assert out.shape == args.query.shape and out.dtype == args.query.dtype
    keys = int(np.max(batch["kv_lens"][: int(batch["num_seqs"][0])], initial=1))
    assert_close("out", out, want, approx, keys)
    padding = int(batch["query_start_loc"][int(batch["num_seqs"][0])])
    np.testing.assert_array_equal(to_f64(out)[padding:], 0.0, err_msg="padding rows must be 0")
    np.testing.assert_array_equal(to_f64(out)[want == 0.0], 0.0, err_msg="rows that see nothing must be 0")


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(impl, case, rng):
    batch = make_batch(CASES[case], rng)
    args = core_args(batch)
    impl.require(*args.features())
    check_output(impl.attention(args), batch, args)


def _regarble(batch: dict, rng: np.random.Generator) -> dict:
    """The same batch with other garbage wherever nothing may be read."""
    other = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in batch.items()}
    ns = int(batch["num_seqs"][0])
    padding = int(batch["query_start_loc"][ns])
    other["query"][padding:] = other["query"].dtype.type(1000.0)
    for name in ("key_cache", "value_cache"):
        cache = other[name]
        cache[np.isnan(to_f64(cache))] = cache.dtype.type(400.0)
    n = batch["kv_lens"].shape[0]
    other["kv_lens"][ns:] = rng.integers(-(2**31), 2**31 - 1, n - ns)
    other["block_tables"][ns:] = rng.integers(-(2**31), 2**31 - 1, other["block_tables"][ns:].shape)
    other["query_start_loc"][ns + 1 :] = rng.integers(-(2**31), 2**31 - 1, n - ns)
    if other["kv_starts"] is not None:
        other["kv_starts"][ns:] = rng.integers(-(2**31), 2**31 - 1, n - ns)
    return other


def test_garbage_is_never_read(impl, rng):
    """Different garbage in padding rows, hidden cache slots and padding metadata gives
    bit-identical outputs."""
    spec = dataclasses.replace(CASES["everything_bf16_token_major_s8"], cache_dtype="float8_e4m3fn", k_scale=0.05,
                               v_scale=0.02, dtype="float32", kv_heads=2, kv_layout="head_major")
    batch = make_batch(spec, rng)
    args = core_args(batch)
    impl.require(*args.features())
    first = np.asarray(impl.attention(args))
    second = np.asarray(impl.attention(core_args(_regarble(batch, rng))))
    np.testing.assert_array_equal(first, second)
    assert np.isfinite(first).all()


# Without query_start_loc (what the decode operations pass) sequence n owns query row n.
DECODE = ((1, 37), (1, 1), (1, 64), (1, 90), (1, 16), (1, 200))
ABSENT_QSL_CASES = {
    "f32_head_major": Spec(DECODE),
    "everything_bf16_token_major": Spec(DECODE, dtype="bfloat16", kv_layout="token_major", page_size=8, kv_heads=1,
                                        soft_cap=6.0, sinks=True, window=17, kv_starts=True),
    "fp8_f16": Spec(DECODE, dtype="float16", cache_dtype="float8_e4m3fn", k_scale=0.05, v_scale=0.02),
}


@pytest.mark.parametrize("case", sorted(ABSENT_QSL_CASES))
def test_absent_query_start_loc(impl, case, rng):
    """Matches the reference and, bit for bit, the explicit [0, 1, ..., N]; under jit too,
    with fewer sequences (their rows become padding)."""
    batch = make_batch(ABSENT_QSL_CASES[case], rng)
    args = core_args({**batch, "query_start_loc": None})
    assert args.query_start_loc is None
    impl.require(*args.features())
    out = impl.attention(args)
    check_output(out, batch, args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(impl.attention(core_args(batch))))
    attend = jax.jit(lambda num_seqs: impl.attention(dataclasses.replace(args, num_seqs=num_seqs)))
    fewer = {**batch, "num_seqs": np.array([3], np.int32)}
    check_output(attend(jnp.asarray(fewer["num_seqs"])), fewer, args)


def _check_update(batch: dict, key_cache, value_cache):
    """The updated caches equal, bit for bit, the NumPy scatter of the batch's new tokens
    (which the query_start_loc of `batch` places); returns that scatter."""
    meta = {k: batch[k] for k in ("kv_lens", "block_tables", "query_start_loc", "num_seqs", "kv_layout", "k_scale",
                                  "v_scale")}
    want_k, want_v = scatter_reference(batch["new_keys"], batch["new_values"], batch["key_cache"],
                                       batch["value_cache"], **meta)
    for name, got, want in (("key_cache", key_cache, want_k), ("value_cache", value_cache, want_v)):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8), err_msg=name)
    return want_k, want_v


def test_absent_query_start_loc_cache_update(impl, rng):
    batch = make_batch(Spec(DECODE, dtype="bfloat16", kv_layout="token_major", update=True, page_size=8), rng)
    args = core_args({**batch, "query_start_loc": None})
    impl.require(*args.features())
    _check_update(batch, *impl.update(args))


UPDATE_CASES = {
    "bf16_token_major": Spec(MIXED, dtype="bfloat16", kv_layout="token_major", update=True),
    "fp8_head_major_scaled": Spec(MIXED, dtype="bfloat16", cache_dtype="float8_e4m3fn", k_scale=0.05, v_scale=0.02,
                                  update=True, page_size=8, sinks=True),
    # Scales of a non-fp8 cache apply when reading only (params.h): the new tokens are stored as they are.
    "f32_gqa4_s32_scaled": Spec(MIXED, kv_heads=1, page_size=32, update=True, window=9, k_scale=0.5, v_scale=2.0),
}


@pytest.mark.parametrize("case", sorted(UPDATE_CASES))
def test_cache_update(impl, case, rng):
    """v3: the updated caches equal the NumPy scatter, and attention sees the new tokens."""
    batch = make_batch(UPDATE_CASES[case], rng)
    args = core_args(batch)
    impl.require(*args.features())
    if "fp8" in case:  # exercise saturation: a few new values beyond the largest float8
        batch["new_keys"][0, 0, :3] = np.asarray([1e3, -1e3, 30.0], np.float32).astype(batch["new_keys"].dtype)
        args = core_args(batch)
    check_update_then_attention(impl, batch, args)


def check_update_then_attention(impl, batch: dict, args: PagedArgs) -> None:
    """The updated caches equal the NumPy scatter, then attention over them is checked."""
    key_cache, value_cache = impl.update(args)
    want_k, want_v = _check_update(batch, key_cache, value_cache)
    updated = {**batch, "key_cache": want_k, "value_cache": want_v}
    check_output(impl.attention(dataclasses.replace(args, key_cache=key_cache, value_cache=value_cache)), updated,
                 args)


def random_spec(rng: np.random.Generator, long: bool) -> Spec:
    """A batch of 1-8 sequences mixing decode rows, prefill, chunked prefill, empty sequences
    and history without queries; every option drawn with its own odds. long: contexts up to
    ~1000 keys (the CUDA kernels' splits and tiles), else up to ~130."""
    max_kv = 1000 if long else 130

    def sequence():
        kv_len = int(rng.choice([0, 1, rng.integers(2, 40), rng.integers(40, max_kv)]))
        q_len = int(rng.choice([0, 1, 1, rng.integers(0, kv_len + 1)]))
        return min(q_len, kv_len), kv_len

    cache_dtype = str(rng.choice(["float8_e4m3fn", "float16", "bfloat16", "float32", "same"], p=[0.2, 0.05, 0.05, 0.05, 0.65]))
    kv_heads = int(rng.integers(1, 3))
    scaled = cache_dtype == "float8_e4m3fn" or rng.random() < 0.15
    return Spec(
        tuple(sequence() for _ in range(int(rng.integers(1, 9)))),
        page_size=int(rng.choice([8, 16, 32, 64, 128])),
        q_heads=kv_heads * int(rng.choice([1, 2, 4, 8])), kv_heads=kv_heads,
        head_dim=int(rng.choice([16, 32, 64, 80, 128, 256])),
        dtype=str(rng.choice(["float32", "bfloat16", "float16"])), cache_dtype=None if cache_dtype == "same" else cache_dtype,
        kv_layout=str(rng.choice(["head_major", "token_major"])),
        padding_seqs=int(rng.integers(0, 4)), padding_rows=int(rng.integers(0, 6)), extra_pages=int(rng.integers(0, 5)),
        soft_cap=float(rng.uniform(2.0, 10.0)) if rng.random() < 0.25 else None,
        sinks=bool(rng.random() < 0.25),
        window=int(rng.integers(0, 80)) if rng.random() < 0.3 else -1,
        kv_starts=bool(rng.random() < 0.2), causal=bool(rng.random() < 0.8),
        k_scale=float(rng.uniform(0.02, 0.5)) if scaled else 1.0, v_scale=float(rng.uniform(0.02, 0.5)) if scaled else 1.0,
        update=bool(rng.random() < 0.25),
    )


# Besides the fixed cases, every run draws EJK_RANDOM_CASES random batches per implementation
# (scripts/gpu_check.sh draws 300).
RANDOM_CASES = int(os.environ.get("EJK_RANDOM_CASES", "4"))


@pytest.mark.parametrize("index", range(RANDOM_CASES))
def test_random_batch_matches_reference(impl, index, rng):
    """The attention core; for batches with new tokens, the cache update first, then attention
    over the updated caches."""
    spec = random_spec(rng, long=impl.name.startswith("cuda"))
    print(spec)  # with the printed seed, what a failure needs to be reproduced
    batch = make_batch(spec, rng)
    args = core_args(batch)
    impl.require(*args.features())
    if spec.update:
        check_update_then_attention(impl, batch, args)
    else:
        check_output(impl.attention(args), batch, args)


def test_jit_with_traced_metadata(impl, rng):
    """Metadata are data: one compilation serves other lengths and sequence counts."""
    spec = Spec(MIXED, sinks=True, window=20, kv_heads=1)
    batch = make_batch(spec, rng)
    static = {k: batch[k] for k in STATIC}
    args = core_args(batch)
    impl.require(*args.features())

    @jax.jit
    def attend(q, kc, vc, kv_lens, tables, qsl, num_seqs, sinks):
        return impl.attention(normalize(q, kc, vc, kv_lens, tables, qsl, num_seqs, sinks=sinks, **static))

    names = ("query", "key_cache", "value_cache", "kv_lens", "block_tables", "query_start_loc", "num_seqs", "sinks")
    out = attend(*(jnp.asarray(batch[n]) for n in names))
    check_output(out, batch, args)
    # Fewer sequences and shorter contexts, same shapes: the extra rows become padding.
    fewer = {**batch, "num_seqs": np.array([4], np.int32), "kv_lens": batch["kv_lens"].copy()}
    fewer["kv_lens"][0] -= 5  # the decoding query of sequence 0 moves back by 5 keys
    out = attend(*(jnp.asarray(fewer[n]) for n in names))
    check_output(out, fewer, core_args(fewer))
    assert attend._cache_size() == 1


def test_bad_traced_metadata_stays_in_bounds(impl, rng):
    """Under jit nothing can be checked before launch: bad values of present sequences give
    wrong numbers for them (or, on the CPU, whose metadata live on the host, an error that
    names the argument), never an out-of-bounds access; rows of intact sequences and
    padding rows keep their values."""
    batch = make_batch(Spec(MIXED, kv_layout="token_major", page_size=8), rng)
    args = core_args(batch)
    impl.require(*args.features())
    want = np.asarray(impl.attention(args))
    bad = dataclasses.replace(
        args,
        kv_lens=args.kv_lens.at[0].set(2**30).at[4].set(-7),
        block_tables=args.block_tables.at[3, 2].set(2**30).at[3, 4].set(-(2**31)),
    )
    fields = ("query", "key_cache", "value_cache", "kv_lens", "block_tables", "query_start_loc", "num_seqs")
    attend = jax.jit(lambda *a: impl.attention(dataclasses.replace(args, **dict(zip(fields, a)))))
    try:
        got = np.asarray(attend(*(getattr(bad, f) for f in fields)))
    except Exception as exc:  # noqa: BLE001 - the native CPU kernel validates host metadata
        assert impl.name == "cpu" and ("kv_lens" in str(exc) or "block_tables" in str(exc)), exc
        return
    qsl = batch["query_start_loc"]
    intact = np.r_[qsl[1]:qsl[2], qsl[6]:args.query.shape[0]]  # sequences 1 and 6, then padding
    np.testing.assert_array_equal(got[intact], want[intact])


# jit over arrays sharded along a mesh axis "x" of up to 4 devices: (batch, what is sharded
# along "x", whether the native calls run on each device's heads, so that the compiled
# program gathers nothing).
JIT_SHARDED_CASES = {
    "heads": (Spec(MIXED, q_heads=8, kv_heads=4, sinks=True, window=30, kv_starts=True), "heads", True),
    "heads_token_major_update": (Spec(MIXED, q_heads=8, kv_heads=4, dtype="bfloat16", kv_layout="token_major",
                                      soft_cap=5.0, update=True), "heads", True),
    # The query split over tokens, the caches whole: the call splits over heads instead.
    "tokens": (Spec(MIXED, q_heads=8, kv_heads=4, padding_rows=0), "tokens", True),
    # Not split: one key/value head (MQA, the query split over heads or tokens; gathered).
    "query_heads_mqa": (Spec(MIXED, q_heads=8, kv_heads=1, sinks=True), "query_heads", False),
    "tokens_mqa": (Spec(MIXED, q_heads=8, kv_heads=1, padding_rows=0), "tokens", False),
}


@pytest.mark.parametrize("case", sorted(JIT_SHARDED_CASES))
def test_jit_sharded(impl, case, rng):
    """Under jit with the query, new tokens and caches sharded over heads (tensor parallelism),
    or the query over tokens, the native calls run on each device's heads (no all-gather in
    the compiled program, the output sharded like the query) and the results match the
    reference; other shardings are gathered and match it too."""
    check_jit_sharded(impl, case, rng)


def test_jit_sharded_gspmd(impl, rng):
    """The same under XLA's older partitioner (GSPMD), which asks the sharding callbacks
    rather than Shardy's rule."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        check_jit_sharded(impl, "heads_token_major_update", rng)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def check_jit_sharded(impl, case, rng):
    spec, axis, split = JIT_SHARDED_CASES[case]
    devices = min(4, jax.device_count())
    if devices < 2:
        pytest.skip("needs several devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    batch = make_batch(spec, rng)
    args = core_args(batch)
    impl.require(*args.features())
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    cache = P(None, None, "x") if spec.kv_layout == "token_major" else P(None, "x")
    specs = {"tokens": {"query": P("x")}, "query_heads": {"query": P(None, "x")}}.get(axis, {
        "query": P(None, "x"), "new_keys": P(None, "x"), "new_values": P(None, "x"), "sinks": P("x"),
        "key_cache": cache, "value_cache": cache})
    arrays = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
              if isinstance(getattr(args, f.name), jax.Array)}
    sharded = {n: jax.device_put(a, NamedSharding(mesh, specs.get(n, P()))) for n, a in arrays.items()}

    @jax.jit
    def call(arrays):
        call_args = dataclasses.replace(args, **arrays)
        if not spec.update:
            return impl.attention(call_args), None
        caches = impl.update(call_args)
        return impl.attention(dataclasses.replace(call_args, key_cache=caches[0], value_cache=caches[1])), caches

    out, caches = call(sharded)
    if spec.update:
        want_k, want_v = _check_update(batch, *caches)
        batch = {**batch, "key_cache": want_k, "value_cache": want_v}
    check_output(out, batch, args)
    if split and impl.name != "xla":
        assert "all-gather" not in call.lower(sharded).compile().as_text(), f"{case}: the program gathers operands"
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, specs["query"]), out.ndim)


@pytest.mark.parametrize("what", ["no_rows", "no_sequences", "no_sequence_slots"])
def test_empty(impl, what, rng):
    spec = Spec(((1, 5), (3, 9)), padding_seqs=1)
    batch = make_batch(spec, rng)
    if what == "no_rows":
        batch.update(query=batch["query"][:0], query_start_loc=np.zeros_like(batch["query_start_loc"]))
    elif what == "no_sequences":
        batch["num_seqs"] = np.array([0], np.int32)
    else:
        batch.update(num_seqs=np.array([0], np.int32), kv_lens=batch["kv_lens"][:0],
                     block_tables=batch["block_tables"][:0], query_start_loc=batch["query_start_loc"][:1])
    args = core_args(batch)
    impl.require(*args.features())
    out = np.asarray(impl.attention(args))
    assert out.shape == args.query.shape
    np.testing.assert_array_equal(out, 0.0)


# The XLA implementation's own properties.


@pytest.mark.parametrize("block_kv,block_tokens", [(1, 1), (7, 5), (512, 1000)])
def test_xla_block_sizes(block_kv, block_tokens, rng):
    batch = make_batch(Spec(MIXED, page_size=8, sinks=True, soft_cap=5.0, kv_starts=True), rng)
    args = core_args(batch)
    out = paged_attention_xla(
        args.query, args.key_cache, args.value_cache, args.kv_lens, args.block_tables, args.query_start_loc,
        args.num_seqs, kv_starts=args.kv_starts, sinks=args.sinks, softmax_scale=args.softmax_scale,
        logits_soft_cap=args.logits_soft_cap, block_kv=block_kv, block_tokens=block_tokens,
    )
    check_output(out, batch, args)


def test_xla_memory_is_bounded():
    """Temporaries stay near one step's 32 MiB budget, far below gathering every row's
    context (here 4096 rows x 2048 keys x 2 heads x 64 dims of float32 keys alone = 4 GiB)."""
    t, pages, page_size, m = 4096, 512, 16, 128
    q = jax.ShapeDtypeStruct((t, 8, 64), jnp.float32)
    cache = jax.ShapeDtypeStruct((pages, 2, page_size, 64), jnp.float32)
    ints = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((64,), (64, m), (65,), (1,))]

    def attend(q, kc, vc, kv_lens, tables, qsl, num_seqs):
        return paged_attention_xla(q, kc, vc, kv_lens, tables, qsl, num_seqs, softmax_scale=0.125, block_kv=512)

    temp = jax.jit(attend).lower(q, cache, cache, *ints).compile().memory_analysis().temp_size_in_bytes
    assert temp < 64 << 20, f"{temp} bytes of temporaries"
