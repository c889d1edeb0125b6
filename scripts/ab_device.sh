#!/usr/bin/env bash
# A/B timing on the GPU machine: two packs (scripts/pack_device.sh), or one pack under two
# environments, alternated in one call, so that both sides see the same GPU, clocks and power cap
# (docs/gpu.md). Usage (device tool, carry ["pack"]):
#   bash scripts/ab_device.sh A.tar.gz B.tar.gz "MODE [MODE ...]" [ROUNDS]
# A and B may be the same file. HSTU_AB_ENV_A / HSTU_AB_ENV_B: "VAR=value ..." set for that side's
# runs only (e.g. HSTU_AB_ENV_B="HSTU_ATTN_CLUSTER=0"). HSTU_BENCH_FLAGS: flags added to every run
# (e.g. "--batches 8"). ROUNDS (default 2) alternate A B, then B A, and so on, so that a drift of
# the clock within the call does not favour one side. Each run's log is
# $OUT/ab_MODE_SIDE_ROUND.log; its table rows (lines starting "| " with a digit) are printed
# under a header naming the side, round and pack commit.
set -uo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
PACK_A="$1" PACK_B="$2" MODES="$3" ROUNDS="${4:-2}"
OUT="${OUT:-/tmp/hstu_out}"
mkdir -p "$OUT"
for f in "$PACK_A" "$PACK_B"; do
  [ -f "$f" ] || { echo "ab_device.sh: no pack $f" >&2; exit 2; }
done
case "$ROUNDS" in '' | *[!0-9]* | 0) echo "ab_device.sh: ROUNDS must be a number >= 1, got '$ROUNDS'" >&2; exit 2 ;; esac
[ -n "${MODES// /}" ] || { echo "ab_device.sh: no modes given" >&2; exit 2; }
source "$(dirname "$0")/device_env.sh"
BASE_LD="${LD_LIBRARY_PATH:-}"
unpack_and_setup "$PACK_A" /tmp/hstu_ab_A || exit 1
HOME_A="$H"
unpack_and_setup "$PACK_B" /tmp/hstu_ab_B || exit 1
HOME_B="$H"
# Each side runs with its own pack's libraries only (the other pack's lib/ is not on its path,
# so a library missing from one pack is not quietly taken from the other).
BASE_LD="$CUDA_LIB${CUDA_LIB:+${BASE_LD:+:}}$BASE_LD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/ab_device.txt"
echo "A: $(tr '\n' ' ' < "$HOME_A/COMMIT")${HSTU_AB_ENV_A:-}" | tee -a "$OUT/ab_device.txt"
echo "B: $(tr '\n' ' ' < "$HOME_B/COMMIT")${HSTU_AB_ENV_B:-}" | tee -a "$OUT/ab_device.txt"

rc=0
run_side() {  # side mode round
  local side="$1" mode="$2" round="$3" home env_vars log
  if [ "$side" = A ]; then home="$HOME_A" env_vars="${HSTU_AB_ENV_A:-}"; else home="$HOME_B" env_vars="${HSTU_AB_ENV_B:-}"; fi
  log="$OUT/ab_${mode}_${side}_${round}.log"
  # shellcheck disable=SC2086  # the env assignments and bench flags are word lists on purpose
  env LD_LIBRARY_PATH="$home/lib${BASE_LD:+:$BASE_LD}" $env_vars "$home/bin/hstu_bench" "$mode" \
    ${HSTU_BENCH_FLAGS:-} > "$log" 2>&1
  local r=$?
  echo "== $mode, $side, round $round (exit $r)"
  grep -E '^\| [0-9]' "$log"
  [ $r -ne 0 ] && rc=$r
}
for mode in $MODES; do
  for ((round = 1; round <= ROUNDS; ++round)); do
    if [ $((round % 2)) -eq 1 ]; then
      run_side A "$mode" "$round"; run_side B "$mode" "$round"
    else
      run_side B "$mode" "$round"; run_side A "$mode" "$round"
    fi
  done
done
exit $rc
