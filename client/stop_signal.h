// hstu_loadgen's stop signals: SIGINT/SIGTERM stop the level running, and the report of what was
// measured is printed and written; a second signal ends the process at once, unless it came
// within 100 ms of the first: the same stop sent to the process and then to its group, as
// timeout(1) and `kill -TERM -PGID` do (before, that ended a third of such runs without a
// report).
//
// Thread-safety: the handler uses only lock-free atomics and clock_gettime (async-signal-safe);
// Interrupted() may be read from any thread.
#pragma once

#include <cstdint>

namespace hstu::loadgen {

// A second stop signal less than this after the first is the same stop.
inline constexpr int64_t kSameStopNanoseconds = 100'000'000;

void InstallStopSignals();
// Whether a stop signal came.
bool Interrupted();

}  // namespace hstu::loadgen
