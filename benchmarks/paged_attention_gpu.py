"""Paged (inference) attention on an NVIDIA GPU: ejkernel's CUDA kernels against XLA and the
Pallas paged attention shipped with JAX, in one process.

Decode is memory bound, so the figure of merit is effective bandwidth: bytes of K/V the
sequences actually own, read once, over the time, against a device-to-device copy (bytes read
plus written) measured in the same run. Each decode case is timed two ways: as a program of
its own per call (every call pays XLA's per-program launch and completion work, a few
microseconds), and as one of 8 calls on different queries inside one program, as the layers
of a model's decode step run. Pages are in random order (a fragmented cache) unless the case
says "in order" (pages allocated one after another, as in FlashInfer's decode benchmark).
The mixed ragged batch (48 decode + 4 prefill sequences of 1024 tokens) is timed as one
ragged_page_attention call against decode and prefill as two calls.

    python benchmarks/paged_attention_gpu.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flash_attention_gpu import _time_ms  # noqa: E402

from ejkernel.modules import page_attention, ragged_page_attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def copy_bandwidth_gbs() -> float:
    """Device-to-device streaming copy of 1 GiB (read + write), as XLA runs it."""
    x = jnp.arange(2**28, dtype=jnp.uint32)
    copy = jax.jit(lambda x: x ^ jnp.uint32(1))
    return 2 * x.nbytes / _time_ms(copy, (x,), budget_s=1.0) / 1e6


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    page_size: int
    layout: str = "head_major"
    pages_in_order: bool = False

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * 2


def _decode_inputs(case: DecodeCase, rng: np.random.Generator):
    pages_per_seq = -(-case.context // case.page_size)
    num_pages = case.batch * pages_per_seq + 7
    if case.layout == "head_major":
        shape = (num_pages, KV_HEADS, case.page_size, HEAD_DIM)
    else:
        shape = (num_pages, case.page_size, KV_HEADS, HEAD_DIM)
    key = jax.random.key(int(rng.integers(2**31)))
    kk, kv, kq = jax.random.split(key, 3)
    k_cache = jax.random.normal(kk, shape, jnp.bfloat16)
    v_cache = jax.random.normal(kv, shape, jnp.bfloat16)
    q = jax.random.normal(kq, (case.batch, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    order = np.arange(num_pages) if case.pages_in_order else rng.permutation(num_pages)
    tables = jnp.asarray(order[: case.batch * pages_per_seq].reshape(case.batch, pages_per_seq), jnp.int32)
    lens = jnp.full((case.batch,), case.context, jnp.int32)
    return q, k_cache, v_cache, lens, tables


def _pallas_decode(case: DecodeCase) -> Callable | None:
    """JAX's Pallas (Triton) paged attention; caches as [kv_heads, pages, page_size, head_dim]."""
    if case.layout != "head_major":
        return None
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

    pages_per_seq = -(-case.context // case.page_size)
    k_splits = next(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
    per_block = next(p for p in (8, 4, 2, 1) if (pages_per_seq // k_splits) % p == 0)

    def run(q, k_pages, v_pages, lens, tables):
        return pallas_paged.paged_attention(q * jnp.asarray(HEAD_DIM**-0.5, q.dtype), k_pages, v_pages, tables, lens,
                                            k_splits=k_splits, pages_per_compute_block=per_block)

    return run


PROGRAM_CALLS = 8


def _in_program(fn: Callable) -> Callable:
    """PROGRAM_CALLS calls of fn, one per query array, in one jitted program."""
    return jax.jit(lambda queries, *rest: [fn(q, *rest) for q in queries])


def run_decode(case: DecodeCase, rng: np.random.Generator, copy_gbs: float) -> dict[str, Any]:
    q, k_cache, v_cache, lens, tables = _decode_inputs(case, rng)
    row: dict[str, Any] = dataclasses.asdict(case)
    row["kv_bytes"] = case.kv_bytes
    args = (q, k_cache, v_cache, lens, tables)
    impls: dict[str, tuple[Callable, tuple]] = {
        "ours": (lambda *a: page_attention(*a, kv_layout=case.layout, platform="cuda"), args),
        "xla": (lambda *a: page_attention(*a, kv_layout=case.layout, platform="xla"), args),
    }
    pallas = _pallas_decode(case)
    if pallas is not None:
        k_pages, v_pages = (jnp.transpose(c, (1, 0, 2, 3)) for c in (k_cache, v_cache))
        impls["pallas"] = (pallas, (q, k_pages, v_pages, lens, tables))
    queries = [q + jnp.asarray(0.01 * i, q.dtype) for i in range(PROGRAM_CALLS)]
    reference = None
    for name, (raw_fn, fn_args) in impls.items():
        try:
            fn = jax.jit(raw_fn)
            out = fn(*fn_args)
            if reference is None:
                reference = np.asarray(out, np.float32)
            else:
                diff = np.asarray(out, np.float32) - reference
                row[f"{name}_diff_vs_ours"] = float(np.linalg.norm(diff) / np.linalg.norm(reference))
            timings = (("", _time_ms(fn, fn_args)),
                       ("_program", _time_ms(_in_program(raw_fn), (queries, *fn_args[1:])) / PROGRAM_CALLS))
            for suffix, ms in timings:
                row[f"{name}{suffix}_ms"] = ms
                row[f"{name}{suffix}_gbs"] = case.kv_bytes / ms / 1e6
                row[f"{name}{suffix}_copy_fraction"] = row[f"{name}{suffix}_gbs"] / copy_gbs
        except Exception as exc:  # noqa: BLE001 - an anchor that cannot run this case is recorded
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if name == "ours" and reference is None:
            break
    return row


def run_mixed(rng: np.random.Generator, page_size: int = 16, decode_seqs: int = 48, decode_context: int = 4096,
              prefill_seqs: int = 4, prefill_len: int = 1024) -> dict[str, Any]:
    """One ragged call for 48 decode + 4 prefill sequences against two calls."""
    num_seqs = decode_seqs + prefill_seqs
    kv_lens = np.array([decode_context] * decode_seqs + [prefill_len] * prefill_seqs, np.int32)
    q_lens = np.array([1] * decode_seqs + [prefill_len] * prefill_seqs, np.int32)
    pages_per_seq = -(-int(kv_lens.max()) // page_size)
    num_pages = num_seqs * pages_per_seq + 3
    tables = rng.permutation(num_pages)[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq).astype(np.int32)
    key = jax.random.key(int(rng.integers(2**31)))
    kk, kv, kq = jax.random.split(key, 3)
    shape = (num_pages, page_size, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(kv, shape, jnp.bfloat16)
    total = int(q_lens.sum())
    queries = jax.random.normal(kq, (total, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    def one_call(queries, k_cache, v_cache):
        return ragged_page_attention(queries, k_cache, v_cache, jnp.asarray(kv_lens), jnp.asarray(tables),
                                     jnp.asarray(qsl), jnp.asarray([num_seqs], jnp.int32), platform="cuda")

    def two_calls(queries, k_cache, v_cache):
        decode = ragged_page_attention(
            queries[:decode_seqs], k_cache, v_cache, jnp.asarray(kv_lens[:decode_seqs]),
            jnp.asarray(tables[:decode_seqs]), jnp.arange(decode_seqs + 1, dtype=jnp.int32),
            jnp.asarray([decode_seqs], jnp.int32), platform="cuda")
        prefill_qsl = jnp.asarray(qsl[decode_seqs:] - qsl[decode_seqs])
        prefill = ragged_page_attention(
            queries[decode_seqs:], k_cache, v_cache, jnp.asarray(kv_lens[decode_seqs:]),
            jnp.asarray(tables[decode_seqs:]), prefill_qsl, jnp.asarray([prefill_seqs], jnp.int32), platform="cuda")
        return jnp.concatenate([decode, prefill])

    row: dict[str, Any] = dict(decode_seqs=decode_seqs, decode_context=decode_context, prefill_seqs=prefill_seqs,
                               prefill_len=prefill_len, page_size=page_size)
    args = (queries, k_cache, v_cache)
    one, two = jax.jit(one_call), jax.jit(two_calls)
    out_one, out_two = np.asarray(one(*args), np.float32), np.asarray(two(*args), np.float32)
    row["one_vs_two_diff"] = float(np.linalg.norm(out_one - out_two) / np.linalg.norm(out_two))
    row["one_call_ms"] = _time_ms(one, args)
    row["two_calls_ms"] = _time_ms(two, args)
    row["xla_one_call_ms"] = _time_ms(jax.jit(lambda *a: ragged_page_attention(
        a[0], a[1], a[2], jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(qsl),
        jnp.asarray([num_seqs], jnp.int32), platform="xla")), args)
    return row


def plot(rows: list[dict[str, Any]], copy_gbs: float, device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 5))
    labels = [f"B{r['batch']} x {r['context']}\npage {r['page_size']}\n"
              + ("head-major" if r["layout"] == "head_major" else "token-major")
              + ("\npages in order" if r.get("pages_in_order") else "") for r in rows]
    xs = np.arange(len(rows))
    bars = (("ours", "ejkernel, a program per call"), ("ours_program", f"ejkernel, {PROGRAM_CALLS} calls per program"),
            ("pallas", "Pallas"), ("xla", "XLA"))
    width = 0.8 / len(bars)
    for i, (name, label) in enumerate(bars):
        ax.bar(xs + i * width, [(r.get(f"{name}_gbs") or 0) / 1e3 for r in rows], width, label=label)
    ax.axhline(copy_gbs / 1e3, color="k", linestyle="--", label="device copy")
    ax.axhline(0.85 * copy_gbs / 1e3, color="gray", linestyle=":", label="85% of copy")
    ax.set_xticks(xs + 0.4 - width / 2, labels, fontsize=8)
    ax.set_ylabel("effective K/V bandwidth, TB/s")
    ax.set_title(f"Paged decode attention, bf16, 32 q / 8 kv heads, d=128 ({device})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise SystemExit(f"needs an NVIDIA GPU; the default device is {device.platform}")
    rng = np.random.default_rng(int(time.time_ns() % 2**32))
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s", flush=True)
    cases = [DecodeCase(b, c, p, layout) for b, c in ((64, 4096), (1, 65536)) for p in (16, 64)
             for layout in ("head_major", "token_major")]
    cases += [DecodeCase(1, 65536, p, pages_in_order=True) for p in (16, 64)]
    rows = []
    for case in cases:
        rows.append(run_decode(case, rng, copy_gbs))
        r = rows[-1]
        print(f"{case}: ours {r.get('ours_gbs', 0):.0f} GB/s ({100 * r.get('ours_copy_fraction', 0):.1f}% of copy), "
              f"in a program {r.get('ours_program_gbs', 0):.0f} GB/s "
              f"({100 * r.get('ours_program_copy_fraction', 0):.1f}%); pallas {r.get('pallas_gbs') or 0:.0f} / "
              f"{r.get('pallas_program_gbs') or 0:.0f}, xla {r.get('xla_gbs') or 0:.0f} / "
              f"{r.get('xla_program_gbs') or 0:.0f}" + (f"  {r['ours_error']}" if "ours_error" in r else ""),
              flush=True)
    mixed = run_mixed(rng)
    print(f"mixed batch: one call {mixed['one_call_ms']:.3f} ms, two calls {mixed['two_calls_ms']:.3f} ms, "
          f"XLA {mixed['xla_one_call_ms']:.3f} ms", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": device.device_kind, "jax": jax.__version__, "copy_gbs": copy_gbs, "q_heads": Q_HEADS,
            "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"}
    (args.out / "paged_attention_gpu.json").write_text(json.dumps({"meta": meta, "decode": rows, "mixed": mixed},
                                                                   indent=1))
    try:
        plot(rows, copy_gbs, device.device_kind, args.out / "paged_attention_gpu.png")
    except ImportError as exc:
        print(f"no plot: {exc}")


if __name__ == "__main__":
    main()
