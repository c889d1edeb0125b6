#include "server/scheduler.h"

#include <algorithm>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hstu::server {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Why a request can no longer be answered usefully (its deadline passed, or its call was
// cancelled), `where` in its life; OK while it can. An expired call is also cancelled by gRPC;
// DEADLINE_EXCEEDED is the more useful answer.
absl::Status DeadStatus(const PendingRank& p, Clock::time_point now, const char* where) {
  if (p.deadline <= now) return absl::DeadlineExceededError(absl::StrCat("deadline expired ", where));
  if (p.is_cancelled && p.is_cancelled()) {
    return absl::CancelledError(absl::StrCat("call was cancelled ", where));
  }
  return absl::OkStatus();
}

}  // namespace

const char* SubmitRejectionName(SubmitRejection reason) {
  switch (reason) {
    case SubmitRejection::kNone: return "";
    case SubmitRejection::kQueueFull: return "queue_full";
    case SubmitRejection::kUserQueueFull: return "user_queue_full";
    case SubmitRejection::kShuttingDown: return "shutting_down";
    case SubmitRejection::kStarting: return "starting";
  }
  return "";
}

int64_t DefaultTokenCost(const RankRequest& request) {
  return 2 * static_cast<int64_t>(request.history_item_ids.size()) +
         static_cast<int64_t>(request.candidate_item_ids.size());
}

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(const SchedulerOptions& options,
                                                             RunBatchFn run_batch,
                                                             BatchObserver observer) {
  for (const auto& [name, value, min] : {std::tuple<const char*, int64_t, int64_t>{
                                             "max_batch_size", options.max_batch_size, 1},
                                         {"max_batch_tokens", options.max_batch_tokens, 1},
                                         {"max_queue", options.max_queue, 1},
                                         {"max_queued_tokens", options.max_queued_tokens, 0},
                                         {"max_queue_per_user", options.max_queue_per_user, 0}}) {
    if (value < min) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be >= ", min, ", got ", value));
    }
  }
  if (options.batch_timeout.count() < 0) {
    return absl::InvalidArgumentError("batch_timeout must be >= 0");
  }
  if (!run_batch) return absl::InvalidArgumentError("run_batch must be set");
  return std::unique_ptr<Scheduler>(
      new Scheduler(options, std::move(run_batch), std::move(observer)));
}

Scheduler::Scheduler(const SchedulerOptions& options, RunBatchFn run_batch, BatchObserver observer)
    : options_(options), run_batch_(std::move(run_batch)), observer_(std::move(observer)) {
  worker_ = std::thread([this] { WorkerLoop(); });
}

Scheduler::~Scheduler() { Drain(); }

absl::Status Scheduler::Submit(PendingRank pending, SubmitRejection* reason) {
  auto reject = [reason](SubmitRejection why, absl::Status status) {
    if (reason != nullptr) *reason = why;
    return status;
  };
  if (reason != nullptr) *reason = SubmitRejection::kNone;
  Item item;
  item.memory_tokens = DefaultTokenCost(pending.request);
  item.tokens = options_.token_cost ? options_.token_cost(pending.request)
                                    : DefaultTokenCost(pending.request);
  item.enqueued = Clock::now();
  item.pending = std::move(pending);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) {
      return reject(SubmitRejection::kShuttingDown,
                    absl::UnavailableError("server is shutting down"));
    }
    // Requests whose deadline passed or whose call was cancelled hold no place: they are answered
    // at the next batch boundary. (The queue's storage stays bounded at twice max_queue.)
    const int64_t entries = static_cast<int64_t>(queue_.size());
    if (entries >= options_.max_queue) {
      const int64_t live = LiveQueuedLocked(item.enqueued);
      if (live >= options_.max_queue) {
        return reject(SubmitRejection::kQueueFull,
                      absl::ResourceExhaustedError(absl::StrCat(
                          "request queue is full (", options_.max_queue, " requests)")));
      }
      if (entries >= 2 * static_cast<int64_t>(options_.max_queue)) {
        return reject(SubmitRejection::kQueueFull,
                      absl::ResourceExhaustedError(absl::StrCat(
                          "request queue is full: it keeps at most ", entries,
                          " entries (twice --max_queue), and ", entries - live,
                          " of them, expired or cancelled, are answered when the batch on the "
                          "engine ends")));
      }
    }
    if (TokensFullLocked(item.memory_tokens, item.enqueued)) {
      return reject(SubmitRejection::kQueueFull,
                    absl::ResourceExhaustedError(absl::StrCat(
                        "request queue is full: it holds at most ", options_.max_queued_tokens,
                        " estimated tokens (--max_queued_tokens), and this request has ",
                        item.memory_tokens)));
    }
    if (UserQueueFullLocked(item.pending.request.user_id, item.enqueued)) {
      return reject(SubmitRejection::kUserQueueFull,
                    absl::ResourceExhaustedError(absl::StrCat(
                        "user ", item.pending.request.user_id, " already has ",
                        options_.max_queue_per_user,
                        " requests queued (--max_queue_per_user); they run one per batch")));
    }
    queued_tokens_ += item.memory_tokens;
    queue_.push_back(std::move(item));
    depth_.store(static_cast<int64_t>(queue_.size()), std::memory_order_relaxed);
  }
  cv_.notify_one();
  return absl::OkStatus();
}

template <typename Weight>
int64_t Scheduler::SumLiveLocked(Clock::time_point now, Weight weight) const {
  int64_t sum = 0;
  for (const Item& item : queue_) {
    if (const int64_t w = weight(item); w != 0 && DeadStatus(item.pending, now, "").ok()) sum += w;
  }
  return sum;
}

int64_t Scheduler::LiveQueuedLocked(Clock::time_point now) const {
  return SumLiveLocked(now, [](const Item&) { return 1; });
}

bool Scheduler::UserQueueFullLocked(uint64_t user, Clock::time_point now) const {
  if (options_.max_queue_per_user == 0) return false;
  return SumLiveLocked(now, [user](const Item& item) {
           return item.pending.request.user_id == user ? 1 : 0;
         }) >= options_.max_queue_per_user;
}

bool Scheduler::TokensFullLocked(int64_t tokens, Clock::time_point now) const {
  const int64_t budget = options_.max_queued_tokens;
  if (budget == 0 || queue_.empty() || queued_tokens_ + tokens <= budget) return false;
  // Dead requests hold no place here either, up to twice the budget (their memory is still held).
  if (queued_tokens_ + tokens > 2 * budget) return true;
  const int64_t live = SumLiveLocked(now, [](const Item& item) { return item.memory_tokens; });
  return live > 0 && live + tokens > budget;
}

void Scheduler::SweepDeadLocked(Clock::time_point now, std::vector<Item>* rejected) {
  size_t kept = 0;
  for (size_t i = 0; i < queue_.size(); ++i) {
    Item& item = queue_[i];
    if (absl::Status dead = DeadStatus(item.pending, now, "while queued"); !dead.ok()) {
      item.rejection = std::move(dead);
      queued_tokens_ -= item.memory_tokens;
      rejected->push_back(std::move(item));
    } else if (kept++ != i) {
      queue_[kept - 1] = std::move(item);
    }
  }
  queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(kept), queue_.end());
}

int64_t Scheduler::QueueDepth() const { return depth_.load(std::memory_order_relaxed); }

absl::Duration Scheduler::BusyFor() const {
  const int64_t start = batch_start_ns_.load();
  if (start == 0) return absl::ZeroDuration();
  return absl::Nanoseconds(Clock::now().time_since_epoch() / std::chrono::nanoseconds(1) - start);
}

bool Scheduler::Draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
}

void Scheduler::StopWaitingForFullerBatches() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    no_batch_waits_ = true;
  }
  cv_.notify_all();
}

void Scheduler::Drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
    no_batch_waits_ = true;
  }
  cv_.notify_all();
  std::lock_guard<std::mutex> join_lock(join_mu_);
  if (worker_.joinable()) worker_.join();
}

bool Scheduler::TakeBatchLocked(std::vector<Item>* batch, Clock::time_point* wake_at,
                                std::vector<Item>* rejected) {
  const Clock::time_point now = Clock::now();
  std::vector<size_t> chosen;
  std::unordered_set<uint64_t> users;
  int64_t tokens = 0;
  bool full = false;
  // Every dead request is answered now, without engine work, wherever it is in the queue (its
  // caller waits, and it holds a place).
  SweepDeadLocked(now, rejected);
  for (size_t i = 0; i < queue_.size();) {
    Item& item = queue_[i];
    const uint64_t user = item.pending.request.user_id;
    if (users.contains(user)) {
      ++i;  // the user's earlier request runs first; this one keeps its place
      continue;
    }
    if (!chosen.empty() && tokens + item.tokens > options_.max_batch_tokens) {
      full = true;  // stop rather than skip, so large requests are not overtaken forever
      break;
    }
    chosen.push_back(i);
    users.insert(user);
    tokens += item.tokens;
    ++i;
    if (static_cast<int32_t>(chosen.size()) >= options_.max_batch_size ||
        tokens >= options_.max_batch_tokens) {
      full = true;
      break;
    }
  }
  if (chosen.empty()) return false;
  if (options_.adaptive_fill && static_cast<int32_t>(chosen.size()) >= last_batch_size_) full = true;
  if (!full && !no_batch_waits_ && options_.batch_timeout.count() > 0) {
    const Clock::time_point ready_at = queue_[chosen.front()].enqueued + options_.batch_timeout;
    if (ready_at > now) {
      *wake_at = ready_at;
      return false;
    }
  }
  last_batch_size_ = static_cast<int32_t>(chosen.size());
  batch->reserve(chosen.size());
  for (size_t idx : chosen) {
    queued_tokens_ -= queue_[idx].memory_tokens;
    batch->push_back(std::move(queue_[idx]));
  }
  // Erase back to front so earlier indices stay valid.
  for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) {
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(*it));
  }
  return true;
}

void Scheduler::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    std::vector<Item> batch, rejected;
    Clock::time_point wake_at = Clock::time_point::max();
    const bool got = TakeBatchLocked(&batch, &wake_at, &rejected);
    depth_.store(static_cast<int64_t>(queue_.size()), std::memory_order_relaxed);
    // Pointers into the queue: only this thread removes items, and a deque keeps its elements in
    // place when Submit() appends.
    std::vector<const RankRequest*> upcoming;
    if (got && options_.prefetch) {
      for (const Item& item : queue_) {
        if (static_cast<int32_t>(upcoming.size()) >= options_.max_batch_size) break;
        upcoming.push_back(&item.pending.request);
      }
    }
    if (got || !rejected.empty()) {
      lock.unlock();
      if (!upcoming.empty()) {
        std::vector<const RankRequest*> running;
        for (const Item& item : batch) running.push_back(&item.pending.request);
        options_.prefetch(running, upcoming);
      }
      const Clock::time_point now = Clock::now();
      for (Item& item : rejected) {
        RequestTiming timing;
        timing.queue_seconds = Seconds(now - item.enqueued);
        item.pending.done(std::move(item.rejection), timing);
      }
      if (got) RunBatch(batch);
      lock.lock();
      continue;
    }
    if (draining_ && queue_.empty()) break;
    if (wake_at == Clock::time_point::max()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, wake_at);
    }
  }
}

void Scheduler::RunBatch(std::vector<Item>& batch) {
  // A request can expire, or its call be cancelled, between the scan and now (the prefetch runs in
  // between): it gets no engine work either.
  const Clock::time_point taken = Clock::now();
  std::erase_if(batch, [&](Item& item) {
    absl::Status dead = DeadStatus(item.pending, taken, "before its batch ran");
    if (dead.ok()) return false;
    RequestTiming timing;
    timing.queue_seconds = Seconds(taken - item.enqueued);
    item.pending.done(std::move(dead), timing);
    return true;
  });
  if (batch.empty()) return;
  std::vector<RankRequest> requests;
  requests.reserve(batch.size());
  BatchInfo info;
  info.num_requests = static_cast<int32_t>(batch.size());
  for (Item& item : batch) {
    info.num_tokens += item.tokens;
    requests.push_back(std::move(item.pending.request));
  }
  const Clock::time_point start = Clock::now();
  batch_start_ns_.store(std::max<int64_t>(1, start.time_since_epoch() / std::chrono::nanoseconds(1)));
  std::vector<absl::StatusOr<RankResult>> results = run_batch_(requests);
  const Clock::time_point end = Clock::now();
  batch_start_ns_.store(0);
  info.compute_seconds = Seconds(end - start);
  if (results.size() != batch.size()) {
    // A broken engine contract fails this batch only; the server keeps serving.
    results.assign(batch.size(), absl::InternalError(absl::StrCat(
                                     "engine returned ", results.size(), " results for a batch of ",
                                     batch.size())));
  }
  if (observer_) observer_(info);
  for (size_t i = 0; i < batch.size(); ++i) {
    RequestTiming timing;
    timing.queue_seconds = Seconds(start - batch[i].enqueued);
    timing.compute_seconds = info.compute_seconds;
    timing.batch_size = info.num_requests;
    batch[i].pending.done(std::move(results[i]), timing);
  }
}

}  // namespace hstu::server
