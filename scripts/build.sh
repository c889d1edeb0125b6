#!/usr/bin/env bash
# Configures and builds into build/ (CUDA on when nvcc is found; override with HSTU_CMAKE_ARGS).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${HSTU_JOBS:-$(nproc)}"
# Configured on every run (quick when nothing changed), so that HSTU_CMAKE_ARGS given later apply.
# shellcheck disable=SC2086
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${HSTU_CMAKE_ARGS:-} > /dev/null
cmake --build build -j "$JOBS"
