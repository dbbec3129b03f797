#!/usr/bin/env bash
# The whole test suite: the C++ runtime and kernels under GoogleTest (CUDA sources compiled
# too when nvcc is present, so a CUDA build break shows without a GPU), then the Python suite
# against the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B build/tests -G Ninja -DEJKERNEL_BUILD_TESTS=ON -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
  ${EJKERNEL_CMAKE_ARGS:-} >/dev/null
cmake --build build/tests -j "$JOBS"
ctest --test-dir build/tests --output-on-failure -j "$JOBS"

# Tests import the installed package, not the source tree.
cd tests
"$PYTHON" -m pytest -q -n "$JOBS" -p no:cacheprovider "$@" .
