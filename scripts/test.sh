#!/usr/bin/env bash
# The whole test suite: the C++ runtime and kernels under GoogleTest, then the Python suite
# against the installed package. CUDA sources are built only where a GPU is visible (they
# take long to compile and nothing here could run them); scripts/gpu_check.sh is the GPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
cuda=${EJKERNEL_CUDA:-$(nvidia-smi -L >/dev/null 2>&1 && echo AUTO || echo OFF)}
cmake -S . -B build/tests -G Ninja -DEJKERNEL_BUILD_TESTS=ON -DEJKERNEL_CUDA="$cuda" -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
  ${EJKERNEL_CMAKE_ARGS:-} >/dev/null
cmake --build build/tests -j "$JOBS"
ctest --test-dir build/tests --output-on-failure -j "$JOBS"

# Tests import the installed package, not the source tree.
cd tests
"$PYTHON" -m pytest -q -n "$JOBS" -p no:cacheprovider "$@" .
