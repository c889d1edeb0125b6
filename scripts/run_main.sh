#!/usr/bin/env bash
# The README's main command: installs dependencies, builds, scores sample requests offline
# (returning users show reused_tokens > 0), then starts hstu_server on the embedded default model,
# drives it with hstu_loadgen for a few seconds and prints the report (scripts/demo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
echo
echo "== hstu_rank: sample requests on the CPU reference engine (model random:tiny) =="
./build/client/hstu_rank --model random:tiny --input examples/sample_requests.jsonl
if [ -x build/server/hstu_server ] && [ -f scripts/demo.sh ]; then
  echo
  echo "== hstu_server + hstu_loadgen =="
  bash scripts/demo.sh
fi
