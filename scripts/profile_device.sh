#!/usr/bin/env bash
# Runs on the GPU machine from pack/hstu_pack.tar.gz (scripts/pack_device.sh): one hstu_bench mode
# under Nsight Compute, recording only each kernel's GPU time, then the per-kernel table of every
# forward step (scripts/ncu_steps.py). The profiler serialises the kernels but leaves the clocks
# and caches as the run left them (--clock-control none --cache-control none), so a kernel reads
# what its predecessor left in L2, as in the real step. Usage (device tool, carry ["pack"]):
#   bash scripts/profile_device.sh block --batches 1,8 --reps 1
# Output: $OUT/ncu.csv.gz (raw), $OUT/ncu_steps.md (tables). GEMM tuning timings are distorted
# under the profiler, so the routes and algorithms it picks can differ from an unprofiled run.
set -uo pipefail
OUT="${OUT:-/tmp/hstu_out}"
mkdir -p "$OUT"
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/device_env.sh"
unpack_and_setup "${HSTU_PACK_FILE:-pack/hstu_pack.tar.gz}" /tmp/hstu_run || exit 1
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
if [ -z "$NCU" ]; then
  echo "profile_device.sh: Nsight Compute (ncu) not found" >&2
  exit 1
fi
[ $# -gt 0 ] || set -- block --batches 1,8 --reps 1
{
  echo "commit: $(tr '\n' ' ' < "$H/COMMIT")"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "command: hstu_bench $*"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee "$OUT/ncu_steps.md"
"$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
  --print-units base "$H/bin/hstu_bench" "$@" > "$OUT/ncu.csv" 2> "$OUT/ncu_stderr.txt"
rc=$?
python3 "$HERE/ncu_steps.py" "$OUT/ncu.csv" >> "$OUT/ncu_steps.md"
steps_rc=$?
gzip -f "$OUT/ncu.csv"
echo "ncu exit code: $rc; ncu_steps.py exit code: $steps_rc; tables in $OUT/ncu_steps.md"
# ncu's own failure first; else a table step that found nothing or failed.
[ $rc -ne 0 ] && exit $rc
exit $steps_rc
