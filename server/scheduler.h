// Dynamic batching scheduler between the RPC front end and the engine (DESIGN §8). It knows nothing
// of gRPC: requests arrive as engine RankRequests with a deadline, a cancellation probe and a
// completion callback, and leave through that callback exactly once.
//
// Rules:
//  - one worker thread owns the engine and runs one batch at a time;
//  - a batch holds at most `max_batch_size` requests and `max_batch_tokens` estimated tokens (a
//    single larger request still runs, alone);
//  - a batch never holds two requests of one user: the later one stays queued, keeps its place
//    and runs in a later batch, where it reuses the earlier one's cache;
//  - the worker starts as soon as it is idle and work is queued; with `batch_timeout` > 0 a
//    partly filled batch waits until its oldest request has been queued that long; with
//    `adaptive_fill` as well, a batch counts as full once it holds as many requests as the batch
//    before it, so the callers of a closed loop, whose answers just went out, are regrouped into
//    one batch without waiting out the timeout (and a falling load waits it out only once);
//  - a request whose deadline passed or whose call was cancelled is answered before any engine
//    work (DEADLINE_EXCEEDED / CANCELLED), checked when a batch is formed (the whole queue) and
//    again right before the batch runs;
//  - the queue is bounded: Submit() answers RESOURCE_EXHAUSTED when it holds max_queue requests
//    that can still be answered (dead ones, not yet answered, take no place), or, with
//    max_queue_per_user > 0, that many of the request's user (they run one per batch, so a user's
//    flood would otherwise hold the queue's places and only lengthen its own wait), or, with
//    max_queued_tokens > 0, when the request's estimated tokens would take the queue past that
//    (a request always queues behind an empty queue);
//  - Drain() stops admitting (UNAVAILABLE), finishes everything queued, then stops the worker;
//  - an engine failure of one batch answers INTERNAL for that batch only.
//
// Thread-safety: Submit(), QueueDepth() and Drain() may be called from any thread. Callbacks run
// on the worker thread (or inside Submit() for a rejected request) and must not block.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/request.h"

namespace hstu::server {

using Clock = std::chrono::steady_clock;

struct SchedulerOptions {
  int32_t max_batch_size = 8;       // requests (users) per engine call
  int64_t max_batch_tokens = 65536;  // estimated tokens per engine call
  std::chrono::microseconds batch_timeout{0};
  // With batch_timeout > 0: a partly filled batch is full at the previous batch's size (see above)
  // instead of at max_batch_size.
  bool adaptive_fill = false;
  int32_t max_queue = 1024;          // queued requests beyond which Submit() rejects
  int32_t max_queue_per_user = 0;    // queued requests of one user beyond which it rejects; 0: none
  // Estimated tokens queued (DefaultTokenCost: every history event, even those the model will not
  // keep, since the request holds them in memory) beyond which Submit() rejects, unless the queue
  // is empty: what bounds the queue's memory, since one request may carry 2^20 events. 0: none.
  int64_t max_queued_tokens = 0;
  // Estimated tokens of a request (history tokens + candidates); the scheduler cannot see the
  // cache, so this is an upper bound of what the engine computes. Unset: 2 * events + candidates.
  std::function<int64_t(const RankRequest&)> token_cost;
  // Called on the worker thread right before each batch runs, with the batch and up to
  // `max_batch_size` requests still queued behind it, so that their KV onloads start early
  // (Engine::Prefetch). Unset: no prefetch.
  // The pointers stay valid during the call.
  std::function<void(absl::Span<const RankRequest* const> batch,
                     absl::Span<const RankRequest* const> queued)>
      prefetch;
};

// Per-request timings handed to the completion callback.
struct RequestTiming {
  double queue_seconds = 0;    // Submit() → its batch starts
  double compute_seconds = 0;  // its batch's engine call (0 when answered without engine work)
  int32_t batch_size = 0;      // requests in that batch (0 when answered without engine work)
};

using RankDone = std::function<void(absl::StatusOr<RankResult>, const RequestTiming&)>;

struct PendingRank {
  RankRequest request;
  Clock::time_point deadline = Clock::time_point::max();
  std::function<bool()> is_cancelled;  // optional; polled right before the request joins a batch
  RankDone done;
};

// What one batch looked like, for metrics.
struct BatchInfo {
  int32_t num_requests = 0;
  int64_t num_tokens = 0;  // estimated, as counted against max_batch_tokens
  double compute_seconds = 0;
};

// Why a request was turned away before any engine work: Submit()'s reasons, and kStarting (the
// service's own: the model is still loading).
enum class SubmitRejection { kNone, kQueueFull, kUserQueueFull, kShuttingDown, kStarting };
// Label values for metrics: "queue_full", "user_queue_full", "shutting_down", "starting" ("" for
// kNone).
const char* SubmitRejectionName(SubmitRejection reason);

class Scheduler {
 public:
  // Runs a batch on the engine: one result per request, in order.
  using RunBatchFn =
      std::function<std::vector<absl::StatusOr<RankResult>>(absl::Span<const RankRequest>)>;
  using BatchObserver = std::function<void(const BatchInfo&)>;

  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(const SchedulerOptions& options,
                                                           RunBatchFn run_batch,
                                                           BatchObserver observer = nullptr);
  ~Scheduler();  // Drain()s
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. On rejection (queue full, the user's share of it full, draining) `done` has
  // NOT been called, the returned status says why and `*reason` (if given) which rule it was; the
  // caller answers the RPC itself.
  absl::Status Submit(PendingRank pending, SubmitRejection* reason = nullptr);
  int64_t QueueDepth() const;
  // How long the batch now on the engine has been running; zero while the worker is idle.
  // Thread-safe.
  absl::Duration BusyFor() const;
  // From now on runs what is queued without waiting for fuller batches: the caller admits no more
  // calls, so nothing can join them (a call already past its admission is still queued). Returns
  // at once. Idempotent, thread-safe.
  void StopWaitingForFullerBatches();
  // Stops admitting, finishes queued and running work, joins the worker. Idempotent.
  void Drain();
  // Whether Drain() has begun: Submit() refuses from then on.
  bool Draining() const;

 private:
  struct Item {
    PendingRank pending;
    Clock::time_point enqueued;
    int64_t tokens = 0;         // token_cost: what it counts against max_batch_tokens
    int64_t memory_tokens = 0;  // DefaultTokenCost, history uncapped: against max_queued_tokens
    absl::Status rejection;  // why it left the queue without engine work
  };

  Scheduler(const SchedulerOptions& options, RunBatchFn run_batch, BatchObserver observer);
  void WorkerLoop();
  // Moves every expired or cancelled request of the queue to *rejected, then the next batch out
  // of the queue.
  // Returns false with an empty batch when it should wait (until `*wake_at`) instead.
  bool TakeBatchLocked(std::vector<Item>* batch, Clock::time_point* wake_at,
                       std::vector<Item>* rejected);
  void RunBatch(std::vector<Item>& batch);
  // The sum of `weight(item)` over the queued requests that can still be answered usefully
  // (deadline ahead, call not cancelled); items of weight 0 are not probed.
  template <typename Weight>
  int64_t SumLiveLocked(Clock::time_point now, Weight weight) const;
  // Queued requests that can still be answered usefully.
  int64_t LiveQueuedLocked(Clock::time_point now) const;
  // Whether `user` already has max_queue_per_user such requests queued.
  bool UserQueueFullLocked(uint64_t user, Clock::time_point now) const;
  // Whether `tokens` more would take the queue's live requests past max_queued_tokens.
  bool TokensFullLocked(int64_t tokens, Clock::time_point now) const;
  // Moves the dead requests of the queue to *rejected, keeping the order of the others.
  void SweepDeadLocked(Clock::time_point now, std::vector<Item>* rejected);

  const SchedulerOptions options_;
  const RunBatchFn run_batch_;
  const BatchObserver observer_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  int64_t queued_tokens_ = 0;  // the memory_tokens of queue_'s items, dead ones included
  bool draining_ = false;
  bool no_batch_waits_ = false;  // StopWaitingForFullerBatches(), or Drain()
  std::atomic<int64_t> depth_{0};
  std::atomic<int64_t> batch_start_ns_{0};  // steady clock of the running batch's start; 0: idle
  int32_t last_batch_size_ = 0;  // requests in the batch the worker took last (guarded by mu_)
  std::mutex join_mu_;  // Drain() may race with itself (signal path and destructor)
  std::thread worker_;
};

// The default token estimate: 2 tokens per history event plus one per candidate.
int64_t DefaultTokenCost(const RankRequest& request);

}  // namespace hstu::server
