// The real server in-process on loopback, driven by a real gRPC client: scores against a separate
// engine (the reference), validation errors, deadlines, queue limits, cancellation, concurrency
// with repeated users, engine failures and the /metrics exposition. server_lifecycle_test.cc
// covers signals, drains, stalls and a lost device.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "prometheus/text_serializer.h"
#include "server/metrics.h"
#include "server/prom_family.h"
#include "server/rank_service.h"
#include "server/ranking_server.h"
#include "server/validation.h"
#include "tests/integration/raw_rank.h"
#include "tests/integration/server_fixture.h"
#include "tests/integration/test_util.h"
#include "tests/util/faulty_backend.h"
#include "tests/util/tolerance.h"

namespace hstu::server {
namespace {

using namespace std::chrono_literals;
using fixture::Gate;
using fixture::MakeRequest;
using fixture::Prefix;
using fixture::ServerTest;
using hstu::testing::ParseExposition;

// The engine's running totals are mirrored into prometheus-cpp counters at each scrape: a counter
// only moves up, and a series is one object however often it is asked for.
TEST(PromFamily, MirroredTotalsOnlyMoveUpAndASeriesIsMadeOnce) {
  prometheus::Registry registry;
  const LabeledFamily<prometheus::Counter> family =
      RegisterCounter(registry, "hstu_test_total", "A test counter.", {"kind"});
  prometheus::Counter& a = family.WithLabels({"a"});
  EXPECT_EQ(&family.WithLabels({"a"}), &a);
  EXPECT_NE(&family.WithLabels({"b"}), &a);
  MirrorTotal(a, 5);
  EXPECT_EQ(a.Value(), 5);
  MirrorTotal(a, 3);  // a smaller total (never the engine's) leaves the counter alone
  EXPECT_EQ(a.Value(), 5);
  MirrorTotal(a, 7.5);
  EXPECT_EQ(a.Value(), 7.5);
  const LabeledFamily<prometheus::Histogram> h =
      RegisterHistogram(registry, "hstu_test_seconds", "A test histogram.", {0.1, 1});
  h.WithLabels({}).Observe(0.5);
  h.WithLabels({}).Observe(2);
  const std::string page = prometheus::TextSerializer().Serialize(registry.Collect());
  EXPECT_NE(page.find("hstu_test_total{kind=\"a\"} 7.5"), std::string::npos) << page;
  EXPECT_NE(page.find("hstu_test_seconds_bucket{le=\"1\"} 1"), std::string::npos) << page;
  EXPECT_NE(page.find("hstu_test_seconds_count 2"), std::string::npos) << page;
}

TEST_F(ServerTest, HealthIsServingAndModelInfoDescribesTheModel) {
  StartServer();
  ExpectHealth(grpc::health::v1::HealthCheckResponse::SERVING);
  grpc::ClientContext ctx;
  hstu::v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&ctx, hstu::v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_name(), "hstu-tiny");
  EXPECT_EQ(info.num_layers(), 2u);
  EXPECT_EQ(info.hidden_dim(), 64u);
  EXPECT_EQ(info.num_tasks(), 3u);
  EXPECT_EQ(info.max_history_tokens(), 256u);
  EXPECT_EQ(info.max_candidates(), 1024u);
  EXPECT_EQ(info.candidates_per_forward(), 64u);
  EXPECT_EQ(info.num_actions(), 16u);
  EXPECT_EQ(info.item_rows(), 1000u);
  EXPECT_EQ(info.truncation_stride(), 64u);  // the default, M / 4
  EXPECT_EQ(info.page_size(), 32u);
  EXPECT_EQ(info.device(), "cpu");
}

TEST_F(ServerTest, ScoresAndReuseEqualTheEngineForTheSameRequests) {
  StartServer();
  auto reference = ReferenceEngine();
  // Growing histories of three users, interleaved, one shorter (edited) history, 150 candidates
  // (more than the 64 of one forward, so chunked), and a history past the model's maximum.
  std::vector<hstu::v1::RankRequest> seq;
  const auto a = MakeRequest(1, 100, 150, 1), b = MakeRequest(2, 40, 10, 2),
             c = MakeRequest(3, 200, 5, 3);
  seq = {Prefix(a, 30), Prefix(b, 20), Prefix(a, 45), b, Prefix(a, 100), Prefix(b, 10),
         Prefix(c, 120), c};
  for (size_t i = 0; i < seq.size(); ++i) {
    hstu::v1::RankResponse resp;
    const grpc::Status s = Rank(seq[i], &resp);
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
    const RankRequest engine_req = FromProto(seq[i]);
    auto ref = reference->Rank({&engine_req, 1});
    ASSERT_TRUE(ref[0].ok()) << ref[0].status();
    EXPECT_EQ(resp.request_id(), seq[i].request_id());
    EXPECT_EQ(resp.num_tasks(), 3u);
    ASSERT_EQ(resp.scores_size(), static_cast<int>(ref[0]->scores.size())) << i;
    for (int k = 0; k < resp.scores_size(); ++k) {
      // One request per batch on both sides: the same arithmetic, so the same bits.
      ASSERT_EQ(resp.scores(k), ref[0]->scores[k]) << "request " << i << " score " << k;
      ASSERT_GT(resp.scores(k), 0.f);
      ASSERT_LT(resp.scores(k), 1.f);
    }
    EXPECT_EQ(resp.reused_tokens(), ref[0]->reused_tokens) << i;
    EXPECT_EQ(resp.computed_tokens(), ref[0]->computed_tokens) << i;
    EXPECT_EQ(resp.cache_result(), LookupResultName(ref[0]->cache_result)) << i;
  }
}

TEST_F(ServerTest, EveryValidationErrorIsInvalidArgumentNamingTheField) {
  ServerOptions o;
  o.engine.limits.max_candidates = 100;
  o.max_message_bytes = 64 << 10;
  StartServer(o);
  const auto good = MakeRequest(9, 10, 4, 9);
  struct Case {
    std::string name, field;
    hstu::v1::RankRequest req;
  };
  std::vector<Case> cases;
  {
    auto r = good;
    r.add_history_actions(1);
    cases.push_back({"unequal history arrays", "history_actions", r});
  }
  {
    auto r = good;
    r.set_history_item_ids(3, -5);
    cases.push_back({"negative history item", "history_item_ids[3]", r});
  }
  {
    auto r = good;
    r.set_history_actions(2, 16);
    cases.push_back({"action out of range", "history_actions[2]", r});
  }
  {
    auto r = good;
    r.set_history_actions(0, -1);
    cases.push_back({"negative action", "history_actions[0]", r});
  }
  {
    auto r = good;
    r.clear_candidate_item_ids();
    cases.push_back({"no candidates", "candidate_item_ids", r});
  }
  {
    auto r = good;
    for (int i = 0; i < 97; ++i) r.add_candidate_item_ids(i);
    cases.push_back({"too many candidates", "candidate_item_ids", r});
  }
  {
    auto r = good;
    r.set_candidate_item_ids(1, -2);
    cases.push_back({"negative candidate", "candidate_item_ids[1]", r});
  }
  {
    auto r = good;
    r.set_request_id(std::string(300, 'x'));  // echoed back: bounded like the reply
    cases.push_back({"request_id too long", "request_id", r});
  }
  for (const Case& c : cases) {
    hstu::v1::RankResponse resp;
    const grpc::Status s = Rank(c.req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_NE(s.error_message().find(c.field), std::string::npos)
        << c.name << ": '" << s.error_message() << "' does not name " << c.field;
  }
  // Oversize message: gRPC's own limit (--max_message_bytes) answers RESOURCE_EXHAUSTED.
  auto big = good;
  for (int i = 0; i < 40000; ++i) {
    big.add_history_item_ids(i);
    big.add_history_actions(1);
  }
  ASSERT_GT(big.ByteSizeLong(), 64u << 10);
  hstu::v1::RankResponse resp;
  EXPECT_EQ(Rank(big, &resp).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // None of them reached the engine; a valid request still works.
  EXPECT_FALSE(gate_.Saw(9));
  EXPECT_TRUE(Rank(good, &resp).ok());
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "INVALID_ARGUMENT"}}), static_cast<double>(cases.size()));
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "OK"}}), 1);
}

TEST_F(ServerTest, BytesThatDoNotParseAreInvalidArgumentAndCounted) {
  // Before: gRPC refused them before the service saw them, as UNIMPLEMENTED with no message (as
  // if the method did not exist), and no metric counted them.
  StartServer();
  const auto good = MakeRequest(9, 10, 4, 9);
  const std::string bytes = good.SerializeAsString();
  const std::string bad_utf8 = hstu::testing::WithNonUtf8RequestId(good);
  for (const auto& [name, b] : std::vector<std::pair<std::string, std::string>>{
           {"truncated", bytes.substr(0, bytes.size() - 3)},
           {"request_id not UTF-8", bad_utf8},
           {"a length past the end", std::string("\x08\x01\x12\x05\x01", 5)},
           {"wire type 7, which does not exist", std::string("\x08\x01\x0f\x01", 4)}}) {
    std::string reply;
    const grpc::Status s = hstu::testing::RankBytes(channel_, b, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("does not parse as hstu.v1.RankRequest"), std::string::npos)
        << name << ": " << s.error_message();
  }
  // The same bytes whole are a request like any other.
  std::string reply;
  ASSERT_TRUE(hstu::testing::RankBytes(channel_, bytes, &reply).ok());
  hstu::v1::RankResponse parsed, typed;
  ASSERT_TRUE(parsed.ParseFromString(reply));
  EXPECT_EQ(parsed.request_id(), good.request_id());
  EXPECT_EQ(parsed.scores_size(), 4 * static_cast<int>(parsed.num_tasks()));
  ASSERT_TRUE(Rank(good, &typed).ok());
  EXPECT_EQ(typed.scores_size(), parsed.scores_size());
  // The second call reuses the first's cached K/V: equal within fp32 rounding (BLAS may sum a row
  // in another order when its call has fewer rows).
  for (int i = 0; i < typed.scores_size(); ++i) {
    EXPECT_NEAR(typed.scores(i), parsed.scores(i), hstu::test::kF32Abs) << i;
  }
  EXPECT_EQ(gate_.seen_count(), 2);  // only the two whole requests reached the engine
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "INVALID_ARGUMENT"}}), 4);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "OK"}}), 2);
  // GetModelInfo alike (before: UNIMPLEMENTED, no message); its empty message, or one with
  // fields it does not know, is answered.
  const std::string info_method = "/hstu.v1.Ranker/GetModelInfo";
  const grpc::Status bad = hstu::testing::CallBytes(channel_, info_method, "\xff\xff", &reply);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.error_message();
  EXPECT_NE(bad.error_message().find("does not parse as hstu.v1.GetModelInfoRequest"),
            std::string::npos);
  for (const std::string& b : {std::string(), std::string("\x08\x01", 2)}) {
    ASSERT_TRUE(hstu::testing::CallBytes(channel_, info_method, b, &reply).ok());
    hstu::v1::ModelInfo info;
    ASSERT_TRUE(info.ParseFromString(reply));
    EXPECT_GT(info.num_layers(), 0u);
  }
}

TEST_F(ServerTest, ACallWhoseMessageNeverCameIsCountedAsTheClientEndedIt) {
  // A client that gives up before its message is sent: the raw method is handed no bytes. Before,
  // they failed to parse and were counted as INVALID_ARGUMENT, a client's bug, when the client
  // had only cancelled or timed out (18 of ~4,000 calls under a 2 ms deadline).
  StartServer();
  hstu::testing::RankWithoutAMessage(channel_, hstu::testing::CallEnd::kCancel, 30s);
  hstu::testing::RankWithoutAMessage(channel_, hstu::testing::CallEnd::kDeadline, 300ms);
  // The server counts each once it has seen the call end: wait for both.
  const auto end = std::chrono::steady_clock::now() + 20s;
  hstu::testing::Exposition m;
  do {
    std::this_thread::sleep_for(20ms);
    m = Scrape();
  } while (m.Sum("hstu_requests_total") < 2 && std::chrono::steady_clock::now() < end);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "CANCELLED"}}), 1);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "DEADLINE_EXCEEDED"}}), 1);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "INVALID_ARGUMENT"}}), 0);
  EXPECT_EQ(gate_.seen_count(), 0);
}

TEST_F(ServerTest, ExpiredDeadlineAnswersDeadlineExceededWithoutEngineWork) {
  StartServer();
  gate_.Close();
  // User 1 holds the engine at the gate; user 2 waits in the queue past its deadline.
  std::thread blocker([&] {
    hstu::v1::RankResponse r;
    EXPECT_TRUE(Rank(MakeRequest(1, 5, 3, 1), &r).ok());
  });
  ASSERT_TRUE(gate_.WaitEntered(1));  // the warm-up bypasses the gate
  hstu::v1::RankResponse resp;
  // 1 s: time enough on a loaded machine for the call to reach the queue before it expires.
  EXPECT_EQ(Rank(MakeRequest(2, 5, 3, 2), &resp, 1s).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // gRPC sends the deadline as a timeout that the server counts from when it receives the call,
  // which on a loaded machine can be well after the client sent it: open the gate only once the
  // call is queued and its deadline has passed on the server's clock too.
  // The server received it before it was seen queued, so its deadline, at most 1 s after
  // receipt, has passed 1 s after that.
  for (int i = 0; i < 1000 && Scrape().Sum("hstu_queue_depth") < 1; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  const auto seen_queued = std::chrono::steady_clock::now();
  ASSERT_EQ(Scrape().Sum("hstu_queue_depth"), 1);
  std::this_thread::sleep_until(seen_queued + 1s + 10ms);
  gate_.Open();
  blocker.join();
  EXPECT_FALSE(gate_.Saw(2));
  // The server answers it when its turn comes; the metric says DEADLINE_EXCEEDED.
  for (int i = 0; i < 100; ++i) {
    if (Scrape().Sum("hstu_requests_total", {{"code", "DEADLINE_EXCEEDED"}}) == 1) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(Scrape().Sum("hstu_requests_total", {{"code", "DEADLINE_EXCEEDED"}}), 1);
}

TEST_F(ServerTest, ACallThatExpiresDuringItsBatchIsCountedAsTheClientSawIt) {
  // Before: the batch's OK was counted, while the client had DEADLINE_EXCEEDED.
  StartServer();
  gate_.Close();
  hstu::v1::RankResponse resp;
  std::thread caller([&] {
    // 2 s: time enough on a loaded machine to reach the engine before it expires.
    EXPECT_EQ(Rank(MakeRequest(1, 5, 3, 1), &resp, 2s).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  });
  ASSERT_TRUE(gate_.WaitEntered(1));  // in the engine
  // The server's copy of the deadline, at most 2 s after it received the call, passes too.
  const auto entered = std::chrono::steady_clock::now();
  caller.join();
  std::this_thread::sleep_until(entered + 2s + 10ms);
  gate_.Open();
  for (int i = 0; i < 100; ++i) {
    if (Scrape().Sum("hstu_requests_total", {{"code", "DEADLINE_EXCEEDED"}}) == 1) break;
    std::this_thread::sleep_for(20ms);
  }
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "DEADLINE_EXCEEDED"}}), 1);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "OK"}}), 0);
}

TEST(TimeLeft, SaturatesFarDeadlinesToNone) {
  const gpr_timespec now = gpr_now(GPR_CLOCK_REALTIME);
  auto at = [&](int64_t seconds) {
    gpr_timespec t = now;
    t.tv_sec += seconds;
    return t;
  };
  EXPECT_FALSE(TimeLeft(gpr_inf_future(GPR_CLOCK_REALTIME), now).has_value());
  EXPECT_EQ(TimeLeft(at(5), now), std::chrono::nanoseconds(5s));
  EXPECT_EQ(TimeLeft(at(-1), now), std::chrono::nanoseconds(0));
  // 2562047 hours (~292 years, what some clients send for "forever") and more: no deadline.
  EXPECT_FALSE(TimeLeft(at(int64_t{2562047} * 3600), now).has_value());
  EXPECT_FALSE(TimeLeft(at(int64_t{99999999} * 3600), now).has_value());
  EXPECT_EQ(TimeLeft(at(3600), now), std::chrono::nanoseconds(1h));
}

TEST(AsSeenByTheClient, KeepsServerFailuresAndTellsDeadlinesFromCancels) {
  const auto now = Clock::now();
  EXPECT_EQ(AsSeenByTheClient(absl::OkStatus(), now - 1ms, now).code(),
            absl::StatusCode::kDeadlineExceeded);
  // The client's deadline passes a network trip before the server's copy.
  EXPECT_EQ(AsSeenByTheClient(absl::OkStatus(), now + kDeadlineSlack / 2, now).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(AsSeenByTheClient(absl::CancelledError(), now + kDeadlineSlack / 2, now).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(AsSeenByTheClient(absl::OkStatus(), now + 1s, now).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(AsSeenByTheClient(absl::OkStatus(), Clock::time_point::max(), now).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(AsSeenByTheClient(absl::InternalError("x"), now - 1ms, now).code(),
            absl::StatusCode::kInternal);
}

TEST(AsCounted, AnOkReadyOnlyAfterTheDeadlineIsCountedAsTheClientSawIt) {
  const auto now = Clock::now();
  // Before: a call whose deadline timer had not yet marked it cancelled was counted OK, though
  // gRPC dropped the answer (the client saw 107 OK, the server counted 141, under a 4 ms deadline).
  EXPECT_EQ(AsCounted(absl::OkStatus(), false, now - 1ms, now).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(AsCounted(absl::OkStatus(), false, now, now).code(),
            absl::StatusCode::kDeadlineExceeded);
  // Answered in time and not cancelled: counted as answered, whatever it was.
  EXPECT_EQ(AsCounted(absl::OkStatus(), false, now + 1ms, now).code(), absl::StatusCode::kOk);
  EXPECT_EQ(AsCounted(absl::OkStatus(), false, Clock::time_point::max(), now).code(),
            absl::StatusCode::kOk);
  EXPECT_EQ(AsCounted(absl::InvalidArgumentError("x"), false, now + 1s, now).code(),
            absl::StatusCode::kInvalidArgument);
  // The server's own failure stays what it was, past the deadline too.
  EXPECT_EQ(AsCounted(absl::InternalError("x"), false, now - 1ms, now).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(AsCounted(absl::InternalError("x"), true, now - 1ms, now).code(),
            absl::StatusCode::kInternal);
  // Cancelled: as the client saw it.
  EXPECT_EQ(AsCounted(absl::OkStatus(), true, now + 1s, now).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(AsCounted(absl::OkStatus(), true, now + kDeadlineSlack / 2, now).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ServerTest, FullQueueAnswersResourceExhausted) {
  ServerOptions o;
  o.scheduler.max_queue = 3;
  o.scheduler.max_queue_per_user = 1;
  StartServer(o);
  gate_.Close();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  auto send = [&](uint64_t user) {
    threads.emplace_back([&, user] {
      hstu::v1::RankResponse r;
      if (Rank(MakeRequest(user, 5, 3, user), &r).ok()) ++ok;
    });
  };
  send(1);
  ASSERT_TRUE(gate_.WaitEntered(1));
  send(2);
  send(3);
  ASSERT_EQ(AwaitQueueDepth(2), 2);
  hstu::v1::RankResponse resp;
  // User 2 has its one queued request: its next call is turned away, other users' are not.
  const grpc::Status user_full = Rank(MakeRequest(2, 6, 3, 2), &resp);
  EXPECT_EQ(user_full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(user_full.error_message().find("user 2 already has 1 requests queued"),
            std::string::npos)
      << user_full.error_message();
  send(4);
  ASSERT_EQ(AwaitQueueDepth(3), 3);
  const grpc::Status full = Rank(MakeRequest(5, 5, 3, 5), &resp);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(full.error_message().find("queue is full"), std::string::npos);
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_queue_depth"), 3);
  EXPECT_EQ(m.Sum("hstu_queue_rejections_total", {{"reason", "user_queue_full"}}), 1);
  EXPECT_EQ(m.Sum("hstu_queue_rejections_total", {{"reason", "queue_full"}}), 1);
  EXPECT_EQ(m.Sum("hstu_queue_rejections_total", {{"reason", "shutting_down"}}), 0);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "RESOURCE_EXHAUSTED"}}), 2);
  gate_.Open();
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4);
}

TEST_F(ServerTest, TheQueuedTokensAreBounded) {
  // Before: only the number of queued requests was bounded, and requests of 2^20 events (~29 MiB
  // each once parsed) could take a replica out of memory. The budget counts every event a request
  // carries, also those past the model's maximum history (256 tokens here), which it holds in
  // memory all the same.
  ServerOptions o;
  o.scheduler.max_queued_tokens = 1000;
  StartServer(o);
  gate_.Close();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  auto send = [&](uint64_t user, int events) {
    threads.emplace_back([&, user, events] {
      hstu::v1::RankResponse r;
      if (Rank(MakeRequest(user, events, 3, user), &r).ok()) ++ok;
    });
  };
  send(1, 5);
  ASSERT_TRUE(gate_.WaitEntered(1));
  send(2, 300);  // 603 estimated tokens (259 once the history is cut to the model's 256)
  ASSERT_EQ(AwaitQueueDepth(1), 1);
  hstu::v1::RankResponse resp;
  const grpc::Status full = Rank(MakeRequest(3, 300, 3, 3), &resp);  // 603 more: past 1000
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(full.error_message().find("--max_queued_tokens"), std::string::npos)
      << full.error_message();
  EXPECT_EQ(Scrape().Sum("hstu_queue_rejections_total", {{"reason", "queue_full"}}), 1);
  send(4, 50);  // 103 more: fits
  EXPECT_EQ(AwaitQueueDepth(2), 2);
  gate_.Open();
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 3);
}

TEST_F(ServerTest, AFarDeadlineIsNoDeadline) {
  // A sanity check end to end: the C++ client caps a far deadline itself before it sends it. The
  // raw grpc-timeout some clients send for "forever" (2562047H, ~292 years), which overflowed the
  // server's std::chrono conversion (DEADLINE_EXCEEDED at once; undefined behaviour), is
  // TimeLeft's test above.
  StartServer();
  grpc::ClientContext ctx;
  gpr_timespec forever = gpr_now(GPR_CLOCK_REALTIME);
  forever.tv_sec += int64_t{99999999} * 3600;
  ctx.set_deadline(forever);
  hstu::v1::RankResponse resp;
  const grpc::Status s = stub_->Rank(&ctx, MakeRequest(1, 5, 3, 1), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(ServerTest, ASecondServerCannotShareThePort) {
  // Before: gRPC's SO_REUSEPORT let a second server bind the same port and take half of the new
  // connections, silently.
  StartServer();
  ServerOptions o;
  o.listen = absl::StrCat("127.0.0.1:", server_->port());
  o.metrics_listen = "";
  o.engine.device = "cpu";
  auto second = RankingServer::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot listen"), std::string::npos) << second.status();
}

TEST_F(ServerTest, CancelledCallIsDroppedBeforeTheEngine) {
  StartServer();
  gate_.Close();
  std::thread blocker([&] {
    hstu::v1::RankResponse r;
    EXPECT_TRUE(Rank(MakeRequest(1, 5, 3, 1), &r).ok());
  });
  ASSERT_TRUE(gate_.WaitEntered(1));
  grpc::ClientContext ctx;
  hstu::v1::RankResponse resp;
  const auto req = MakeRequest(2, 5, 3, 2);
  std::atomic<bool> finished{false};
  grpc::Status status;
  stub_->async()->Rank(&ctx, &req, &resp, [&](grpc::Status s) {
    status = s;
    finished = true;
  });
  ASSERT_EQ(AwaitQueueDepth(1), 1);
  ctx.TryCancel();
  for (int i = 0; i < 250 && !finished; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(finished);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  // The client sees its own cancellation at once; give the RST_STREAM time to reach the server
  // before the queued call's turn comes.
  std::this_thread::sleep_for(1s);
  gate_.Open();
  blocker.join();
  EXPECT_FALSE(gate_.Saw(2));
}

TEST_F(ServerTest, EngineFailureAnswersInternalAndServingContinues) {
  StartServer();
  hstu::v1::RankResponse resp;
  const grpc::Status s = Rank(MakeRequest(Gate::kFailUser, 5, 3, 1), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_TRUE(Rank(MakeRequest(5, 5, 3, 1), &resp).ok());
}

TEST_F(ServerTest, ConcurrentClientsWithRepeatedUsersLoseNothingAndReuseCorrectly) {
  ServerOptions o;
  o.scheduler.max_batch_size = 4;
  StartServer(o);
  auto reference = ReferenceEngine();
  // Hot users 100..103 always send the same history: after their first request the whole
  // history is reused. Each thread also owns a user whose history grows by 3 events per visit:
  // exactly the previous history is reused.
  constexpr int kThreads = 6, kIters = 25;
  std::vector<hstu::v1::RankRequest> hot;
  std::vector<std::vector<float>> hot_ref;
  for (int u = 0; u < 4; ++u) {
    hot.push_back(MakeRequest(100 + u, 30 + 5 * u, 8, 5));
    const RankRequest e = FromProto(hot.back());
    auto r = reference->Rank({&e, 1});
    ASSERT_TRUE(r[0].ok());
    hot_ref.push_back(r[0]->scores);
  }
  std::atomic<int> ok{0}, fully_computed_hot{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto stub = hstu::v1::Ranker::NewStub(channel_);
      const auto own = MakeRequest(1000 + t, 3 * kIters, 6, 7);
      for (int i = 0; i < kIters; ++i) {
        hstu::v1::RankResponse resp;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + 20s);
        const int events = 3 * (i + 1);
        if (!stub->Rank(&ctx, Prefix(own, events), &resp).ok()) {
          ++failures;
          continue;
        }
        ++ok;
        if (resp.reused_tokens() != static_cast<uint32_t>(2 * 3 * i) ||
            resp.computed_tokens() != 6u) {
          ++failures;
        }
        const int h = (t + i) % 4;
        grpc::ClientContext ctx2;
        ctx2.set_deadline(std::chrono::system_clock::now() + 20s);
        hstu::v1::RankResponse hot_resp;
        if (!stub->Rank(&ctx2, hot[h], &hot_resp).ok()) {
          ++failures;
          continue;
        }
        ++ok;
        const uint32_t tokens = 2 * hot[h].history_item_ids_size();
        if (hot_resp.reused_tokens() + hot_resp.computed_tokens() != tokens) ++failures;
        if (hot_resp.computed_tokens() == tokens) ++fully_computed_hot;
        for (int k = 0; k < hot_resp.scores_size(); ++k) {
          // Batched with other users: allow float reassociation.
          if (std::abs(hot_resp.scores(k) - hot_ref[h][k]) > 1e-5f) ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(ok.load(), 2 * kThreads * kIters);
  // Each hot user is computed once; every later request of it reuses the whole history.
  EXPECT_EQ(fully_computed_hot.load(), 4);
  EXPECT_FALSE(gate_.duplicate_in_batch());
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "OK"}}), 2 * kThreads * kIters);
  EXPECT_EQ(m.Sum("hstu_request_duration_seconds_count", {{"code", "OK"}}), 2 * kThreads * kIters);
  EXPECT_EQ(m.Sum("hstu_inflight_requests"), 0);
}

// A client that connects to /metrics and trickles its request a byte a second.
class TricklingClient {
 public:
  explicit TricklingClient(int port) {
    fd_ = testing::ConnectLoopback(port);
    connected_ = fd_ >= 0;
    thread_ = std::thread([this] {
      const std::string req = "GET /metrics HTTP/1.1\r\n";
      for (size_t i = 0; !stop_ && i < req.size(); ++i) {
        if (send(fd_, &req[i], 1, MSG_NOSIGNAL) != 1) break;  // the server closed it
        for (int t = 0; t < 10 && !stop_; ++t) std::this_thread::sleep_for(100ms);
      }
    });
  }
  ~TricklingClient() {
    stop_ = true;
    thread_.join();
    close(fd_);
  }
  bool connected() const { return connected_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TEST_F(ServerTest, ASlowMetricsClientHoldsNeitherTheScrapeNorTheShutdown) {
  // A trickling client used to hold the exposer (and the shutdown, which joins it) for as long as
  // it kept sending. Now a connection gets 2 s in all, and connections are served side by side.
  StartServer();
  TricklingClient slow(server_->metrics_port());
  ASSERT_TRUE(slow.connected());
  std::this_thread::sleep_for(200ms);  // accepted first
  auto start = std::chrono::steady_clock::now();
  auto body = testing::HttpGet(server_->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_NE(body->find("hstu_requests_total"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
  TricklingClient slow2(server_->metrics_port());
  ASSERT_TRUE(slow2.connected());
  std::this_thread::sleep_for(200ms);
  start = std::chrono::steady_clock::now();
  server_->Shutdown(absl::Seconds(5));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
}

TEST_F(ServerTest, IdleMetricsConnectionsDelayNoScrape) {
  // Before: connections were served one at a time, 2 s each: 20 idle ones held a scrape 34 s.
  StartServer();
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    const int fd = testing::ConnectLoopback(server_->metrics_port());
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(200ms);  // accepted first
  const auto start = std::chrono::steady_clock::now();
  auto body = testing::HttpGet(server_->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  for (const int fd : idle) close(fd);
}

TEST_F(ServerTest, MetricsEndpointAnswersOddRequestsPlainly) {
  StartServer();
  const int port = server_->metrics_port();
  // A request ended by bare line feeds (before: no reply, the connection held 2 s).
  const auto start = std::chrono::steady_clock::now();
  const std::string lf = testing::RawHttp(port, "GET /metrics HTTP/1.0\n\n");
  EXPECT_EQ(lf.rfind("HTTP/1.1 200 OK", 0), 0u) << lf;
  EXPECT_NE(lf.find("hstu_requests_total"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  // A request line without a version (HTTP/0.9: complete at its line's end, no headers follow),
  // or with doubled spaces, names the same target.
  for (const char* request : {"GET /metrics\r\n", "GET  /metrics  HTTP/1.1\r\n\r\n"}) {
    const std::string reply = testing::RawHttp(port, request);
    EXPECT_EQ(reply.rfind("HTTP/1.1 200 OK", 0), 0u) << request << reply;
    EXPECT_NE(reply.find("hstu_requests_total"), std::string::npos) << request;
  }
  // HEAD: the headers of GET, no body (before: 405).
  const std::string head = testing::RawHttp(port, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK", 0), 0u) << head;
  EXPECT_EQ(head.find("hstu_requests_total"), std::string::npos);
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n");
  // Another method: 405 with the methods allowed (before: no Allow header).
  const std::string post = testing::RawHttp(port, "POST /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(post.rfind("HTTP/1.1 405", 0), 0u) << post;
  EXPECT_NE(post.find("Allow: GET, HEAD\r\n"), std::string::npos) << post;
  // Errors are plain text, not labelled as the exposition format.
  const std::string missing = testing::RawHttp(port, "GET /nothing HTTP/1.1\r\n\r\n");
  EXPECT_EQ(missing.rfind("HTTP/1.1 404", 0), 0u) << missing;
  EXPECT_NE(missing.find("Content-Type: text/plain; charset=utf-8\r\n"), std::string::npos);
  // A header block past 16 KiB: 431, delivered whole although the client's bytes were not all
  // read (before: the request line was served and the close reset the connection).
  const std::string big =
      testing::RawHttp(port, "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(40000, 'a'));
  EXPECT_EQ(big.rfind("HTTP/1.1 431", 0), 0u) << big.substr(0, 200);
  EXPECT_NE(big.find("over 16384 bytes"), std::string::npos) << big.substr(0, 200);
  // Two pipelined requests: the first is answered whole, then the connection closes.
  const std::string two =
      testing::RawHttp(port, "GET /metrics HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n");
  ASSERT_EQ(two.rfind("HTTP/1.1 200 OK", 0), 0u) << two.substr(0, 200);
  const size_t length_at = two.find("Content-Length: ");
  const size_t body_at = two.find("\r\n\r\n");
  ASSERT_NE(length_at, std::string::npos);
  ASSERT_NE(body_at, std::string::npos);
  EXPECT_EQ(two.size() - (body_at + 4), std::stoul(two.substr(length_at + 16)));
}

TEST_F(ServerTest, EveryCodeTheServerAnswersHasASeriesFromTheStart) {
  // Before: only code="OK" existed until the first failure, whose series then appeared at its
  // value, a step that rate() and increase() do not see.
  StartServer();
  const auto m = Scrape();
  for (const char* code : {"OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                           "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE"}) {
    const bool present = std::any_of(m.samples.begin(), m.samples.end(), [&](const auto& s) {
      return s.name == "hstu_requests_total" && s.labels.count("code") &&
             s.labels.at("code") == code;
    });
    EXPECT_TRUE(present) << code;
  }
  for (const char* reason : {"queue_full", "user_queue_full", "shutting_down", "starting"}) {
    const bool present = std::any_of(m.samples.begin(), m.samples.end(), [&](const auto& s) {
      return s.name == "hstu_queue_rejections_total" && s.labels.count("reason") &&
             s.labels.at("reason") == reason;
    });
    EXPECT_TRUE(present) << reason;
  }
}

TEST_F(ServerTest, MetricsExposeEveryFamilyWithSaneValues) {
  StartServer();
  hstu::v1::RankResponse resp;
  const auto req = MakeRequest(1, 20, 5, 1);
  ASSERT_TRUE(Rank(req, &resp).ok());
  ASSERT_TRUE(Rank(req, &resp).ok());
  auto bad = req;
  bad.clear_candidate_item_ids();
  ASSERT_FALSE(Rank(bad, &resp).ok());
  const auto m = Scrape();
  const std::map<std::string, std::string> want = {
      {"hstu_request_duration_seconds", "histogram"},
      {"hstu_request_queue_seconds", "histogram"},
      {"hstu_batch_compute_seconds", "histogram"},
      {"hstu_kv_onload_wait_seconds", "histogram"},
      {"hstu_batch_size", "histogram"},
      {"hstu_batch_tokens", "histogram"},
      {"hstu_requests_total", "counter"},
      {"hstu_inflight_requests", "gauge"},
      {"hstu_queue_depth", "gauge"},
      {"hstu_kv_lookups_total", "counter"},
      {"hstu_kv_tokens_total", "counter"},
      {"hstu_kv_pages", "gauge"},
      {"hstu_kv_transfer_bytes_total", "counter"},
      {"hstu_kv_evictions_total", "counter"},
      {"hstu_kv_onload_bandwidth_bytes_per_second", "gauge"},
      {"hstu_kv_recompute_seconds_per_token", "gauge"},
      {"hstu_cuda_graph_replays_total", "counter"},
      {"hstu_cuda_graph_fallbacks_total", "counter"},
      {"hstu_gpu_memory_bytes", "gauge"},
      {"hstu_engine_compute_seconds_total", "counter"},
      {"hstu_engine_device_seconds_total", "counter"},
      {"hstu_build_info", "gauge"},
  };
  for (const auto& [name, type] : want) {
    ASSERT_TRUE(m.types.contains(name)) << name;
    EXPECT_EQ(m.types.at(name), type) << name;
    EXPECT_FALSE(m.helps.at(name).empty()) << name;
    EXPECT_TRUE(m.Has(type == "histogram" ? name + "_count" : name)) << name << " has no sample";
  }
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "OK"}}), 2);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "INVALID_ARGUMENT"}}), 1);
  EXPECT_EQ(m.Sum("hstu_request_queue_seconds_count"), 2);
  EXPECT_EQ(m.Sum("hstu_batch_size_count"), 2);
  EXPECT_GT(m.Sum("hstu_batch_compute_seconds_sum"), 0);
  // The engine's counters start at SERVING: the warm-up request is not in them, so they agree
  // with the scheduler's batches and the requests served.
  EXPECT_EQ(m.Sum("hstu_engine_batches_total"), 2);
  EXPECT_EQ(m.Sum("hstu_kv_lookups_total"), 2);
  EXPECT_EQ(m.Sum("hstu_kv_lookups_total", {{"result", "miss"}}), 1);
  EXPECT_EQ(m.Sum("hstu_kv_lookups_total", {{"result", "gpu_hit"}}), 1);
  // The second request reused the first's 40 history tokens; 40 were computed, by the first.
  EXPECT_EQ(m.Sum("hstu_kv_tokens_total", {{"kind", "reused"}}), 40);
  EXPECT_EQ(m.Sum("hstu_kv_tokens_total", {{"kind", "computed"}}), 40);
  EXPECT_GT(m.Sum("hstu_kv_pages", {{"tier", "gpu"}, {"state", "free"}}), 0);
  EXPECT_GT(m.Sum("hstu_kv_pages", {{"tier", "gpu"}, {"state", "used"}}), 0);
  EXPECT_EQ(m.Sum("hstu_kv_pages", {{"tier", "gpu"}, {"state", "pinned"}}), 0);
  EXPECT_EQ(m.Sum("hstu_cuda_graph_replays_total"), 0);
  EXPECT_EQ(m.Sum("hstu_cuda_graph_fallbacks_total"), 0);
  EXPECT_GT(m.Sum("hstu_engine_compute_seconds_total"), 0);
  EXPECT_EQ(m.Sum("hstu_engine_device_seconds_total"), 0);  // the CPU backend has no device time
  // The GPU telemetry families have no series on the CPU (no GPU to read); prometheus-cpp leaves
  // a family without series out of the page altogether.
  for (const char* name : {"hstu_gpu_sm_clock_hertz", "hstu_gpu_power_watts",
                           "hstu_gpu_clock_event_active", "hstu_gpu_energy_joules_total",
                           "hstu_gpu_throttled_seconds_total"}) {
    EXPECT_FALSE(m.Has(name)) << name << " has a sample on the CPU backend";
  }
  EXPECT_GT(m.Sum("hstu_kv_onload_bandwidth_bytes_per_second"), 0);
  EXPECT_GT(m.Sum("hstu_kv_recompute_seconds_per_token"), 0);
  EXPECT_EQ(m.Sum("hstu_kv_lookups_total", {{"result", "host_recompute"}}), 0);
  EXPECT_EQ(m.Sum("hstu_build_info", {{"device", "cpu"}, {"model", "hstu-tiny"}}), 1);
  // Histograms: cumulative buckets never decrease and end at _count.
  for (const std::string h : {"hstu_request_duration_seconds", "hstu_batch_compute_seconds"}) {
    double prev = 0, last = -1;
    for (const auto& s : m.samples) {
      if (s.name != h + "_bucket" || (h == "hstu_request_duration_seconds" && s.labels.at("code") != "OK")) continue;
      EXPECT_GE(s.value, prev) << h;
      prev = s.value;
      last = s.value;
    }
    const std::map<std::string, std::string> lbl =
        h == "hstu_request_duration_seconds" ? std::map<std::string, std::string>{{"code", "OK"}}
                                             : std::map<std::string, std::string>{};
    EXPECT_EQ(last, m.Sum(h + "_count", lbl)) << h;
  }
  // No label carries a user or item id.
  for (const auto& s : m.samples) {
    for (const auto& [k, v] : s.labels) {
      EXPECT_NE(k, "user_id");
      EXPECT_NE(k, "user");
    }
  }
}

}  // namespace
}  // namespace hstu::server
