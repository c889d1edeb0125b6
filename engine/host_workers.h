// Helper threads that share a forward's per-request host work (request checks, history keys,
// page hashes) with the calling thread (engine/engine.cc).
//
// The caller takes part: ParallelFor claims items from one counter, so a helper that is not
// awake yet costs nothing but the items it does not take. After a job a helper polls for the
// next one for `spin` (a busy server's next batch comes within a GPU step), then naps with a
// growing interval (50 µs to 1 ms): a sleeping helper is never signalled, since waking one
// through the kernel takes 20–200 µs on a cloud VM, longer than the work it would share.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace hstu {

class HostWorkers {
 public:
  // `threads` helpers beside the caller (0: ParallelFor runs everything on the caller).
  HostWorkers(int threads, std::chrono::microseconds spin);
  ~HostWorkers();
  HostWorkers(const HostWorkers&) = delete;
  HostWorkers& operator=(const HostWorkers&) = delete;

  int threads() const { return static_cast<int>(threads_.size()); }

  // Runs fn(0), ..., fn(n - 1), each once, on the caller and the helpers that are polling, and
  // returns when all have run. One caller at a time; fn must not call ParallelFor.
  void ParallelFor(int n, absl::FunctionRef<void(int)> fn);

 private:
  void HelperLoop();
  // Claims and runs items of the current job until none is left.
  void RunClaimed();

  const std::chrono::microseconds spin_;
  std::mutex mu_;
  const absl::FunctionRef<void(int)>* fn_ = nullptr;  // the current job; null between jobs
  int n_ = 0, next_ = 0;                                // guarded by mu_
  std::atomic<int> done_{0};
  std::atomic<uint64_t> generation_{0};                 // bumped when a job is posted
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace hstu
