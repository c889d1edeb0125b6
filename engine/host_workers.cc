#include "engine/host_workers.h"

#include <algorithm>

namespace hstu {

HostWorkers::HostWorkers(int threads, std::chrono::microseconds spin) : spin_(spin) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { HelperLoop(); });
}

HostWorkers::~HostWorkers() {
  stop_.store(true, std::memory_order_release);
  for (std::thread& t : threads_) t.join();
}

void HostWorkers::ParallelFor(int n, absl::FunctionRef<void(int)> fn) {
  if (n <= 0) return;
  if (threads_.empty() || n == 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    done_.store(0, std::memory_order_relaxed);
  }
  generation_.fetch_add(1, std::memory_order_release);
  RunClaimed();
  // The items helpers claimed are running; fn stays valid until they are done.
  while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();
  std::lock_guard<std::mutex> lock(mu_);
  fn_ = nullptr;
}

void HostWorkers::RunClaimed() {
  for (;;) {
    int i = 0;
    const absl::FunctionRef<void(int)>* fn = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fn_ == nullptr || next_ >= n_) return;
      i = next_++;
      fn = fn_;
    }
    (*fn)(i);
    done_.fetch_add(1, std::memory_order_release);
  }
}

void HostWorkers::HelperLoop() {
  using Clock = std::chrono::steady_clock;
  uint64_t seen = generation_.load(std::memory_order_acquire);
  while (!stop_.load(std::memory_order_acquire)) {
    const Clock::time_point spin_until = Clock::now() + spin_;
    std::chrono::microseconds nap(50);
    uint64_t now_at = seen;
    while ((now_at = generation_.load(std::memory_order_acquire)) == seen &&
           !stop_.load(std::memory_order_acquire)) {
      if (Clock::now() < spin_until) continue;
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
    seen = now_at;
    RunClaimed();
  }
}

}  // namespace hstu
