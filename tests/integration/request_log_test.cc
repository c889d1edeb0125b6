// The slow-request log (server/request_log.h): the line's fields for each point a call can end
// at, the escaping of what the client sent, the rate limit, the flags' ranges, and the server
// writing it for a slow call only.

#include "server/request_log.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "server/log_format.h"
#include "spdlog/sinks/ostream_sink.h"
#include "tests/integration/server_fixture.h"
#include "tests/util/captured_log.h"

namespace hstu::server {
namespace {

// The lines that start with "slow request: ", without it.
std::vector<std::string> SlowLines(const testing::CapturedLog& log) {
  std::vector<std::string> lines;
  for (absl::string_view line : log.Lines()) {
    if (absl::ConsumePrefix(&line, "slow request: ")) lines.emplace_back(line);
  }
  return lines;
}

// `r` as a call that waited 10 ms and was scored in a batch of 8 in 2.1 ms, a GPU hit.
void AnsweredFromTheQueueAndABatchOf8(RequestRecord* r) {
  r->code = absl::StatusCode::kOk;
  r->queued = true;
  r->queue_seconds = 0.01;
  r->batch_size = 8;
  r->compute_seconds = 0.0021;
  r->answered = true;
  r->reused_tokens = 396;
  r->computed_tokens = 4;
  r->cache_result = "gpu_hit";
}

TEST(RequestLog, LineHasTheFieldsOfWhatTheCallReached) {
  RequestRecord r;
  r.total_seconds = 0.0123456;
  EXPECT_EQ(FormatRequestRecord(r), "total_ms=12.346 code=OK");

  r.code = absl::StatusCode::kInvalidArgument;
  r.error = "history_actions has 2 entries, history_item_ids 3";
  r.parsed = true;
  r.request_id = "abc";
  r.user_id = 42;
  r.num_events = 3;
  r.num_candidates = 5;
  EXPECT_EQ(FormatRequestRecord(r),
            "total_ms=12.346 code=INVALID_ARGUMENT request_id=\"abc\" user_id=42 events=3 "
            "candidates=5 error=\"history_actions has 2 entries, history_item_ids 3\"");

  AnsweredFromTheQueueAndABatchOf8(&r);
  EXPECT_EQ(FormatRequestRecord(r),
            "total_ms=12.346 queue_ms=10.000 compute_ms=2.100 batch=8 code=OK request_id=\"abc\" "
            "user_id=42 events=3 candidates=5 reused_tokens=396 computed_tokens=4 cache=gpu_hit");
}

TEST(RequestLog, WhatTheClientSentCannotBreakTheLine) {
  RequestRecord r;
  r.parsed = true;
  r.request_id = "a\"b\nslow request: total_ms=0";
  r.code = absl::StatusCode::kDeadlineExceeded;
  const std::string long_error(1000, 'x');
  r.error = long_error;
  const std::string line = FormatRequestRecord(r);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_NE(line.find("request_id=\"a\\\"b\\nslow request: total_ms=0\""), std::string::npos)
      << line;
  EXPECT_NE(line.find(std::string(300, 'x') + "...\""), std::string::npos) << line;
  EXPECT_EQ(line.find(std::string(301, 'x')), std::string::npos);

  // UTF-8 stays as it is (greppable); an id past 256 bytes (refused by the server, and logged
  // with its refusal) is cut at a character's start.
  r.request_id = "caf\xc3\xa9\xe2\x98\x83\t";
  EXPECT_NE(FormatRequestRecord(r).find("request_id=\"caf\xc3\xa9\xe2\x98\x83\\t\""),
            std::string::npos)
      << FormatRequestRecord(r);
  const std::string long_id = std::string(255, 'a') + "\xc3\xa9" + std::string(100, 'b');
  r.request_id = long_id;
  EXPECT_NE(FormatRequestRecord(r).find("request_id=\"" + std::string(255, 'a') + "...\""),
            std::string::npos)
      << FormatRequestRecord(r);
}

TEST(RequestLog, WritesAtMostTheRateAndCountsTheRestInOneLine) {
  testing::CapturedLog captured;
  RequestLog log(RequestLogOptions{.slow_request_ms = 0, .max_lines_per_s = 3});
  const RequestLog::Clock::time_point t0 = RequestLog::Clock::time_point() + std::chrono::hours(1);
  RequestRecord r;
  for (int i = 0; i < 10; ++i) {
    r.total_seconds = i * 1e-3;
    log.Write(r, t0 + std::chrono::milliseconds(10 * i));
  }
  r.total_seconds = 0.5;
  log.Write(r, t0 + std::chrono::milliseconds(1000));  // a new second
  log.Write(r, t0 + std::chrono::milliseconds(1001));
  log.Write(r, t0 + std::chrono::milliseconds(1002));
  log.Write(r, t0 + std::chrono::milliseconds(1003));  // held back: reported by the Flush
  log.Flush();
  log.Flush();  // nothing more held back: no line
  const std::vector<std::string> lines = SlowLines(captured);
  ASSERT_EQ(lines.size(), 8u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[0], "total_ms=0.000 code=OK");
  EXPECT_EQ(lines[2], "total_ms=2.000 code=OK");
  EXPECT_EQ(lines[3],
            "7 more slow-request lines were not written (at most 3 a second, "
            "--slow_request_log_per_s)");
  EXPECT_EQ(lines[4], "total_ms=500.000 code=OK");
  EXPECT_EQ(lines[7],
            "1 more slow-request line was not written (at most 3 a second, "
            "--slow_request_log_per_s)");
}

// A burst's count is written once its second is over, without waiting for another slow call.
TEST(RequestLog, TheCountHeldBackIsWrittenOnceItsSecondIsOver) {
  testing::CapturedLog captured;
  RequestLog log(RequestLogOptions{.slow_request_ms = 0, .max_lines_per_s = 1});
  const RequestLog::Clock::time_point t0 = RequestLog::Clock::time_point() + std::chrono::hours(1);
  for (int i = 0; i < 4; ++i) log.Write(RequestRecord(), t0 + std::chrono::milliseconds(i));
  log.FlushEnded(t0 + std::chrono::milliseconds(999));  // its second is not over: nothing
  EXPECT_EQ(SlowLines(captured).size(), 1u);
  log.FlushEnded(t0 + std::chrono::milliseconds(1000));
  log.FlushEnded(t0 + std::chrono::milliseconds(1200));  // nothing more held back
  const std::vector<std::string> lines = SlowLines(captured);
  ASSERT_EQ(lines.size(), 2u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[1],
            "3 more slow-request lines were not written (at most 1 a second, "
            "--slow_request_log_per_s)");
}

TEST(RequestLog, NoLimitAndOffAndThreshold) {
  RequestLog off(RequestLogOptions{});
  EXPECT_FALSE(off.Slow(1e6));
  RequestLog every(RequestLogOptions{.slow_request_ms = 0});
  EXPECT_TRUE(every.Slow(0));
  RequestLog slow(RequestLogOptions{.slow_request_ms = 5});
  EXPECT_FALSE(slow.Slow(0.0049));
  EXPECT_TRUE(slow.Slow(0.005));

  testing::CapturedLog captured;
  RequestLog unlimited(RequestLogOptions{.slow_request_ms = 0, .max_lines_per_s = 0});
  const auto t0 = RequestLog::Clock::now();
  for (int i = 0; i < 50; ++i) unlimited.Write(RequestRecord(), t0);
  EXPECT_EQ(SlowLines(captured).size(), 50u);
}

// With --log_format=json the line's fields are keys of their own, beside the message.
TEST(RequestLog, JsonLinesCarryTheFieldsAsKeys) {
  RequestRecord r;
  r.total_seconds = 0.0123456;
  r.code = absl::StatusCode::kResourceExhausted;
  r.error = "queue full";
  r.parsed = true;
  const std::string long_id = std::string(255, 'a') + "\xc3\xa9" + "\"\n\xff";
  r.request_id = long_id;
  r.user_id = std::numeric_limits<uint64_t>::max();
  r.num_events = 3;
  r.num_candidates = 5;
  const auto refused = nlohmann::json::parse("{" + RequestRecordJsonFields(r) + "}");
  EXPECT_EQ(refused,
            nlohmann::json::parse(R"({"event":"slow_request","total_ms":12.346,
                "code":"RESOURCE_EXHAUSTED","request_id":")" +
                                  std::string(255, 'a') +
                                  R"(","request_id_cut":true,"user_id":"18446744073709551615",
                "events":3,"candidates":5,"error":"queue full"})"));

  r.request_id = "id \"1\"\n\xff";
  AnsweredFromTheQueueAndABatchOf8(&r);
  const auto answered = nlohmann::json::parse("{" + RequestRecordJsonFields(r) + "}");
  EXPECT_EQ(answered["request_id"], "id \"1\"\n\xef\xbf\xbd");  // not UTF-8: U+FFFD
  EXPECT_FALSE(answered.contains("request_id_cut"));
  EXPECT_FALSE(answered.contains("error"));
  EXPECT_EQ(answered["queue_ms"], 10.0);
  EXPECT_EQ(answered["compute_ms"], 2.1);
  EXPECT_EQ(answered["batch"], 8);
  EXPECT_EQ(answered["reused_tokens"], 396);
  EXPECT_EQ(answered["computed_tokens"], 4);
  EXPECT_EQ(answered["cache"], "gpu_hit");

  // Through the log: the keys follow the message, on the slow-request lines only.
  r.request_id = "id-2";
  std::ostringstream out;
  const std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
  auto json_logger = std::make_shared<spdlog::logger>(
      "json", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  json_logger->set_formatter(std::make_unique<JsonLogFormatter>());
  spdlog::set_default_logger(json_logger);
  {
    RequestLog log(RequestLogOptions{.slow_request_ms = 0, .max_lines_per_s = 1});
    const auto t0 = RequestLog::Clock::time_point() + std::chrono::hours(1);
    log.Write(r, t0);
    log.Write(r, t0 + std::chrono::milliseconds(1));  // held back
    log.Write(r, t0 + std::chrono::milliseconds(2));  // held back
    log.Flush();
    spdlog::info("another line");
  }
  spdlog::set_default_logger(previous);
  const std::vector<std::string> lines = absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << out.str();
  const auto first = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(first["message"], "slow request: " + FormatRequestRecord(r));
  EXPECT_EQ(first["level"], "info");
  EXPECT_EQ(first["event"], "slow_request");
  EXPECT_EQ(first["request_id"], "id-2");
  EXPECT_EQ(first["user_id"], "18446744073709551615");
  EXPECT_EQ(first["cache"], "gpu_hit");
  const auto held_back = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(held_back["event"], "slow_requests_not_written");
  EXPECT_EQ(held_back["lines"], 2);
  const auto other = nlohmann::json::parse(lines[2]);
  EXPECT_EQ(other["message"], "another line");
  EXPECT_FALSE(other.contains("event")) << lines[2];
}

TEST(RequestLog, OptionsOutOfRangeNameTheFlag) {
  for (double ms : {std::nan(""), std::numeric_limits<double>::infinity(), 86400e3 + 1}) {
    const absl::Status s = CheckRequestLogOptions(RequestLogOptions{.slow_request_ms = ms});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << ms;
    EXPECT_TRUE(absl::StrContains(s.message(), "--slow_request_ms")) << s;
  }
  EXPECT_TRUE(CheckRequestLogOptions(RequestLogOptions{.slow_request_ms = -1}).ok());
  EXPECT_TRUE(CheckRequestLogOptions(RequestLogOptions{.slow_request_ms = 86400e3}).ok());
  const absl::Status s = CheckRequestLogOptions(RequestLogOptions{.max_lines_per_s = -1});
  EXPECT_TRUE(absl::StrContains(s.message(), "--slow_request_log_per_s")) << s;
}

// The log is captured for the fixture's whole life: the server's threads, which may still log
// until its TearDown shuts it down, never see the logger put back under them.
class RequestLogServerTest : public fixture::ServerTest {
 protected:
  void StartLogging(double slow_request_ms) {
    ServerOptions o;
    o.request_log.slow_request_ms = slow_request_ms;
    StartServer(o);
  }

  testing::CapturedLog captured_;
};

// A call held at the engine past the threshold gets a line with its queue, batch and cache
// fields; fast calls get none.
TEST_F(RequestLogServerTest, SlowCallIsLoggedAndFastCallsAreNot) {
  ASSERT_NO_FATAL_FAILURE(StartLogging(1000));
  hstu::v1::RankResponse fast;
  ASSERT_TRUE(Rank(fixture::MakeRequest(7, 10, 3, 1), &fast).ok());
  grpc::Status held;
  std::thread caller = HoldOneBatch(&held);  // user 5, request_id "req-5-1"
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  gate_.Open();
  caller.join();
  ASSERT_TRUE(held.ok()) << held.error_message();
  ASSERT_TRUE(Rank(fixture::MakeRequest(7, 12, 3, 1), &fast).ok());
  server_->Shutdown(absl::Seconds(5));
  const std::vector<std::string> lines = SlowLines(captured_);
  ASSERT_EQ(lines.size(), 1u) << absl::StrJoin(lines, "\n");
  const std::string& line = lines[0];
  EXPECT_NE(line.find(" code=OK request_id=\"req-5-1\" user_id=5 events=5 candidates=3 "
                      "reused_tokens=0 computed_tokens=10 cache=miss"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find(" batch=1 "), std::string::npos) << line;
  double total_ms = 0, compute_ms = 0;
  for (absl::string_view field : absl::StrSplit(line, ' ')) {
    if (absl::ConsumePrefix(&field, "total_ms=")) {
      ASSERT_TRUE(absl::SimpleAtod(field, &total_ms));
    }
    if (absl::ConsumePrefix(&field, "compute_ms=")) {
      ASSERT_TRUE(absl::SimpleAtod(field, &compute_ms));
    }
  }
  EXPECT_GE(compute_ms, 1090) << line;  // the gate held the batch inside the engine's call
  EXPECT_GE(total_ms, compute_ms) << line;
}

// With a threshold of 0 every call has a line, also one refused as invalid, which names its
// error and has no queue or engine fields.
TEST_F(RequestLogServerTest, ThresholdZeroLogsEveryCallWithItsError) {
  ASSERT_NO_FATAL_FAILURE(StartLogging(0));
  hstu::v1::RankResponse resp;
  ASSERT_TRUE(Rank(fixture::MakeRequest(3, 4, 2, 1), &resp).ok());
  ASSERT_TRUE(Rank(fixture::MakeRequest(3, 6, 2, 1), &resp).ok());
  hstu::v1::RankRequest bad = fixture::MakeRequest(4, 4, 2, 1);
  bad.add_history_actions(1);
  EXPECT_EQ(Rank(bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  hstu::v1::RankRequest long_id = fixture::MakeRequest(6, 4, 2, 1);
  long_id.set_request_id(std::string(300, 'z'));
  EXPECT_EQ(Rank(long_id, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  server_->Shutdown(absl::Seconds(5));
  const std::vector<std::string> lines = SlowLines(captured_);
  ASSERT_EQ(lines.size(), 4u) << absl::StrJoin(lines, "\n");
  // A line is written after its call is answered, so the next call's may come first: each is
  // looked up by what it holds.
  auto line_with = [&](const std::string& part) {
    for (const std::string& line : lines) {
      if (line.find(part) != std::string::npos) return line;
    }
    ADD_FAILURE() << "no line has: " << part << "\n" << absl::StrJoin(lines, "\n");
    return std::string();
  };
  line_with(" user_id=3 events=4 candidates=2 reused_tokens=0 computed_tokens=8 cache=miss");
  line_with(" user_id=3 events=6 candidates=2 reused_tokens=8 computed_tokens=4 cache=gpu_hit");
  const std::string invalid = line_with(
      " code=INVALID_ARGUMENT request_id=\"req-4-1\" user_id=4 events=4 candidates=2 "
      "error=\"history_");
  EXPECT_EQ(invalid.find("queue_ms"), std::string::npos) << invalid;
  line_with(absl::StrCat(" code=INVALID_ARGUMENT request_id=\"", std::string(256, 'z'),
                         "...\" user_id=6 events=4 candidates=2 error=\"request_id has 300 bytes"));
}

}  // namespace
}  // namespace hstu::server
