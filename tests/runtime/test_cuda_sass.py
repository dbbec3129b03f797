"""Machine-code check of the built CUDA kernels.

ptxas of CUDA 13.0 can encode a global memory access with its 64-bit memory descriptor in an
odd uniform register pair (`desc[UR1]`), which the GPU rejects as an illegal instruction at
run time. It happened to the paged attention kernel's cache-hinted copies after unrelated
source changes, so every build is scanned: no instruction may name an odd descriptor register.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ejkernel import _native

_ODD_DESCRIPTOR = re.compile(r"desc\[UR(\d*[13579])\]")
_FUNCTION = re.compile(r"Function : (\S+)")


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "cuobjdump").exists():
            return str(Path(root) / "bin" / "cuobjdump")
    return None


def _cuda_library() -> str | None:
    path = _native.library_path()
    if path is None or not _native.build_info().get("has_cuda"):
        return None
    return path


@pytest.mark.skipif(_cuda_library() is None, reason="libejkernel was built without CUDA kernels")
@pytest.mark.skipif(_cuobjdump() is None, reason="cuobjdump (CUDA toolkit) not found")
def test_cuda_kernels_use_even_descriptor_registers():
    proc = subprocess.Popen([_cuobjdump(), "-sass", _cuda_library()], stdout=subprocess.PIPE, text=True)
    function, bad = "?", {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if "Function :" in line:
            function = _FUNCTION.search(line).group(1)
        elif "desc[UR" in line and _ODD_DESCRIPTOR.search(line):
            bad.setdefault(function, line.strip())
    assert proc.wait() == 0, "cuobjdump failed"
    assert not bad, "instructions with an odd descriptor register (illegal at run time):\n" + "\n".join(
        f"{name}: {line}" for name, line in bad.items())
