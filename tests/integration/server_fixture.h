// The in-process server of the server tests (server_test.cc, server_lifecycle_test.cc): a
// RankingServer on loopback ports whose engine batches pass a gate the test can close, a typed
// client, a reference engine, health and /metrics helpers, and the requests they send.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "server/ranking_server.h"
#include "tests/integration/test_util.h"

namespace hstu::server::fixture {

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
    return cv_.wait_for(l, std::chrono::seconds(20), [&] { return entered_ >= n; });
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

inline hstu::v1::RankRequest MakeRequest(uint64_t user, int events, int candidates, uint64_t seed) {
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
    ASSERT_TRUE(
        channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  }
  // Waits (up to 20 s: calls reach the queue late on a loaded, sanitized machine) until `depth`
  // calls are queued; returns the depth then.
  int64_t AwaitQueueDepth(int64_t depth) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (server_->scheduler().QueueDepth() < depth && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
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
                    std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
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
    // The same on the metrics port, for probes without gRPC (or without TLS).
    const bool serving = want == grpc::health::v1::HealthCheckResponse::SERVING;
    const std::string healthz =
        testing::RawHttp(server_->metrics_port(), "GET /healthz HTTP/1.1\r\n\r\n");
    EXPECT_EQ(healthz.rfind(serving ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.1 503 ", 0), 0u) << healthz;
    EXPECT_NE(healthz.find(serving ? "\r\n\r\nSERVING\n" : "\r\n\r\nNOT_SERVING\n"),
              std::string::npos)
        << healthz;
  }

  // Closes the gate and sends one request from a thread of its own; returns once its batch is
  // held at the gate (the engine busy with it). The caller's status lands in *status, if given.
  std::thread HoldOneBatch(grpc::Status* status = nullptr) {
    gate_.Close();
    std::thread caller([this, status] {
      hstu::v1::RankResponse resp;
      const grpc::Status s = Rank(MakeRequest(5, 5, 3, 1), &resp, std::chrono::seconds(30));
      if (status != nullptr) *status = s;
    });
    EXPECT_TRUE(gate_.WaitEntered(1));
    return caller;
  }

  hstu::testing::Exposition Scrape() {
    auto body = hstu::testing::HttpGet(server_->metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    auto e = hstu::testing::ParseExposition(body.ok() ? *body : "");
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
inline hstu::v1::RankRequest Prefix(const hstu::v1::RankRequest& full, int events) {
  hstu::v1::RankRequest r = full;
  r.mutable_history_item_ids()->Truncate(events);
  r.mutable_history_actions()->Truncate(events);
  return r;
}

}  // namespace hstu::server::fixture
