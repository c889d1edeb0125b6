// The onload-or-recompute cost rule (engine/onload_policy.h) on numbers: rates, backlog, ties.
#include "engine/onload_policy.h"

#include "gtest/gtest.h"

namespace hstu {
namespace {

TEST(OnloadPolicy, ParsesItsNamesAndRejectsOthers) {
  EXPECT_EQ(*ParseOnloadPolicy("cost"), OnloadPolicy::kCost);
  EXPECT_EQ(*ParseOnloadPolicy("always"), OnloadPolicy::kAlways);
  EXPECT_STREQ(OnloadPolicyName(OnloadPolicy::kCost), "cost");
  EXPECT_STREQ(OnloadPolicyName(OnloadPolicy::kAlways), "always");
  for (const char* bad : {"", "Cost", "never", "cost "}) {
    const auto p = ParseOnloadPolicy(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find("cost, always"), absl::string_view::npos);
  }
}

TEST(OnloadCostModel, StartsFromTheStartValuesAndFollowsObservations) {
  OnloadCostModel m(0, 0);
  EXPECT_EQ(m.bytes_per_second(), OnloadCostModel::kStartBytesPerSecond);
  EXPECT_EQ(m.seconds_per_token(), OnloadCostModel::kStartSecondsPerToken);
  m.ObserveCopy(1000, 2.0);
  EXPECT_DOUBLE_EQ(m.bytes_per_second(), 500);
  m.ObserveCompute(100, 0.5);
  EXPECT_DOUBLE_EQ(m.seconds_per_token(), 0.005);
  // Later samples weigh more: (0.9 * 1000 + 3000) / (0.9 * 2 + 1) bytes per second.
  m.ObserveCopy(3000, 1.0);
  EXPECT_DOUBLE_EQ(m.bytes_per_second(), (0.9 * 1000 + 3000) / (0.9 * 2 + 1));
  // Empty or untimed samples change nothing.
  const double bw = m.bytes_per_second(), spt = m.seconds_per_token();
  m.ObserveCopy(0, 1.0);
  m.ObserveCopy(1000, 0.0);
  m.ObserveCompute(0, 1.0);
  m.ObserveCompute(10, -1.0);
  EXPECT_EQ(m.bytes_per_second(), bw);
  EXPECT_EQ(m.seconds_per_token(), spt);
  // Many samples of one rate converge to it.
  for (int i = 0; i < 200; ++i) m.ObserveCopy(4000, 1.0);
  EXPECT_NEAR(m.bytes_per_second(), 4000, 1e-3);
}

TEST(OnloadCostModel, RecomputeRateIsTheMarginalCostOfARow) {
  // Forwards of 400 and 4000 rows taking 0.9 and 2.0 ms: 0.9 ms fixed-ish, 0.306 us per extra row.
  OnloadCostModel m(0, 0);
  for (int i = 0; i < 20; ++i) {
    m.ObserveCompute(400, 0.9e-3 - 0.122e-3 + 400 * 0.3055e-6);
    m.ObserveCompute(4000, 0.9e-3 - 0.122e-3 + 4000 * 0.3055e-6);
  }
  EXPECT_NEAR(m.seconds_per_token(), 0.3055e-6, 1e-9);
  // The line's intercept is the forward's fixed part; a wave's copies overlap all but the last
  // layer's share of fixed part and rows.
  EXPECT_NEAR(m.forward_fixed_seconds(), 0.778e-3, 1e-7);
  EXPECT_NEAR(m.ForwardSeconds(1000), 0.778e-3 + 1000 * 0.3055e-6, 1e-7);
  EXPECT_NEAR(m.OverlapSeconds(1000, 8), (0.778e-3 + 1000 * 0.3055e-6) * 7 / 8, 1e-7);
  EXPECT_EQ(m.ForwardSeconds(0), 0);
  // Forwards of one size give no slope: seconds per row, as before, and no fixed part.
  OnloadCostModel same(0, 0);
  for (int i = 0; i < 20; ++i) same.ObserveCompute(1000, 1e-3);
  EXPECT_NEAR(same.seconds_per_token(), 1e-6, 1e-12);
  EXPECT_NEAR(same.forward_fixed_seconds(), 0, 1e-12);
  // A slope above the average rate (no fixed part, noise) is capped at the average.
  OnloadCostModel steep(0, 0);
  for (int i = 0; i < 20; ++i) {
    steep.ObserveCompute(100, 0.05e-3);
    steep.ObserveCompute(1000, 1e-3);
  }
  // (The line's slope is 1.056 us per row; the rows' average is 0.955 us.)
  EXPECT_LT(steep.seconds_per_token(), 1.0e-6);
  EXPECT_NEAR(steep.seconds_per_token(), (0.05e-3 + 1e-3) / 1100, 0.02e-6);
}

TEST(OnloadCostModel, FixedRatesIgnoreObservations) {
  OnloadCostModel m(123.0, 4.0);
  m.ObserveCopy(1000, 1.0);
  m.ObserveCompute(1000, 1.0);
  EXPECT_EQ(m.bytes_per_second(), 123.0);
  EXPECT_EQ(m.seconds_per_token(), 4.0);
  EXPECT_EQ(m.forward_fixed_seconds(), 0);
}

TEST(OnloadCostModel, OnloadsWhileTheQueuedCopyFinishesNoLaterThanTheRecompute) {
  OnloadCostModel m(/*bytes/s=*/100, /*s/token=*/1);  // 10 tokens: 10 s of recompute
  const double t = 1000;
  EXPECT_TRUE(m.ShouldOnload(999, 10, t));   // 9.99 s
  EXPECT_TRUE(m.ShouldOnload(1000, 10, t));  // 10 s: a tie goes to the copy
  EXPECT_FALSE(m.ShouldOnload(1001, 10, t));
  m.CopyIssued(400, t);  // 4 s queued
  EXPECT_DOUBLE_EQ(m.queued_seconds(t), 4);
  EXPECT_TRUE(m.ShouldOnload(600, 10, t));
  EXPECT_FALSE(m.ShouldOnload(700, 10, t));
  m.CopyIssued(400, t + 1);  // behind the first: done at t + 8
  EXPECT_DOUBLE_EQ(m.queued_seconds(t + 1), 7);
  EXPECT_DOUBLE_EQ(m.queued_seconds(t + 8), 0);
  EXPECT_DOUBLE_EQ(m.queued_seconds(t + 9), 0);
  EXPECT_TRUE(m.ShouldOnload(1000, 10, t + 8));  // the backlog drained with time
  m.CopyIssued(500, t + 9);                      // an idle link starts at once: done at t + 14
  EXPECT_DOUBLE_EQ(m.queued_seconds(t + 9), 5);
  m.CopiesIdle(t + 10);  // the backend says everything is done
  EXPECT_DOUBLE_EQ(m.queued_seconds(t + 10), 0);
  m.CopiesIdle(t + 20);  // idle earlier than now is still idle
  EXPECT_DOUBLE_EQ(m.queued_seconds(t + 10), 0);
}

TEST(OnloadCostModel, CopyMayTakeAsLongAsTheRecomputePlusTheComputeItOverlaps) {
  OnloadCostModel m(/*bytes/s=*/100, /*s/token=*/0.5);  // 10 tokens: 5 s of recompute
  const double t = 50;
  EXPECT_FALSE(m.ShouldOnload(800, 10, t));     // 8 s against 5
  EXPECT_TRUE(m.ShouldOnload(800, 10, t, 3));   // against 5 + 3
  EXPECT_FALSE(m.ShouldOnload(801, 10, t, 3));
  EXPECT_FALSE(m.ShouldOnload(800, 10, t, -3));  // no negative overlap
  // 16 rows through 8 layers: the copy hides behind 7 of the 8 layers' 8 s.
  EXPECT_DOUBLE_EQ(m.OverlapSeconds(16, 8), 7);
  EXPECT_DOUBLE_EQ(m.OverlapSeconds(16, 1), 0);  // one layer: it waits for the whole copy
  EXPECT_DOUBLE_EQ(m.OverlapSeconds(0, 8), 0);
  EXPECT_DOUBLE_EQ(m.OverlapSeconds(16, 0), 0);
  m.CopyIssued(400, t);  // 4 s queued
  EXPECT_TRUE(m.ShouldOnload(800, 10, t, 7));   // 12 s against 5 + 7
  EXPECT_FALSE(m.ShouldOnload(900, 10, t, 7));
}

}  // namespace
}  // namespace hstu
