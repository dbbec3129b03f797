"""What this installation of ejkernel holds: `ejkernel-info` or `python -m ejkernel`."""

from __future__ import annotations

import json
from typing import Any

from . import _native


def build_info() -> dict[str, Any]:
    """Library path, compiled CUDA architectures, platforms usable here, cache location."""
    import jax

    from .registry import kernel_registry

    lib = _native.build_info()
    backends = sorted({d.platform for d in jax.devices()})
    ops: dict[str, list[str]] = {}
    for algorithm in kernel_registry.algorithms():
        ops[algorithm] = [
            entry.platform.value for entry in kernel_registry.implementations(algorithm) if entry.available()
        ]
    return {
        "version": lib.get("version"),
        "library": _native.library_path(),
        "library_error": _native.load_error(),
        "has_cuda": lib.get("has_cuda", False),
        "cuda_archs": lib.get("cuda_archs", []),
        "hopper_kernels": lib.get("hopper_kernels", False),
        "compiler": lib.get("compiler"),
        "cpu_isa": lib.get("cpu_isa", []),
        "jax": jax.__version__,
        "jax_backends": backends,
        "operations": ops,
        "native_implementations": _native.registry_entries(),
        "cache_dir": _native.default_cache_dir(),
    }


def print_build_info() -> None:
    info = build_info()
    print(f"ejkernel {info['version'] or '(no native library)'}")
    print(f"  library        {info['library'] or 'missing: ' + str(info['library_error'])}")
    if info["has_cuda"]:
        hopper = "Hopper kernels built" if info["hopper_kernels"] else "no Hopper kernels: sm_90a not built"
        print(f"  CUDA kernels   sm {', '.join(info['cuda_archs'])} ({hopper})")
    else:
        print("  CUDA kernels   not built")
    print(f"  compiler       {info['compiler']}")
    print(f"  CPU ISA        {', '.join(info['cpu_isa'])}")
    print(f"  jax            {info['jax']} (devices: {', '.join(info['jax_backends'])})")
    for op, platforms in info["operations"].items():
        print(f"  {op:<14} {', '.join(platforms)}")
    print(f"  config cache   {info['cache_dir']}")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="ejkernel-info", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the build as JSON")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(build_info(), indent=2))
    else:
        print_build_info()
