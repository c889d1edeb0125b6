// hstu_loadgen's numbers (client/latency_histogram.h, client/report.h): the histogram's
// resolution and quantiles, and the open-loop sender's lag in the table, JSON and CSV; the
// answers it records (client/answer_log.h).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "client/answer_log.h"
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

TEST(ReportTest, EachErrorCodesLatencyIsReported) {
  // Before: only the OK answers' latency was reported, so how fast a refusal or an expiry came
  // back (an overloaded server's RESOURCE_EXHAUSTED at once, DEADLINE_EXCEEDED at the deadline)
  // was not in the report.
  RunInfo info;
  LevelResult l = ClosedLevel();
  l.errors["RESOURCE_EXHAUSTED"] = 3;
  for (int i = 0; i < 3; ++i) l.error_latency["RESOURCE_EXHAUSTED"].Record(0.0002);
  l.errors["DEADLINE_EXCEEDED"] = 2;
  for (int i = 0; i < 2; ++i) l.error_latency["DEADLINE_EXCEEDED"].Record(0.05);
  const std::string table = FormatTable(info, {ClosedLevel(), l});
  const size_t section = table.find("errors by code");
  ASSERT_NE(section, std::string::npos) << table;
  const std::string rows = table.substr(section);
  EXPECT_TRUE(absl::StrContains(rows, "| c=4                | DEADLINE_EXCEEDED  |         2 |   "))
      << table;
  EXPECT_TRUE(absl::StrContains(rows, "| c=4                | RESOURCE_EXHAUSTED |         3 |    "
                                      "0.200"))
      << table;
  // No section when no call failed.
  EXPECT_FALSE(absl::StrContains(FormatTable(info, {ClosedLevel()}), "errors by code"));

  const auto json = nlohmann::json::parse(ToJson(info, {ClosedLevel(), l}));
  EXPECT_TRUE(json["levels"][0]["error_latency_ms"].empty());
  const auto& by_code = json["levels"][1]["error_latency_ms"];
  EXPECT_EQ(by_code["DEADLINE_EXCEEDED"]["calls"], 2);
  EXPECT_GE(by_code["DEADLINE_EXCEEDED"]["p50"].get<double>(), 50.0);
  EXPECT_LT(by_code["DEADLINE_EXCEEDED"]["p50"].get<double>(), 50.0 * (1 + 1.0 / 64));
  EXPECT_EQ(by_code["RESOURCE_EXHAUSTED"]["calls"], 3);
  EXPECT_LT(by_code["RESOURCE_EXHAUSTED"]["max"].get<double>(), 0.21);
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

TEST(AnswerLogTest, ALineIsTheRequestAndItsScoresEachFloatReadBackExactly) {
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> score(0, 1);
  const std::vector<int64_t> items = {0, 7, 9223372036854775807};
  const std::vector<int32_t> actions = {3, 0, 2147483647};
  const std::vector<int64_t> candidates = {11, 12, 13, 14, 15};
  std::vector<float> scores;
  for (int i = 0; i < 15; ++i) scores.push_back(score(rng));
  scores[4] = 1e-30f;  // a denormal-adjacent value: %g's exponent form is JSON too
  scores[5] = std::nextafter(1.0f, 0.0f);
  const std::string line =
      AnswerLine(18446744073709551615ull, items, actions, candidates, scores, 3, "host_hit");
  EXPECT_EQ(line.find('\n'), std::string::npos);
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["user_id"].get<uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(j["history_item_ids"].get<std::vector<int64_t>>(), items);
  EXPECT_EQ(j["history_actions"].get<std::vector<int32_t>>(), actions);
  EXPECT_EQ(j["candidate_item_ids"].get<std::vector<int64_t>>(), candidates);
  EXPECT_EQ(j["cache_result"], "host_hit");
  ASSERT_EQ(j["expected_scores"].size(), 5u);  // candidate-major, a row of 3 tasks each
  for (size_t c = 0; c < 5; ++c) {
    ASSERT_EQ(j["expected_scores"][c].size(), 3u);
    for (size_t t = 0; t < 3; ++t) {
      EXPECT_EQ(static_cast<float>(j["expected_scores"][c][t].get<double>()), scores[c * 3 + t])
          << c << " " << t;
    }
  }
  // A score that is not finite (never from our server) is null, so the line is still JSON.
  std::vector<float> odd_scores = scores;
  odd_scores[1] = std::numeric_limits<float>::quiet_NaN();
  odd_scores[2] = std::numeric_limits<float>::infinity();
  const auto with_null = nlohmann::json::parse(AnswerLine(1, items, actions, candidates, odd_scores, 3, "miss"));
  EXPECT_TRUE(with_null["expected_scores"][0][1].is_null());
  EXPECT_TRUE(with_null["expected_scores"][0][2].is_null());
  EXPECT_EQ(static_cast<float>(with_null["expected_scores"][0][0].get<double>()), scores[0]);
  // What is not an enum name is not written into the JSON string.
  const auto odd = nlohmann::json::parse(AnswerLine(1, {}, {}, candidates, scores, 3, "a\"b\\c\n"));
  EXPECT_EQ(odd["cache_result"], "abc");
  EXPECT_TRUE(odd["history_item_ids"].empty());
}

// --record=/dev/stdout (here /dev/fd/N) into a file a shell opened for `>>`: appended at the
// descriptor's offset (before: fopen truncated the file, the earlier lines lost), and the
// descriptor stays open after Close().
TEST(AnswerLogTest, AnOpenDescriptorIsAppendedToAndLeftOpen) {
  const std::string path =
      ::testing::TempDir() + "/answers_fd_" + std::to_string(getpid()) + ".jsonl";
  { std::ofstream(path) << "{\"earlier\":1}\n"; }
  const int fd = open(path.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  auto log = AnswerLog::Open("/dev/fd/" + std::to_string(fd), 1);
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_TRUE((*log)->Take());
  (*log)->Write("{\"n\":0}");
  ASSERT_TRUE((*log)->Close().ok());
  EXPECT_EQ(fcntl(fd, F_GETFD), 0) << "the descriptor was closed";
  close(fd);
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_EQ(ss.str(), "{\"earlier\":1}\n{\"n\":0}\n");
  std::remove(path.c_str());
}

TEST(AnswerLogTest, WritesEveryNthAnswerAndSaysWhenWritingFailed) {
  const std::string path =
      ::testing::TempDir() + "/answers_every_" + std::to_string(getpid()) + ".jsonl";
  auto log = AnswerLog::Open(path, 3);
  ASSERT_TRUE(log.ok()) << log.status();
  for (int i = 0; i < 10; ++i) {
    if ((*log)->Take()) (*log)->Write("{\"n\":" + std::to_string(i) + "}");
  }
  ASSERT_TRUE((*log)->Close().ok());
  EXPECT_EQ((*log)->lines(), 4);
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_EQ(ss.str(), "{\"n\":0}\n{\"n\":3}\n{\"n\":6}\n{\"n\":9}\n");
  EXPECT_FALSE((*log)->Take());  // closed: nothing more is offered
  std::remove(path.c_str());

  EXPECT_FALSE(AnswerLog::Open(path, 0).ok());
  const auto missing = AnswerLog::Open("/nonexistent/dir/a.jsonl", 1);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/dir/a.jsonl: cannot create it"),
            std::string::npos);
  // A full disk: the lines are buffered, so the failure shows at the flush, and is reported.
  auto full = AnswerLog::Open("/dev/full", 1);
  ASSERT_TRUE(full.ok()) << full.status();
  for (int i = 0; i < 3; ++i) {
    if ((*full)->Take()) (*full)->Write(std::string(100, 'x'));
  }
  const absl::Status closed = (*full)->Close();
  EXPECT_FALSE(closed.ok());
  EXPECT_NE(closed.message().find("--record=/dev/full: writing failed"), std::string::npos) << closed;
}

}  // namespace
}  // namespace hstu::loadgen
