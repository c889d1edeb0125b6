// The real server in-process on loopback, driven by a real gRPC client: scores against a separate
// engine (the reference), validation errors, deadlines, queue limits, cancellation, concurrency
// with repeated users, engine failures (a lost device among them) and the /metrics exposition.
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
#include <deque>
#include <functional>
#include <future>
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
#include "server/stop_signals.h"
#include "server/validation.h"
#include "tests/integration/raw_rank.h"
#include "tests/integration/test_util.h"
#include "tests/util/faulty_backend.h"

namespace hstu::server {
namespace {

using namespace std::chrono_literals;
using hstu::testing::ParseExposition;

// Holds batches at a gate and records which users reached the engine.
class Gate {
 public:
  std::vector<absl::StatusOr<RankResult>> Run(absl::Span<const RankRequest> batch,
                                              const Scheduler::RunBatchFn& run) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      std::set<uint64_t> users;
      for (const auto& r : batch) {
        seen_.push_back(r.user_id);
        if (!users.insert(r.user_id).second) duplicate_in_batch_ = true;
      }
      ++entered_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
    }
    for (const auto& r : batch) {
      if (r.user_id == kFailUser) {
        return std::vector<absl::StatusOr<RankResult>>(batch.size(),
                                                       absl::InternalError("injected failure"));
      }
    }
    return run(batch);
  }
  void Close() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = false;
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu_);
    open_ = true;
    cv_.notify_all();
  }
  bool WaitEntered(int n) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, 20s, [&] { return entered_ >= n; });
  }
  bool Saw(uint64_t user) {
    std::lock_guard<std::mutex> l(mu_);
    return std::find(seen_.begin(), seen_.end(), user) != seen_.end();
  }
  int64_t seen_count() {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int64_t>(seen_.size());
  }
  bool duplicate_in_batch() {
    std::lock_guard<std::mutex> l(mu_);
    return duplicate_in_batch_;
  }
  static constexpr uint64_t kFailUser = 666;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int entered_ = 0;
  bool duplicate_in_batch_ = false;
  std::vector<uint64_t> seen_;
};

hstu::v1::RankRequest MakeRequest(uint64_t user, int events, int candidates, uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + user);
  hstu::v1::RankRequest r;
  r.set_user_id(user);
  for (int i = 0; i < events; ++i) {
    r.add_history_item_ids(static_cast<int64_t>(rng() % 5000));
    r.add_history_actions(static_cast<int32_t>(rng() % 16));
  }
  for (int c = 0; c < candidates; ++c) r.add_candidate_item_ids(static_cast<int64_t>(rng() % 5000));
  r.set_request_id(absl::StrCat("req-", user, "-", seed));
  return r;
}

class ServerTest : public ::testing::Test {
 protected:
  void StartServer(ServerOptions o = ServerOptions()) {
    o.listen = "127.0.0.1:0";
    o.metrics_listen = "127.0.0.1:0";
    o.engine.device = "cpu";
    o.batch_interceptor = [this](absl::Span<const RankRequest> b, const Scheduler::RunBatchFn& run) {
      return gate_.Run(b, run);
    };
    options_ = o;
    auto s = RankingServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = hstu::v1::Ranker::NewStub(channel_);
    // Connected before a test's first call: its deadline then times only the call, not the
    // connection's set-up on a loaded machine.
    ASSERT_TRUE(channel_->WaitForConnected(std::chrono::system_clock::now() + 10s));
  }
  // Waits (up to 20 s: calls reach the queue late on a loaded, sanitized machine) until `depth`
  // calls are queued; returns the depth then.
  int64_t AwaitQueueDepth(int64_t depth) {
    const auto end = std::chrono::steady_clock::now() + 20s;
    while (server_->scheduler().QueueDepth() < depth && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(5ms);
    }
    return server_->scheduler().QueueDepth();
  }
  // One call each for users 1 .. users (10 events, 3 candidates), on threads of their own;
  // *ok counts the OK answers.
  std::vector<std::thread> RankOnThreads(int users, std::atomic<int>* ok) {
    std::vector<std::thread> threads;
    for (int u = 1; u <= users; ++u) {
      threads.emplace_back([this, ok, u] {
        hstu::v1::RankResponse r;
        if (Rank(MakeRequest(u, 10, 3, 1), &r).ok()) ++*ok;
      });
    }
    return threads;
  }
  void TearDown() override {
    gate_.Open();
    if (server_) server_->Shutdown(absl::Seconds(5));
  }

  grpc::Status Rank(const hstu::v1::RankRequest& req, hstu::v1::RankResponse* resp,
                    std::chrono::milliseconds timeout = 60s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    return stub_->Rank(&ctx, req, resp);
  }

  // The reference: a separate engine with the same options, fed the same requests in order.
  std::unique_ptr<Engine> ReferenceEngine() {
    auto e = Engine::Create(options_.engine);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  }

  // The whole server's health ("") and the Ranker service's, both `want`.
  void ExpectHealth(grpc::health::v1::HealthCheckResponse::ServingStatus want) {
    auto health = grpc::health::v1::Health::NewStub(channel_);
    for (const char* service : {"", "hstu.v1.Ranker"}) {
      grpc::ClientContext ctx;
      grpc::health::v1::HealthCheckRequest req;
      req.set_service(service);
      grpc::health::v1::HealthCheckResponse resp;
      ASSERT_TRUE(health->Check(&ctx, req, &resp).ok()) << service;
      EXPECT_EQ(resp.status(), want) << service;
    }
  }

  // Closes the gate and sends one request from a thread of its own; returns once its batch is
  // held at the gate (the engine busy with it). The caller's status lands in *status, if given.
  std::thread HoldOneBatch(grpc::Status* status = nullptr) {
    gate_.Close();
    std::thread caller([this, status] {
      hstu::v1::RankResponse resp;
      const grpc::Status s = Rank(MakeRequest(5, 5, 3, 1), &resp, 30s);
      if (status != nullptr) *status = s;
    });
    EXPECT_TRUE(gate_.WaitEntered(1));
    return caller;
  }

  hstu::testing::Exposition Scrape() {
    auto body = hstu::testing::HttpGet(server_->metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    auto e = ParseExposition(body.ok() ? *body : "");
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *e : hstu::testing::Exposition();
  }

  Gate gate_;
  ServerOptions options_;
  std::unique_ptr<RankingServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<hstu::v1::Ranker::Stub> stub_;
};

// A prefix of `full` with its first `events` events (same candidates).
hstu::v1::RankRequest Prefix(const hstu::v1::RankRequest& full, int events) {
  hstu::v1::RankRequest r = full;
  r.mutable_history_item_ids()->Truncate(events);
  r.mutable_history_actions()->Truncate(events);
  return r;
}

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

TEST_F(ServerTest, TheWarmUpLeavesNothingInTheCache) {
  // Before: the warm-up request (user 2^64 - 1, items 1-4, candidates 5-6) left its entry, so a
  // client's user with that id reused 8 tokens on a first visit, or counted a hash mismatch.
  StartServer();
  hstu::v1::RankRequest req;
  req.set_user_id(~uint64_t{0});
  for (int64_t item : {1, 2, 3, 4}) {
    req.add_history_item_ids(item);
    req.add_history_actions(0);
  }
  req.add_candidate_item_ids(5);
  req.add_candidate_item_ids(6);
  grpc::ClientContext ctx;
  hstu::v1::RankResponse resp;
  ASSERT_TRUE(stub_->Rank(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.reused_tokens(), 0u);
  EXPECT_EQ(resp.computed_tokens(), 8u);
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_kv_lookups_total", {{"result", "miss"}}), 1);
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
  for (int i = 0; i < typed.scores_size(); ++i) EXPECT_EQ(typed.scores(i), parsed.scores(i)) << i;
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

TEST(StopSignals, ASignalTakenByAnotherThreadStillReachesTheWait) {
  // Before: the stop signals were blocked in main()'s threads and taken with sigtimedwait; a
  // thread a library started before main() (OpenBLAS's) did not block them, and the kernel's
  // delivery to it killed the process.
  auto stop = StopSignals::Install({SIGUSR2});
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_EQ((*stop)->Wait(absl::Milliseconds(20)), -1);
#if !defined(__SANITIZE_THREAD__)
  // (ThreadSanitizer defers a signal sent to one thread until that thread's own next steps, and
  // in this test delivered it only after the thread had ended: the check runs without it.)
  std::atomic<bool> done{false};
  std::thread other([&done] {
    while (!done) std::this_thread::sleep_for(1ms);
  });
  ASSERT_EQ(pthread_kill(other.native_handle(), SIGUSR2), 0);
  EXPECT_EQ((*stop)->Wait(absl::Seconds(5)), SIGUSR2);
  done = true;
  other.join();
#endif
  ASSERT_EQ(kill(getpid(), SIGUSR2), 0);  // to the process: whichever thread takes it
  EXPECT_EQ((*stop)->Wait(absl::Seconds(5)), SIGUSR2);
  EXPECT_EQ((*stop)->Wait(absl::Milliseconds(20)), -1);
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

// main()'s wait on a thread of its own; Signal() hands it SIGUSR1 as a stop signal, as the
// handler hands SIGTERM to main()'s wait.
class ServingThread {
 public:
  ServingThread(RankingServer& server, absl::Duration grace) {
    thread_ = std::thread([this, &server, grace] {
      result_.set_value(ServeUntilStopped(
          server, [this](absl::Duration timeout) { return WaitSignal(timeout); }, grace));
      done_ = true;
    });
    code_ = result_.get_future();
  }
  // A test that failed early leaves the wait running: two signals end it.
  ~ServingThread() {
    while (!done_) {
      Signal();
      std::this_thread::sleep_for(150ms);
    }
    thread_.join();
  }
  void Signal(int sig = SIGUSR1) { Signal(std::vector<int>{sig}); }
  // Several signals queued at once: the wait finds the later ones already waiting.
  void Signal(const std::vector<int>& sigs) {
    std::lock_guard<std::mutex> lock(mu_);
    signals_.insert(signals_.end(), sigs.begin(), sigs.end());
    cv_.notify_all();
  }
  bool Returned(std::chrono::milliseconds within) {
    return code_.wait_for(within) == std::future_status::ready;
  }
  int code() { return code_.get(); }

 private:
  int WaitSignal(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout), [this] { return !signals_.empty(); });
    if (signals_.empty()) return -1;
    const int sig = signals_.front();
    signals_.pop_front();
    return sig;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> signals_;
  std::promise<int> result_;
  std::future<int> code_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// A lost device (a sticky CUDA error, injected): its batch answers INTERNAL, then health turns
// NOT_SERVING for good, later requests answer UNAVAILABLE without reaching the device, and the
// server says so to main() (which then exits to be restarted) and to Prometheus.
TEST_F(ServerTest, LostDeviceTurnsHealthNotServingAndAnswersUnavailable) {
  auto faults = std::make_shared<hstu::testing::Faults>();
  ServerOptions o;
  o.engine.wrap_backend = hstu::testing::WrapWithFaults(faults);
  StartServer(o);
  hstu::v1::RankResponse resp;
  ASSERT_TRUE(Rank(MakeRequest(5, 5, 3, 1), &resp).ok());
  EXPECT_TRUE(server_->engine_health().ok());
  EXPECT_EQ(Scrape().Sum("hstu_engine_healthy"), 1);

  faults->device_lost = true;
  EXPECT_EQ(Rank(MakeRequest(6, 5, 3, 1), &resp).error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(server_->engine_health().code(), absl::StatusCode::kUnavailable);
  ExpectHealth(grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  const int forwards = faults->forwards;
  const grpc::Status s = Rank(MakeRequest(5, 6, 3, 1), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("the device is lost"), std::string::npos) << s.error_message();
  EXPECT_EQ(faults->forwards, forwards);
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_engine_healthy"), 0);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "UNAVAILABLE"}}), 1);
  EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "INTERNAL"}}), 1);

  // main()'s wait: it drains the server and returns 1 (no signal needed).
  ServingThread serving(*server_, absl::Seconds(5));
  ASSERT_TRUE(serving.Returned(10s));
  EXPECT_EQ(serving.code(), 1);
}

// A batch that never returns (a hung GPU, here a batch held at the gate): past the stall timeout,
// main()'s wait turns health NOT_SERVING and returns kEngineStalled without draining, which would
// wait for that batch forever. Off on the CPU unless asked for.
TEST_F(ServerTest, StalledBatchEndsServingWithoutDraining) {
  ServerOptions o;
  o.engine_stall_timeout_s = 1;
  StartServer(o);
  EXPECT_EQ(server_->stall_timeout(), absl::Seconds(1));
  std::thread caller = HoldOneBatch();
  const auto start = std::chrono::steady_clock::now();
  ServingThread serving(*server_, absl::Seconds(5));
  ASSERT_TRUE(serving.Returned(10s));
  EXPECT_EQ(serving.code(), kEngineStalled);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 500ms);  // the batch's age, not at once
  EXPECT_GE(server_->scheduler().BusyFor(), absl::Seconds(1));
  ExpectHealth(grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  gate_.Open();  // the test's own teardown drains
  caller.join();
  EXPECT_EQ(server_->scheduler().BusyFor(), absl::ZeroDuration());
}

// The drain waits for the batch on the engine. A batch that hangs during the drain still ends
// main()'s wait once it is past the stall timeout; so does a second signal (a second Ctrl-C).
TEST_F(ServerTest, StallDuringTheDrainEndsTheWait) {
  ServerOptions o;
  o.engine_stall_timeout_s = 1;
  StartServer(o);
  std::thread caller = HoldOneBatch();
  const auto start = std::chrono::steady_clock::now();
  {
    ServingThread serving(*server_, absl::Seconds(30));
    serving.Signal();
    ASSERT_TRUE(serving.Returned(10s));
    EXPECT_EQ(serving.code(), kEngineStalled);
  }
  EXPECT_GE(std::chrono::steady_clock::now() - start, 500ms);
  EXPECT_GE(server_->scheduler().BusyFor(), absl::Seconds(1));
  gate_.Open();  // the drain left running finishes; the teardown waits for it
  caller.join();
}

TEST_F(ServerTest, SecondSignalDuringTheDrainEndsTheWait) {
  StartServer();  // stall timeout off on the CPU
  std::thread caller = HoldOneBatch();
  {
    ServingThread serving(*server_, absl::Seconds(30));
    serving.Signal();
    EXPECT_FALSE(serving.Returned(600ms));  // draining: the batch is still held
    serving.Signal();
    ASSERT_TRUE(serving.Returned(5s));
    EXPECT_EQ(serving.code(), kDrainInterrupted);
  }
  gate_.Open();
  caller.join();
}

TEST_F(ServerTest, TwoDifferentSignalsAtOnceEndTheWait) {
  // The second is waiting when the first is taken: it is not the same signal sent twice.
  StartServer();
  std::thread caller = HoldOneBatch();
  {
    ServingThread serving(*server_, absl::Seconds(30));
    serving.Signal({SIGUSR1, SIGUSR2});
    ASSERT_TRUE(serving.Returned(5s));
    EXPECT_EQ(serving.code(), kDrainInterrupted);
  }
  gate_.Open();
  caller.join();
}

TEST_F(ServerTest, AnOpenHealthWatchDoesNotHoldTheDrain) {
  // Before: the drain waited for every call, and a health Watch stream never ends by itself: the
  // process exited only when the whole grace had passed.
  StartServer();
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext watch_ctx;
  grpc::health::v1::HealthCheckRequest req;
  auto reader = health->Watch(&watch_ctx, req);
  grpc::health::v1::HealthCheckResponse first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_EQ(first.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  std::thread watcher([&] {
    grpc::health::v1::HealthCheckResponse r;
    while (reader->Read(&r)) {
    }
    reader->Finish().ok();
  });
  const auto start = std::chrono::steady_clock::now();
  {
    ServingThread serving(*server_, absl::Seconds(30));
    serving.Signal();
    ASSERT_TRUE(serving.Returned(10s));
    EXPECT_EQ(serving.code(), 0);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  watcher.join();
}

// Without a second signal the drain finishes the held batch: the caller gets its scores and
// main()'s wait returns 0.
class DrainTest : public ServerTest {
 protected:
  // Holds a batch, sends `signals` stop signals, runs `while_draining`, then lets the batch end.
  void ExpectTheHeldBatchDrained(int signals, const std::function<void()>& while_draining = {}) {
    StartServer();
    grpc::Status status;
    std::thread caller = HoldOneBatch(&status);
    ServingThread serving(*server_, absl::Seconds(30));
    serving.Signal(std::vector<int>(signals, SIGUSR1));
    EXPECT_FALSE(serving.Returned(300ms));  // still draining: the held batch
    if (while_draining) while_draining();
    gate_.Open();
    ASSERT_TRUE(serving.Returned(10s));
    EXPECT_EQ(serving.code(), 0);
    caller.join();
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
};

TEST_F(DrainTest, SignalDrainsTheHeldBatchAndReturnsZero) { ExpectTheHeldBatchDrained(1); }

TEST_F(DrainTest, CallsDuringTheDrainAreRefusedAndCountedAsSuch) {
  ExpectTheHeldBatchDrained(1, [this] {
    hstu::v1::RankResponse resp;
    const grpc::Status refused = Rank(MakeRequest(9, 5, 3, 1), &resp, 5s);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_NE(refused.error_message().find("shutting down"), std::string::npos)
        << refused.error_message();
    const auto m = Scrape();
    EXPECT_EQ(m.Sum("hstu_queue_rejections_total", {{"reason", "shutting_down"}}), 1);
    EXPECT_EQ(m.Sum("hstu_requests_total", {{"code", "UNAVAILABLE"}}), 0);
    // GetModelInfo too (before: answered OK during the drain).
    grpc::ClientContext ctx;
    hstu::v1::ModelInfo info;
    const grpc::Status info_status = stub_->GetModelInfo(&ctx, {}, &info);
    EXPECT_EQ(info_status.error_code(), grpc::StatusCode::UNAVAILABLE);
  });
}

// A fake signal source for StartupWatch: `Send` queues a signal, the watch's waits take them.
class FakeSignals {
 public:
  void Send(int sig) {
    std::lock_guard<std::mutex> lock(mu_);
    queued_.push_back(sig);
    cv_.notify_all();
  }
  int Wait(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout), [&] { return !queued_.empty(); })) {
      return -1;
    }
    const int sig = queued_.front();
    queued_.pop_front();
    return sig;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queued_;
};

TEST(StartupWatchTest, ASignalDuringTheStartUpIsActedOnAtOnce) {
  FakeSignals signals;
  std::promise<int> got;
  StartupWatch watch([&](absl::Duration t) { return signals.Wait(t); },
                     [&](int sig) { got.set_value(sig); });
  std::future<int> f = got.get_future();
  signals.Send(SIGTERM);
  // Before: nothing read the signal until the start-up had finished.
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(f.get(), SIGTERM);
  EXPECT_EQ(watch.Finish(), -1);  // acted on: nothing left for the serving loop
}

TEST(StartupWatchTest, AfterTheStartUpSignalsAreTheServingLoops) {
  FakeSignals signals;
  std::atomic<int> acted{0};
  StartupWatch watch([&](absl::Duration t) { return signals.Wait(t); },
                     [&](int) { acted.fetch_add(1); });
  std::this_thread::sleep_for(120ms);  // a few of the watch's waits, with no signal
  EXPECT_EQ(watch.Finish(), -1);
  signals.Send(SIGINT);  // after Finish: the serving loop's to read, not the watch's
  EXPECT_EQ(signals.Wait(absl::Seconds(1)), SIGINT);
  EXPECT_EQ(acted.load(), 0);
}

// The service alone on a gRPC server on a free loopback port, and a stub to it; shut down when
// it goes.
struct ServiceOnly {
  explicit ServiceOnly(RankService* service) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service);
    server = builder.BuildAndStart();
    if (server == nullptr) return;
    stub = hstu::v1::Ranker::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                                         grpc::InsecureChannelCredentials()));
  }
  ~ServiceOnly() {
    if (server != nullptr) server->Shutdown();
  }
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<hstu::v1::Ranker::Stub> stub;
};

// The metrics after `n` refusals for `reason` and nothing else: counted as refusals, not as
// answers in hstu_requests_total, and none left in flight.
void ExpectOnlyRefused(ServerMetrics& metrics, const std::string& reason, int n) {
  auto m = ParseExposition(metrics.Serialize());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->Sum("hstu_queue_rejections_total", {{"reason", reason}}), n);
  EXPECT_EQ(m->Sum("hstu_requests_total"), 0);
  EXPECT_EQ(m->Sum("hstu_inflight_requests"), 0);
}

TEST(RankServiceTest, CallsWhileTheModelLoadsAreRefusedAndCountedAsSuch) {
  // The service before Attach(): what a client probing a starting replica gets. Before, these
  // refusals were counted in hstu_requests_total{code="UNAVAILABLE"} (the error ratio's numerator).
  ServerMetrics metrics("test");
  RankService service(&metrics);
  ServiceOnly served(&service);
  ASSERT_NE(served.server, nullptr);
  auto& stub = served.stub;
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    hstu::v1::RankRequest req;
    req.add_candidate_item_ids(1);
    hstu::v1::RankResponse resp;
    const grpc::Status s = stub->Rank(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(s.error_message(), "model is loading");
  }
  ExpectOnlyRefused(metrics, "starting", 3);
}

TEST(RankServiceTest, ACallTheDrainingSchedulerRefusesIsCountedAsShuttingDownOnly) {
  // The race of a drain: the call passed the service's admission check, and the scheduler began
  // draining before the call reached it. Before, the refusal was also counted in
  // hstu_requests_total{code="UNAVAILABLE"}, which the error-ratio alert reads as a failure.
  ServerMetrics metrics("test");
  RankService service(&metrics);
  auto engine = Engine::Create(EngineOptions{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto scheduler = Scheduler::Create(SchedulerOptions{}, [&](absl::Span<const RankRequest> b) {
    return (*engine)->Rank(b);
  });
  ASSERT_TRUE(scheduler.ok()) << scheduler.status();
  (*scheduler)->Drain();
  service.Attach(engine->get(), scheduler->get());
  ServiceOnly served(&service);
  ASSERT_NE(served.server, nullptr);
  auto& stub = served.stub;
  grpc::ClientContext ctx;
  hstu::v1::RankResponse resp;
  const grpc::Status s = stub->Rank(&ctx, MakeRequest(1, 4, 2, 1), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(s.error_message(), "server is shutting down");
  ExpectOnlyRefused(metrics, "shutting_down", 1);
  EXPECT_EQ(service.InFlight(), 0);
}

// timeout(1) sends its signal to the process and to its group: the second copy arrives within
// microseconds. Before, it cut the drain short (exit 3).
TEST_F(DrainTest, TheSameSignalTwiceAtOnceIsOneRequestToStop) { ExpectTheHeldBatchDrained(2); }

TEST(ServerStallDefault, OffOnTheCpu) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.engine.device = "cpu";
  auto s = RankingServer::Start(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->stall_timeout(), absl::ZeroDuration());
  (*s)->Shutdown(absl::Seconds(1));
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
  // A request line without a version (HTTP/0.9), or with doubled spaces, names the same target
  // (before: the method was read as the path, 404).
  for (const char* request : {"GET /metrics\r\n\r\n", "GET  /metrics  HTTP/1.1\r\n\r\n"}) {
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

TEST_F(ServerTest, ShutdownDrainsInFlightRequests) {
  StartServer();
  gate_.Close();
  std::atomic<int> ok{0};
  std::vector<std::thread> threads = RankOnThreads(4, &ok);
  ASSERT_TRUE(gate_.WaitEntered(1));
  // Every call in: held at the gate (the first batch can take more than one) or queued.
  const auto end = std::chrono::steady_clock::now() + 20s;
  while (gate_.seen_count() + server_->scheduler().QueueDepth() < 4 &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(gate_.seen_count() + server_->scheduler().QueueDepth(), 4);
  std::thread stopper([&] { server_->Shutdown(absl::Seconds(10)); });
  std::this_thread::sleep_for(100ms);
  gate_.Open();
  stopper.join();
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4);
}

TEST_F(ServerTest, ADrainRunsQueuedCallsWithoutWaitingForFullerBatches) {
  // Before: the drain left queued calls waiting out the batch timeout (up to 10 s) although no
  // call could join their batch any more, and past the grace the process outlived it by as much,
  // its clients already cut off.
  ServerOptions o;
  o.scheduler.batch_timeout = std::chrono::seconds(60);
  o.scheduler.max_batch_size = 8;
  StartServer(o);
  std::atomic<int> ok{0};
  std::vector<std::thread> threads = RankOnThreads(2, &ok);
  ASSERT_EQ(AwaitQueueDepth(2), 2);  // waiting for a fuller batch
  const auto stop = std::chrono::steady_clock::now();
  server_->Shutdown(absl::Seconds(30));
  const auto took = std::chrono::steady_clock::now() - stop;
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 2);
  EXPECT_LT(took, 20s) << "the drain waited for the batch timeout";
  EXPECT_EQ(gate_.seen_count(), 2);
}

}  // namespace
}  // namespace hstu::server
