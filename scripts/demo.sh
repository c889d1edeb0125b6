#!/usr/bin/env bash
# The server + loadgen part of the README's main command (scripts/run_main.sh): builds what is out
# of date, starts hstu_server on an embedded random model
# (tiny on the CPU, base on cuda:0 when a GPU is present), waits for health, runs hstu_loadgen for
# a few seconds, prints its report, stops the server with SIGTERM and checks that it exits 0.
#
#   scripts/demo.sh                      # defaults
#   BUILD_DIR=build DURATION=5 CONCURRENCY=1:8:x2 scripts/demo.sh
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
DURATION="${DURATION:-5}"
CONCURRENCY="${CONCURRENCY:-1:8:x2}"
PORT="${PORT:-50051}"
METRICS_PORT="${METRICS_PORT:-9464}"
JOBS="${JOBS:-2}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  HAVE_GPU=1
else
  HAVE_GPU=0
fi

# Built (or brought up to date: binaries older than their sources are rebuilt) on every run. A
# fresh build dir is configured as scripts/build.sh configures it (CUDA on when nvcc is found), so
# that the README's test command later finds the same configuration.
if [ ! -f "$BUILD_DIR/build.ninja" ] && [ ! -f "$BUILD_DIR/Makefile" ]; then
  echo "[demo] configuring $BUILD_DIR"
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
fi
echo "[demo] building hstu_server and hstu_loadgen (if not up to date)"
if ! build_log="$(cmake --build "$BUILD_DIR" -j"$JOBS" --target hstu_server hstu_loadgen 2>&1)"; then
  echo "$build_log" >&2
  echo "[demo] the build failed (above)" >&2
  exit 1
fi

# The GPU model only where the build has the CUDA backend.
if [ "$HAVE_GPU" = 1 ] && grep -q "HSTU_ENABLE_CUDA:BOOL=ON" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
  MODEL=random:base
  DEVICE=cuda:0
else
  MODEL=random:tiny
  DEVICE=cpu
fi

LOG="$(mktemp -t hstu_server.XXXXXX.log)"
echo "[demo] starting hstu_server --model=$MODEL --device=$DEVICE (log: $LOG)"
"$BUILD_DIR/server/hstu_server" --model="$MODEL" --device="$DEVICE" \
  --listen="127.0.0.1:$PORT" --metrics_listen="127.0.0.1:$METRICS_PORT" >"$LOG" 2>&1 &
SERVER_PID=$!
cleanup() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then kill -KILL "$SERVER_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT

# Our server, not another one on the same port: wait for its own "ready" line, or its exit (a port
# already in use ends it at once).
for _ in $(seq 1 1200); do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "[demo] hstu_server exited during start-up (port $PORT or $METRICS_PORT in use? set PORT / METRICS_PORT); log:" >&2
    cat "$LOG" >&2
    exit 1
  fi
  grep -q "ready: health SERVING" "$LOG" && break
  sleep 0.1
done

status=0
"$BUILD_DIR/client/hstu_loadgen" --target="127.0.0.1:$PORT" --wait_ready_s=120 \
  --concurrency="$CONCURRENCY" --duration="$DURATION" --warmup=1 || status=$?
if [ "$status" != 0 ]; then
  echo "[demo] hstu_loadgen failed ($status); server log:" >&2
  cat "$LOG" >&2
fi

echo "[demo] metrics sample (http://127.0.0.1:$METRICS_PORT/metrics):"
if command -v curl >/dev/null 2>&1; then
  curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" | grep -E '^hstu_(requests_total|kv_tokens_total|engine_compute_seconds_total)' || true
fi

echo "[demo] stopping hstu_server (SIGTERM)"
kill -TERM "$SERVER_PID" 2>/dev/null || true
server_rc=0
wait "$SERVER_PID" || server_rc=$?
if [ "$server_rc" != 0 ]; then
  echo "[demo] hstu_server exited with $server_rc; log:" >&2
  cat "$LOG" >&2
  exit 1
fi
echo "[demo] hstu_server drained and exited 0"
rm -f "$LOG"
exit "$status"
