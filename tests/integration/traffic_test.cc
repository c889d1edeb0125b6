// hstu_loadgen's traffic model (client/traffic.h): history growth, restarts, option checks.
#include "client/traffic.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
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

TEST(TrafficTest, AUsersHistoryGrowsOnlyWhenNoneOfItsVisitsIsInFlight) {
  // Before: a visit drawn while another of its user was in flight had a longer history; reaching
  // the server first, it left the earlier one a shorter history than the cache (a cut).
  TrafficOptions o;
  o.num_users = 4;
  o.zipf_s = 3;  // user 0 is drawn ~85 % of the time
  o.new_user_rate = 0.2;
  o.num_candidates = 1;
  o.overlapping_visits = true;
  auto t = TrafficModel::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  std::mt19937 rng(5);
  std::vector<Visit> in_flight;
  std::unordered_map<int64_t, size_t> answered;  // slot → history length of its last answer
  int same = 0, grown = 0;
  for (int i = 0; i < 20000; ++i) {
    // Up to 6 visits in flight, answered in random order.
    if (in_flight.size() == 6 || (!in_flight.empty() && rng() % 2 == 0)) {
      const size_t k = rng() % in_flight.size();
      answered[in_flight[k].slot] = in_flight[k].history_item_ids.size();
      (*t)->Done(in_flight[k]);
      in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(k));
      continue;
    }
    Visit v = (*t)->Next();
    for (const Visit& f : in_flight) {
      if (f.slot != v.slot) continue;
      // The same user and history as the visit in flight: whichever arrives first, neither cuts
      // what the other committed.
      ASSERT_EQ(v.user_id, f.user_id);
      ASSERT_EQ(v.history_item_ids, f.history_item_ids);
      ASSERT_FALSE(v.new_user);
      ++same;
    }
    const bool busy = std::any_of(in_flight.begin(), in_flight.end(),
                                  [&](const Visit& f) { return f.slot == v.slot; });
    if (!busy && !v.new_user && answered.contains(v.slot)) {
      EXPECT_GT(v.history_item_ids.size(), answered[v.slot]);
      ++grown;
    }
    in_flight.push_back(std::move(v));
  }
  EXPECT_GT(same, 1000);
  EXPECT_GT(grown, 1000);
  // Popularity is the Zipf law's: 1 / (1 + 2^-3 + 3^-3 + 4^-3) = 0.849 for user 0.
  for (const Visit& f : in_flight) (*t)->Done(f);
  std::unordered_map<int64_t, int> by_slot;
  for (int i = 0; i < 20000; ++i) {
    const Visit v = (*t)->Next();
    ++by_slot[v.slot];
    (*t)->Done(v);
  }
  EXPECT_NEAR(by_slot[0] / 20000.0, 0.849, 0.015);
}

TEST(TrafficTest, AVisitGoesToAUserWithNoneInFlightWhileThereIsOne) {
  // Before: at 32 callers on 1,000 Zipf-1 users a quarter of the visits went to a user already
  // in flight and queued behind it in the server, identical, and inflated the p99 ~4x.
  TrafficOptions o;
  o.num_users = 1000;
  o.zipf_s = 1.5;  // the top user alone is ~38 % of the draws
  o.num_candidates = 1;
  auto t = TrafficModel::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  std::mt19937 rng(7);
  std::vector<Visit> in_flight;
  std::unordered_map<int64_t, int> visits;
  for (int i = 0; i < 20000; ++i) {
    if (in_flight.size() == 64) {
      const size_t k = rng() % in_flight.size();
      (*t)->Done(in_flight[k]);
      in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(k));
    }
    Visit v = (*t)->Next();
    for (const Visit& f : in_flight) ASSERT_NE(f.slot, v.slot) << "visit " << i;
    ++visits[v.slot];
    in_flight.push_back(std::move(v));
  }
  // Popularity still orders the users: the top one as often as it is free, far above the tail.
  EXPECT_GT(visits[0], 20 * visits[500] + 100);

  // Four users and six visits in flight: a second visit of a user goes out only when all four
  // have one, and then re-sends that user's history.
  o.num_users = 4;
  t = TrafficModel::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<Visit> six;
  for (int i = 0; i < 6; ++i) six.push_back((*t)->Next());
  std::unordered_map<int64_t, int> per_slot;
  for (int i = 0; i < 4; ++i) ++per_slot[six[i].slot];
  EXPECT_EQ(per_slot.size(), 4u);
  for (int i = 4; i < 6; ++i) {
    const auto same = std::find_if(six.begin(), six.begin() + 4,
                                   [&](const Visit& f) { return f.slot == six[i].slot; });
    ASSERT_NE(same, six.begin() + 4);
    EXPECT_EQ(same->history_item_ids, six[i].history_item_ids);
  }
}

TEST(TrafficTest, TwoSeedsPopulationsShareNoUserId) {
  // Before: user k + 1000003 of one seed was user k of the next.
  TrafficOptions o;
  o.num_users = 1;
  o.new_user_rate = 1;  // every visit a new user: ids k = 0, 1, 2, ...
  o.num_candidates = 1;
  o.initial_events_min = o.initial_events_max = o.max_events = 1;
  std::unordered_map<uint64_t, uint64_t> seen;  // id -> seed
  for (uint64_t seed : {1, 2}) {
    o.seed = seed;
    auto t = TrafficModel::Create(o);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int i = 0; i < 1100000; ++i) {
      const Visit v = (*t)->Next();
      (*t)->Done(v);
      const auto [it, fresh] = seen.emplace(v.user_id, seed);
      ASSERT_TRUE(fresh || it->second == seed) << "seed " << seed << " visit " << i;
    }
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
