"""Flash attention on an NVIDIA GPU: ejkernel's CUDA kernels against cuDNN, XLA and Pallas, in
one process, forward and forward+backward.

The grid follows FlashAttention-3's: B * S = 16384 tokens, H * D = 2048, head dims 64/128/256,
S from 512 to 16384, causal and not; plus GQA 32/8, a sliding window of 1024 against full
causal attention at S = 16384, packed variable-length sequences, segment ids, head dims 96
and 192, and a dense bias (with its gradient or not), boolean mask, or both. TFLOP/s count
only the visible (unmasked) score entries (a dense mask's pairs all count): 4 * B * H * D *
visible pairs forward, 2.5x that backward. Each implementation is timed in 3 rounds of
alternating order and its best round is kept.

    python benchmarks/flash_attention_gpu.py [--quick] [--out benchmarks/results]
    # in parts (e.g. to fit a time limit), then one JSON and plot from the parts:
    python benchmarks/flash_attention_gpu.py --head-dims 64,128 --no-extra --part a
    python benchmarks/flash_attention_gpu.py --head-dims 256 --no-extra --part b
    python benchmarks/flash_attention_gpu.py --head-dims '' --part c  # the extra cases
    python benchmarks/flash_attention_gpu.py --merge a b c
    # some extra cases alone, by name:
    python benchmarks/flash_attention_gpu.py --head-dims '' --only bias,mask,dbias --part bias_mask
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import flash_attention

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    kv_heads: int = 0  # 0: same as heads
    causal: bool = False
    window: int = -1  # left window (with causal), -1: none
    varlen: bool = False  # pack `batch` sequences of random lengths into one row
    segments: int = 0  # segment ids: this many documents of random lengths in each row
    deterministic: bool = False  # the backward's bit-reproducible mode
    # "bias": an additive [1, H, S, S] bias; "bias_bh": one of [B, H, S, S]; "bias_f32": the
    # [1, H, S, S] bias in float32 (every implementation gets it as it is); "mask": a boolean
    # [B, 1, S, S] mask; "bias_mask": the [1, H, S, S] bias and a [1, 1, S, S] mask;
    # "bias_mask_rows": the [1, H, S, S] bias and a [B, 1, S, S] mask (crossed broadcasts);
    # "key_padding": a [B, 1, 1, S] mask hiding each row's keys past a random length in
    # [S/2, S] (cuDNN and XLA get the lengths as key_value_seq_lengths); "bias_key_padding":
    # the [1, H, S, S] bias and that mask
    dense: str = ""
    dense_grad: bool = False  # forward+backward also differentiates the bias
    # Dropout on the probabilities (ours; XLA: ejkernel's XLA implementation, the same hash).
    # cuDNN and Pallas take no dropout through JAX: they are timed without it, as the cost of
    # the same attention with none.
    dropout: float = 0.0

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    def visible_pairs(self, lengths: list[int] | None = None) -> float:
        # With segment ids, `lengths` are the documents of every row.
        seqs = lengths or [self.seqlen] * self.batch
        total = 0.0
        for s in seqs:
            if self.window >= 0:
                w = self.window + 1  # keys i - window .. i
                total += sum(min(i + 1, w) for i in range(s)) if s <= 65536 else s * w
            elif self.causal:
                total += s * (s + 1) / 2
            else:
                total += s * s
        return total


def fa3_grid(quick: bool, head_dims: tuple[int, ...] = (64, 128, 256)) -> list[Case]:
    lengths = (512, 1024, 2048, 4096, 8192, 16384)
    if quick:
        lengths = (1024, 4096)
    cases = []
    for head_dim in head_dims:
        for causal in (False, True):
            for s in lengths:
                cases.append(Case("fa3", 16384 // s, s, 2048 // head_dim, head_dim, causal=causal))
    return cases


def extra_cases() -> list[Case]:
    return [
        Case("gqa", 4, 4096, 32, 128, kv_heads=8),
        Case("gqa", 4, 4096, 32, 128, kv_heads=8, causal=True),
        Case("full_causal_16k", 1, 16384, 16, 128, causal=True),
        Case("window_1024_16k", 1, 16384, 16, 128, causal=True, window=1024),
        Case("varlen", 16, 2048, 16, 128, causal=True, varlen=True),
        Case("segments", 4, 4096, 16, 128, causal=True, segments=4),
        # Head dims outside the grid, 16 heads each.
        Case("d96", 4, 4096, 16, 96),
        Case("d96", 4, 4096, 16, 96, causal=True),
        Case("d192", 4, 4096, 16, 192),
        Case("d192", 4, 4096, 16, 192, causal=True),
        # Head dims without kernels of their own, run by the next built head dim's (80 -> 96, 40 -> 64).
        Case("d80", 4, 4096, 16, 80),
        Case("d80", 4, 4096, 16, 80, causal=True),
        Case("d40", 4, 4096, 32, 40),
        Case("bias", 4, 4096, 16, 128, dense="bias"),
        Case("bias", 4, 4096, 16, 128, causal=True, dense="bias"),
        Case("mask", 4, 4096, 16, 128, dense="mask"),
        Case("dbias", 4, 4096, 16, 128, dense="bias", dense_grad=True),
        Case("dbias", 4, 4096, 16, 128, causal=True, dense="bias", dense_grad=True),
        # A bias computed per example (a pair representation's, as in AlphaFold).
        Case("dbias_bh", 4, 4096, 16, 128, dense="bias_bh", dense_grad=True),
        Case("dbias_bh", 4, 4096, 16, 128, causal=True, dense="bias_bh", dense_grad=True),
        # A learned relative-position bias at d=64, as in T5.
        Case("bias_d64", 4, 4096, 32, 64, dense="bias"),
        Case("dbias_d64", 4, 4096, 32, 64, dense="bias", dense_grad=True),
        # A bias at d=256 (the Hopper forward's 64-key tiles).
        Case("bias_d256", 4, 4096, 8, 256, dense="bias"),
        Case("bias_d256", 4, 4096, 8, 256, causal=True, dense="bias"),
        Case("dbias_d256", 4, 4096, 8, 256, dense="bias", dense_grad=True),
        # A float32 bias with bf16 inputs (the Hopper forward's float32 tile).
        Case("bias_f32", 4, 4096, 16, 128, dense="bias_f32"),
        Case("bias_f32", 4, 4096, 16, 128, causal=True, dense="bias_f32"),
        Case("bias_f32_d64", 4, 4096, 32, 64, dense="bias_f32"),
        Case("bias_f32_d64", 4, 4096, 32, 64, causal=True, dense="bias_f32"),
        Case("dbias_f32", 4, 4096, 16, 128, dense="bias_f32", dense_grad=True),
        Case("dbias_f32_d64", 4, 4096, 32, 64, dense="bias_f32", dense_grad=True),
        # A bias with a mask shared by every batch row and head.
        Case("bias_mask", 4, 4096, 16, 128, dense="bias_mask"),
        Case("dbias_mask", 4, 4096, 16, 128, dense="bias_mask", dense_grad=True),
        Case("bias_mask_d64", 4, 4096, 32, 64, dense="bias_mask"),
        Case("dbias_mask_d64", 4, 4096, 32, 64, dense="bias_mask", dense_grad=True),
        # Attention dropout in training (the Hopper kernels hash every element).
        Case("dropout", 4, 4096, 16, 128, dropout=0.1),
        Case("dropout", 4, 4096, 16, 128, causal=True, dropout=0.1),
        Case("dropout_d64", 4, 4096, 32, 64, causal=True, dropout=0.1),
        Case("dropout_d256", 4, 4096, 8, 256, causal=True, dropout=0.1),
        # Dropout with a bias (T5's relative positions at d=64, with its gradient) or a mask.
        Case("dropout_bias", 4, 4096, 16, 128, dense="bias", dropout=0.1),
        Case("dropout_bias", 4, 4096, 16, 128, causal=True, dense="bias", dropout=0.1),
        Case("dropout_mask", 4, 4096, 16, 128, dense="mask", dropout=0.1),
        Case("dropout_dbias_d64", 4, 4096, 32, 64, dense="bias", dense_grad=True, dropout=0.1),
        Case("dropout_bias_f32", 4, 4096, 16, 128, dense="bias_f32", dropout=0.1),
        Case("dropout_mask_d64", 4, 4096, 32, 64, dense="mask", dropout=0.1),
        # T5 in training: a learned relative-position bias shared by the batch, a mask per
        # example, dropout.
        Case("dbias_mask_rows_d64", 4, 4096, 32, 64, dense="bias_mask_rows", dense_grad=True),
        Case("dropout_dbias_mask_rows_d64", 4, 4096, 32, 64, dense="bias_mask_rows", dense_grad=True, dropout=0.1),
        # Padded batches (BERT): a key padding mask, run as segment ids.
        Case("key_padding", 8, 2048, 16, 128, dense="key_padding"),
        Case("key_padding_d64", 8, 2048, 12, 64, dense="key_padding"),
        Case("dbias_key_padding_d64", 4, 4096, 32, 64, dense="bias_key_padding", dense_grad=True),
        # The same with dropout (T5 in training on padded batches): segment ids, a bias, dropout.
        Case("dropout_dbias_key_padding_d64", 4, 4096, 32, 64, dense="bias_key_padding", dense_grad=True,
             dropout=0.1),
    ]


def _inputs(case: Case, rng: np.random.Generator):
    b = 1 if case.varlen else case.batch
    s = case.batch * case.seqlen if case.varlen else case.seqlen

    def normal(h):
        return jnp.asarray(rng.standard_normal((b, s, h, case.head_dim), np.float32), jnp.bfloat16)

    q, k, v, g = normal(case.heads), normal(case.num_kv_heads), normal(case.num_kv_heads), normal(case.heads)
    lengths = None
    if case.varlen:
        # Random lengths around seqlen, summing to the packed row.
        cuts = np.sort(rng.choice(np.arange(1, s), case.batch - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [s]])).tolist()
    if case.segments:
        # Documents of random lengths, the same in every row (their lengths give the FLOPs),
        # drawn from a fixed seed: the skipped tiles, and so the times, depend on them.
        cuts = np.sort(np.random.default_rng(s).choice(np.arange(1, s), case.segments - 1, replace=False))
        doc = np.diff(np.concatenate([[0], cuts, [s]]))
        lengths = doc.tolist() * case.batch
    return q, k, v, g, lengths


def _dense_inputs(case: Case, rng: np.random.Generator) -> tuple:
    """The bias or mask, passed to every implementation as an argument (a closed-over array
    would be compiled in as a constant)."""
    def shared_bias():  # [1, H, S, S], bf16
        return jnp.asarray(rng.standard_normal((1, case.heads, case.seqlen, case.seqlen), np.float32), jnp.bfloat16)

    if case.dense in ("bias", "bias_bh", "bias_f32"):
        rows = case.batch if case.dense == "bias_bh" else 1
        shape = (rows, case.heads, case.seqlen, case.seqlen)
        dtype = jnp.float32 if case.dense == "bias_f32" else jnp.bfloat16
        return (jnp.asarray(rng.standard_normal(shape, np.float32), dtype),)
    if case.dense in ("key_padding", "bias_key_padding"):
        lengths = np.random.default_rng(case.seqlen).integers(case.seqlen // 2, case.seqlen + 1, case.batch)
        mask = jnp.asarray(np.arange(case.seqlen)[None, None, None, :] < lengths[:, None, None, None])
        if case.dense == "key_padding":
            return (mask,)
        return shared_bias(), mask
    if case.dense == "mask":
        return (jnp.asarray(rng.random((case.batch, 1, case.seqlen, case.seqlen)) > 0.1),)
    if case.dense in ("bias_mask", "bias_mask_rows"):
        bias = shared_bias()
        rows = case.batch if case.dense == "bias_mask_rows" else 1
        return bias, jnp.asarray(rng.random((rows, 1, case.seqlen, case.seqlen)) > 0.1)
    return ()


def _dense_kwargs(case: Case, dense: tuple, bias: str, mask: str) -> dict[str, Any]:
    """The dense inputs as keyword arguments named `bias` and `mask`."""
    names = {"bias": (bias,), "bias_bh": (bias,), "bias_f32": (bias,), "mask": (mask,), "bias_mask": (bias, mask),
             "bias_mask_rows": (bias, mask), "key_padding": (mask,), "bias_key_padding": (bias, mask)}.get(
        case.dense, ())
    return dict(zip(names, dense))


def _segment_ids(case: Case, lengths) -> jax.Array:
    ids = np.repeat(np.arange(case.segments), lengths[: case.segments])
    return jnp.asarray(np.broadcast_to(ids, (case.batch, case.seqlen)), jnp.int32)


# The seed of every dropout case (ours and XLA draw the same mask from it).
DROPOUT_SEED = 1234


def _ours(case: Case, lengths) -> Callable:
    kw: dict[str, Any] = dict(causal=case.causal, deterministic=case.deterministic, platform="cuda")
    if case.dropout:
        kw.update(dropout_prob=case.dropout, dropout_seed=DROPOUT_SEED)
    if case.window >= 0:
        kw["sliding_window"] = (case.window, 0)
    if case.segments:
        ids = _segment_ids(case, lengths)
        kw.update(q_segment_ids=ids, kv_segment_ids=ids)
    elif lengths is not None:
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        kw.update(cum_seqlens_q=cu, cum_seqlens_k=cu)
    return lambda q, k, v, *dense: flash_attention(
        q, k, v, **kw, **_dense_kwargs(case, dense, "bias", "attention_mask"))


# XLA materialises the S x S scores: past this length it only shows how far behind it is.
XLA_MAX_SEQLEN = 4096


def _dpa(case: Case, lengths, implementation: str) -> Callable | None:
    if implementation == "xla" and case.seqlen * (case.batch if case.varlen else 1) > XLA_MAX_SEQLEN:
        return None
    if implementation == "xla" and case.dropout:
        # jax.nn.dot_product_attention has no dropout: ejkernel's XLA implementation, same mask.
        return lambda q, k, v, *dense: flash_attention(
            q, k, v, causal=case.causal, dropout_prob=case.dropout, dropout_seed=DROPOUT_SEED,
            platform="xla", **_dense_kwargs(case, dense, "bias", "attention_mask"))
    kw: dict[str, Any] = dict(is_causal=case.causal, implementation=implementation)
    if case.window >= 0:
        kw["local_window_size"] = (case.window, 0)
    if case.segments:
        # Segment ids as a boolean mask [B, 1, S, S], built inside the timed function.
        ids = _segment_ids(case, lengths)
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=(ids[:, :, None] == ids[:, None, :])[:, None], **kw)
    if lengths is not None:
        # Padded layout [num_seqs, max_len] with per-sequence lengths: what cuDNN offers for varlen.
        return None
    if case.dense in ("key_padding", "bias_key_padding"):
        def padded(q, k, v, *dense):
            *bias, mask = dense
            return jax.nn.dot_product_attention(
                q, k, v, *bias, key_value_seq_lengths=jnp.sum(mask[:, 0, 0], axis=-1, dtype=jnp.int32), **kw)

        return padded
    return lambda q, k, v, *dense: jax.nn.dot_product_attention(
        q, k, v, **kw, **_dense_kwargs(case, dense, "bias", "mask"))


def _pallas_mgpu(case: Case, lengths) -> Callable | None:
    """JAX's Pallas Mosaic GPU attention (Hopper); it applies no softmax scale, so q is scaled.
    It takes float16 only (this JAX rejects bfloat16), so it is timed on float16 copies."""
    if lengths is not None or case.window >= 0 or case.dense:
        return None  # packed sequences, segment ids, windows, bias, masks: not in this kernel
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    blocks = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64) if not case.causal else {}
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=64 if case.head_dim > 128 else 128,
                                         max_concurrent_steps=2, causal=case.causal, **blocks)
    scale = 1.0 / math.sqrt(case.head_dim)
    return lambda q, k, v: attention_mgpu.attention(q * jnp.asarray(scale, q.dtype), k, v, config)


def _pallas_triton(case: Case, lengths) -> Callable | None:
    """JAX's Pallas Triton attention (any NVIDIA GPU); no GQA, no window. Timed only at
    d=128, where the Mosaic GPU kernel is the stronger Pallas anchor elsewhere too."""
    if case.varlen or case.window >= 0 or case.dense or case.num_kv_heads != case.heads or case.head_dim != 128:
        return None
    from jax.experimental.pallas.ops.gpu import attention

    scale = 1.0 / math.sqrt(case.head_dim)
    ids = _segment_ids(case, lengths) if case.segments else None
    return lambda q, k, v: attention.mha(q, k, v, segment_ids=ids, sm_scale=scale, causal=case.causal)


def _fwd_bwd(fn: Callable, dense_grad: bool = False) -> Callable:
    def loss(q, k, v, g, *dense):
        return jnp.sum(fn(q, k, v, *dense).astype(jnp.float32) * g.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 4) if dense_grad else (0, 1, 2))


TIMING_ROUNDS = 3


def _time_ms(fn: Callable, args: tuple, budget_s: float = 0.2) -> float:
    """Median per-call time over batches of calls (one host sync per batch). A batch lasts about
    50 ms, so the start and the final sync (~0.1 ms together) do not count for short calls."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-5)
    per_batch = max(1, min(1000, int(0.05 / once)))
    batches = max(3, min(10, int(budget_s / (once * per_batch))))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / per_batch)
    return float(np.median(times))


def _relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def run_case(case: Case, rng: np.random.Generator, backward: bool) -> dict[str, Any]:
    q, k, v, g, lengths = _inputs(case, rng)
    dense = _dense_inputs(case, rng)
    flops = 4.0 * case.heads * case.head_dim * case.visible_pairs(lengths)
    impls = {
        "ours": _ours(case, lengths),
        "cudnn": _dpa(case, lengths, "cudnn"),
        "xla": _dpa(case, lengths, "xla"),
    }
    for name, make in (("pallas_mgpu", _pallas_mgpu), ("pallas_triton", _pallas_triton)):
        try:
            impls[name] = make(case, lengths)
        except Exception as exc:  # noqa: BLE001 - not in this JAX, or refuses the shape
            impls[name] = None
            row_note = f"{type(exc).__name__}: {exc}"[:200]
            impls.setdefault("_notes", []).append(f"{name}: {row_note}")
    row: dict[str, Any] = dataclasses.asdict(case)
    row["tflop_fwd"] = flops / 1e12
    for note in impls.pop("_notes", []):
        row.setdefault("notes", []).append(note)
    # Compile and check every implementation, then time them in rounds of alternating order,
    # keeping each one's best round: clocks drift with temperature over a run, and the order
    # within one round must not decide a comparison.
    reference = None
    runnable: dict[str, tuple[Callable, Callable | None, tuple]] = {}
    for name, fn in impls.items():
        if fn is None:
            row[f"{name}_fwd_ms"] = None
            continue
        inputs = (q, k, v, g) if name != "pallas_mgpu" else tuple(x.astype(jnp.float16) for x in (q, k, v, g))
        try:
            jitted = jax.jit(fn)
            out = jitted(*inputs[:3], *dense)
            if reference is None and name == "ours":
                reference = out
            elif reference is not None and not (case.dropout and name != "xla"):  # the others drop nothing
                row[f"{name}_diff_vs_ours"] = _relative_error(out, reference)
        except Exception as exc:  # noqa: BLE001 - an anchor that cannot run this case is recorded
            row[f"{name}_error"] = _describe(exc)
            continue
        grad = None
        if backward:
            try:
                grad = jax.jit(_fwd_bwd(fn, case.dense_grad))
                jax.block_until_ready(grad(*inputs, *dense))
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_fwdbwd_error"] = _describe(exc)
                grad = None
        runnable[name] = (jitted, grad, inputs)
    for round_index in range(TIMING_ROUNDS):
        names = list(runnable) if round_index % 2 == 0 else list(reversed(runnable))
        for name in names:
            jitted, grad, inputs = runnable[name]
            timings = [("fwd", 1.0, lambda: _time_ms(jitted, (*inputs[:3], *dense)))]
            if grad is not None:
                timings.append(("fwdbwd", 3.5, lambda: _time_ms(grad, (*inputs, *dense))))
            for kind, flop_factor, measure in timings:
                try:
                    ms = measure()
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory in one round
                    row[f"{name}_{kind}_error"] = _describe(exc)
                    continue
                best = row.get(f"{name}_{kind}_ms")
                if best is None or ms < best:
                    row[f"{name}_{kind}_ms"] = ms
                    row[f"{name}_{kind}_tflops"] = flop_factor * flops / ms / 1e9
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(r, key):
        x = r.get(key)
        return "-" if x is None else f"{x:.0f}"

    for r in rows:
        for mode in ("fwd", "fwdbwd"):
            found = [r.get(f"pallas_{kind}_{mode}_tflops") for kind in ("mgpu", "triton")]
            found = [x for x in found if x]
            r[f"pallas_{mode}_tflops"] = max(found) if found else None

    def ratio(r, a, b):
        x, y = r.get(a), r.get(b)
        return "-" if not x or not y else f"{x / y:.2f}"

    lines = [
        "| case | B | S | H | Hkv | D | causal | window | ours fwd | cuDNN fwd | Pallas fwd | XLA fwd | fwd ours/cuDNN | ours fwd+bwd | cuDNN fwd+bwd | fwd+bwd ours/cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['batch']} | {r['seqlen']} | {r['heads']} | {r['kv_heads'] or r['heads']} | {r['head_dim']} "
            f"| {r['causal']} | {r['window']} | {cell(r, 'ours_fwd_tflops')} | {cell(r, 'cudnn_fwd_tflops')} "
            f"| {cell(r, 'pallas_fwd_tflops')} | {cell(r, 'xla_fwd_tflops')} | {ratio(r, 'ours_fwd_tflops', 'cudnn_fwd_tflops')} "
            f"| {cell(r, 'ours_fwdbwd_tflops')} | {cell(r, 'cudnn_fwdbwd_tflops')} | {ratio(r, 'ours_fwdbwd_tflops', 'cudnn_fwdbwd_tflops')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in rows if r["name"] == "fa3"]
    fig, axes = plt.subplots(2, 6, figsize=(30, 9), squeeze=False)
    for col, (head_dim, causal) in enumerate((d, c) for d in (64, 128, 256) for c in (False, True)):
        for row_index, mode in enumerate(("fwd", "fwdbwd")):
            ax = axes[row_index][col]
            sel = sorted((r for r in grid if r["head_dim"] == head_dim and r["causal"] == causal), key=lambda r: r["seqlen"])
            if not sel:
                continue
            xs = np.arange(len(sel))
            names = ("ours", "cudnn", "pallas_mgpu", "pallas_triton", "xla")
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                ys = [r.get(f"{name}_{mode}_tflops") or 0.0 for r in sel]
                labels = {"ours": "ejkernel", "cudnn": "cuDNN", "pallas_mgpu": "Pallas (Mosaic GPU, f16)",
                          "pallas_triton": "Pallas (Triton)", "xla": "XLA"}
                ax.bar(xs + i * width, ys, width, label=labels[name])
            ax.set_xticks(xs + 0.4 - width / 2, [str(r["seqlen"]) for r in sel])
            ax.set_title(f"{'forward' if mode == 'fwd' else 'forward+backward'}, d={head_dim}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            if row_index == 0 and col == 0:
                ax.legend()
    fig.suptitle(f"Flash attention, bf16, B*S=16384, H*D=2048 ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="S in {1024, 4096} only, plus the extra cases")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--head-dims", default="64,128,256",
                        help="head dims of the FlashAttention-3 grid ('': the extra cases only)")
    parser.add_argument("--no-extra", action="store_true", help="skip the GQA, window and varlen cases")
    parser.add_argument("--only", help="comma-separated names of the extra cases to run (default: all)")
    parser.add_argument("--part", help="write flash_attention_gpu.<part>.json instead of the final files")
    parser.add_argument("--merge", nargs="+", metavar="PART", help="merge parts into the final JSON and plot")
    args = parser.parse_args()

    if args.merge:
        parts = [json.loads((args.out / f"flash_attention_gpu.{p}.json").read_text()) for p in args.merge]
        meta, rows = parts[0]["meta"], [r for part in parts for r in part["rows"]]
        (args.out / "flash_attention_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, meta["device"], args.out / "flash_attention_gpu.png")
        print(format_table(rows))
        return

    device = jax.devices()[0]
    if device.platform != "gpu":
        raise SystemExit(f"needs an NVIDIA GPU; the default device is {device.platform}")
    rng = np.random.default_rng(int(time.time_ns() % 2**32))
    head_dims = tuple(int(d) for d in args.head_dims.split(",") if d)
    extra = [] if args.no_extra else extra_cases()
    if args.only:
        extra = [c for c in extra if c.name in args.only.split(",")]
    cases = fa3_grid(args.quick, head_dims) + extra
    args.out.mkdir(parents=True, exist_ok=True)
    import ejkernel

    meta = {"device": device.device_kind, "jax": jax.__version__, "ejkernel": ejkernel.__version__,
            "dtype": "bfloat16", "flops": "4*H*D*visible pairs forward; 3.5x forward+backward"}
    name = f"flash_attention_gpu.{args.part}" if args.part else "flash_attention_gpu"
    rows = []
    for i, case in enumerate(cases):
        row = run_case(case, rng, backward=not args.no_backward)
        rows.append(row)
        # Written after every case, so a run cut short keeps what it measured.
        (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"[{i + 1}/{len(cases)}] {case}: ours {row.get('ours_fwd_tflops', float('nan')):.0f} / "
              f"cuDNN {row.get('cudnn_fwd_tflops') or float('nan'):.0f} TFLOP/s fwd"
              + (f"  ({row['ours_error']})" if "ours_error" in row else ""), flush=True)
    if not args.part:
        try:
            plot(rows, device.device_kind, args.out / "flash_attention_gpu.png")
        except ImportError as exc:
            print(f"no plot: {exc}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
