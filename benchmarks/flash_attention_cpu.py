"""Native CPU flash attention against XLA's jax.nn.dot_product_attention, in one process.

For each sequence length: forward and forward+backward times (median of repeats), their
ratio, GFLOP/s, peak temporary memory from XLA's compiled memory analysis, and the error
of both against a float64 reference on a small slice. At lengths where XLA's S x S score
matrix cannot fit in this machine's memory, XLA is not run and the table says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import flash_attention

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Case:
    seqlen: int
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    causal: bool = False
    dtype: str = "float32"
    backward: bool = True

    @property
    def flops_forward(self) -> float:
        flops = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        return flops / 2 if self.causal else flops


def _inputs(case: Case, seed: int) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape, dtype=np.float32), case.dtype) for _ in range(4))


def _ours(platform: str, causal: bool) -> Callable[..., jax.Array]:
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, platform=platform)


def _xla_dpa(causal: bool) -> Callable[..., jax.Array]:
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def _fwd_bwd(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    def loss(q, k, v, g):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def _median_ms(fn: Callable[..., Any], args: tuple, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def _temp_bytes(fn: Callable[..., Any], args: tuple) -> int | None:
    try:
        analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
        return int(analysis.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - some backends report nothing
        return None


def _xla_fits(case: Case) -> tuple[bool, str]:
    """XLA materialises [B, H, S, S] f32 scores (several copies in the backward)."""
    scores = case.batch * case.heads * case.seqlen**2 * 4
    factor = 4 if case.backward else 2
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if scores * factor > 0.6 * available:
        return False, f"needs ~{scores * factor / 2**30:.0f} GiB for S x S scores"
    return True, ""


def _reference_error(case: Case, fn: Callable[..., jax.Array], q, k, v) -> float:
    """Relative error on the first 64 query rows against a float64 NumPy reference."""
    rows = min(64, case.seqlen)
    out = np.asarray(jax.jit(fn)(q, k, v)[:, :rows], np.float64)
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", qn[:, :rows], kn) / np.sqrt(case.head_dim)
    if case.causal:
        logits = np.where(np.tril(np.ones((rows, case.seqlen), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.einsum("bhqk,bkhd->bqhd", probs, vn)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def run_case(case: Case, repeats: int, platform: str = "cpu") -> dict[str, Any]:
    q, k, v, g = _inputs(case, seed=int(time.time_ns() % 2**31))
    ours, xla = _ours(platform, case.causal), _xla_dpa(case.causal)
    row: dict[str, Any] = dataclasses.asdict(case)
    row["error_ours"] = _reference_error(case, ours, q, k, v)
    row["fwd_ms_ours"] = _median_ms(jax.jit(ours), (q, k, v), repeats)
    row["temp_bytes_ours"] = _temp_bytes(_fwd_bwd(ours) if case.backward else ours, (q, k, v, g) if case.backward else (q, k, v))
    if case.backward:
        row["fwdbwd_ms_ours"] = _median_ms(jax.jit(_fwd_bwd(ours)), (q, k, v, g), repeats)
    fits, why = _xla_fits(case)
    row["xla_skipped"] = why
    if fits:
        row["error_xla"] = _reference_error(case, xla, q, k, v)
        row["fwd_ms_xla"] = _median_ms(jax.jit(xla), (q, k, v), repeats)
        row["temp_bytes_xla"] = _temp_bytes(_fwd_bwd(xla) if case.backward else xla, (q, k, v, g) if case.backward else (q, k, v))
        if case.backward:
            row["fwdbwd_ms_xla"] = _median_ms(jax.jit(_fwd_bwd(xla)), (q, k, v, g), repeats)
    row["fwd_gflops_ours"] = case.flops_forward / row["fwd_ms_ours"] / 1e6
    if case.backward:
        row["fwdbwd_gflops_ours"] = 3.5 * case.flops_forward / row["fwdbwd_ms_ours"] / 1e6
    return row


def default_cases() -> list[tuple[Case, int]]:
    cases = [(Case(seqlen=s), 5 if s <= 2048 else 3) for s in (512, 1024, 2048, 4096, 8192)]
    cases.append((Case(seqlen=4096, causal=True), 3))
    cases.append((Case(seqlen=32768, backward=False), 1))
    return cases


def format_table(rows: list[dict[str, Any]]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{b / a:.2f}x"

    def mib(x: int | None) -> str:
        return "-" if x is None else f"{x / 2**20:,.0f}"

    lines = [
        "| S | causal | fwd ours ms | fwd XLA ms | fwd speedup | fwd+bwd ours ms | fwd+bwd XLA ms | fwd+bwd speedup | ours GFLOP/s fwd / fwd+bwd | temp MiB ours / XLA | rel. error ours / XLA |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        xla_note = r["xla_skipped"]
        lines.append(
            f"| {r['seqlen']} | {r['causal']} | {ms(r['fwd_ms_ours'])} | {ms(r.get('fwd_ms_xla')) if not xla_note else 'not run: ' + xla_note} "
            f"| {ratio(r['fwd_ms_ours'], r.get('fwd_ms_xla'))} | {ms(r.get('fwdbwd_ms_ours'))} | {ms(r.get('fwdbwd_ms_xla'))} "
            f"| {ratio(r.get('fwdbwd_ms_ours'), r.get('fwdbwd_ms_xla'))} "
            f"| {r['fwd_gflops_ours']:.1f} / {r.get('fwdbwd_gflops_ours', float('nan')):.1f} "
            f"| {mib(r.get('temp_bytes_ours'))} / {mib(r.get('temp_bytes_xla'))} "
            f"| {r['error_ours']:.1e} / {r.get('error_xla', float('nan')):.1e} |"
        )
    return "\n".join(lines)


def save(rows: list[dict[str, Any]], name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    from ejkernel.info import build_info

    info = build_info()
    device = {"cpu_isa": info["cpu_isa"], "cores": os.cpu_count(), "jax": info["jax"]}
    try:
        with open("/proc/cpuinfo") as f:
            device["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    path.write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return path


def masked_rows(repeats: int = 5) -> list[dict[str, Any]]:
    """Calls whose keys are partly hidden, ours against XLA (B=4, S=1024, H=8, D=64, float32):
    a key padding mask (rows of 1024, 512, 600 and 300 keys; XLA gets the lengths as
    key_value_seq_lengths) and causal segment ids of 4 equal documents (XLA gets the boolean
    mask), with the unmasked and causal calls for scale."""
    batch, seqlen = 4, 1024
    q, k, v, g = _inputs(Case(seqlen=seqlen, batch=batch), seed=int(time.time_ns() % 2**31))
    lengths = np.array([1024, 512, 600, 300])
    padding = jnp.asarray(np.arange(seqlen)[None, None, None, :] < lengths[:, None, None, None])
    ids = jnp.asarray(np.repeat(np.arange(4), seqlen // 4)[None].repeat(batch, 0), jnp.int32)
    same_document = (ids[:, :, None] == ids[:, None, :])[:, None]
    cases = {
        "unmasked": (dict(), dict()),
        "causal": (dict(causal=True), dict(is_causal=True)),
        "key padding": (dict(attention_mask=padding), dict(key_value_seq_lengths=jnp.asarray(lengths, jnp.int32))),
        "4 documents, causal": (dict(q_segment_ids=ids, kv_segment_ids=ids, causal=True),
                                dict(mask=same_document, is_causal=True)),
    }
    rows = []
    for name, (ours_kw, xla_kw) in cases.items():
        ours = lambda q, k, v, kw=ours_kw: flash_attention(q, k, v, platform="cpu", **kw)  # noqa: E731
        xla = lambda q, k, v, kw=xla_kw: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)  # noqa: E731
        row = {"case": name, "max_abs_diff": float(jnp.max(jnp.abs(jax.jit(ours)(q, k, v) - jax.jit(xla)(q, k, v))))}
        for label, fn in (("ours", ours), ("xla", xla)):
            row[f"fwd_ms_{label}"] = _median_ms(jax.jit(fn), (q, k, v), repeats)
            row[f"fwdbwd_ms_{label}"] = _median_ms(jax.jit(_fwd_bwd(fn)), (q, k, v, g), repeats)
        rows.append(row)
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="CPU flash attention benchmarks (the full table: benchmarks/run.py)")
    parser.add_argument("--masked", action="store_true", help="key padding and segment ids against XLA")
    if parser.parse_args().masked:
        rows = masked_rows()
        print("| case | ours fwd / fwd+bwd ms | XLA fwd / fwd+bwd ms | max abs diff |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['fwd_ms_ours']:.1f} / {r['fwdbwd_ms_ours']:.1f} | "
                  f"{r['fwd_ms_xla']:.1f} / {r['fwdbwd_ms_xla']:.1f} | {r['max_abs_diff']:.1e} |")
        print("saved", save(rows, "flash_attention_cpu_masked"))
