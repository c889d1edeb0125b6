#!/usr/bin/env bash
# Builds the host code (no CUDA) with sanitizers and runs the CPU tests under them.
#   scripts/sanitize.sh [address,undefined | thread] [ctest args...]
# Build dirs: build-asan/ (address,undefined) or build-tsan/ (thread). Any report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
SAN="${1:-address,undefined}"
shift || true
case "$SAN" in
  thread) DIR=build-tsan ;;
  address,undefined | address | undefined) DIR=build-asan ;;
  *) echo "sanitize.sh: unknown sanitizer set '$SAN' (address,undefined | thread)" >&2; exit 2 ;;
esac
JOBS="${HSTU_JOBS:-$(nproc)}"
# Configured on every run: build-asan serves address, undefined and both, and a directory left by
# one of them must not run the others' tests without their checks.
cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHSTU_ENABLE_CUDA=OFF \
  -DHSTU_SANITIZE="$SAN" > /dev/null
cmake --build "$DIR" -j "$JOBS"
# allocator_may_return_null: an allocation too large for the machine fails as it would without a
# sanitizer (new(std::nothrow) returns null, and the code under test reports RESOURCE_EXHAUSTED)
# instead of the sanitizer aborting the test.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:allocator_may_return_null=1:suppressions=$PWD/tests/tsan_suppressions.txt}"
ctest --test-dir "$DIR" --output-on-failure --no-tests=error -j "$JOBS" "$@"
