#!/usr/bin/env bash
# Builds the fuzz targets (tests/fuzz) as libFuzzer binaries with clang, ASan and UBSan (build-fuzz/,
# CUDA and the server off) and runs one of them:
#   scripts/fuzz.sh engine|model_file [seconds, default 60] [more libFuzzer flags...]
# Inputs that reach new code go to build-fuzz/corpus/TARGET (seeded from tests/fuzz/corpus/TARGET);
# a failing input is saved as build-fuzz/crash-*: minimise it (-minimize_crash=1), fix the bug, and
# add the input to tests/fuzz/corpus/TARGET, which CTest replays on every build (fuzz_*_corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${1:?usage: scripts/fuzz.sh engine|model_file [seconds] [libFuzzer flags...]}"
SECONDS_TO_RUN="${2:-60}"
shift $(( $# >= 2 ? 2 : 1 ))
case "$TARGET" in
  engine | model_file) ;;
  *) echo "fuzz.sh: unknown target '$TARGET' (engine | model_file)" >&2; exit 2 ;;
esac
command -v clang++ > /dev/null || { echo "fuzz.sh: needs clang++ (apt-get install clang)" >&2; exit 2; }
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DHSTU_ENABLE_CUDA=OFF -DHSTU_BUILD_SERVER=OFF -DHSTU_FUZZ=ON -DHSTU_SANITIZE=address,undefined
fi
cmake --build build-fuzz -j "${HSTU_JOBS:-$(nproc)}" --target "${TARGET}_fuzz"
mkdir -p "build-fuzz/corpus/$TARGET"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
cd build-fuzz
"./tests/fuzz/${TARGET}_fuzz" -max_total_time="$SECONDS_TO_RUN" -timeout=20 -rss_limit_mb=4096 \
  -print_final_stats=1 "$@" "corpus/$TARGET" "../tests/fuzz/corpus/$TARGET"
