#!/usr/bin/env bash
# Runs on the GPU machine from pack/hstu_pack.tar.gz (scripts/pack_device.sh): GPU tests, then the
# benchmarks; logs and JSON go to $OUT. Usage (device tool, carry ["pack"]):
#   bash scripts/run_device.sh [tests|bench|all] [bench modes, default "attention kernels block
#   block_graphs e2e offload"]; HSTU_BENCH_FLAGS adds flags to every mode (e.g. "--batches 8
#   --no_cache_only"). The SM clock, power and throttle reasons are logged meanwhile
#   ($OUT/gpu_clocks.csv, summed up per mode in $OUT/gpu_clocks_summary.txt).
#   bash scripts/run_device.sh sanitize [tools [gtest filter]] — the GPU tests under
#     compute-sanitizer, one run a tool (HSTU_SANITIZE_TIMEOUT seconds each, default 240), each log
#     in $OUT/sanitize_TOOL.log; any report fails the run. Without tools, the gate (~2.5 min on an
#     H100): memcheck with the leak check over every test but the device-loss one (which faults on
#     purpose), racecheck and synccheck over the kernel tests (the rest run cuBLAS's kernels, in
#     which racecheck reports hazards: docs/gpu.md).
set -uo pipefail
WHAT="${1:-all}"
case "$WHAT" in
  tests | bench | all | sanitize) ;;
  *) echo "run_device.sh: unknown mode '$WHAT' (tests | bench | all | sanitize)" >&2; exit 2 ;;
esac
OUT="${OUT:-/tmp/hstu_out}"
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
unpack_and_setup "${HSTU_PACK_FILE:-pack/hstu_pack.tar.gz}" /tmp/hstu_run || exit 1
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
if [ "$WHAT" = sanitize ]; then
  if ! find_compute_sanitizer; then echo "run_device.sh: compute-sanitizer not found" >&2; exit 2; fi
  if [ -n "${2:-}" ]; then
    runs=()
    for tool in $2; do runs+=("$tool:${3:-*}"); done
  else
    # The device-loss test faults on purpose (in a child process); the recoverable-error test
    # fails a cudaMalloc on purpose.
    runs=("memcheck:*-CudaEngineDeviceLoss.*:CudaEngine.ARecoverableCudaErrorLeavesLaterRequestsServed" "racecheck:CudaKernels.*" "synccheck:CudaKernels.*")
  fi
  for run in "${runs[@]}"; do
    tool="${run%%:*}" filter="${run#*:}"
    extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check full)
    start=$(date +%s)
    timeout "${HSTU_SANITIZE_TIMEOUT:-240}" "$CS" --tool "$tool" "${extra[@]}" --error-exitcode 9 \
      --print-limit 40 "$H/bin/hstu_gpu_tests" --gtest_filter="$filter" \
      > "$OUT/sanitize_$tool.log" 2>&1
    trc=$?
    echo "== $tool ($filter): exit $trc in $(( $(date +%s) - start )) s (9: errors reported, 124: timed out)"
    grep -E "ERROR SUMMARY|LEAK SUMMARY|^\[  (FAILED|PASSED) |tests ran" "$OUT/sanitize_$tool.log"
    grep -E "^========= [A-Z]" "$OUT/sanitize_$tool.log" | grep -v "ERROR SUMMARY" | sort | uniq -c \
      | sort -rn | head -12
    [ $trc -ne 0 ] && rc=$trc
  done
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  # The SM clock, power, utilisation and throttle reasons every 100 ms while the benchmarks run:
  # under sustained load the GPU can hit its power cap and lower its clock (docs/gpu.md), which
  # moves the numbers.
  TZ=UTC nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 100 -f "$OUT/gpu_clocks.csv" & clk=$!
  : > "$OUT/bench_spans.txt"
  for mode in ${2:-attention kernels block block_graphs e2e offload}; do
    start=$(date +%s.%N)
    # shellcheck disable=SC2086  # HSTU_BENCH_FLAGS: extra flags for every mode, e.g. "--batches 8"
    "$H/bin/hstu_bench" "$mode" --json "$OUT/bench_$mode.json" ${HSTU_BENCH_FLAGS:-} 2>&1 | tee -a "$OUT/bench.log"
    st=${PIPESTATUS[0]}
    echo "$mode $start $(date +%s.%N)" >> "$OUT/bench_spans.txt"
    if [ "$st" != 0 ]; then echo "hstu_bench $mode exit code: $st" | tee -a "$OUT/bench.log"; rc=1; fi
  done
  kill -INT "$clk"; wait "$clk" 2> /dev/null
  python3 "$(dirname "$0")/clock_summary.py" "$OUT/gpu_clocks.csv" "$OUT/bench_spans.txt" \
    | tee "$OUT/gpu_clocks_summary.txt"
fi
exit $rc
