#include "client/stop_signal.h"

#include <signal.h>
#include <time.h>

#include <atomic>

namespace hstu::loadgen {
namespace {

// Set by the first stop signal.
std::atomic<bool> g_interrupted{false};

// CLOCK_MONOTONIC's nanoseconds at the first stop signal; 0 before it.
std::atomic<int64_t> g_first_signal_ns{0};

extern "C" void OnStopSignal(int sig) {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const int64_t now = int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
  int64_t first = 0;
  if (g_first_signal_ns.compare_exchange_strong(first, now)) {
    g_interrupted.store(true);
    return;
  }
  if (now - first < kSameStopNanoseconds) return;
  // A second stop: the process ends at once, by the signal.
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void InstallStopSignals() {
  struct sigaction sa = {};
  sa.sa_handler = OnStopSignal;
  sa.sa_flags = SA_RESTART;  // stdio writes to a pipe are not cut short by the signal
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool Interrupted() { return g_interrupted.load(); }

}  // namespace hstu::loadgen
