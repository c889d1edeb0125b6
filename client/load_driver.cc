#include "client/load_driver.h"

#include <sys/prctl.h>

#include <algorithm>
#include <condition_variable>
#include <random>
#include <span>
#include <thread>
#include <unordered_set>
#include <utility>

namespace hstu::loadgen {
namespace {

// Sleeps until `t` in short slices; false when a stop signal came first.
bool SleepUntil(Clock::time_point t) {
  while (!Interrupted()) {
    const Clock::time_point now = Clock::now();
    if (now >= t) return true;
    std::this_thread::sleep_for(std::min<Clock::duration>(t - now, std::chrono::milliseconds(50)));
  }
  return false;
}

bool SleepFor(double s) {
  return SleepUntil(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(std::max(0.0, s))));
}

// The calls of a level in flight, so that a stop signal can cancel them instead of waiting out
// their deadlines (up to --timeout_ms).
class InFlightCalls {
 public:
  void Add(grpc::ClientContext* ctx) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    calls_.insert(ctx);
  }
  // Before the context is destroyed.
  void Remove(grpc::ClientContext* ctx) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    calls_.erase(ctx);
  }
  // Holds the lock, so no context is destroyed meanwhile, except by a completion that gRPC runs
  // inside TryCancel on this thread (hence the recursive lock, and the walk over a copy that
  // skips what such a completion removed).
  void CancelAll() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const std::vector<grpc::ClientContext*> now(calls_.begin(), calls_.end());
    for (grpc::ClientContext* ctx : now) {
      if (calls_.contains(ctx)) ctx->TryCancel();
    }
  }

 private:
  std::recursive_mutex mu_;
  std::unordered_set<grpc::ClientContext*> calls_;
};

// A call that a stop signal cancelled: not the server's answer, so not counted.
bool CancelledByUs(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::CANCELLED && Interrupted();
}

}  // namespace

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

const char* CodeName(grpc::StatusCode code) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                 "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kNames[c] : "UNKNOWN";
}

hstu::v1::RankRequest Driver::MakeRequest(const Visit& v) {
  hstu::v1::RankRequest req;
  req.set_user_id(v.user_id);
  req.mutable_history_item_ids()->Assign(v.history_item_ids.begin(), v.history_item_ids.end());
  req.mutable_history_actions()->Assign(v.history_actions.begin(), v.history_actions.end());
  req.mutable_candidate_item_ids()->Assign(v.candidate_item_ids.begin(),
                                           v.candidate_item_ids.end());
  req.set_request_id(absl::StrCat(next_id_.fetch_add(1)));
  return req;
}

void Driver::PrepareContext(grpc::ClientContext* ctx, uint64_t user_id, Clock::time_point start) {
  // The deadline counts from the intended send time, like the latency.
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(timeout_ms_) -
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(
                        Clock::now() - start));
  ctx->AddMetadata("x-user-id", absl::StrCat(user_id));
}

Ranker::Stub* Driver::NextStub() { return stubs_[next_stub_.fetch_add(1) % stubs_.size()].get(); }

void Driver::Record(const hstu::v1::RankRequest& req, const grpc::Status& status,
                    const hstu::v1::RankResponse& resp) {
  if (answers_ == nullptr || !status.ok() || !answers_->Take()) return;
  auto span_of = [](const auto& field) { return std::span(field.data(), field.size()); };
  answers_->Write(AnswerLine(req.user_id(), span_of(req.history_item_ids()),
                             span_of(req.history_actions()), span_of(req.candidate_item_ids()),
                             span_of(resp.scores()), static_cast<int>(resp.num_tasks()),
                             resp.cache_result()));
}

// Closed loop: `concurrency` threads, each with one synchronous call outstanding. A stop
// signal ends the level early (the window closes then); an error only when its threads could
// not all start.
absl::Status Driver::RunClosed(Level* level, int32_t concurrency, double warmup_s, double duration_s,
                               int64_t num_requests) {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> issued{0};
  std::atomic<int32_t> running{0};
  InFlightCalls calls;
  std::vector<std::thread> workers;
  auto worker = [&] {
    // An unreachable server answers UNAVAILABLE at once, and a full queue RESOURCE_EXHAUSTED:
    // back off (1 ms doubling to 100 ms), as a well-behaved client does, instead of spinning
    // through failed calls (800 refusals a second at 8 callers on a queue of 6).
    std::chrono::milliseconds backoff{0};
    while (!stop.load() && !Interrupted()) {
      const bool measured = level->measuring();
      if (measured && num_requests > 0 && issued.fetch_add(1) >= num_requests) break;
      // A replay waits here while every user in reach has a visit in flight (client/replay.h):
      // the level may end meanwhile, and a visit taken then goes unsent.
      auto stopped = [&] { return stop.load() || Interrupted(); };
      const std::optional<Visit> next = traffic_->NextUnless(stopped);
      if (!next) break;
      if (stopped()) {
        traffic_->Done(*next);
        break;
      }
      const Visit& v = *next;
      const hstu::v1::RankRequest req = MakeRequest(v);
      hstu::v1::RankResponse resp;
      grpc::ClientContext ctx;
      const Clock::time_point start = Clock::now();
      PrepareContext(&ctx, v.user_id, start);
      calls.Add(&ctx);
      const grpc::Status status = NextStub()->Rank(&ctx, req, &resp);
      // Read at once: the bookkeeping below takes locks other callers hold.
      const double latency_s = Since(start);
      calls.Remove(&ctx);
      traffic_->Done(v);
      if (!CancelledByUs(status)) level->Done(measured, status, latency_s, resp, v.new_user);
      Record(req, status, resp);
      if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
          status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        backoff = std::clamp(2 * backoff, std::chrono::milliseconds(1),
                             std::chrono::milliseconds(100));
        std::this_thread::sleep_for(backoff);
      } else {
        backoff = std::chrono::milliseconds(0);
      }
    }
  };
  // Without a warm-up the window opens before the first call: every call sent is counted
  // (before, the callers' first calls went out unmeasured while the window was still shut).
  if (warmup_s <= 0) level->StartMeasuring();
  absl::Status started;
  try {
    for (int32_t w = 0; w < concurrency; ++w) {
      running.fetch_add(1);
      workers.emplace_back([&] {
        worker();
        running.fetch_sub(1);
      });
    }
  } catch (const std::system_error& e) {
    running.fetch_sub(1);  // the thread that did not start
    started = absl::ResourceExhaustedError(absl::StrCat("could not start caller thread ",
                                                        workers.size() + 1, " of ", concurrency,
                                                        ": ", e.what()));
    stop.store(true);
  }
  if (started.ok() && SleepFor(warmup_s)) {
    if (warmup_s > 0) level->StartMeasuring();
    // With --requests the workers stop by themselves after the count, and the window closes at
    // the last answer; a stop signal stops them too.
    if (num_requests == 0) {
      SleepFor(duration_s);
      level->CloseWindow();
    }
  }
  if (num_requests == 0 || !started.ok() || Interrupted()) stop.store(true);
  // A stop signal cancels the calls in flight instead of waiting out their deadlines.
  while (running.load() > 0) {
    if (Interrupted()) calls.CancelAll();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& t : workers) t.join();
  level->Finish();
  return started;
}

// Open loop: one sender on a schedule; answers arrive on gRPC's callback threads.
void Driver::RunOpen(Level* level, double rate, bool poisson, double warmup_s, double duration_s,
                     int64_t num_requests, int64_t max_outstanding, uint64_t seed) {
  // The sender's sleeps end when asked, not up to the kernel's default 50 µs slack later.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  std::mt19937_64 rng(Mix64(seed + 99));
  std::exponential_distribution<double> gap(rate);
  std::atomic<int64_t> outstanding{0};
  std::mutex done_mu;
  std::condition_variable done_cv;
  InFlightCalls calls;
  const Clock::time_point t0 = Clock::now();
  double offset_s = 0;
  bool measuring = false;
  Clock::time_point measure_start;
  int64_t sent_measured = 0;
  // The call is built before its time comes: neither building it nor the sender's wake-up is
  // timed as the server's. What lateness is left is reported as the sender's lag. A call whose
  // slot is skipped (backlog) waits for the next slot: a visit is drawn only for a call sent,
  // so no user's history advances past what the server saw.
  struct Call {
    grpc::ClientContext ctx;
    hstu::v1::RankRequest req;
    hstu::v1::RankResponse resp;
    Visit visit;
  };
  std::unique_ptr<Call> pending;
  while (true) {
    offset_s += poisson ? gap(rng) : 1.0 / rate;
    const Clock::time_point scheduled =
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(offset_s));
    if (!measuring && offset_s >= warmup_s) {
      if (!SleepUntil(scheduled)) break;  // a stop signal in the warm-up: nothing measured
      level->StartMeasuring();
      measuring = true;
      measure_start = scheduled;
    }
    if (measuring) {
      if (num_requests > 0 && sent_measured >= num_requests) break;
      if (num_requests == 0 &&
          scheduled - measure_start >= std::chrono::duration<double>(duration_s)) {
        SleepUntil(scheduled);
        level->CloseWindow();
        break;
      }
      ++sent_measured;
    }
    if (pending == nullptr) {
      // A replay's sender waits here while every user in reach has a visit in flight, and falls
      // behind its schedule (reported as its lag); a stop signal ends the wait.
      std::optional<Visit> next = traffic_->NextUnless([] { return Interrupted(); });
      if (!next) {
        if (measuring) level->CloseWindow();
        break;
      }
      pending = std::make_unique<Call>();
      pending->visit = *std::move(next);
      pending->req = MakeRequest(pending->visit);
    }
    if (!SleepUntil(scheduled)) {
      if (measuring) level->CloseWindow();
      break;
    }
    if (outstanding.load() >= max_outstanding) {
      level->Backlog();  // this slot is skipped; the call waits for the next one
      continue;
    }
    if (measuring) {
      level->Sent(std::chrono::duration<double>(Clock::now() - scheduled).count());
    }
    Call* call = pending.release();
    PrepareContext(&call->ctx, call->visit.user_id, scheduled);
    outstanding.fetch_add(1);
    calls.Add(&call->ctx);
    const bool measured = measuring;
    NextStub()->async()->Rank(
        &call->ctx, &call->req, &call->resp,
        [this, call, level, measured, scheduled, &calls, &outstanding, &done_mu,
         &done_cv](grpc::Status s) {
          // Latency from the scheduled send time: queueing in a slow client or server counts.
          const double latency = std::chrono::duration<double>(Clock::now() - scheduled).count();
          traffic_->Done(call->visit);
          if (!CancelledByUs(s))
            level->Done(measured, s, latency, call->resp, call->visit.new_user);
          Record(call->req, s, call->resp);
          calls.Remove(&call->ctx);
          delete call;
          std::lock_guard<std::mutex> lock(done_mu);
          outstanding.fetch_sub(1);
          done_cv.notify_all();
        });
  }
  if (pending != nullptr) traffic_->Done(pending->visit);  // built, never sent
  // The answers still out; a stop signal cancels them instead of waiting out their deadlines.
  while (true) {
    {
      std::unique_lock<std::mutex> lock(done_mu);
      if (done_cv.wait_for(lock, std::chrono::milliseconds(20),
                           [&] { return outstanding.load() == 0; })) {
        break;
      }
    }
    if (Interrupted()) calls.CancelAll();  // not under done_mu, which completions take
  }
  level->Finish();
}

}  // namespace hstu::loadgen
