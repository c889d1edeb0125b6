#!/usr/bin/env bash
# Configures and builds into build/ (CUDA on when nvcc is found; override with HSTU_CMAKE_ARGS).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${HSTU_JOBS:-$(nproc)}"
if [ ! -f build/CMakeCache.txt ]; then
  # shellcheck disable=SC2086
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${HSTU_CMAKE_ARGS:-}
fi
cmake --build build -j "$JOBS"
