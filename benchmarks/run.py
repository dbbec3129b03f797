"""The main job: benchmarks ejkernel's kernels on this machine's default device.

On an NVIDIA GPU: flash attention against cuDNN, Pallas and XLA (flash_attention_gpu.py)
and paged attention against a device copy, Pallas and XLA (paged_attention_gpu.py). On a
CPU: flash attention against XLA. Results go to benchmarks/results/ as JSON (and PNG plots
on the GPU).

    python benchmarks/run.py            # the full suite for the default device
    python benchmarks/run.py --quick    # small sizes only
    python benchmarks/run.py --cpu      # the CPU suite even where the default device is a GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flash_attention_cpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--cpu", action="store_true", help="run the CPU suite on a GPU machine")
    args = parser.parse_args()

    if jax.default_backend() == "gpu" and not args.cpu:
        import flash_attention_gpu
        import paged_attention_gpu

        sys.argv = [sys.argv[0]] + (["--quick"] if args.quick else [])
        flash_attention_gpu.main()
        sys.argv = sys.argv[:1]
        paged_attention_gpu.main()
        return

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import ejkernel

    console = Console()
    ejkernel.print_build_info()
    backend = jax.default_backend()
    if backend != "cpu":
        console.print(f"[yellow]default device is {backend}: the CPU suite below runs on the host CPU[/]")

    cases = flash_attention_cpu.default_cases()
    if args.quick:
        cases = [(case, repeats) for case, repeats in cases if case.seqlen <= 2048]
    rows = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("flash attention, native CPU vs XLA", total=len(cases))
        for case, repeats in cases:
            progress.update(task, description=f"flash attention S={case.seqlen} causal={case.causal}")
            with jax.default_device(jax.devices("cpu")[0]):
                rows.append(flash_attention_cpu.run_case(case, repeats))
            progress.advance(task)
    path = flash_attention_cpu.save(rows, "flash_attention_cpu")
    console.print("\nFlash attention, native CPU (ours) vs jax.nn.dot_product_attention on XLA CPU "
                  f"(B=1, H=8, D=64, float32, {rows[0]['batch']} batch)")
    console.print(flash_attention_cpu.format_table(rows), markup=False)
    console.print(f"results: {path}")


if __name__ == "__main__":
    main()
