// gRPC core's log lines through spdlog (server/grpc_log.h): the rate limit by kind, the summary of
// what it held back (by the timer and at the router's end), and the router as gRPC's code calls it
// (gpr_log), from several threads.

#include "server/grpc_log.h"

#include <grpc/support/log.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "spdlog/spdlog.h"
#include "tests/util/captured_log.h"

namespace hstu::server {
namespace {

using Clock = LogRateLimiter::Clock;
using std::chrono::seconds;

TEST(LogRateLimiter, WritesABurstPerKindAndReportsTheRestOnceTheWindowIsOver) {
  LogRateLimiter limiter(3, seconds(10));
  const Clock::time_point t0 = Clock::time_point() + seconds(1000);
  std::vector<LogRateLimiter::Suppressed> ended;
  int written = 0;
  // One kind: the same site and message but for its digits (a port, a count).
  for (int i = 0; i < 8; ++i) {
    written += limiter.Admit("a.cc:1", absl::StrCat("from 10.0.0.", i, ":5", i), 2, t0 + seconds(i),
                             &ended);
  }
  EXPECT_EQ(written, 3);
  EXPECT_TRUE(ended.empty());
  // Another message at the same site, and another site, are kinds of their own.
  EXPECT_TRUE(limiter.Admit("a.cc:1", "another message", 2, t0 + seconds(9), &ended));
  EXPECT_TRUE(limiter.Admit("b.cc:2", "from 10.0.0.1:51", 1, t0 + seconds(9), &ended));
  EXPECT_TRUE(ended.empty());
  // The first kind's window is over at t0 + 10 s: its 5 held-back lines are reported once, and it
  // writes again.
  EXPECT_TRUE(limiter.Admit("a.cc:1", "from 10.0.0.9:59", 2, t0 + seconds(10), &ended));
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].site, "a.cc:1");
  EXPECT_EQ(ended[0].last_message, "from 10.0.0.7:57");
  EXPECT_EQ(ended[0].lines, 5u);
  EXPECT_EQ(ended[0].level, 2);
  ended.clear();
  EXPECT_TRUE(limiter.Admit("a.cc:1", "from 10.0.0.9:59", 2, t0 + seconds(11), &ended));
  EXPECT_TRUE(ended.empty());
  // Windows with nothing held back report nothing when they end.
  EXPECT_TRUE(limiter.TakeEnded(t0 + seconds(30)).empty());
}

TEST(LogRateLimiter, TakeEndedAndTakeAllReportWithoutANewLine) {
  LogRateLimiter limiter(1, seconds(10));
  const Clock::time_point t0 = Clock::time_point() + seconds(1000);
  std::vector<LogRateLimiter::Suppressed> ended;
  EXPECT_TRUE(limiter.Admit("a.cc:1", "m", 2, t0, &ended));
  EXPECT_FALSE(limiter.Admit("a.cc:1", "m", 2, t0, &ended));
  EXPECT_FALSE(limiter.Admit("a.cc:1", "m", 2, t0, &ended));
  EXPECT_TRUE(limiter.Admit("b.cc:1", "m", 2, t0, &ended));
  EXPECT_FALSE(limiter.Admit("b.cc:1", "m", 2, t0 + seconds(5), &ended));
  // The timer's sweep at t0 + 10 s: a's and b's windows (both from t0) are over.
  std::vector<LogRateLimiter::Suppressed> swept = limiter.TakeEnded(t0 + seconds(10));
  ASSERT_EQ(swept.size(), 2u);
  EXPECT_EQ(swept[0].site, "a.cc:1");
  EXPECT_EQ(swept[0].lines, 2u);
  EXPECT_EQ(swept[1].lines, 1u);
  EXPECT_TRUE(limiter.TakeEnded(t0 + seconds(10)).empty());  // taken
  // At exit, windows still open are reported too, once.
  EXPECT_TRUE(limiter.Admit("a.cc:1", "m", 2, t0 + seconds(11), &ended));
  EXPECT_FALSE(limiter.Admit("a.cc:1", "m", 2, t0 + seconds(11), &ended));
  std::vector<LogRateLimiter::Suppressed> all = limiter.TakeAll();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].lines, 1u);
  EXPECT_TRUE(limiter.TakeAll().empty());
}

// spdlog's default logger writes plain "[level] message" lines for the test, and is put back at
// its end.
class GrpcLogRouterTest : public ::testing::Test {
 protected:
  hstu::testing::CapturedLog log_{"[%l] %v"};
};

// Logs as gRPC's code does, from one line of code, and returns that line.
// clang-format off
int LogHandshakeFailed(int i) { gpr_log(GPR_ERROR, "handshake from port %d failed", i); return __LINE__; }
// clang-format on

TEST_F(GrpcLogRouterTest, GrpcLinesGoThroughSpdlogAtMostABurstOfAKind) {
  int line = 0;
  {
    GrpcLogRouter router;
    for (int i = 0; i < 20; ++i) line = LogHandshakeFailed(40000 + i);
    gpr_log(GPR_ERROR, "another line of code");  // a kind of its own
    const std::vector<std::string> lines = log_.Lines();
    ASSERT_EQ(lines.size(), GrpcLogRouter::kBurst + 1u) << log_.str();
    const std::string site = absl::StrCat("grpc_log_test.cc:", line);
    EXPECT_EQ(lines[0],
              absl::StrCat("[error] grpc-core: handshake from port 40000 failed (", site, ")"));
    EXPECT_EQ(lines[4],
              absl::StrCat("[error] grpc-core: handshake from port 40004 failed (", site, ")"));
    EXPECT_NE(lines[5].find("grpc-core: another line of code (grpc_log_test.cc:"),
              std::string::npos);
    log_.Clear();
  }
  // At the router's end what it held back is summed up, with the last such line.
  const std::vector<std::string> lines = log_.Lines();
  ASSERT_EQ(lines.size(), 1u) << log_.str();
  EXPECT_EQ(lines[0],
            absl::StrCat("[error] grpc-core: 15 more lines like this were not written (at "
                         "most 5 of a kind in 10 s): handshake from port 40019 failed "
                         "(grpc_log_test.cc:",
                         line, ")"));
  // Past it, gRPC's lines go to stderr, not through spdlog (which may be torn down by then).
  log_.Clear();
  gpr_log(GPR_ERROR, "after the router");
  EXPECT_EQ(log_.str(), "");
}

TEST_F(GrpcLogRouterTest, TheTimerWritesTheSummaryOnceTheWindowIsOver) {
  GrpcLogRouter router;
  for (int i = 0; i < GrpcLogRouter::kBurst + 2; ++i) LogHandshakeFailed(i);
  // No further gRPC line: the timer (every second) writes the summary after the 10 s window.
  const auto end = std::chrono::steady_clock::now() + GrpcLogRouter::kWindow + seconds(5);
  while (log_.str().find("2 more lines") == std::string::npos &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(log_.str().find("grpc-core: 2 more lines like this"), std::string::npos) << log_.str();
}

TEST_F(GrpcLogRouterTest, ManyThreadsLoggingOneKindWriteOneBurst) {
  GrpcLogRouter router;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) gpr_log(GPR_ERROR, "thread %d, line %d", t, i);
    });
  }
  for (std::thread& t : threads) t.join();
  // Written within one window (this test takes far less than 10 s).
  EXPECT_EQ(log_.Lines().size(), static_cast<size_t>(GrpcLogRouter::kBurst)) << log_.str();
}

TEST_F(GrpcLogRouterTest, WithGrpcTraceSetNothingIsHeldBack) {
  ASSERT_EQ(setenv("GRPC_TRACE", "http", 1), 0);  // no other thread reads the environment here
  {
    GrpcLogRouter router;
    for (int i = 0; i < 20; ++i) LogHandshakeFailed(i);
  }
  unsetenv("GRPC_TRACE");
  EXPECT_EQ(log_.Lines().size(), 20u) << log_.str();
}

}  // namespace
}  // namespace hstu::server
