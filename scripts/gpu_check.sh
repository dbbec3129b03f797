#!/usr/bin/env bash
# Builds ejkernel with its CUDA kernels on an NVIDIA GPU machine and runs the GPU checks:
# build info, the flash attention tests on the GPU (the CUDA implementations against the
# float32 XLA reference), and compute-sanitizer memcheck/racecheck on small shapes.
# Logs go to $OUT (default /tmp/ejkernel-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ejkernel-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTHON=${PYTHON:-python3}
ARCHS=${EJKERNEL_CUDA_ARCHS:-90a}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
"$PYTHON" -m pip install --no-build-isolation --no-deps -q . \
  -C cmake.define.EJKERNEL_CUDA=ON -C cmake.define.EJKERNEL_CUDA_ARCHS="$ARCHS" \
  -C build-dir=build/gpu >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
"$PYTHON" -X faulthandler -m ejkernel 2>&1 | tee "$OUT/info.txt"

"$PYTHON" -m pytest -q -p no:cacheprovider tests/flash_attention/test_flash_attention.py -k "cuda or xla" 2>&1 | tee "$OUT/tests.log" | tail -15

for tool in memcheck racecheck; do
  timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 3 --target-processes all \
    "$PYTHON" tests/flash_attention/sanitize_cuda.py >"$OUT/sanitizer-$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer-$tool.log") clean summaries)"
  tail -3 "$OUT/sanitizer-$tool.log"
done
