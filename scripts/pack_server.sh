#!/usr/bin/env bash
# Builds hstu_server, hstu_loadgen, hstu_rank and hstu_model with the CUDA backend (own build dir) and packs them
# with their non-system shared libraries (gRPC, protobuf, absl, spdlog, OpenBLAS, ...) into
# pack/hstu_server_pack.tar.gz for the GPU machine, which has no -dev packages. The CUDA runtime and
# cuBLAS come from the GPU machine's toolkit (see scripts/run_device_server.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="${HSTU_SERVER_BUILD_DIR:-build-server-cuda}"
JOBS="${HSTU_JOBS:-2}"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHSTU_ENABLE_CUDA=ON \
    -DHSTU_BUILD_SERVER=ON -DHSTU_BUILD_TESTS=OFF \
    -DHSTU_REQUIRE_CUTLASS=ON
else
  # An existing build dir (its other options kept): the pack needs the fused GEMM, and the check
  # runs again at this configure, so headers fetched since the last one are found.
  cmake -S . -B "$BUILD" -DHSTU_REQUIRE_CUTLASS=ON > /dev/null
fi
BINS=(server/hstu_server client/hstu_loadgen client/hstu_rank client/hstu_model)
cmake --build "$BUILD" -j "$JOBS" --target hstu_server hstu_loadgen hstu_rank hstu_model
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/hstu_server/bin" "$STAGE/hstu_server/lib"
for b in "${BINS[@]}"; do cp "$BUILD/$b" "$STAGE/hstu_server/bin/"; done
bash scripts/collect_libs.sh "$STAGE/hstu_server/lib" "${BINS[@]/#/$BUILD/}"
git rev-parse --short HEAD > "$STAGE/hstu_server/COMMIT" 2>/dev/null || echo unknown > "$STAGE/hstu_server/COMMIT"
# Captured, not piped into `grep -q` (pipefail and git's SIGPIPE would hide a dirty tree).
if [ -n "$(git status --porcelain -- CMakeLists.txt proto kernels kvcache engine server client 2>/dev/null)" ]; then
  echo "+dirty" >> "$STAGE/hstu_server/COMMIT"
fi
cp tools/make_requests.py tools/compare_rank_outputs.py tools/soak_monitor.py "$STAGE/hstu_server/"
mkdir -p pack
tar -C "$STAGE" -czf pack/hstu_server_pack.tar.gz hstu_server
ls -la pack/hstu_server_pack.tar.gz
