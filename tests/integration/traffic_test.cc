// hstu_loadgen's traffic model (client/traffic.h): history growth, restarts, option checks.
#include "client/traffic.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <unordered_map>
#include <vector>

namespace hstu::loadgen {
namespace {

// The bench-shaped load of docs/benchmarks.md (`e2e_sat`): users start at exactly 128 events,
// every visit adds exactly 128, and a user that would pass 2048 starts over.
TEST(TrafficTest, FixedGrowthAddsExactlyThatManyEventsAndRestartsAtTheMaximum) {
  TrafficOptions o;
  o.num_users = 4;
  o.zipf_s = 0;
  o.new_user_rate = 0;
  o.initial_events_min = o.initial_events_max = 128;
  o.new_events_min = o.new_events_max = 128;
  o.max_events = 2048;
  o.num_candidates = 3;
  auto t = TrafficModel::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  std::unordered_map<uint64_t, size_t> last;  // user → events at its previous visit
  int restarts = 0;
  for (int i = 0; i < 400; ++i) {
    const Visit v = (*t)->Next();
    (*t)->Done(v);
    const size_t n = v.history_item_ids.size();
    ASSERT_EQ(v.history_actions.size(), n);
    ASSERT_EQ(v.candidate_item_ids.size(), 3u);
    ASSERT_EQ(n % 128, 0u) << n;
    ASSERT_LE(n, 2048u);
    if (v.new_user) {
      EXPECT_EQ(n, 128u);
      EXPECT_FALSE(last.contains(v.user_id));
      restarts += last.size() >= 4 ? 1 : 0;
    } else {
      ASSERT_TRUE(last.contains(v.user_id));
      EXPECT_EQ(n, last[v.user_id] + 128);
    }
    last[v.user_id] = n;
  }
  // 400 visits over 4 users of 16 visits each: the users have started over many times.
  EXPECT_GT(restarts, 10);
}

TEST(TrafficTest, AUserWithAVisitInFlightGetsNoSecondOneUntilItsAnswer) {
  // Before: two visits of one user could be in flight at once, the second with a longer history;
  // arriving first, it left the first one a shorter history than the server's cache (a cut).
  TrafficOptions o;
  o.num_users = 4;
  o.zipf_s = 3;  // user 0 is drawn ~85 % of the time
  o.new_user_rate = 0;
  o.num_candidates = 1;
  auto t = TrafficModel::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  using Busy = TrafficModel::BusyUser;
  // kRedraw: no user twice while another is free; with every user in flight, a fifth still comes.
  std::vector<Visit> in_flight;
  std::unordered_map<uint64_t, int> seen;
  for (int i = 0; i < 4; ++i) {
    in_flight.push_back((*t)->Next(Busy::kRedraw));
    EXPECT_EQ(++seen[in_flight.back().user_id], 1) << "visit " << i << " drew a user in flight";
  }
  in_flight.push_back((*t)->Next(Busy::kRedraw));
  EXPECT_TRUE(seen.contains(in_flight.back().user_id));
  for (const Visit& v : in_flight) (*t)->Done(v);
  // kWait: the popular user's next visit waits for the answer to its last one, and then extends
  // that history.
  const Visit first = (*t)->Next(Busy::kWait);
  std::atomic<bool> got{false};
  Visit second;
  std::thread waiter([&] {
    do {
      if (second.slot >= 0) (*t)->Done(second);  // a draw of another user: try again
      second = (*t)->Next(Busy::kWait);
    } while (second.user_id != first.user_id);
    got.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(got.load()) << "a second visit of the user came while the first was in flight";
  (*t)->Done(first);
  waiter.join();
  EXPECT_GT(second.history_item_ids.size(), first.history_item_ids.size());
  (*t)->Done(second);
  // One at a time, the popularity is the Zipf law's in both modes: 1 / (1 + 2^-3 + 3^-3 + 4^-3)
  // = 0.849 for user 0.
  for (const Busy busy : {Busy::kWait, Busy::kRedraw}) {
    std::unordered_map<int64_t, int> by_slot;
    for (int i = 0; i < 20000; ++i) {
      const Visit v = (*t)->Next(busy);
      ++by_slot[v.slot];
      (*t)->Done(v);
    }
    EXPECT_NEAR(by_slot[0] / 20000.0, 0.849, 0.015);
  }
}

TEST(TrafficTest, RejectsEmptyOrNonPositiveEventRanges) {
  TrafficOptions o;
  o.new_events_min = 5;
  o.new_events_max = 4;
  auto t = TrafficModel::Create(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("new events range [5, 4]"), std::string::npos)
      << t.status();
  o = TrafficOptions();
  o.new_events_min = 0;
  EXPECT_EQ(TrafficModel::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = TrafficOptions();
  o.initial_events_min = 10;
  o.initial_events_max = 9;
  EXPECT_EQ(TrafficModel::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hstu::loadgen
