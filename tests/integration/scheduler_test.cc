// Rules of the batching scheduler (server/scheduler.h) against a fake engine that records every
// batch and can be held at a gate. No gRPC involved.
#include "server/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "absl/types/span.h"

namespace hstu::server {
namespace {

using namespace std::chrono_literals;

// A fake engine: answers each request with scores = {user_id}, records batches, can block.
class FakeEngine {
 public:
  std::vector<absl::StatusOr<RankResult>> Run(absl::Span<const RankRequest> batch) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      std::vector<uint64_t> users;
      for (const auto& r : batch) users.push_back(r.user_id);
      batches_.push_back(users);
      const int me = ++entered_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_ || me <= released_; });
    }
    std::vector<absl::StatusOr<RankResult>> out;
    for (const auto& r : batch) {
      if (r.user_id == kFailUser) {
        out.push_back(absl::InternalError("injected failure"));
        continue;
      }
      RankResult res;
      res.num_tasks = 1;
      res.scores = {static_cast<float>(r.user_id)};
      out.push_back(res);
    }
    return out;
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // While closed, lets the oldest batch not yet let through pass (batches count from 1).
  void ReleaseOne() {
    std::lock_guard<std::mutex> lock(mu_);
    ++released_;
    cv_.notify_all();
  }
  void WaitEntered(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    ASSERT_TRUE(cv_.wait_for(lock, 5s, [&] { return entered_ >= n; }));
  }
  std::vector<std::vector<uint64_t>> batches() {
    std::lock_guard<std::mutex> lock(mu_);
    return batches_;
  }
  static constexpr uint64_t kFailUser = 666;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int entered_ = 0;
  int released_ = 0;
  std::vector<std::vector<uint64_t>> batches_;
};

struct Outcome {
  std::promise<absl::StatusOr<RankResult>> promise;
  std::future<absl::StatusOr<RankResult>> future = promise.get_future();
};

PendingRank Pending(uint64_t user, Outcome* out, int64_t events = 1,
                    Clock::time_point deadline = Clock::time_point::max()) {
  PendingRank p;
  p.request.user_id = user;
  p.request.history_item_ids.assign(events, 1);
  p.request.history_actions.assign(events, 0);
  p.request.candidate_item_ids = {1};
  p.deadline = deadline;
  p.done = [out](absl::StatusOr<RankResult> r, const RequestTiming&) {
    out->promise.set_value(std::move(r));
  };
  return p;
}

// The outcome, or UNKNOWN "never answered" after 10 s (a test of a broken scheduler fails, not hangs).
absl::StatusOr<RankResult> Await(Outcome& o) {
  if (o.future.wait_for(10s) != std::future_status::ready) return absl::UnknownError("never answered");
  return o.future.get();
}

// Closes the engine's gate and holds it in a batch of user 100, so that what is submitted next
// queues behind it.
void HoldEngine(FakeEngine& engine, Scheduler& s, Outcome* first) {
  engine.Close();
  ASSERT_TRUE(s.Submit(Pending(100, first)).ok());
  engine.WaitEntered(1);
}

std::unique_ptr<Scheduler> MakeScheduler(FakeEngine* engine, SchedulerOptions o) {
  auto s = Scheduler::Create(o, [engine](absl::Span<const RankRequest> b) { return engine->Run(b); });
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

// A scheduler whose engine is held in a batch of user 100 (HoldEngine), answered into *first.
std::unique_ptr<Scheduler> MakeHeldScheduler(FakeEngine& engine, SchedulerOptions o, Outcome* first) {
  auto s = MakeScheduler(&engine, std::move(o));
  HoldEngine(engine, *s, first);
  return s;
}

// Queues one request each for users first_user, first_user + 1, ... with a 10 ms deadline (an
// outcome each in *outs), then waits until they have expired.
void QueueExpired(Scheduler& s, uint64_t first_user, absl::Span<Outcome> outs) {
  for (size_t i = 0; i < outs.size(); ++i) {
    ASSERT_TRUE(s.Submit(Pending(first_user + i, &outs[i], 1, Clock::now() + 10ms)).ok());
  }
  std::this_thread::sleep_for(30ms);
}

TEST(SchedulerTest, RejectsBadOptions) {
  auto run = [](absl::Span<const RankRequest>) { return std::vector<absl::StatusOr<RankResult>>(); };
  SchedulerOptions o;
  o.max_batch_size = 0;
  EXPECT_EQ(Scheduler::Create(o, run).status().code(), absl::StatusCode::kInvalidArgument);
  o = SchedulerOptions();
  o.max_queue = 0;
  EXPECT_EQ(Scheduler::Create(o, run).status().code(), absl::StatusCode::kInvalidArgument);
  o = SchedulerOptions();
  o.max_queued_tokens = -1;
  EXPECT_EQ(Scheduler::Create(o, run).status().code(), absl::StatusCode::kInvalidArgument);
  o = SchedulerOptions();
  o.max_queue_per_user = -1;
  EXPECT_EQ(Scheduler::Create(o, run).status().code(), absl::StatusCode::kInvalidArgument);
  o = SchedulerOptions();
  EXPECT_EQ(Scheduler::Create(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SchedulerTest, IdleEngineTakesFirstRequestAtOnce) {
  FakeEngine engine;
  SchedulerOptions o;
  o.batch_timeout = 0us;
  auto s = MakeScheduler(&engine, o);
  Outcome out;
  const auto t0 = Clock::now();
  ASSERT_TRUE(s->Submit(Pending(7, &out)).ok());
  ASSERT_EQ(out.future.wait_for(2s), std::future_status::ready);
  auto r = out.future.get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->scores[0], 7.f);
  EXPECT_LT(Clock::now() - t0, 200ms);
}

TEST(SchedulerTest, BatchesQueuedRequestsUpToMaxBatchSizeAndNeverOneUserTwice) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_batch_size = 3;
  auto s = MakeScheduler(&engine, o);
  engine.Close();
  Outcome first;
  ASSERT_TRUE(s->Submit(Pending(100, &first)).ok());
  engine.WaitEntered(1);  // the worker is busy with user 100; the rest queues up
  // Users: 1, 1, 2, 3, 4, 1, 5 → batches {1,2,3} {1,4,5} {1}.
  const std::vector<uint64_t> users = {1, 1, 2, 3, 4, 1, 5};
  std::vector<Outcome> outs(users.size());
  for (size_t i = 0; i < users.size(); ++i) ASSERT_TRUE(s->Submit(Pending(users[i], &outs[i])).ok());
  EXPECT_EQ(s->QueueDepth(), 7);
  engine.Open();
  for (auto& o2 : outs) ASSERT_EQ(o2.future.wait_for(2s), std::future_status::ready);
  const auto batches = engine.batches();
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(batches[2], (std::vector<uint64_t>{1, 4, 5}));
  EXPECT_EQ(batches[3], (std::vector<uint64_t>{1}));
  for (const auto& b : batches) {
    EXPECT_EQ(std::set<uint64_t>(b.begin(), b.end()).size(), b.size());
  }
}

TEST(SchedulerTest, PrefetchSeesTheRequestsQueuedBehindEachBatch) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_batch_size = 2;
  std::mutex mu;
  std::vector<std::vector<uint64_t>> prefetched;  // one entry per batch that had a queue behind it
  o.prefetch = [&](absl::Span<const RankRequest* const> batch,
                   absl::Span<const RankRequest* const> queued) {
    EXPECT_FALSE(batch.empty());
    std::vector<uint64_t> users;
    for (const RankRequest* r : queued) users.push_back(r->user_id);
    std::lock_guard<std::mutex> lock(mu);
    prefetched.push_back(users);
  };
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  // Queue 1..5 → batches {1,2} {3,4} {5}; before {1,2} the prefetch sees {3,4} (at most
  // max_batch_size), before {3,4} it sees {5}, before {5} nothing (and is not called).
  std::vector<Outcome> outs(5);
  for (uint64_t u = 1; u <= 5; ++u) ASSERT_TRUE(s->Submit(Pending(u, &outs[u - 1])).ok());
  engine.Open();
  for (auto& o2 : outs) ASSERT_EQ(o2.future.wait_for(2s), std::future_status::ready);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(prefetched.size(), 2u);
  EXPECT_EQ(prefetched[0], (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(prefetched[1], (std::vector<uint64_t>{5}));
}

TEST(SchedulerTest, TokenBudgetSplitsBatchesButOversizeRequestRunsAlone) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_batch_size = 8;
  o.max_batch_tokens = 100;  // cost = 2 * events + 1 candidate
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  // Costs 41, 41, 41 (two fit), then 201 (alone), then 3.
  std::vector<Outcome> outs(5);
  ASSERT_TRUE(s->Submit(Pending(1, &outs[0], 20)).ok());
  ASSERT_TRUE(s->Submit(Pending(2, &outs[1], 20)).ok());
  ASSERT_TRUE(s->Submit(Pending(3, &outs[2], 20)).ok());
  ASSERT_TRUE(s->Submit(Pending(4, &outs[3], 100)).ok());
  ASSERT_TRUE(s->Submit(Pending(5, &outs[4], 1)).ok());
  engine.Open();
  for (auto& x : outs) ASSERT_EQ(x.future.wait_for(2s), std::future_status::ready);
  const auto batches = engine.batches();
  ASSERT_EQ(batches.size(), 5u);
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(batches[2], (std::vector<uint64_t>{3}));
  EXPECT_EQ(batches[3], (std::vector<uint64_t>{4}));
  EXPECT_EQ(batches[4], (std::vector<uint64_t>{5}));
}

TEST(SchedulerTest, BatchTimeoutWaitsForMoreRequests) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_batch_size = 4;
  // 1 s, far above the 20 ms between the two calls: a stalled test thread on a loaded (or
  // sanitized) machine must not split the batch.
  o.batch_timeout = 1s;
  auto s = MakeScheduler(&engine, o);
  std::vector<Outcome> outs(2);
  const auto t0 = Clock::now();
  ASSERT_TRUE(s->Submit(Pending(1, &outs[0])).ok());
  std::this_thread::sleep_for(20ms);
  ASSERT_TRUE(s->Submit(Pending(2, &outs[1])).ok());
  for (auto& x : outs) ASSERT_EQ(x.future.wait_for(5s), std::future_status::ready);
  EXPECT_GE(Clock::now() - t0, 950ms);
  const auto batches = engine.batches();
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0], (std::vector<uint64_t>{1, 2}));
}

TEST(SchedulerTest, AdaptiveFillRegroupsAtThePreviousBatchSizeAndWaitsOutAFallOnce) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_batch_size = 8;
  // 2 s, far above the 20 ms between calls, so that a stalled test thread is not read as a
  // fall in the arrival rate.
  o.batch_timeout = 2s;
  o.adaptive_fill = true;
  auto s = MakeScheduler(&engine, o);
  auto submit_all = [&](const std::vector<uint64_t>& users, std::vector<Outcome>* outs) {
    outs->resize(users.size());
    for (size_t i = 0; i < users.size(); ++i) {
      ASSERT_TRUE(s->Submit(Pending(users[i], &(*outs)[i])).ok());
      std::this_thread::sleep_for(20ms);
    }
  };
  auto wait_all = [](std::vector<Outcome>* outs) {
    for (auto& x : *outs) ASSERT_EQ(x.future.wait_for(10s), std::future_status::ready);
  };
  // The first batch has no predecessor: it runs at once. Three requests queue behind it.
  Outcome first;
  HoldEngine(engine, *s, &first);
  std::vector<Outcome> a, b, c, d;
  submit_all({1, 2, 3}, &a);
  engine.Open();
  wait_all(&a);
  // Three callers come back one by one: the batch waits for the third, not for the timeout.
  auto t0 = Clock::now();
  submit_all({4, 5, 6}, &b);
  wait_all(&b);
  EXPECT_LT(Clock::now() - t0, 1500ms);
  // One caller comes back alone: it waits out the timeout once...
  t0 = Clock::now();
  submit_all({7}, &c);
  wait_all(&c);
  EXPECT_GE(Clock::now() - t0, 1900ms);
  // ...and the next single caller runs at once.
  t0 = Clock::now();
  submit_all({8}, &d);
  wait_all(&d);
  EXPECT_LT(Clock::now() - t0, 1500ms);
  const auto batches = engine.batches();
  ASSERT_EQ(batches.size(), 5u);
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(batches[2], (std::vector<uint64_t>{4, 5, 6}));
  EXPECT_EQ(batches[3], (std::vector<uint64_t>{7}));
  EXPECT_EQ(batches[4], (std::vector<uint64_t>{8}));
}

TEST(SchedulerTest, FullQueueAnswersResourceExhausted) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_queue = 2;
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  std::vector<Outcome> outs(3);
  EXPECT_TRUE(s->Submit(Pending(1, &outs[0])).ok());
  EXPECT_TRUE(s->Submit(Pending(2, &outs[1])).ok());
  const absl::Status full = s->Submit(Pending(3, &outs[2]));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(outs[2].future.wait_for(0s), std::future_status::timeout);  // done not called
  engine.Open();
  EXPECT_TRUE(outs[0].future.get().ok());
  EXPECT_TRUE(outs[1].future.get().ok());
}

TEST(SchedulerTest, ExpiredAndCancelledRequestsNeverReachTheEngine) {
  FakeEngine engine;
  Outcome first;
  auto s = MakeHeldScheduler(engine, SchedulerOptions(), &first);
  Outcome expired, cancelled, fine;
  ASSERT_TRUE(s->Submit(Pending(1, &expired, 1, Clock::now() + 10ms)).ok());
  std::atomic<bool> cancel{false};
  PendingRank p = Pending(2, &cancelled);
  p.is_cancelled = [&cancel] { return cancel.load(); };
  ASSERT_TRUE(s->Submit(std::move(p)).ok());
  ASSERT_TRUE(s->Submit(Pending(3, &fine)).ok());
  std::this_thread::sleep_for(30ms);
  cancel.store(true);
  engine.Open();
  EXPECT_EQ(expired.future.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.future.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(fine.future.get().ok());
  for (const auto& b : engine.batches()) {
    for (uint64_t u : b) EXPECT_TRUE(u != 1 && u != 2) << "user " << u << " reached the engine";
  }
}

TEST(SchedulerTest, DeadRequestsHoldNoPlaceInTheQueue) {
  // Before: two expired requests filled a queue of two until the engine's batch ended, and live
  // requests were answered RESOURCE_EXHAUSTED meanwhile.
  FakeEngine engine;
  SchedulerOptions o;
  o.max_queue = 2;
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  std::vector<Outcome> dead(2), live(3);
  QueueExpired(*s, 1, absl::MakeSpan(dead));
  EXPECT_TRUE(s->Submit(Pending(11, &live[0])).ok());
  EXPECT_TRUE(s->Submit(Pending(12, &live[1])).ok());
  // Two live requests: the queue is full now.
  const absl::Status full = s->Submit(Pending(13, &live[2]));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("request queue is full (2 requests)"), std::string::npos) << full;
  engine.Open();
  for (auto& d : dead) EXPECT_EQ(Await(d).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Await(live[0]).ok());
  EXPECT_TRUE(Await(live[1]).ok());
}

TEST(SchedulerTest, AQueueFullOfDeadEntriesSaysSo) {
  // The queue keeps at most twice max_queue entries: dead ones wait there for the batch on the
  // engine to end. Before, a call refused then read "request queue is full (2 requests)" while
  // no live request was queued.
  FakeEngine engine;
  SchedulerOptions o;
  o.max_queue = 2;
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  std::vector<Outcome> dead(4), refused(1);
  // Two expire first: the next two are then accepted though the queue holds max_queue entries.
  QueueExpired(*s, 1, absl::MakeSpan(dead).subspan(0, 2));
  QueueExpired(*s, 3, absl::MakeSpan(dead).subspan(2, 2));
  const absl::Status full = s->Submit(Pending(11, &refused[0]));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("it keeps at most 4 entries (twice --max_queue), and 4 of them, "
                                "expired or cancelled, are answered when the batch on the engine "
                                "ends"),
            std::string::npos)
      << full;
  engine.Open();
  for (auto& d : dead) EXPECT_EQ(Await(d).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(SchedulerTest, OneUsersFloodTakesAtMostItsShareOfTheQueue) {
  // Before: with no per-user limit, one user's calls filled the whole queue (they run one per
  // batch), and every other user was answered RESOURCE_EXHAUSTED.
  FakeEngine engine;
  SchedulerOptions o;
  o.max_queue = 6;
  o.max_queue_per_user = 3;
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  std::vector<Outcome> flood(5), others(2);
  std::atomic<bool> cancel{false};
  for (int i = 0; i < 3; ++i) {
    PendingRank p = Pending(7, &flood[i]);
    if (i == 0) p.is_cancelled = [&cancel] { return cancel.load(); };
    ASSERT_TRUE(s->Submit(std::move(p)).ok()) << i;
  }
  SubmitRejection why = SubmitRejection::kNone;
  const absl::Status capped = s->Submit(Pending(7, &flood[3]), &why);
  EXPECT_EQ(capped.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(why, SubmitRejection::kUserQueueFull);
  EXPECT_NE(capped.message().find("user 7"), std::string::npos) << capped;
  EXPECT_NE(capped.message().find("--max_queue_per_user"), std::string::npos) << capped;
  EXPECT_EQ(flood[3].future.wait_for(0s), std::future_status::timeout);  // done not called
  // Other users still queue.
  EXPECT_TRUE(s->Submit(Pending(8, &others[0]), &why).ok());
  EXPECT_EQ(why, SubmitRejection::kNone);
  // A cancelled request of the user holds no place of its share either.
  cancel.store(true);
  EXPECT_TRUE(s->Submit(Pending(7, &flood[4])).ok());
  engine.Open();
  EXPECT_EQ(Await(flood[0]).status().code(), absl::StatusCode::kCancelled);
  for (int i : {1, 2, 4}) EXPECT_TRUE(Await(flood[i]).ok()) << i;
  EXPECT_TRUE(Await(others[0]).ok());
  // The user's requests ran one per batch, in order of arrival.
  int runs_of_7 = 0;
  for (const auto& b : engine.batches()) {
    EXPECT_LE(std::count(b.begin(), b.end(), 7u), 1);
    runs_of_7 += static_cast<int>(std::count(b.begin(), b.end(), 7u));
  }
  EXPECT_EQ(runs_of_7, 3);
}

TEST(SchedulerTest, WithoutAPerUserLimitOneUserMayFillTheQueue) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_queue = 4;
  o.max_queue_per_user = 0;
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  std::vector<Outcome> outs(5);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(s->Submit(Pending(7, &outs[i])).ok()) << i;
  SubmitRejection why = SubmitRejection::kNone;
  EXPECT_EQ(s->Submit(Pending(8, &outs[4]), &why).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(why, SubmitRejection::kQueueFull);
  engine.Open();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(Await(outs[i]).ok()) << i;
}

TEST(SchedulerTest, TheQueuedTokenBudgetCountsLiveRequestsAndAdmitsBehindAnEmptyQueue) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_queued_tokens = 50;  // Pending(user, out, events): 2 * events + 1 tokens
  Outcome first;
  auto s = MakeHeldScheduler(engine, o, &first);
  std::vector<Outcome> outs(4);
  // Larger than the budget, but the queue is empty: it queues (it could never run otherwise).
  // Its deadline leaves a loaded machine time for the next Submit while it is still live.
  ASSERT_TRUE(s->Submit(Pending(1, &outs[0], 26, Clock::now() + 2s)).ok());  // 53
  SubmitRejection why = SubmitRejection::kNone;
  EXPECT_EQ(s->Submit(Pending(2, &outs[1], 5), &why).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(why, SubmitRejection::kQueueFull);
  // Once the large one's deadline has passed, it holds no place of the budget (its memory counts
  // only against twice the budget, until it is answered).
  std::this_thread::sleep_for(2050ms);
  EXPECT_TRUE(s->Submit(Pending(2, &outs[2], 20), &why).ok());  // 41 live, 94 in all
  EXPECT_EQ(s->Submit(Pending(3, &outs[3], 5), &why).code(),  // 41 + 11 > 50
            absl::StatusCode::kResourceExhausted);
  engine.Open();
  EXPECT_EQ(Await(outs[0]).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Await(outs[2]).ok());
}

TEST(SchedulerTest, DeadRequestsBehindAFullBatchAreAnsweredWhenItStarts) {
  // Before: the scan stopped at the full batch, and the expired request waited for that batch
  // to end (and every batch after it, while the queue held more than a batch).
  FakeEngine engine;
  SchedulerOptions o;
  o.max_batch_size = 1;
  Outcome first, live, expired;
  auto s = MakeHeldScheduler(engine, o, &first);
  ASSERT_TRUE(s->Submit(Pending(1, &live)).ok());
  ASSERT_TRUE(s->Submit(Pending(2, &expired, 1, Clock::now() + 10ms)).ok());
  std::this_thread::sleep_for(30ms);
  engine.ReleaseOne();      // user 100's batch ends; user 1's starts and is held
  engine.WaitEntered(2);
  EXPECT_EQ(expired.future.wait_for(5s), std::future_status::ready) << "not answered while the batch ran";
  EXPECT_EQ(live.future.wait_for(0s), std::future_status::timeout);  // still in the engine
  engine.Open();
  EXPECT_EQ(Await(expired).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Await(live).ok());
}

TEST(SchedulerTest, ARequestThatExpiresWhileItsBatchIsPreparedGetsNoEngineWork) {
  // The prefetch of the requests queued behind a batch runs between the scan and the engine call.
  // The deadline is far enough ahead that the scan sees the request live even on a loaded,
  // sanitized machine; the prefetch then outlasts it.
  FakeEngine engine;
  SchedulerOptions o;
  const Clock::time_point deadline = Clock::now() + 2s;
  std::atomic<bool> live_at_prefetch{false};
  o.prefetch = [&](absl::Span<const RankRequest* const>, absl::Span<const RankRequest* const>) {
    if (Clock::now() < deadline) live_at_prefetch = true;
    std::this_thread::sleep_until(deadline + 50ms);
  };
  Outcome first, expires, later;
  auto s = MakeHeldScheduler(engine, o, &first);
  ASSERT_TRUE(s->Submit(Pending(1, &expires, 1, deadline)).ok());
  ASSERT_TRUE(s->Submit(Pending(1, &later)).ok());  // one user: stays queued, so a prefetch runs
  engine.Open();
  EXPECT_EQ(Await(expires).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Await(later).ok());
  int user1_runs = 0;
  for (const auto& b : engine.batches()) user1_runs += static_cast<int>(std::count(b.begin(), b.end(), 1));
  EXPECT_EQ(user1_runs, 1);  // the later request only
  EXPECT_TRUE(live_at_prefetch) << "the request expired before its batch was prepared";
}

TEST(SchedulerTest, EngineFailureFailsOnlyThatRequestAndServingContinues) {
  FakeEngine engine;
  auto s = MakeScheduler(&engine, SchedulerOptions());
  Outcome bad, good;
  ASSERT_TRUE(s->Submit(Pending(FakeEngine::kFailUser, &bad)).ok());
  EXPECT_EQ(bad.future.get().status().code(), absl::StatusCode::kInternal);
  ASSERT_TRUE(s->Submit(Pending(5, &good)).ok());
  EXPECT_TRUE(good.future.get().ok());
}

TEST(SchedulerTest, WrongResultCountIsInternalForThatBatch) {
  std::atomic<int> calls{0};
  auto s = Scheduler::Create(SchedulerOptions(), [&](absl::Span<const RankRequest> b) {
    ++calls;
    return std::vector<absl::StatusOr<RankResult>>();  // broken contract
  });
  ASSERT_TRUE(s.ok());
  Outcome out;
  ASSERT_TRUE((*s)->Submit(Pending(1, &out)).ok());
  EXPECT_EQ(out.future.get().status().code(), absl::StatusCode::kInternal);
}

TEST(SchedulerTest, DrainFinishesQueuedWorkThenRejects) {
  FakeEngine engine;
  Outcome first;
  auto s = MakeHeldScheduler(engine, SchedulerOptions(), &first);
  std::vector<Outcome> outs(5);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(s->Submit(Pending(i + 1, &outs[i])).ok());
  std::thread drainer([&] { s->Drain(); });
  // Waits for the drainer thread to begin (a fixed 20 ms was once too short for a thread start).
  const auto end = Clock::now() + 10s;
  while (!s->Draining() && Clock::now() < end) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(s->Draining());
  Outcome late;
  EXPECT_EQ(s->Submit(Pending(9, &late)).code(), absl::StatusCode::kUnavailable);
  engine.Open();
  drainer.join();
  EXPECT_TRUE(first.future.get().ok());
  for (auto& o : outs) EXPECT_TRUE(o.future.get().ok());
}

TEST(SchedulerTest, ManyThreadsNoRequestLost) {
  FakeEngine engine;
  SchedulerOptions o;
  o.max_batch_size = 4;
  o.max_queue = 100000;
  auto s = MakeScheduler(&engine, o);
  constexpr int kThreads = 8, kPerThread = 200;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        Outcome out;
        ASSERT_TRUE(s->Submit(Pending(static_cast<uint64_t>((t * 7 + i) % 5), &out)).ok());
        if (out.future.get().ok()) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kPerThread);
  for (const auto& b : engine.batches()) {
    EXPECT_EQ(std::set<uint64_t>(b.begin(), b.end()).size(), b.size());
    EXPECT_LE(b.size(), 4u);
  }
}

}  // namespace
}  // namespace hstu::server
