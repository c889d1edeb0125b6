#!/usr/bin/env bash
# The README's test command: build, then every CTest test (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure --no-tests=error -j "${HSTU_JOBS:-$(nproc)}"
