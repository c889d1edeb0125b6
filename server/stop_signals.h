// SIGTERM and SIGINT for main(): a handler that writes the signal's number into a pipe, and a
// wait on that pipe. Blocking the signals in every thread and waiting with sigtimedwait() is not
// enough: a library may start threads before main() runs (OpenBLAS starts its pool in a
// constructor), and a signal the kernel hands to such a thread took the default action and
// killed the process. The handler runs on whichever thread the kernel picks and only calls
// write(), which is async-signal-safe.
#pragma once

#include <initializer_list>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hstu::server {

class StopSignals {
 public:
  // Installs the handler for `signals` (once per process; later calls add signals).
  static absl::StatusOr<StopSignals*> Install(std::initializer_list<int> signals);
  // The next signal received, waiting up to `timeout`; -1 if none came.
  int Wait(absl::Duration timeout);

 private:
  StopSignals() = default;
};

}  // namespace hstu::server
