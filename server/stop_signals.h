// The stop signals (SIGTERM, SIGINT, SIGHUP) for main(): a handler that writes the signal's
// number into a pipe, and a wait on that pipe. Blocking the signals in every thread and waiting
// with sigtimedwait() is not enough: a library may start threads before main() runs (OpenBLAS
// starts its pool in a constructor), and a signal the kernel hands to such a thread took the
// default action and killed the process. The handler runs on whichever thread the kernel picks
// and only calls write(), which is async-signal-safe.
#pragma once

#include <functional>
#include <initializer_list>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hstu::server {

// "SIGTERM", "SIGINT", "SIGHUP", or "signal N".
const char* StopSignalName(int sig);

class StopSignals {
 public:
  // Installs the handler for `signals` (once per process; later calls add signals).
  static absl::StatusOr<StopSignals*> Install(std::initializer_list<int> signals);
  // The next signal received, waiting up to `timeout`; -1 if none came.
  int Wait(absl::Duration timeout);

 private:
  StopSignals() = default;
};

// Watches for a stop signal while the server starts (model load, graph capture, warm-up: seconds
// to minutes). A signal then goes to `on_signal` at once, with nothing served yet and nothing to
// drain; main() ends the process there. (Before, the signals waited in the pipe until the server
// was up: a pod stopped during a long load loaded on, reported SERVING, then drained, and two
// signals seconds apart were read as one sent twice.)
class StartupWatch {
 public:
  using WaitFn = std::function<int(absl::Duration)>;  // as StopSignals::Wait
  StartupWatch(WaitFn wait, std::function<void(int)> on_signal);
  ~StartupWatch() { Finish(); }
  StartupWatch(const StartupWatch&) = delete;
  StartupWatch& operator=(const StartupWatch&) = delete;
  // The start-up is over (whether it succeeded or not): stops watching. Returns a signal that
  // arrived as it ended and was not given to `on_signal` (it is the serving loop's), or -1.
  // Not from `on_signal`, which runs under the lock this takes.
  int Finish();

 private:
  std::mutex mu_;
  bool finished_ = false;  // under mu_
  int unhandled_ = -1;     // under mu_
  std::thread thread_;     // last: started once the members above exist
};

}  // namespace hstu::server
