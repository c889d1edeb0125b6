#!/usr/bin/env bash
# On the GPU machine (device tool, carry ["pack"]): starts hstu_server on random:base / cuda:0 and
# drives it with hstu_loadgen: a Zipf population of users several times larger than the GPU KV pool,
# growing histories; once with the cache (GPU pool + host tier), once without; then the e2e shape
# (every user GPU-resident, ~256 new tokens + 256 candidates per request, as `hstu_bench e2e`), to
# compare the server's throughput with the engine's. JSON and logs → $OUT.
#   bash scripts/run_device_server.sh [duration_s] [parts: "parity cache cache_always nocache e2e"]
# (memcheck: the server under compute-sanitizer's memcheck with a small pool, 300 requests;
# cache_always: the cache with --onload_policy=always, every host hit onloaded: the A/B of the
# onload-or-recompute rule; cache_gpu: the GPU pool alone, no host tier; cache_b512: a write-behind backlog of
# 512 MiB instead of the default 128; cache_window: the cache's load on the base shapes with a sliding window
# of 512 tokens (a model file), whose cache holds a user's last ~700 tokens only; these three are
# not in the default parts; nor are verify and verify_window: the cache run's answers at 8 callers
# recorded and recomputed without the cache by hstu_rank on the GPU; nor replay: the cache part's
# load recorded, then replayed by hstu_loadgen --replay into a fresh server and the answers joined;
# nor soak: SOAK_S seconds (360) of Zipf load on 3,000 users at 8 callers, churning both tiers,
# with tools/soak_monitor.py checking the metrics' and the process's invariants every 15 s and
# once idle, and every 100th answer recomputed without the cache by hstu_rank on the GPU.)
# Server against `hstu_bench e2e` with the bench's exact shape (every user starts at 128 events and
# each visit adds exactly 128 = 256 tokens, up to 2048 events; 256 candidates), one loadgen run per
# concurrency so the server's metrics split by level (not in the default parts):
#   e2e_fixed      closed loop c = 1, 2, 4, 8, --max_batch_size=8, no batch wait
#   e2e_adapt      the same with --batch_timeout_us=$ADAPT_US and adaptive fill
#   e2e_sat        --max_batch_size=B with 2B callers (B = 1, 2, 4, 8): the server's GPU throughput
#                  at batch size B, the callers' round trips overlapping the engine's work
#   e2e_var_adapt / e2e_var_eager  the variable-size e2e load (as `e2e`), adaptive, with CUDA
#                  graphs (padded to their row buckets) and without
#   e2e_tls        e2e_fixed over mutual TLS (the test certificates of tests/data/tls): what TLS
#                  costs, beside an e2e_fixed run of the same call; its metrics are scraped over
#                  HTTPS (--metrics_tls)
set -uo pipefail
DUR="${1:-8}"
PARTS="${2:-parity cache cache_always nocache e2e}"
has() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
# A misspelt part would otherwise run nothing and pass.
for part in $PARTS; do
  case "$part" in
    parity | cache | cache_b512 | cache_gpu | cache_always | nocache | verify | verify_window | replay | soak | \
    cache_window | memcheck | e2e | e2e_fixed | e2e_adapt | e2e_sat | e2e_var_adapt | e2e_var_eager | \
    e2e_tls) ;;
    *) echo "run_device_server.sh: unknown part '$part'" >&2; exit 2 ;;
  esac
done
[ -n "${PARTS// /}" ] || { echo "run_device_server.sh: no parts given" >&2; exit 2; }
status=0  # the exit code: 1 when a parity comparison, a loadgen run or a server's exit failed
OUT="${OUT:-/tmp/hstu_out}"
mkdir -p "$OUT"
DIR=/tmp/hstu_srv
mkdir -p "$DIR"  # the parity files and the window model are written here (HSTU_H runs too)
source "$(dirname "$0")/device_env.sh"
if [ -n "${HSTU_H:-}" ]; then
  H="$HSTU_H"  # a folder with bin/ (a local dry run: HSTU_SRV_MODEL=random:tiny HSTU_SRV_DEVICE=cpu)
else
  unpack_and_setup "${HSTU_SERVER_PACK_FILE:-pack/hstu_server_pack.tar.gz}" "$DIR" || exit 1
fi
# A server a part started and did not stop (the script ended early) would hold the ports.
trap 'kill $(jobs -p) 2> /dev/null' EXIT
MODEL="${HSTU_SRV_MODEL:-random:base}"
DEVICE="${HSTU_SRV_DEVICE:-cuda:0}"
{ echo "commit: $(cat "$H/COMMIT")"; date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } | tee "$OUT/server_device.txt"

# hstu_rank --device cuda:0 vs --device cpu on the same requests (issue 3: within 2e-3), for a
# mid-size model file with position encoding and a window, and for the base preset.
if has parity; then
cd "$DIR"
"$H/bin/hstu_model" init --preset base --seed 5 --layers 4 --hidden 512 --heads 2 --head-dim 128 \
  --max-history 1024 --max-candidates 128 --items 100000 --position-encoding true --window 600 \
  --out mid.safetensors > /dev/null
python3 "$H/make_requests.py" --model mid.safetensors --users 12 --visits 5 --seed 3 --out mid.jsonl
# Each model also runs on cpu-bf16, the CPU reference rounded where the GPU stores bf16: DESIGN §2.4
# calls the GPU correct when it is as close to the fp32 CPU as that is (compare_rank_outputs --bf16).
rank3() {  # model, requests, output prefix
  for dev in cpu cpu-bf16 cuda:0; do
    "$H/bin/hstu_rank" --model "$1" --input "$2" --device "$dev" > "$3_${dev%%:*}.jsonl"
  done
}
rank3 mid.safetensors mid.jsonl mid
echo "parity mid model (4 layers, d 512, 2 x 128, window 600, position encoding):" | tee "$OUT/parity.txt"
python3 "$H/compare_rank_outputs.py" mid_cpu.jsonl mid_cuda.jsonl --bf16 mid_cpu-bf16.jsonl 2>&1 | tee -a "$OUT/parity.txt" || status=1
python3 - <<'PY' > base.jsonl
import json, random
r = random.Random(9)
for v in range(2):
    for u in range(3):
        n = 150 + 100 * v + 20 * u  # each visit extends the user's previous history
        ri, ra = random.Random(u), random.Random(1000 + u)
        print(json.dumps({"user_id": u, "history_item_ids": [ri.randrange(10**6) for _ in range(n)],
                          "history_actions": [ra.randrange(128) for _ in range(n)],
                          "candidate_item_ids": [r.randrange(10**6) for _ in range(256)]}))
PY
rank3 random:base base.jsonl base
echo "parity base preset (6 requests, 3 returning users, up to 290 events, 256 candidates):" | tee -a "$OUT/parity.txt"
python3 "$H/compare_rank_outputs.py" base_cpu.jsonl base_cuda.jsonl --bf16 base_cpu-bf16.jsonl 2>&1 | tee -a "$OUT/parity.txt" || status=1
# The same shapes from a bf16 checkpoint (what a model served in bf16 is): both devices then hold
# the same weights, and what is left is the GPU's bf16 activations. (The fp32 random preset above
# adds the rounding of every weight to bf16 on the GPU.) The preset's 1M item rows: a 2 GB file.
"$H/bin/hstu_model" init --preset base --seed 1 --dtype bf16 --items 1000000 --out base_bf16.safetensors > /dev/null
rank3 base_bf16.safetensors base.jsonl base16
echo "parity base shapes from a bf16 checkpoint (same requests):" | tee -a "$OUT/parity.txt"
python3 "$H/compare_rank_outputs.py" base16_cpu.jsonl base16_cuda.jsonl --bf16 base16_cpu-bf16.jsonl 2>&1 | tee -a "$OUT/parity.txt" || status=1
cd - > /dev/null
fi

# GPU pool: 2048 pages of 32 tokens = 16 users of 4096 tokens (2 GiB bf16); host tier: 64 users.
# The population (400 users, histories up to 2048 events = 4096 tokens) is far larger than the pool.
run() {  # name, "loadgen flags", extra server flags...
  local name="$1" lg="$2"; shift 2
  "$H/bin/hstu_server" --model="${RUN_MODEL:-$MODEL}" --device="$DEVICE" \
    --listen=127.0.0.1:50051 --metrics_listen=127.0.0.1:9464 --max_batch_size=8 "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  # RUN_LG_DEFAULTS: the loadgen flags every run gets (a replay takes no --candidates).
  # shellcheck disable=SC2086
  "$H/bin/hstu_loadgen" --target=127.0.0.1:50051 --wait_ready_s=240 $lg \
    ${RUN_LG_DEFAULTS:---candidates=256 --timeout_ms=5000 --duration=$DUR --warmup=2} \
    --progress=false --json="$OUT/loadgen_$name.json" 2>&1 | tee "$OUT/loadgen_$name.txt"
  local lg_status=${PIPESTATUS[0]}
  [ "$lg_status" = 0 ] || { echo "loadgen ($name) exit code: $lg_status"; status=1; }
  curl -sf http://127.0.0.1:9464/metrics > "$OUT/metrics_$name.txt" 2>/dev/null || true
  kill -TERM "$pid"; wait "$pid"; local srv_status=$?
  echo "server ($name) exit code: $srv_status"
  [ "$srv_status" = 0 ] || status=1
  grep -E '^hstu_kv_lookups_total|^hstu_kv_tokens_total|^hstu_kv_window|^hstu_kv_evictions_total|^hstu_kv_prefetch|^hstu_kv_onload_bandwidth|^hstu_kv_recompute_seconds|^hstu_batch_compute_seconds_(sum|count)|^hstu_batch_size_(sum|count)' \
    "$OUT/metrics_$name.txt" || true
}
ZIPF="--users=400 --zipf=1.0 --initial_events=1800 --new_events=64 --concurrency=1:16:x2"
# CACHE_SERVER_FLAGS: more server flags for the cache part (A/B runs, e.g. --warmup=false).
# shellcheck disable=SC2086
has cache && run cache "$ZIPF" --cache_pages=2048 --host_cache_pages=8192 ${CACHE_SERVER_FLAGS:-}
has cache_b512 && run cache_b512 "$ZIPF" --cache_pages=2048 --host_cache_pages=8192 --offload_backlog_mib=512
has cache_gpu && run cache_gpu "$ZIPF" --cache_pages=2048 --host_cache_pages=0
has cache_always && run cache_always "$ZIPF" --cache_pages=2048 --host_cache_pages=8192 --onload_policy=always
has nocache && run nocache "$ZIPF" --no_cache --cache_pages=2048
# The cache's answers checked: the cache run's load at 8 callers, every 4th OK answer recorded with
# its scores (hstu_loadgen --record), then each recomputed from its whole history without the cache
# by hstu_rank on the GPU, which reports the largest score difference by cache result (GPU hit,
# host hit, partial, hash mismatch, miss) and fails above VERIFY_TOL; then a sample of the answers
# against the fp32 CPU engine. VERIFY_SERVER_FLAGS: more server flags (--max_batch_size=1).
# verify_window: the same with the cache_window part's model (a 512-token window, whose cache
# releases the pages that slid out of it) and --onload_policy=always (every host hit onloaded).
verify() {  # name, model, server flags...
  local name="$1" model="$2"; shift 2
  rm -f "$DIR/answers_$name.jsonl"
  RUN_MODEL="$model" run "$name" "--users=400 --zipf=1.0 --initial_events=1800 --new_events=64 --concurrency=8 --record=$DIR/answers_$name.jsonl --record_every=4" \
    --cache_pages=2048 --host_cache_pages=8192 "$@" ${VERIFY_SERVER_FLAGS:-}
  # hstu_rank passes an empty input: no recorded answer is a failure here, not a pass.
  [ -s "$DIR/answers_$name.jsonl" ] || { echo "$name: the loadgen recorded no answers"; status=1; }
  # The tolerance: a server batch of 8 and a recompute alone round differently in bf16, ~1e-2 at
  # most over 6,000 answers of the base model, whatever the cache did (docs/benchmarks.md).
  "$H/bin/hstu_rank" --model="$model" --device=cuda:0 --no_cache --input="$DIR/answers_$name.jsonl" \
    --max_score_diff="${VERIFY_TOL:-2e-2}" 2> "$OUT/${name}.txt" > "$DIR/${name}_scores.jsonl"
  local v_status=$?
  tail -n 12 "$OUT/${name}.txt"
  echo "hstu_rank ($name) exit code: $v_status"
  [ "$v_status" = 0 ] || status=1
  # The server's answers against the fp32 CPU engine on a sample of the lines, VERIFY_CPU_PER_RESULT
  # (default 1; 0 skips it) of each cache result from the second half of the run: DESIGN §2.4's
  # criterion, as close to the CPU as its bf16 emulation is (compare_rank_outputs.py --bf16). The
  # CPU engine takes ~100 s a line at ~4,000 tokens on one core, so each line and device runs as
  # its own process (~5 GB each).
  [ "${VERIFY_CPU_PER_RESULT:-1}" -gt 0 ] || return 0
  local cpu_out="$OUT/${name}_cpu.txt"
  cd "$DIR"
  python3 - "answers_$name.jsonl" "${VERIFY_CPU_PER_RESULT:-1}" > sample.jsonl <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
taken = {}
for line in lines[len(lines) // 2:]:
    result = json.loads(line).get("cache_result", "")
    if taken.get(result, 0) < int(sys.argv[2]):
        taken[result] = taken.get(result, 0) + 1
        print(line)
PY
  local n
  n=$(wc -l < sample.jsonl)
  rm -rf sample_parts && mkdir sample_parts
  split -l 1 -d -a 3 sample.jsonl sample_parts/line_
  : > "$cpu_out"
  ls sample_parts | grep -v '\.' | sed 's/$/ cpu/;p;s/ cpu$/ cpu-bf16/' | \
    OPENBLAS_NUM_THREADS=1 xargs -r -P 16 -L 1 sh -c 'timeout 400 "$0" --model="$1" --device="$3" --no_cache --input="sample_parts/$2" --max_score_diff=1 > "sample_parts/$2.$3.jsonl" 2> "sample_parts/$2.$3.err"' "$H/bin/hstu_rank" "$model"
  local scored=1
  for dev in cpu cpu-bf16; do
    cat sample_parts/line_*."$dev".jsonl > "sample_$dev.jsonl" 2>/dev/null
    echo "hstu_rank --device=$dev against the server's answers:" >> "$cpu_out"
    cat sample_parts/line_*."$dev".err >> "$cpu_out" 2>/dev/null
    # One scored line per sampled line, or the pairing below would compare the wrong lines.
    if [ "$(grep -c '"scores"' "sample_$dev.jsonl")" != "$n" ]; then
      echo "$name: hstu_rank --device=$dev scored $(grep -c '"scores"' "sample_$dev.jsonl") of $n sampled lines (a timeout?)" | tee -a "$cpu_out"
      scored=0
    fi
  done
  if [ "$n" = 0 ] || [ "$scored" = 0 ]; then
    status=1
    cd - > /dev/null
    return 0
  fi
  # The server's answers as hstu_rank output lines, with the CPU's token counts (the comparison
  # checks those; a no-cache recompute computes every token).
  python3 - sample.jsonl sample_cpu.jsonl > sample_server.jsonl <<'PY'
import json, sys
for rec, cpu in zip(open(sys.argv[1]), open(sys.argv[2])):
    r, c = json.loads(rec), json.loads(cpu)
    print(json.dumps({"user_id": r["user_id"], "scores": r["expected_scores"],
                      "reused_tokens": c.get("reused_tokens"), "computed_tokens": c.get("computed_tokens")}))
PY
  echo "the server's answers (A: cpu, B: the server, --bf16: cpu-bf16), $n lines:" | tee -a "$cpu_out"
  python3 "$H/compare_rank_outputs.py" sample_cpu.jsonl sample_server.jsonl --bf16 sample_cpu-bf16.jsonl 2>&1 | tee -a "$cpu_out" || status=1
  cd - > /dev/null
}
has verify && verify verify random:base
# hstu_loadgen --replay at the GPU's scale: REPLAY_N visits of the cache part's load at 8 callers
# recorded (every answer), then sent again from that file into a fresh server, one pass at 8
# callers (each user's visits in the file's order). The two runs' answers are joined by user and
# history: the scores must agree within VERIFY_TOL (a batch's bf16 rounding differs with its
# company); the cache results are reported, not required equal (evictions and the onload rule
# follow the global order and measured times). Both servers log requests over 50 ms.
if has replay; then
  rm -f "$DIR/replay_in.jsonl" "$DIR/replay_out.jsonl"
  RUN_LG_DEFAULTS="--candidates=256 --timeout_ms=5000 --warmup=0" run replay_record \
    "--users=400 --zipf=1.0 --initial_events=1800 --new_events=64 --concurrency=8 --requests=${REPLAY_N:-3000} --record=$DIR/replay_in.jsonl" \
    --cache_pages=2048 --host_cache_pages=8192 --slow_request_ms=50 --slow_request_log_per_s=0
  n=$(wc -l < "$DIR/replay_in.jsonl" 2>/dev/null || echo 0)
  if [ "$n" -gt 0 ]; then
    RUN_LG_DEFAULTS="--timeout_ms=5000 --warmup=0" run replay \
      "--replay=$DIR/replay_in.jsonl --concurrency=8 --requests=$n --record=$DIR/replay_out.jsonl" \
      --cache_pages=2048 --host_cache_pages=8192 --slow_request_ms=50 --slow_request_log_per_s=0
    for part in replay_record replay; do
      echo "$part: $(grep -c 'slow request: total_ms' "$OUT/server_$part.log") requests over 50 ms logged"
    done | tee "$OUT/replay.txt"
    python3 - "$DIR/replay_in.jsonl" "$DIR/replay_out.jsonl" "${VERIFY_TOL:-2e-2}" <<'PY' 2>&1 | tee -a "$OUT/replay.txt" || status=1
import collections, json, sys
def load(path):
    out = {}
    for line in open(path):
        j = json.loads(line)
        out[(j["user_id"], tuple(j["history_item_ids"]), tuple(j["candidate_item_ids"]))] = j
    return out
rec, rep = load(sys.argv[1]), load(sys.argv[2])
tol = float(sys.argv[3])
both = rec.keys() & rep.keys()
shapes = sum(len(rec[k]["expected_scores"]) != len(rep[k]["expected_scores"]) or
             any(len(a) != len(b) for a, b in zip(rec[k]["expected_scores"], rep[k]["expected_scores"]))
             for k in both)
diff = max((abs(a - b) for k in both
            for ra, rb in zip(rec[k]["expected_scores"], rep[k]["expected_scores"])
            for a, b in zip(ra, rb)), default=float("inf"))
same = sum(rec[k].get("cache_result") == rep[k].get("cache_result") for k in both)
pairs = collections.Counter((rec[k].get("cache_result"), rep[k].get("cache_result")) for k in both)
print(f"replay: {len(rep)} answers of {len(rec)} recorded visits joined ({len(both)} by user, "
      f"history and candidates); largest score difference {diff:.3g} (tolerance {tol:g}); "
      f"same cache result {same} of {len(both)}")
for (a, b), c in sorted(pairs.items(), key=lambda x: -x[1]):
    print(f"  recorded {a} -> replayed {b}: {c}")
if shapes:
    print(f"replay: {shapes} answers with another number of scores than recorded")
sys.exit(0 if len(both) == len(rec) and not shapes and diff <= tol else 1)
PY
  else
    echo "replay: the recording run recorded nothing"; status=1
  fi
fi
# A soak: SOAK_S seconds of the cache part's Zipf load over 3,000 users (GPU pool ~16 of them,
# host tier ~64: evictions, drops, offloads and onloads all the way), 8 callers, and slow calls
# logged. tools/soak_monitor.py samples /metrics and the server's process every 15 s from
# SERVING on, and once more when the load has stopped: pages, counters, threads, fds, resident
# and GPU memory, and, idle, the queue, pins and request counts (its docstring lists them).
# Every 100th OK answer is recorded and recomputed without the cache by hstu_rank on the GPU.
# SOAK_CHAOS=1 adds failing loads beside it (below).
if has soak; then
  rm -f "$DIR/soak_stop" "$DIR/soak_chaos_stop" "$DIR/answers_soak.jsonl"
  "$H/bin/hstu_server" --model="$MODEL" --device="$DEVICE" --listen=127.0.0.1:50051 \
    --metrics_listen=127.0.0.1:9464 --max_batch_size=8 --cache_pages=2048 --host_cache_pages=8192 \
    --slow_request_ms=100 --slow_request_log_per_s=5 > "$OUT/server_soak.log" 2>&1 &
  pid=$!
  for _ in $(seq 480); do
    curl -sf http://127.0.0.1:9464/healthz > /dev/null 2>&1 && break
    kill -0 "$pid" 2> /dev/null || break
    sleep 0.5
  done
  python3 "$H/soak_monitor.py" --metrics-url http://127.0.0.1:9464/metrics --pid "$pid" \
    --interval 15 --stop-file "$DIR/soak_stop" --out "$OUT/soak_samples.jsonl" \
    --summary "$OUT/soak_summary.json" > "$OUT/soak.txt" 2>&1 &
  mon=$!
  chaos=()
  if [ "${SOAK_CHAOS:-0}" = 1 ]; then
    # Beside the load, on the same users: calls with a 4 ms deadline (expiring in the queue and
    # in their batch), requests the server refuses (2,000 candidates, 200 a second), and a loadgen stopped by
    # SIGTERM every 3 s (its calls cancelled mid-flight, host onloads among them). Their exit
    # codes are not judged (they fail by design); the monitor's checks and the main load's are.
    lg_chaos() {  # name, flags...
      local name="$1"; shift
      "$H/bin/hstu_loadgen" --target=127.0.0.1:50051 --wait_ready_s=240 --users=3000 --zipf=1.0 \
        --initial_events=1800 --new_events=64 --warmup=0 --progress=false --max_error_rate=1 "$@" \
        > "$OUT/loadgen_soak_$name.txt" 2>&1
    }
    lg_chaos deadline --candidates=256 --concurrency=4 --timeout_ms=4 --duration="${SOAK_S:-360}" &
    chaos+=($!)
    lg_chaos invalid --candidates=2000 --rate=200 --duration="${SOAK_S:-360}" &
    chaos+=($!)
    ( while [ ! -f "$DIR/soak_chaos_stop" ]; do
        timeout -s TERM 3 "$H/bin/hstu_loadgen" --target=127.0.0.1:50051 --users=3000 --zipf=1.0 \
          --initial_events=1800 --new_events=64 --candidates=256 --concurrency=8 --duration=60 \
          --warmup=0 --progress=false --timeout_ms=5000 >> "$OUT/loadgen_soak_stopped.txt" 2>&1
      done ) &
    chaos+=($!)
  fi
  "$H/bin/hstu_loadgen" --target=127.0.0.1:50051 --wait_ready_s=240 --users=3000 --zipf=1.0 \
    --initial_events=1800 --new_events=64 --candidates=256 --concurrency=8 \
    --duration="${SOAK_S:-360}" --warmup=0 --timeout_ms=5000 --progress=false \
    --record="$DIR/answers_soak.jsonl" --record_every=100 --json="$OUT/loadgen_soak.json" \
    > "$OUT/loadgen_soak.txt" 2>&1
  lg_status=$?
  # The side loads end first, so that the monitor's idle sample sees no call of theirs.
  touch "$DIR/soak_chaos_stop"
  [ "${#chaos[@]}" -gt 0 ] && wait "${chaos[@]}"
  touch "$DIR/soak_stop"
  for f in "$OUT"/loadgen_soak_*.txt; do
    [ -f "$f" ] && { echo "== $f"; grep -E "^\| c=|errors|stopped" "$f" | tail -n 6; }
  done
  wait "$mon"; mon_status=$?
  cat "$OUT/soak.txt"
  tail -n 20 "$OUT/loadgen_soak.txt"
  echo "loadgen (soak) exit code: $lg_status; soak monitor exit code: $mon_status"
  [ "$lg_status" = 0 ] && [ "$mon_status" = 0 ] || status=1
  kill -TERM "$pid"; wait "$pid"; srv_status=$?
  echo "server (soak) exit code: $srv_status; $(grep -c 'slow request: total_ms' "$OUT/server_soak.log") calls over 100 ms logged"
  [ "$srv_status" = 0 ] || status=1
  if [ -s "$DIR/answers_soak.jsonl" ]; then
    "$H/bin/hstu_rank" --model="$MODEL" --device="$DEVICE" --no_cache \
      --input="$DIR/answers_soak.jsonl" --max_score_diff="${VERIFY_TOL:-2e-2}" \
      2> "$OUT/soak_verify.txt" > "$DIR/soak_scores.jsonl"
    v_status=$?
    tail -n 12 "$OUT/soak_verify.txt"
    echo "hstu_rank (soak answers) exit code: $v_status"
    [ "$v_status" = 0 ] || status=1
  else
    echo "soak: the loadgen recorded no answers"; status=1
  fi
fi
# The base shapes with a 512-token window (a model file, written once; hstu_model writes it whole
# or not at all), for cache_window and verify_window.
window_model() {
  [ -f "$DIR/window.safetensors" ] || "$H/bin/hstu_model" init --preset base --seed 5 --window 512 \
    --items 100000 --out "$DIR/window.safetensors" > /dev/null
  echo "$DIR/window.safetensors"
}
has verify_window && verify verify_window "$(window_model)" --onload_policy=always
if has cache_window; then
  RUN_MODEL="$(window_model)" run cache_window "$ZIPF" --cache_pages=2048 \
    --host_cache_pages=8192
fi
# The server under compute-sanitizer memcheck, leak check on: a GPU pool of ~13 users and a host
# tier of ~54 for 60 users, so evictions, write-behind offloads, onloads, prefetches and graph
# replays all run; 300 requests, then SIGTERM (drain, clean exit) and the tool's report at exit.
# Passes when the server exits 0 and the tool reports no error and no leak.
if has memcheck; then
  if find_compute_sanitizer; then
    "$CS" --tool memcheck --leak-check full --error-exitcode 9 --print-limit 40 \
      "$H/bin/hstu_server" --model="$MODEL" --device=cuda:0 --listen=127.0.0.1:50051 \
      --metrics_listen=127.0.0.1:9464 --max_batch_size=8 --cache_pages=512 \
      --host_cache_pages=2048 --graph_buckets=1x512,8x4096 > "$OUT/server_memcheck.log" 2>&1 &
    pid=$!
    "$H/bin/hstu_loadgen" --target=127.0.0.1:50051 --wait_ready_s=400 --users=60 --zipf=1.0 \
      --initial_events=600 --new_events=64 --candidates=256 --concurrency=4 --requests=300 \
      --warmup=0 --timeout_ms=60000 --progress=false 2>&1 | tee "$OUT/loadgen_memcheck.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    curl -sf http://127.0.0.1:9464/metrics > "$OUT/metrics_memcheck.txt" 2>/dev/null || true
    # The signal goes to the server itself (compute-sanitizer's child): the tool would end on it
    # without a report.
    pkill -TERM -P "$pid" -x hstu_server; wait "$pid"; mc_status=$?
    echo "server (memcheck) exit code: $mc_status (9: errors reported)"
    [ "$mc_status" = 0 ] || status=1
    grep -E "ERROR SUMMARY|LEAK SUMMARY" "$OUT/server_memcheck.log"
    grep -E '^hstu_kv_lookups_total|^hstu_kv_evictions_total|^hstu_kv_prefetch|^hstu_cuda_graph_replays_total' \
      "$OUT/metrics_memcheck.txt" || true
  else
    echo "memcheck: compute-sanitizer not found"
  fi
fi
# The e2e shape (`hstu_bench e2e`: users from 256 to 4096 history tokens in 16 steps of 256 new
# tokens + 256 candidates): 512 users of uniform popularity, each starting at up to 64 events and
# growing by ~128 events (256 tokens) a visit until 2048 events (4096 tokens, the model's maximum:
# no truncation), then starting over as a new user; all GPU-resident (65536 pages = 64 GiB).
has e2e && run e2e "--users=512 --zipf=0 --new_user_rate=0 --initial_events=64 --max_events=2048 --new_events=255 --concurrency=1:8:x2" \
  --cache_pages=65536 --host_cache_pages=0

# One server, one loadgen run per concurrency level, the server's metrics scraped after each:
# name, "loadgen flags", "levels", server flags...
run_levels() {
  local name="$1" lg="$2" levels="$3"; shift 3
  "$H/bin/hstu_server" --model="$MODEL" --device="$DEVICE" --listen=127.0.0.1:50051 \
    --metrics_listen=127.0.0.1:9464 "$@" > "$OUT/server_$name.log" 2>&1 &
  local pid=$!
  # A server with --metrics_tls is scraped over HTTPS, verified against the test CA.
  local scheme=http curl_tls=()
  case " $* " in *" --metrics_tls "*) scheme=https; curl_tls=(--cacert "$TLS_DIR/test-ca.crt") ;; esac
  local prev="$OUT/metrics_${name}_start.txt"
  : > "$prev"
  for c in $levels; do
    # shellcheck disable=SC2086
    "$H/bin/hstu_loadgen" --target=127.0.0.1:50051 --wait_ready_s=240 $lg --candidates=256 \
      --timeout_ms=5000 --duration="$DUR" --warmup=2 --progress=false --concurrency="$c" \
      --json="$OUT/loadgen_${name}_c$c.json" > "$OUT/loadgen_${name}_c$c.txt" 2>&1
    local lg_status=$?
    [ "$lg_status" = 0 ] || { echo "loadgen ($name, $c callers) exit code: $lg_status"; status=1; }
    curl -sf "${curl_tls[@]}" "$scheme://127.0.0.1:9464/metrics" > "$OUT/metrics_${name}_c$c.txt" ||
      { echo "metrics scrape ($name, $c callers, $scheme) failed"; status=1; }
    python3 - "$name" "$c" "$prev" "$OUT/metrics_${name}_c$c.txt" "$OUT/loadgen_${name}_c$c.json" <<'PY' | tee -a "$OUT/levels.txt"
import json, re, sys
name, c, prev, cur, lg = sys.argv[1:]
def read(path):
    m = {}
    for line in open(path):
        if line.startswith("#"): continue
        mm = re.match(r'^(\S+?)(\{[^}]*\})? (\S+)$', line.strip())
        if mm: m[mm.group(1) + (mm.group(2) or "")] = float(mm.group(3))
    return m
a, b = read(prev), read(cur)
d = lambda k: b.get(k, 0) - a.get(k, 0)
n = d("hstu_batch_size_count"); reqs = d("hstu_batch_size_sum")
ok = d('hstu_request_duration_seconds_count{code="OK"}')
lvl = json.load(open(lg))["levels"][0]
server_ms = 1e3 * d('hstu_request_duration_seconds_sum{code="OK"}') / max(ok, 1)
cells = [name, c, "%.0f" % lvl["throughput_rps"], "%.2f" % lvl["latency_ms"]["p50"],
         "%.2f" % lvl["latency_ms"]["p99"], "%.2f" % (reqs / max(n, 1)),
         "%.3f" % (1e3 * d("hstu_batch_compute_seconds_sum") / max(n, 1)),
         "%.3f" % (1e3 * d("hstu_request_queue_seconds_sum") / max(reqs, 1)), "%.3f" % server_ms]
print("| " + " | ".join(cells) + " |")
PY
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    prev="$OUT/metrics_${name}_c$c.txt"
  done
  kill -TERM "$pid"; wait "$pid"; local srv_status=$?
  echo "server ($name) exit code: $srv_status"
  [ "$srv_status" = 0 ] || status=1
}
if has e2e_fixed || has e2e_adapt || has e2e_sat || has e2e_var_adapt || has e2e_var_eager || has e2e_tls; then
  echo "| run | callers | rps | p50 ms | p99 ms | requests/batch | ms/batch (engine) | queue ms | in server ms |" | tee -a "$OUT/levels.txt"
  echo "|---|---|---|---|---|---|---|---|---|" | tee -a "$OUT/levels.txt"
fi
ADAPT_US="${ADAPT_US:-300}"
FIXED="--users=512 --zipf=0 --new_user_rate=0 --initial_events_min=128 --initial_events=128 --new_events_min=128 --new_events=128 --max_events=2048"
VAR="--users=512 --zipf=0 --new_user_rate=0 --initial_events=64 --max_events=2048 --new_events=255"
E2E_SRV="--cache_pages=65536 --host_cache_pages=0"
has e2e_fixed && run_levels e2e_fixed "$FIXED" "1 2 4 8" $E2E_SRV --max_batch_size=8
TLS_DIR="$(cd "$(dirname "$0")/.." && pwd)/tests/data/tls"
TLS_SRV="--tls_cert_file=$TLS_DIR/hstu-test-server-1.crt --tls_key_file=$TLS_DIR/hstu-test-server-1.key --tls_client_ca_file=$TLS_DIR/test-ca.crt --metrics_tls"
TLS_LG="--tls_ca_file=$TLS_DIR/test-ca.crt --tls_cert_file=$TLS_DIR/hstu-test-client.crt --tls_key_file=$TLS_DIR/hstu-test-client.key"
has e2e_tls && run_levels e2e_tls "$FIXED $TLS_LG" "1 2 4 8" $E2E_SRV --max_batch_size=8 $TLS_SRV
has e2e_adapt && run_levels e2e_adapt "$FIXED" "1 2 4 8" $E2E_SRV --max_batch_size=8 --batch_timeout_us="$ADAPT_US"
if has e2e_sat; then
  for B in 1 2 4 8; do
    run_levels "e2e_sat_b$B" "$FIXED" "$((2 * B))" $E2E_SRV --max_batch_size="$B"
  done
fi
has e2e_var_adapt && run_levels e2e_var_adapt "$VAR" "1 8" $E2E_SRV --max_batch_size=8 --batch_timeout_us="$ADAPT_US"
has e2e_var_eager && run_levels e2e_var_eager "$VAR" "1 8" $E2E_SRV --max_batch_size=8 --batch_timeout_us="$ADAPT_US" --cuda_graphs=false
exit "$status"
