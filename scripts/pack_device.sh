#!/usr/bin/env bash
# Builds the CUDA binaries here (own build dir, no server) and packs them, with the non-system shared
# libraries they need, into pack/hstu_pack.tar.gz for the GPU machine (see docs/gpu.md).
# CUDA runtime, cuBLAS and cuBLASLt are NOT packed (cuBLASLt alone is ~540 MB): the GPU machine has
# the CUDA 13.0 toolkit and scripts/run_device.sh puts its lib64 on LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
BUILD="${HSTU_CUDA_BUILD_DIR:-build-cuda}"
JOBS="${HSTU_JOBS:-2}"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHSTU_ENABLE_CUDA=ON \
    -DHSTU_BUILD_SERVER=OFF -DHSTU_CUDA_PTXAS_VERBOSE=ON \
    -DHSTU_REQUIRE_CUTLASS=ON
else
  # An existing build dir (its other options kept): the pack needs the fused GEMM, and the check
  # runs again at this configure, so headers fetched since the last one are found.
  cmake -S . -B "$BUILD" -DHSTU_REQUIRE_CUTLASS=ON > /dev/null
fi
BINS=(tests/gpu/hstu_gpu_tests client/hstu_bench)
cmake --build "$BUILD" -j "$JOBS" --target hstu_gpu_tests hstu_bench

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/hstu/bin" "$STAGE/hstu/lib"
for b in "${BINS[@]}"; do cp "$BUILD/$b" "$STAGE/hstu/bin/"; done
bash scripts/collect_libs.sh "$STAGE/hstu/lib" "${BINS[@]/#/$BUILD/}"
git rev-parse --short HEAD > "$STAGE/hstu/COMMIT" 2>/dev/null || echo unknown > "$STAGE/hstu/COMMIT"
# Captured, not piped into `grep -q`: under pipefail git's SIGPIPE would fail the test and a
# dirty tree would be labelled clean.
if [ -n "$(git status --porcelain -- CMakeLists.txt kernels kvcache engine tests/gpu client 2>/dev/null)" ]; then
  echo "+dirty" >> "$STAGE/hstu/COMMIT"
fi
PACK_FILE="${HSTU_PACK_FILE:-pack/hstu_pack.tar.gz}"
mkdir -p "$(dirname "$PACK_FILE")"
tar -C "$STAGE" -czf "$PACK_FILE" hstu
ls -la "$PACK_FILE"
