"""Two builds of libejkernel against each other on the flash attention GPU kernels.

    python3 benchmarks/compare_builds.py BASE NEW [--cases window,c128_32x512] [--rounds 3]

BASE and NEW are libejkernel.so files or source trees; a source tree is first built with
CMake and Ninja into <tree>/build/compare (CUDA for --archs, default sm_90a, the flash
attention head dims of --head-dims), both trees at once. Each build then times every case in a process of its
own (the library is loaded once per process), BASE first in even rounds and NEW first in
odd ones, so that the GPU's drift and the order fall on both. A case's time is the median
of batches of calls (benchmarks/flash_attention_gpu.py); the table gives each build's
range over the rounds and NEW / BASE of the medians. Run a build against itself to see the
spread. Outputs of the same inputs are compared bitwise (a digest of the forward's
output; the backward's dQ sums in no fixed order): a kernel change that should not move a
bit says so here. `--archs 80` builds source trees for sm_80 only, which on a Hopper GPU runs the
mma.sync kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


# name -> flash_attention_gpu.Case fields (batch, seqlen, heads, head_dim, options)
CASES = {
    "window": (1, 16384, 16, 128, dict(causal=True, window=1024)),
    "full_causal": (1, 16384, 16, 128, dict(causal=True)),
    "c128_32x512": (32, 512, 16, 128, dict(causal=True)),
    "c128_16x1024": (16, 1024, 16, 128, dict(causal=True)),
    "n128_32x512": (32, 512, 16, 128, {}),
    "c128_4x4096": (4, 4096, 16, 128, dict(causal=True)),
    "n128_4x4096": (4, 4096, 16, 128, {}),
    "varlen": (16, 2048, 16, 128, dict(causal=True, varlen=True)),
    "varlen_64x512": (64, 512, 16, 128, dict(causal=True, varlen=True)),
    "varlen_4x8192": (4, 8192, 16, 128, dict(causal=True, varlen=True)),
    "varlen_1x16384": (1, 16384, 16, 128, dict(causal=True, varlen=True)),
    "varlen_det": (16, 2048, 16, 128, dict(causal=True, varlen=True, deterministic=True)),
    "n_varlen": (16, 2048, 16, 128, dict(varlen=True)),
    "n_varlen_det": (16, 2048, 16, 128, dict(varlen=True, deterministic=True)),
    "c128_4x4096_det": (4, 4096, 16, 128, dict(causal=True, deterministic=True)),
    "c64_32x512": (32, 512, 32, 64, dict(causal=True)),
    "c64_16x1024": (16, 1024, 32, 64, dict(causal=True)),
    "n64_4x4096": (4, 4096, 32, 64, {}),
    "window64": (1, 16384, 32, 64, dict(causal=True, window=1024)),
    "c256_4x4096": (4, 4096, 8, 256, dict(causal=True)),
    "n256_4x4096": (4, 4096, 8, 256, {}),
    "dropout_n128_4x4096": (4, 4096, 16, 128, dict(dropout=0.1)),
    "dropout_c128_4x4096": (4, 4096, 16, 128, dict(causal=True, dropout=0.1)),
    "dropout_c64_4x4096": (4, 4096, 32, 64, dict(causal=True, dropout=0.1)),
    "dropout_c256_4x4096": (4, 4096, 8, 256, dict(causal=True, dropout=0.1)),
    "segments_c128_4x4096": (4, 4096, 16, 128, dict(causal=True, segments=4)),
    "segments_n128_4x4096": (4, 4096, 16, 128, dict(segments=4)),
    "segments_c64_4x4096": (4, 4096, 32, 64, dict(causal=True, segments=4)),
    "segments_n64_4x4096": (4, 4096, 32, 64, dict(segments=4)),
    "key_padding_n128_8x2048": (8, 2048, 16, 128, dict(dense="key_padding")),
    "key_padding_n64_8x2048": (8, 2048, 12, 64, dict(dense="key_padding")),
    "dropout_n64_4x4096": (4, 4096, 32, 64, dict(dropout=0.1)),
    "dropout_window_2x4096": (2, 4096, 16, 128, dict(causal=True, window=500, dropout=0.1)),
}


def worker(names: list[str], backward: bool) -> None:
    """Times the cases with the library in EJKERNEL_LIBRARY; one JSON line per case (run as a
    script, so that flash_attention_gpu beside it imports)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flash_attention_gpu as bench

    for name in names:
        batch, seqlen, heads, head_dim, options = CASES[name]
        case = bench.Case(name, batch, seqlen, heads, head_dim, **options)
        rng = np.random.default_rng(0)
        q, k, v, g, lengths = bench._inputs(case, rng)
        dense = bench._dense_inputs(case, rng)
        forward = jax.jit(bench._ours(case, lengths))
        out = np.asarray(forward(q, k, v, *dense).astype(jnp.float32))
        row = {
            "case": name,
            "digest": hashlib.sha1(out.tobytes()).hexdigest()[:16],
            "fwd_ms": bench._time_ms(forward, (q, k, v, *dense), 0.3),
        }
        if backward:
            step = jax.jit(bench._fwd_bwd(bench._ours(case, lengths)))
            row["fwd_bwd_ms"] = bench._time_ms(step, (q, k, v, g, *dense), 0.3)
        print(json.dumps(row), flush=True)


def build(trees: list[Path], head_dims: str, archs: str, features: str) -> None:
    jobs = max(1, (os.cpu_count() or 2) // len(trees))
    procs = []
    for tree in trees:
        build_dir = tree / "build" / "compare"
        configure = [
            "cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DEJKERNEL_CUDA=ON", f"-DEJKERNEL_CUDA_ARCHS={archs}", f"-DEJKERNEL_CUDA_HEAD_DIMS={head_dims}",
            f"-DEJKERNEL_CUDA_FEATURES={features}", "-DEJKERNEL_BUILD_TESTS=OFF",
        ]
        script = f"{shlex.join(configure)} && ninja -C {build_dir} -j {jobs} ejkernel"
        build_dir.parent.mkdir(exist_ok=True)
        with open(build_dir.parent / "compare.log", "w") as log:  # the child keeps its own descriptor
            procs.append((tree, subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT)))
    for tree, proc in procs:
        if proc.wait() != 0:
            sys.exit(f"building {tree} failed: see {tree / 'build' / 'compare.log'}")


def library(path: Path) -> Path:
    return path if path.is_file() else path / "build" / "compare" / "libejkernel.so"


def front_end(path: Path) -> Path:
    """The Python package a build runs under: a source tree's own, else this checkout's."""
    return (path if path.is_dir() else HERE.parent) / "python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, nargs="?")
    parser.add_argument("new", type=Path, nargs="?")
    parser.add_argument("--cases", default="all", help="comma-separated case names, or 'all'")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backward", action="store_true", help="time forward+backward too")
    parser.add_argument("--head-dims", default="64;128", help="head dims built for source trees")
    parser.add_argument("--archs", default="90a", help="CUDA architectures built for source trees")
    parser.add_argument("--features", default="", help="EJKERNEL_CUDA_FEATURES for source trees (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if args.worker:
        worker(names, args.backward)
        return
    if args.base is None or args.new is None:
        parser.error("BASE and NEW are required")
    trees = [p.resolve() for p in (args.base, args.new) if p.is_dir()]
    if trees:
        build(trees, args.head_dims, args.archs, args.features)
    sides = {"base": args.base.resolve(), "new": args.new.resolve()}
    rows: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        order = list(sides.items())
        for label, side in order if round_index % 2 == 0 else order[::-1]:
            lib = library(side)
            python_path = os.pathsep.join(filter(None, [str(front_end(side)), os.environ.get("PYTHONPATH")]))
            env = dict(os.environ, EJKERNEL_LIBRARY=str(lib), PYTHONPATH=python_path)
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            command = [sys.executable, __file__, "--worker", "--cases", ",".join(names)]
            if args.backward:
                command.append("--backward")
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"{label} ({lib}) failed:\n{result.stderr[-3000:]}")
            for line in result.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    rows.setdefault((label, row["case"]), []).append(row)

    def summary(label: str, name: str, key: str) -> tuple[str, float]:
        times = sorted(r[key] for r in rows[(label, name)])
        return f"{times[0]:.4f}-{times[-1]:.4f}", times[len(times) // 2]

    keys = ["fwd_ms"] + (["fwd_bwd_ms"] if args.backward else [])
    print("| case | pass | base ms | new ms | new / base | outputs |")
    print("|---|---|---|---|---|---|")
    for name in names:
        digests = {r["digest"] for label in sides for r in rows[(label, name)]}
        for key in keys:
            (base_range, base_mid), (new_range, new_mid) = summary("base", name, key), summary("new", name, key)
            same = "bitwise equal" if len(digests) == 1 else "DIFFER"
            print(f"| {name} | {key[:-3]} | {base_range} | {new_range} | {new_mid / base_mid:.3f} | {same} |")


if __name__ == "__main__":
    main()
