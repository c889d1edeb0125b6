// hstu_loadgen's numbers (client/latency_histogram.h, client/report.h): the histogram's
// resolution and quantiles, and the open-loop sender's lag in the table, JSON and CSV.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "client/latency_histogram.h"
#include "client/report.h"
#include "nlohmann/json.hpp"

namespace hstu::loadgen {
namespace {

TEST(LatencyHistogramTest, AQuantileIsTheUpperEdgeOfItsBucketWithinASixtyFourth) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> log_us(0, 9);  // 1 µs .. 1000 s
  for (int i = 0; i < 2000; ++i) {
    const double s = std::pow(10.0, log_us(rng)) * 1e-6;
    LatencyHistogram h;
    h.Record(s);
    h.Record(10 * s);  // the maximum, so that the median is read from s's bucket, not clamped
    const double q = h.Quantile(0.5);
    EXPECT_GE(q, s) << s;
    EXPECT_LE(q, s * (1 + 1.0 / 64) + 1e-6) << s;
    EXPECT_EQ(h.max_seconds(), 10 * s);
  }
}

TEST(LatencyHistogramTest, QuantilesAreNearestRankAndOrdered) {
  LatencyHistogram h;
  EXPECT_EQ(h.Quantile(0.5), 0);  // empty
  std::vector<double> values;
  for (int ms = 1; ms <= 100; ++ms) values.push_back(ms * 1e-3);
  std::shuffle(values.begin(), values.end(), std::mt19937_64(1));
  for (double v : values) h.Record(v);
  EXPECT_EQ(h.count(), 100);
  EXPECT_NEAR(h.mean_seconds(), 50.5e-3, 1e-12);
  // Nearest rank: the 50th of 100 is 50 ms, the 99th 99 ms, the 100th 100 ms; each bucket is
  // under 1 ms wide here, so a neighbouring rank would be caught.
  for (const auto& [q, want_ms] : {std::pair{0.5, 50.0}, {0.99, 99.0}, {1.0, 100.0}}) {
    EXPECT_GE(h.Quantile(q), want_ms * 1e-3) << q;
    EXPECT_LT(h.Quantile(q), (want_ms + 1) * 1e-3) << q;
  }
  double last = 0;
  for (double q : {0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0}) {
    EXPECT_GE(h.Quantile(q), last) << q;
    last = h.Quantile(q);
  }
}

LevelResult OpenLevel(double lag_s) {
  LevelResult l;
  l.mode = "open";
  l.rate_rps = 500;
  l.arrival = "constant";
  l.duration_s = 2;
  for (int i = 0; i < 1000; ++i) {
    l.sender_lag.Record(lag_s);
    ++l.sent;
    l.latency.Record(0.004);
    ++l.requests;
  }
  return l;
}

LevelResult ClosedLevel() {
  LevelResult l;
  l.mode = "closed";
  l.concurrency = 4;
  l.duration_s = 1;
  l.requests = 10;
  for (int i = 0; i < 10; ++i) l.latency.Record(0.002);
  return l;
}

TEST(ReportTest, ASenderBehindItsScheduleIsReportedAndFlagged) {
  RunInfo info;
  std::vector<LevelResult> levels = {ClosedLevel(), OpenLevel(0.0001), OpenLevel(0.005)};
  levels[2].rate_rps = 1000;
  const std::string table = FormatTable(info, levels);
  const size_t sender = table.find("open-loop sender");
  ASSERT_NE(sender, std::string::npos) << table;
  // The sender's table: a row per open-loop level (1000 calls over 2 s), none for the closed one.
  const std::string rows = table.substr(sender);
  EXPECT_TRUE(absl::StrContains(rows, "| 500 rps constant   |      1000 |     500.0 |")) << table;
  EXPECT_TRUE(absl::StrContains(rows, "| 1000 rps constant  |      1000 |     500.0 |")) << table;
  EXPECT_FALSE(absl::StrContains(rows, "c=4")) << table;
  // The late one only.
  EXPECT_TRUE(absl::StrContains(
      table, "warning: at 1000 rps constant the sender left its calls 5."))
      << table;
  EXPECT_FALSE(absl::StrContains(table, "warning: at 500 rps")) << table;

  const auto json = nlohmann::json::parse(ToJson(info, levels));
  const auto& arr = json["levels"];
  ASSERT_EQ(arr.size(), 3u);
  EXPECT_FALSE(arr[0].contains("sent"));  // closed loop
  EXPECT_EQ(arr[1]["sent"], 1000);
  EXPECT_DOUBLE_EQ(arr[1]["sent_rps"].get<double>(), 500);
  EXPECT_FALSE(arr[1]["sender_fell_behind"].get<bool>());
  EXPECT_TRUE(arr[2]["sender_fell_behind"].get<bool>());
  EXPECT_GE(arr[2]["sender_lag_ms"]["p99"].get<double>(), 5.0);
  EXPECT_LT(arr[2]["sender_lag_ms"]["p99"].get<double>(), 5.0 * (1 + 1.0 / 64));
  EXPECT_GE(arr[2]["sender_lag_ms"]["max"].get<double>(), 5.0);
}

TEST(ReportTest, EveryCsvRowHasTheHeadersFields) {
  LevelResult open = OpenLevel(0.002);
  open.errors["DEADLINE_EXCEEDED"] = 3;
  open.errors["RESOURCE_EXHAUSTED"] = 2;
  open.by_cache_result["gpu_hit"].Record(0.001);
  open.by_cache_result["miss"].Record(0.003);
  const std::string csv = ToCsv({ClosedLevel(), open});
  const std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << csv;
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  EXPECT_EQ(header.back(), "sender_lag_p99_ms");
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> row = absl::StrSplit(lines[i], ',');
    ASSERT_EQ(row.size(), header.size()) << lines[i];
    for (size_t c = 0; c < header.size(); ++c) {
      if (header[c] == "errors") {
        EXPECT_EQ(row[c], i == 1 ? "0" : "5");
      } else if (header[c] == "errors_by_code" && i == 2) {
        EXPECT_EQ(row[c], "DEADLINE_EXCEEDED:3;RESOURCE_EXHAUSTED:2");
      } else if (header[c] == "sent") {
        EXPECT_EQ(row[c], i == 1 ? "0" : "1000");
      }
    }
  }
}

}  // namespace
}  // namespace hstu::loadgen
