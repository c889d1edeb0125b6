// gRPC core's log lines through spdlog (server/grpc_log.h): the per-line rate limit, the summary of
// what it held back, and the router as gRPC's code calls it (gpr_log), from several threads.

#include "server/grpc_log.h"

#include <grpc/support/log.h>
#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace hstu::server {
namespace {

TEST(LogRateLimiter, WritesABurstPerKeyAndReportsTheRestOnceTheWindowIsOver) {
  LogRateLimiter limiter(3, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::vector<LogRateLimiter::Suppressed> ended;
  int written = 0;
  for (int i = 0; i < 8; ++i) written += limiter.Admit("a.cc:1", 2, t0 + absl::Seconds(i), &ended);
  EXPECT_EQ(written, 3);
  EXPECT_TRUE(ended.empty());
  // Another key has a burst of its own.
  EXPECT_TRUE(limiter.Admit("b.cc:2", 1, t0 + absl::Seconds(9), &ended));
  EXPECT_TRUE(ended.empty());
  // a's window is over at t0 + 10 s: its 5 held-back lines are reported once, and it writes again.
  EXPECT_TRUE(limiter.Admit("a.cc:1", 2, t0 + absl::Seconds(10), &ended));
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].key, "a.cc:1");
  EXPECT_EQ(ended[0].lines, 5u);
  EXPECT_EQ(ended[0].level, 2);
  ended.clear();
  EXPECT_TRUE(limiter.Admit("a.cc:1", 2, t0 + absl::Seconds(11), &ended));
  EXPECT_TRUE(ended.empty());
  // A window with nothing held back reports nothing when it ends (b's, at t0 + 19 s).
  EXPECT_TRUE(limiter.Admit("c.cc:3", 1, t0 + absl::Seconds(30), &ended));
  EXPECT_TRUE(ended.empty());
}

TEST(LogRateLimiter, TakeAllReportsWindowsStillOpen) {
  LogRateLimiter limiter(1, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::vector<LogRateLimiter::Suppressed> ended;
  EXPECT_TRUE(limiter.Admit("a.cc:1", 2, t0, &ended));
  EXPECT_FALSE(limiter.Admit("a.cc:1", 2, t0, &ended));
  EXPECT_FALSE(limiter.Admit("a.cc:1", 2, t0, &ended));
  EXPECT_TRUE(limiter.Admit("b.cc:1", 2, t0, &ended));
  std::vector<LogRateLimiter::Suppressed> all = limiter.TakeAll();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].key, "a.cc:1");
  EXPECT_EQ(all[0].lines, 2u);
  EXPECT_TRUE(limiter.TakeAll().empty());  // taken
  // The window still runs: more lines are held back, and counted afresh.
  EXPECT_FALSE(limiter.Admit("a.cc:1", 2, t0 + absl::Seconds(1), &ended));
  ASSERT_EQ(limiter.TakeAll().size(), 1u);
}

std::vector<std::string> Lines(const std::ostringstream& out) {
  return absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
}

// spdlog's default logger writing to `out`, plain "[level] message" lines.
void LogTo(std::ostringstream& out) {
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto logger = std::make_shared<spdlog::logger>("test", sink);
  logger->set_pattern("[%l] %v");
  logger->set_level(spdlog::level::trace);
  spdlog::set_default_logger(logger);
}

// Logs as gRPC's code does, from one line of code, and returns that line.
// clang-format off
int LogErrorLine(int i) { gpr_log(GPR_ERROR, "handshake %d failed", i); return __LINE__; }
// clang-format on

TEST(GrpcLogRouter, GrpcLinesGoThroughSpdlogAtMostABurstALine) {
  std::ostringstream out;
  LogTo(out);
  int line_of_log_call = 0;
  {
    GrpcLogRouter router;
    for (int i = 0; i < 20; ++i) line_of_log_call = LogErrorLine(i);
    gpr_log(GPR_ERROR, "another line of code");  // a burst of its own
    const std::vector<std::string> lines = Lines(out);
    ASSERT_EQ(lines.size(), GrpcLogRouter::kBurst + 1u) << out.str();
    const std::string site = absl::StrCat("grpc_log_test.cc:", line_of_log_call);
    EXPECT_EQ(lines[0], absl::StrCat("[error] grpc: handshake 0 failed (", site, ")"));
    EXPECT_EQ(lines[4], absl::StrCat("[error] grpc: handshake 4 failed (", site, ")"));
    EXPECT_NE(lines[5].find("grpc: another line of code (grpc_log_test.cc:"), std::string::npos);
    out.str("");
  }
  // At the router's end what it held back is summed up.
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 1u) << out.str();
  EXPECT_NE(lines[0].find("[error] grpc: 15 more lines from grpc_log_test.cc:"), std::string::npos)
      << lines[0];
  // Past it, gRPC's lines go to stderr, not through spdlog (which may be torn down by then).
  out.str("");
  gpr_log(GPR_ERROR, "after the router");
  EXPECT_EQ(out.str(), "");
}

TEST(GrpcLogRouter, ManyThreadsLoggingFromOneLineWriteOneBurst) {
  std::ostringstream out;
  LogTo(out);
  GrpcLogRouter router;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      // A line of code of its own: the router's limits last for the process, over the tests.
      for (int i = 0; i < 200; ++i) gpr_log(GPR_ERROR, "thread %d, line %d", t, i);
    });
  }
  for (std::thread& t : threads) t.join();
  // Written within one window (this test takes far less than 10 s).
  EXPECT_EQ(Lines(out).size(), static_cast<size_t>(GrpcLogRouter::kBurst)) << out.str();
}

}  // namespace
}  // namespace hstu::server
