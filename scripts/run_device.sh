#!/usr/bin/env bash
# Runs on the GPU machine from pack/hstu_pack.tar.gz (scripts/pack_device.sh): GPU tests, then the
# benchmarks; logs and JSON go to $OUT. Usage (device tool, carry ["pack"]):
#   bash scripts/run_device.sh [tests|bench|all] [bench modes, default "attention kernels block
#   block_graphs e2e offload"]
set -uo pipefail
WHAT="${1:-all}"
OUT="${OUT:-/tmp/hstu_out}"
mkdir -p "$OUT"
DIR=/tmp/hstu_run
rm -rf "$DIR" && mkdir -p "$DIR"
tar -C "$DIR" -xzf pack/hstu_pack.tar.gz
H="$DIR/hstu"
CUDA_LIB=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13.0/lib64; do
  if [ -e "$d/libcublasLt.so.13" ]; then CUDA_LIB="$d"; break; fi
done
if [ -z "$CUDA_LIB" ]; then
  # Fall back to the pip wheels of the CUDA 13 stack that PyTorch uses.
  CUDA_LIB="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)"
  RT="$(python3 -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))' 2>/dev/null || true)"
  CUDA_LIB="$CUDA_LIB:$RT"
fi
export LD_LIBRARY_PATH="$H/lib:$CUDA_LIB:${LD_LIBRARY_PATH:-}"
{
  echo "commit: $(cat "$H/COMMIT" | tr '\n' ' ')"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "cuda libs: $CUDA_LIB"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
} | tee "$OUT/device.txt"
rc=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  # The log is written whole before it is filtered: a pipe into `head` would end the tests early.
  "$H/bin/hstu_gpu_tests" --gtest_output=json:"$OUT/gpu_tests.json" > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|error|Expected|Which is|actual|  " \
    "$OUT/gpu_tests.log" | head -150
  echo "gpu tests exit code: $rc"
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  for mode in ${2:-attention kernels block block_graphs e2e offload}; do
    "$H/bin/hstu_bench" "$mode" --json "$OUT/bench_$mode.json" 2>&1 | tee -a "$OUT/bench.log"
  done
fi
exit $rc
