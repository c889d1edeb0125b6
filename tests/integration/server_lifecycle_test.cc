// The server's life in-process: start-up and stop signals, drains, stalled batches, a lost device,
// and the refusals of a service still loading or draining (the fixture: server_fixture.h).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
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
#include "server/metrics.h"
#include "server/rank_service.h"
#include "server/ranking_server.h"
#include "server/stop_signals.h"
#include "tests/integration/server_fixture.h"
#include "tests/integration/test_util.h"
#include "tests/util/faulty_backend.h"

namespace hstu::server {
namespace {

using namespace std::chrono_literals;
using fixture::Gate;
using fixture::MakeRequest;
using fixture::Prefix;
using fixture::ServerTest;
using hstu::testing::ParseExposition;

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
