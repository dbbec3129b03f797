#!/usr/bin/env bash
# The GPU test suite, for a machine with an NVIDIA GPU: builds ejkernel with its CUDA kernels,
# prints the build, runs the flash attention and paged attention tests on the GPU (the CUDA
# kernels against float64 references, plus XLA on the GPU) and a scan of the kernels' machine
# code for a known ptxas miscompile, the GoogleTest suite where GoogleTest is installed (or
# under $GTEST_ROOT), then compute-sanitizer memcheck and racecheck on small shapes. Logs go
# to $OUT (default /tmp/ejkernel-gpu).
#   EJKERNEL_CUDA_ARCHS=90a   architectures to build (default: 90a, the H100's)
#   GPU_CHECK_SKIP_BUILD=1    reuse the installed build
#   GPU_CHECK_TESTS=EXPR      pytest -k expression (default "cuda or xla"; empty: no pytest)
#   GPU_CHECK_SANITIZERS=...  sanitizer runs (default "memcheck racecheck racecheck.2"; empty: none)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ejkernel-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTHON=${PYTHON:-python3}
ARCHS=${EJKERNEL_CUDA_ARCHS:-90a}
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# The GoogleTest suite is built beside the library where GoogleTest is installed: the C++
# rules that read the device (its architecture, the code it runs) are only exercised here.
gtests=OFF
for include in /usr/include /usr/local/include "${GTEST_ROOT:-/nonexistent}/include"; do
  [ -f "$include/gtest/gtest.h" ] && gtests=ON
done
if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ]; then
  start=$(date +%s)
  "$PYTHON" -m pip install --no-build-isolation --no-deps -q . \
    -C cmake.define.EJKERNEL_CUDA=ON -C cmake.define.EJKERNEL_CUDA_ARCHS="$ARCHS" \
    -C cmake.define.EJKERNEL_BUILD_TESTS=$gtests \
    -C build-dir=build/gpu >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
if [ -x build/gpu/ejkernel_tests ]; then
  ctest --test-dir build/gpu -j "$(nproc)" >"$OUT/gtest.log" 2>&1 || { status=1; grep -E "Failed|tests passed" "$OUT/gtest.log"; }
  grep -E "tests passed" "$OUT/gtest.log"
else
  echo "GoogleTest: not installed here, C++ suite skipped"
fi
"$PYTHON" -X faulthandler -m ejkernel 2>&1 | tee "$OUT/info.txt"

# 300 random cases per implementation of each family on top of the fixed ones (~3 minutes on
# an H100); XLA's autotuning of every new shape's matrix products would cost more than the tests.
tests=${GPU_CHECK_TESTS-cuda or xla}
if [ -n "$tests" ]; then
  EJK_RANDOM_CASES=${EJK_RANDOM_CASES:-300} XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    "$PYTHON" -m pytest -q -p no:cacheprovider -n 8 tests/flash_attention tests/paged_attention \
    tests/runtime -k "$tests" 2>&1 | tee "$OUT/tests.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

# racecheck runs twice: it has reported a real hazard in some runs of a build and not others.
for run in ${GPU_CHECK_SANITIZERS-memcheck racecheck racecheck.2}; do
  tool=${run%%.*}
  for script in tests/flash_attention/sanitize_cuda.py tests/paged_attention/sanitize_cuda.py; do
    [ -f "$script" ] || continue
    name=$(basename "$(dirname "$script")")
    log="$OUT/sanitizer-$run-$name.log"
    timeout 400 compute-sanitizer --tool "$tool" --error-exitcode 3 --target-processes all \
      "$PYTHON" "$script" >"$log" 2>&1
    rc=$?
    echo "compute-sanitizer $run $name: exit $rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)"
    [ "$rc" = 0 ] || { status=1; tail -5 "$log"; }
  done
done
exit $status
