#!/usr/bin/env bash
# Installs everything ejkernel needs on a fresh Debian/Ubuntu machine, then ejkernel itself.
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
system_packages=(cmake ninja-build g++ nlohmann-json3-dev libgtest-dev libbenchmark-dev)
missing=()
for pkg in "${system_packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing system packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "please install: ${missing[*]} (or pass their locations to CMake)" >&2
  fi
fi

"$PYTHON" -m pip install -q --disable-pip-version-check \
  "jax>=0.7.2" "jaxlib>=0.7.2" "numpy>=1.26" "jaxtyping>=0.2.36" \
  "scikit-build-core>=0.10" "pytest>=8" "hypothesis>=6" "pytest-xdist>=3" "rich>=13" "matplotlib>=3.8"
# No build isolation: the build reads XLA's FFI headers from the jaxlib installed above.
# CUDA kernels are built when nvcc is found and a GPU is visible (EJKERNEL_CUDA=ON/OFF overrides).
cuda=${EJKERNEL_CUDA:-$(nvidia-smi -L >/dev/null 2>&1 && echo AUTO || echo OFF)}
"$PYTHON" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps . \
  -C cmake.define.EJKERNEL_CUDA="$cuda"
"$PYTHON" -m ejkernel
