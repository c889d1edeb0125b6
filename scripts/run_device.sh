#!/usr/bin/env bash
# Runs on the GPU machine from pack/hstu_pack.tar.gz (scripts/pack_device.sh): GPU tests, then the
# benchmarks; logs and JSON go to $OUT. Usage (device tool, carry ["pack"]):
#   bash scripts/run_device.sh [tests|bench|all] [bench modes, default "attention kernels block
#   block_graphs e2e offload"]
set -uo pipefail
WHAT="${1:-all}"
OUT="${OUT:-/tmp/hstu_out}"
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
unpack_and_setup "${HSTU_PACK_FILE:-pack/hstu_pack.tar.gz}" /tmp/hstu_run
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
