// hstu_loadgen: load generator for hstu_server (DESIGN §10).
//
// Closed loop (--concurrency=N or a sweep 1:64:x2 / 1,2,8): N workers each send the next request
// when the previous one answers. Open loop (--rate=R[,R2...]): requests are sent on a schedule
// (constant or Poisson gaps) whatever the server does, and latency is measured from the scheduled
// send time, so a slow server cannot hide its queueing (no coordinated omission).
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/answer_log.h"
#include "client/cli_util.h"
#include "client/latency_histogram.h"
#include "client/report.h"
#include "client/traffic.h"
#include "engine/atomic_file.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "hstu/v1/ranking.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address HOST:PORT.");
ABSL_FLAG(double, duration, 10, "Seconds measured per load level (after --warmup).");
ABSL_FLAG(int64_t, requests, 0, "Requests per load level instead of --duration (0: use duration).");
ABSL_FLAG(std::string, concurrency, "8",
          "Closed loop: outstanding requests, or a sweep: 1:64:x2 (geometric), 1:16:+4 (linear), "
          "or a list 1,4,16.");
ABSL_FLAG(std::string, rate, "",
          "Open loop: requests per second (or a list 100,200); overrides --concurrency.");
ABSL_FLAG(std::string, arrival, "poisson", "Open loop arrivals: constant or poisson.");
ABSL_FLAG(int64_t, users, 1000, "User population.");
ABSL_FLAG(double, zipf, 1.0, "Zipf exponent of user popularity (0: uniform).");
ABSL_FLAG(double, new_user_rate, 0.01, "Fraction of visits that bring a brand-new user.");
ABSL_FLAG(int32_t, new_events, 4,
          "Each return visit adds uniform [--new_events_min, N] events to the history.");
ABSL_FLAG(int32_t, new_events_min, 1,
          "Fewest events a return visit adds (= --new_events: every visit adds exactly that many).");
ABSL_FLAG(int32_t, initial_events, 0,
          "Largest history (events) of a new user, uniform from --initial_events_min; 0: half the "
          "model's maximum.");
ABSL_FLAG(int32_t, initial_events_min, 1, "Smallest history (events) of a new user.");
ABSL_FLAG(int32_t, max_events, 0,
          "A user whose history would grow past this many events starts over as a new user; 0: "
          "twice the model's maximum (at most 1048576, the most the server accepts), so the "
          "server's truncation is exercised.");
ABSL_FLAG(int32_t, candidates, 0,
          "Candidates per request; 0: the model's candidates per forward pass, at most the "
          "server's --max_candidates.");
ABSL_FLAG(int64_t, timeout_ms, 1000, "Per-RPC deadline in milliseconds.");
ABSL_FLAG(double, warmup, 1, "Seconds of unmeasured load before each level.");
ABSL_FLAG(uint64_t, seed, 0,
          "Traffic seed (users, histories, candidates); 0: a fresh one each run, printed with the "
          "report. A run with the seed of an earlier one against the same server resends histories "
          "the server already holds, so its cache results are not a cold start's.");
ABSL_FLAG(int32_t, connections, 1, "gRPC connections (channels), used round-robin (at most 1024).");
ABSL_FLAG(std::string, json, "", "Write the results as JSON to this file.");
ABSL_FLAG(std::string, csv, "", "Write the results as CSV to this file.");
ABSL_FLAG(double, wait_ready_s, 0,
          "Wait up to this long for the server's health to be SERVING before starting.");
ABSL_FLAG(bool, progress, true, "Live progress line on stderr.");
ABSL_FLAG(int64_t, max_outstanding, 10000,
          "Open loop: sends beyond this many unanswered requests are counted as LOADGEN_BACKLOG "
          "errors instead of sent.");
ABSL_FLAG(double, max_error_rate, 0.01,
          "Exit status 1 when a level's failed calls (and open-loop sends skipped as "
          "LOADGEN_BACKLOG) exceed this share of its measured calls, or none succeeded (1: never; "
          "an overload study that expects errors sets it).");
ABSL_FLAG(int64_t, prewarm_visits, 0,
          "Visits sent before the first level and not reported (at the first level's concurrency, "
          "or 8 callers for a rate), so that the population's first visits, all misses, do not "
          "land in the first level.");
ABSL_FLAG(std::string, record, "",
          "Write the OK answers to this file as JSONL: each request with the scores it got "
          "(expected_scores) and its cache_result, warm-ups included. `hstu_rank --no_cache "
          "--input=FILE` recomputes them and reports each line whose scores differ by more than "
          "its --max_score_diff. The file is created once the server answered GetModelInfo.");
ABSL_FLAG(int64_t, record_every, 1, "With --record: write every Nth OK answer only.");
ABSL_FLAG(bool, overlapping_visits, false,
          "Let a user have several visits in flight (the later ones re-send its history). By "
          "default a visit goes to a user with none in flight while there is one.");

namespace hstu::loadgen {
namespace {

using Clock = std::chrono::steady_clock;
using hstu::v1::Ranker;

// Bounds that keep every duration a finite time point and every sweep a sane size.
constexpr double kMaxSeconds = 86400;   // --duration, --warmup, --wait_ready_s: at most a day
constexpr int64_t kMaxTimeoutMs = 86'400'000;
constexpr double kMinRate = 0.001, kMaxRate = 1e7;
constexpr int32_t kMaxConcurrency = 10000;  // a thread each
constexpr size_t kMaxLevels = 1000;
constexpr int32_t kMaxConnections = 1024;
// A request's sizes: the model file's bound on candidates (2^20), and the server's bound on
// history events (2^20, engine/request.h: it rejects longer histories; up to that, histories
// longer than the model's maximum are truncated).
constexpr int32_t kMaxCandidates = 1 << 20;
constexpr int32_t kMaxEvents = 1 << 20;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// SIGINT/SIGTERM: the level running stops and the report of what was measured is printed and
// written; a second signal ends the process at once.
std::atomic<bool> g_interrupted{false};

extern "C" void OnStopSignal(int sig) {
  if (g_interrupted.exchange(true)) {
    signal(sig, SIG_DFL);
    raise(sig);
  }
}

void InstallStopSignals() {
  struct sigaction sa = {};
  sa.sa_handler = OnStopSignal;
  sa.sa_flags = SA_RESTART;  // stdio writes to a pipe are not cut short by the signal
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

// Sleeps until `t` in short slices; false when a stop signal came first.
bool SleepUntil(Clock::time_point t) {
  while (!g_interrupted.load()) {
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
  return status.error_code() == grpc::StatusCode::CANCELLED && g_interrupted.load();
}

const char* CodeName(grpc::StatusCode code) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                 "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kNames[c] : "UNKNOWN";
}

absl::StatusOr<std::vector<int32_t>> ParseConcurrency(const std::string& spec) {
  std::vector<int32_t> out;
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "--concurrency=", spec, ": want N, A:B:xF, A:B:+S or a list A,B,C (each in [1, ",
        kMaxConcurrency, "], at most ", kMaxLevels, " levels)"));
  };
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  if (parts.size() == 3) {
    int32_t lo, hi, step;
    if (!absl::SimpleAtoi(parts[0], &lo) || !absl::SimpleAtoi(parts[1], &hi) || lo < 1 ||
        hi < lo || hi > kMaxConcurrency || parts[2].size() < 2 ||
        !absl::SimpleAtoi(parts[2].substr(1), &step)) {
      return bad();
    }
    if (parts[2][0] == 'x' && step >= 2) {
      for (int64_t c = lo; c <= hi; c *= step) out.push_back(static_cast<int32_t>(c));
    } else if (parts[2][0] == '+' && step >= 1) {
      for (int64_t c = lo; c <= hi && out.size() <= kMaxLevels; c += step) {
        out.push_back(static_cast<int32_t>(c));
      }
    } else {
      return bad();
    }
    if (out.size() > kMaxLevels) return bad();
    return out;
  }
  if (parts.size() != 1) return bad();
  for (absl::string_view p : absl::StrSplit(spec, ',')) {
    int32_t c;
    if (!absl::SimpleAtoi(p, &c) || c < 1 || c > kMaxConcurrency) return bad();
    out.push_back(c);
  }
  if (out.size() > kMaxLevels) return bad();
  return out;
}

absl::StatusOr<std::vector<double>> ParseRates(const std::string& spec) {
  std::vector<double> out;
  for (absl::string_view p : absl::StrSplit(spec, ',')) {
    double r;
    // NaN never ends a level, and a rate below the minimum would wait days for its first send.
    if (!absl::SimpleAtod(p, &r) || !(r >= kMinRate && r <= kMaxRate)) {
      return absl::InvalidArgumentError(absl::StrCat("--rate=", spec,
                                                     ": want R or R1,R2 (each in [", kMinRate, ", ",
                                                     kMaxRate, "] per second)"));
    }
    out.push_back(r);
  }
  if (out.size() > kMaxLevels) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate=", spec, ": at most ", kMaxLevels, " levels"));
  }
  return out;
}

// Everything one load level shares between the senders, the completions and the progress line.
class Level {
 public:
  explicit Level(LevelResult* result) : result_(result) {}

  void StartMeasuring() {
    std::lock_guard<std::mutex> lock(mu_);
    measuring_ = true;
    window_start_ = Clock::now();
    last_done_ = window_start_;
  }
  // The end of a window of fixed length (--duration): throughput counts the OK answers that came
  // back inside it, whenever they were sent, over its length. (Without it, --requests: the window
  // ends at the last measured answer.)
  void CloseWindow() {
    std::lock_guard<std::mutex> lock(mu_);
    window_closed_ = true;
    window_end_ = Clock::now();
  }
  // Whether a call sent now is inside the measured window.
  bool measuring() {
    std::lock_guard<std::mutex> lock(mu_);
    return measuring_ && !window_closed_;
  }
  // Whether the window ever opened (a level stopped in its warm-up did not).
  bool window_opened() {
    std::lock_guard<std::mutex> lock(mu_);
    return measuring_;
  }
  // Open loop: a measured call left `lag_s` after its scheduled time.
  void Sent(double lag_s) {
    std::lock_guard<std::mutex> lock(mu_);
    ++result_->sent;
    result_->sender_lag.Record(lag_s);
  }
  // A finished call; `measured` says whether it was sent inside the measured window.
  void Done(bool measured, const grpc::Status& status, double latency_s,
            const hstu::v1::RankResponse& response, bool new_user) {
    std::lock_guard<std::mutex> lock(mu_);
    ++total_done_;
    if (measuring_ && !window_closed_ && status.ok()) ++ok_in_window_;
    if (!measured) return;
    last_done_ = Clock::now();
    if (status.ok()) {
      ++result_->requests;
      result_->latency.Record(latency_s);
      result_->reused_tokens += response.reused_tokens();
      result_->computed_tokens += response.computed_tokens();
      result_->by_cache_result[response.cache_result().empty() ? "unknown" : response.cache_result()]
          .Record(latency_s);
      if (new_user) ++result_->new_user_visits;
    } else {
      ++result_->errors[CodeName(status.error_code())];
    }
  }
  void Backlog() {
    std::lock_guard<std::mutex> lock(mu_);
    if (measuring_) ++result_->errors["LOADGEN_BACKLOG"];
  }
  void Finish() {
    std::lock_guard<std::mutex> lock(mu_);
    if (window_closed_) {
      result_->duration_s = std::chrono::duration<double>(window_end_ - window_start_).count();
      result_->ok_in_window = ok_in_window_;
    } else {
      result_->duration_s = std::chrono::duration<double>(last_done_ - window_start_).count();
    }
  }
  // Seconds since the level started warming up, or since its window opened.
  std::string Progress(const std::string& label) {
    std::lock_guard<std::mutex> lock(mu_);
    const double elapsed_s = Since(measuring_ ? window_start_ : created_);
    const double rps = measuring_ && elapsed_s > 0 ? result_->requests / elapsed_s : 0;
    return absl::StrCat("[", label, "] ", measuring_ ? "measuring" : "warming up", " ",
                        static_cast<int>(elapsed_s), "s  ok ", result_->requests, "  ",
                        static_cast<int64_t>(rps), " rps  p50 ",
                        absl::StrFormat("%.3f", result_->latency.Quantile(0.5) * 1e3), " ms  p99 ",
                        absl::StrFormat("%.3f", result_->latency.Quantile(0.99) * 1e3),
                        " ms  errors ", result_->error_count());
  }

 private:
  std::mutex mu_;
  LevelResult* result_;
  const Clock::time_point created_ = Clock::now();
  bool measuring_ = false;
  bool window_closed_ = false;
  Clock::time_point window_start_, window_end_, last_done_;
  int64_t total_done_ = 0;
  int64_t ok_in_window_ = 0;
};

class Driver {
 public:
  // `answers`: where OK answers are recorded (--record), or null.
  Driver(std::vector<std::unique_ptr<Ranker::Stub>> stubs, TrafficModel* traffic, int64_t timeout_ms,
         AnswerLog* answers)
      : stubs_(std::move(stubs)), traffic_(traffic), timeout_ms_(timeout_ms), answers_(answers) {}

  hstu::v1::RankRequest MakeRequest(const Visit& v) {
    hstu::v1::RankRequest req;
    req.set_user_id(v.user_id);
    req.mutable_history_item_ids()->Assign(v.history_item_ids.begin(), v.history_item_ids.end());
    req.mutable_history_actions()->Assign(v.history_actions.begin(), v.history_actions.end());
    req.mutable_candidate_item_ids()->Assign(v.candidate_item_ids.begin(),
                                             v.candidate_item_ids.end());
    req.set_request_id(absl::StrCat(next_id_.fetch_add(1)));
    return req;
  }
  void PrepareContext(grpc::ClientContext* ctx, uint64_t user_id, Clock::time_point start) {
    // The deadline counts from the intended send time, like the latency.
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(timeout_ms_) -
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          Clock::now() - start));
    ctx->AddMetadata("x-user-id", absl::StrCat(user_id));
  }
  Ranker::Stub* NextStub() { return stubs_[next_stub_.fetch_add(1) % stubs_.size()].get(); }
  void Record(const hstu::v1::RankRequest& req, const grpc::Status& status,
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
  absl::Status RunClosed(Level* level, int32_t concurrency, double warmup_s, double duration_s,
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
      while (!stop.load() && !g_interrupted.load()) {
        const bool measured = level->measuring();
        if (measured && num_requests > 0 && issued.fetch_add(1) >= num_requests) break;
        const Visit v = traffic_->Next();
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
    if (num_requests == 0 || !started.ok() || g_interrupted.load()) stop.store(true);
    // A stop signal cancels the calls in flight instead of waiting out their deadlines.
    while (running.load() > 0) {
      if (g_interrupted.load()) calls.CancelAll();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (auto& t : workers) t.join();
    level->Finish();
    return started;
  }

  // Open loop: one sender on a schedule; answers arrive on gRPC's callback threads.
  void RunOpen(Level* level, double rate, bool poisson, double warmup_s, double duration_s,
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
        pending = std::make_unique<Call>();
        pending->visit = traffic_->Next();
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
      if (g_interrupted.load()) calls.CancelAll();  // not under done_mu, which completions take
    }
    level->Finish();
  }

 private:
  std::vector<std::unique_ptr<Ranker::Stub>> stubs_;
  TrafficModel* traffic_;
  const int64_t timeout_ms_;
  AnswerLog* const answers_;
  std::atomic<uint64_t> next_stub_{0};
  std::atomic<uint64_t> next_id_{0};
};

absl::Status WaitReady(const std::string& target, double wait_s) {
  const Clock::time_point start = Clock::now();
  std::string last = "no answer";
  while (true) {
    // A fresh channel per try: one whose first connect was refused waits out gRPC's reconnect
    // backoff (seconds) before it tries again.
    auto health = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status s = health->Check(&ctx, req, &resp);
    if (s.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    last = s.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())
                  : absl::StrCat(CodeName(s.error_code()), ": ", s.error_message());
    if (Since(start) >= wait_s) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::UnavailableError(
      absl::StrCat("server not SERVING after ", wait_s, " s (last: ", last, ")"));
}

// The flags that need no server, checked before connecting (a typo fails at once, naming the
// flag), and the load levels they ask for.
absl::StatusOr<std::vector<LevelResult>> LevelsFromFlags() {
  auto bad = [](const char* flag, auto value, absl::string_view want) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", want));
  };
  if (absl::GetFlag(FLAGS_connections) < 1 || absl::GetFlag(FLAGS_connections) > kMaxConnections) {
    return bad("connections", absl::GetFlag(FLAGS_connections),
               absl::StrCat("must be in [1, ", kMaxConnections, "]"));
  }
  if (absl::GetFlag(FLAGS_requests) < 0) {
    return bad("requests", absl::GetFlag(FLAGS_requests), "must be >= 0 (0: use --duration)");
  }
  const std::string a_day = absl::StrCat(" and at most ", kMaxSeconds, " (a day)");
  if (absl::GetFlag(FLAGS_requests) == 0 &&
      !(absl::GetFlag(FLAGS_duration) > 0 && absl::GetFlag(FLAGS_duration) <= kMaxSeconds)) {
    return bad("duration", absl::GetFlag(FLAGS_duration),
               absl::StrCat("must be > 0", a_day, " (or give --requests)"));
  }
  if (!(absl::GetFlag(FLAGS_warmup) >= 0 && absl::GetFlag(FLAGS_warmup) <= kMaxSeconds)) {
    return bad("warmup", absl::GetFlag(FLAGS_warmup), absl::StrCat("must be >= 0", a_day));
  }
  if (!(absl::GetFlag(FLAGS_wait_ready_s) >= 0 &&
        absl::GetFlag(FLAGS_wait_ready_s) <= kMaxSeconds)) {
    return bad("wait_ready_s", absl::GetFlag(FLAGS_wait_ready_s),
               absl::StrCat("must be >= 0", a_day));
  }
  if (absl::GetFlag(FLAGS_timeout_ms) < 1 || absl::GetFlag(FLAGS_timeout_ms) > kMaxTimeoutMs) {
    return bad("timeout_ms", absl::GetFlag(FLAGS_timeout_ms),
               absl::StrCat("must be in [1, ", kMaxTimeoutMs, "] (a day)"));
  }
  if (!(absl::GetFlag(FLAGS_max_error_rate) >= 0 && absl::GetFlag(FLAGS_max_error_rate) <= 1)) {
    return bad("max_error_rate", absl::GetFlag(FLAGS_max_error_rate), "must be in [0, 1]");
  }
  if (absl::GetFlag(FLAGS_prewarm_visits) < 0) {
    return bad("prewarm_visits", absl::GetFlag(FLAGS_prewarm_visits), "must be >= 0");
  }
  if (absl::GetFlag(FLAGS_record_every) < 1) {
    return bad("record_every", absl::GetFlag(FLAGS_record_every), "must be >= 1");
  }
  if (absl::GetFlag(FLAGS_record_every) != 1 && absl::GetFlag(FLAGS_record).empty()) {
    return bad("record_every", absl::GetFlag(FLAGS_record_every), "needs --record=FILE");
  }
  // Output files, checked now, not after a run of minutes (the reports are written after each
  // level, the recording once the server answered): a writable directory, and not one themselves.
  for (const auto& [flag, path] : {std::pair<const char*, std::string>{"json", absl::GetFlag(FLAGS_json)},
                                   {"csv", absl::GetFlag(FLAGS_csv)},
                                   {"record", absl::GetFlag(FLAGS_record)}}) {
    if (path.empty()) continue;
    const std::string what =
        std::string(flag) == "record" ? absl::StrCat("--record=", path) : absl::StrCat("report file ", path);
    const size_t slash = path.rfind('/');
    const std::string dir =
        slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1));
    if (access(dir.c_str(), W_OK | X_OK) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": directory ", dir, " is missing or not writable"));
    }
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": is a directory"));
    }
  }
  const std::string events_bound = absl::StrCat(" and at most ", kMaxEvents);
  if (absl::GetFlag(FLAGS_candidates) < 0 || absl::GetFlag(FLAGS_candidates) > kMaxCandidates) {
    return bad("candidates", absl::GetFlag(FLAGS_candidates),
               absl::StrCat("must be >= 0 (0: the model's candidates per forward) and at most ",
                            kMaxCandidates));
  }
  if (absl::GetFlag(FLAGS_initial_events) < 0 || absl::GetFlag(FLAGS_initial_events) > kMaxEvents) {
    return bad("initial_events", absl::GetFlag(FLAGS_initial_events),
               absl::StrCat("must be >= 0 (0: half the model's maximum)", events_bound));
  }
  if (absl::GetFlag(FLAGS_max_events) < 0 || absl::GetFlag(FLAGS_max_events) > kMaxEvents) {
    return bad("max_events", absl::GetFlag(FLAGS_max_events),
               absl::StrCat("must be >= 0 (0: twice the model's maximum)", events_bound));
  }
  const int64_t users = absl::GetFlag(FLAGS_users);
  if (users < 1 || users > kMaxUsers) {
    return bad("users", users, absl::StrCat("must be in [1, ", kMaxUsers, "]"));
  }
  const double zipf = absl::GetFlag(FLAGS_zipf);
  if (!(zipf >= 0) || !std::isfinite(zipf)) return bad("zipf", zipf, "must be finite and >= 0");
  const double new_user_rate = absl::GetFlag(FLAGS_new_user_rate);
  if (!(new_user_rate >= 0 && new_user_rate <= 1)) {
    return bad("new_user_rate", new_user_rate, "must be in [0, 1]");
  }
  const int32_t new_events_min = absl::GetFlag(FLAGS_new_events_min);
  if (new_events_min < 1) return bad("new_events_min", new_events_min, "must be >= 1");
  if (absl::GetFlag(FLAGS_new_events) < new_events_min ||
      absl::GetFlag(FLAGS_new_events) > kMaxEvents) {
    return bad("new_events", absl::GetFlag(FLAGS_new_events),
               absl::StrCat("must be >= --new_events_min (", new_events_min, ")", events_bound));
  }
  const int32_t initial_events_min = absl::GetFlag(FLAGS_initial_events_min);
  if (initial_events_min < 1 || initial_events_min > kMaxEvents) {
    return bad("initial_events_min", initial_events_min, absl::StrCat("must be >= 1", events_bound));
  }
  const int32_t initial_events = absl::GetFlag(FLAGS_initial_events);
  if (initial_events > 0 && initial_events < initial_events_min) {
    return bad("initial_events", initial_events,
               absl::StrCat("must be >= --initial_events_min (", initial_events_min, ")"));
  }
  const int32_t max_events = absl::GetFlag(FLAGS_max_events);
  const int32_t largest_initial = std::max(initial_events, initial_events_min);
  if (max_events > 0 && max_events < largest_initial) {
    return bad("max_events", max_events,
               absl::StrCat("must be >= --initial_events (", largest_initial, ")"));
  }
  if (absl::GetFlag(FLAGS_max_outstanding) < 1) return bad("max_outstanding", absl::GetFlag(FLAGS_max_outstanding), "must be >= 1");
  const std::string arrival = absl::GetFlag(FLAGS_arrival);
  if (arrival != "constant" && arrival != "poisson") return bad("arrival", arrival, "want constant or poisson");
  std::vector<LevelResult> levels;
  if (const std::string rate = absl::GetFlag(FLAGS_rate); !rate.empty()) {
    auto rates = ParseRates(rate);
    if (!rates.ok()) return rates.status();
    for (double r : *rates) {
      LevelResult l;
      l.mode = "open";
      l.rate_rps = r;
      l.arrival = arrival;
      levels.push_back(l);
    }
  } else {
    auto conc = ParseConcurrency(absl::GetFlag(FLAGS_concurrency));
    if (!conc.ok()) return conc.status();
    for (int32_t c : *conc) {
      LevelResult l;
      l.mode = "closed";
      l.concurrency = c;
      levels.push_back(l);
    }
  }
  return levels;
}

int Main() {
  absl::StatusOr<std::vector<LevelResult>> levels = LevelsFromFlags();
  if (!levels.ok()) {
    std::fprintf(stderr, "%s\n", std::string(levels.status().message()).c_str());
    return 2;
  }
  const std::string target = absl::GetFlag(FLAGS_target);
  const int32_t num_connections = absl::GetFlag(FLAGS_connections);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int32_t i = 0; i < num_connections; ++i) {
    grpc::ChannelArguments args;
    // Each channel gets its own subchannel (TCP connection) instead of sharing the global pool.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(64 << 20);
    channels.push_back(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  if (const double wait_s = absl::GetFlag(FLAGS_wait_ready_s); wait_s > 0) {
    if (absl::Status s = WaitReady(target, wait_s); !s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  hstu::v1::ModelInfo info;
  {
    auto stub = Ranker::NewStub(channels[0]);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status s = stub->GetModelInfo(&ctx, hstu::v1::GetModelInfoRequest(), &info);
    if (!s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: GetModelInfo on %s failed: %s: %s\n", target.c_str(),
                   CodeName(s.error_code()), s.error_message().c_str());
      return 1;
    }
  }
  // Created once the server answered (its directory was checked before connecting): a run that
  // cannot reach the server leaves an earlier recording as it was.
  std::unique_ptr<AnswerLog> answers;
  if (const std::string path = absl::GetFlag(FLAGS_record); !path.empty()) {
    auto log = AnswerLog::Open(path, absl::GetFlag(FLAGS_record_every));
    if (!log.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(log.status().message()).c_str());
      return 1;
    }
    answers = *std::move(log);
  }
  // Every connection up before the first level (the first one is, by the call above): a fresh
  // channel's first call would also time its TCP and HTTP/2 handshake, in the measured window
  // with --warmup=0.
  for (size_t i = 1; i < channels.size(); ++i) {
    if (!channels[i]->WaitForConnected(std::chrono::system_clock::now() +
                                       std::chrono::seconds(10))) {
      std::fprintf(stderr, "hstu_loadgen: connection %zu of %zu to %s not up within 10 s\n", i + 1,
                   channels.size(), target.c_str());
      return 1;
    }
  }

  // Valid requests for the served model: actions below num_actions, histories around its maximum
  // (longer ones are truncated by the server, so growth past it is exercised too).
  const int32_t model_events = std::max<int32_t>(1, static_cast<int32_t>(info.max_history_tokens() / 2));
  TrafficOptions t;
  t.num_users = absl::GetFlag(FLAGS_users);
  t.zipf_s = absl::GetFlag(FLAGS_zipf);
  t.new_user_rate = absl::GetFlag(FLAGS_new_user_rate);
  t.new_events_min = absl::GetFlag(FLAGS_new_events_min);
  t.new_events_max = absl::GetFlag(FLAGS_new_events);
  t.initial_events_min = absl::GetFlag(FLAGS_initial_events_min);
  // The defaults that follow the model give way to the flags given (checked against each other
  // before connecting): a default initial history within [--initial_events_min, --max_events].
  const int32_t max_events_flag = absl::GetFlag(FLAGS_max_events);
  t.initial_events_max = absl::GetFlag(FLAGS_initial_events);
  if (t.initial_events_max == 0) {
    t.initial_events_max = std::max(t.initial_events_min, model_events / 2);
    if (max_events_flag > 0) t.initial_events_max = std::min(t.initial_events_max, max_events_flag);
  }
  t.max_events = max_events_flag > 0
                     ? max_events_flag
                     : std::min(kMaxEvents, std::max(t.initial_events_max, 2 * model_events));
  // Default: one forward pass's worth, within what the server accepts (its --max_candidates).
  int64_t per_forward = info.candidates_per_forward() > 0 ? info.candidates_per_forward()
                                                          : info.max_candidates();
  if (info.max_candidates() > 0) per_forward = std::min<int64_t>(per_forward, info.max_candidates());
  t.num_candidates = absl::GetFlag(FLAGS_candidates) > 0
                         ? absl::GetFlag(FLAGS_candidates)
                         : static_cast<int32_t>(std::max<int64_t>(1, per_forward));
  t.num_actions = info.num_actions() > 0 ? static_cast<int32_t>(info.num_actions()) : 1;
  t.overlapping_visits = absl::GetFlag(FLAGS_overlapping_visits);
  t.seed = absl::GetFlag(FLAGS_seed);
  while (t.seed == 0) {
    t.seed = (static_cast<uint64_t>(std::random_device()()) << 32) ^ std::random_device()() ^
             static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  }
  auto traffic = TrafficModel::Create(t);
  if (!traffic.ok()) {
    std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(traffic.status().message()).c_str());
    return 2;
  }

  const std::string arrival = absl::GetFlag(FLAGS_arrival);

  std::vector<std::unique_ptr<Ranker::Stub>> stubs;
  for (const auto& ch : channels) stubs.push_back(Ranker::NewStub(ch));
  Driver driver(std::move(stubs), traffic->get(), absl::GetFlag(FLAGS_timeout_ms), answers.get());
  const double warmup_s = absl::GetFlag(FLAGS_warmup);
  const double duration_s = absl::GetFlag(FLAGS_duration);
  const int64_t num_requests = absl::GetFlag(FLAGS_requests);
  const bool progress = absl::GetFlag(FLAGS_progress);
  const bool tty = isatty(STDERR_FILENO) != 0;

  RunInfo run;
  run.target = target;
  run.model = info.model_name();
  run.device = info.device();
  run.candidates = t.num_candidates;
  run.users = t.num_users;
  run.zipf = t.zipf_s;
  run.connections = num_connections;
  run.seed = t.seed;
  run.levels_planned = levels->size();
  // The report files hold every level finished so far, each write whole or not at all: a run cut
  // short, even mid-write, keeps what it measured.
  auto write_reports = [&](const std::vector<LevelResult>& done) {
    bool ok = true;
    if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
      if (absl::Status s = WriteFileAtomically(path, ToJson(run, done)); !s.ok()) {
        std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
        ok = false;
      }
    }
    if (const std::string path = absl::GetFlag(FLAGS_csv); !path.empty()) {
      if (absl::Status s = WriteFileAtomically(path, ToCsv(done)); !s.ok()) {
        std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
        ok = false;
      }
    }
    return ok;
  };

  InstallStopSignals();
  int rc = 0;
  if (const int64_t prewarm = absl::GetFlag(FLAGS_prewarm_visits); prewarm > 0) {
    LevelResult scratch;
    Level level(&scratch);
    const int32_t callers = levels->front().mode == "closed" ? levels->front().concurrency : 8;
    std::fprintf(stderr, "hstu_loadgen: prewarm, %lld visits at %d callers\n",
                 static_cast<long long>(prewarm), callers);
    if (absl::Status s = driver.RunClosed(&level, callers, 0, 0, prewarm); !s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  std::vector<LevelResult> done;
  for (LevelResult& l : *levels) {
    if (g_interrupted.load()) break;
    Level level(&l);
    const std::string label = LevelLabel(l);
    std::atomic<bool> running{true};
    std::thread progress_thread;
    if (progress) {
      progress_thread = std::thread([&] {
        int ticks = 0;
        while (running.load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(250));
          if (!running.load()) break;
          // Without a terminal, a line every 2 s instead of a line rewritten in place.
          if (!tty && ++ticks % 8 != 0) continue;
          std::fprintf(stderr, tty ? "\r%-100s" : "%s\n", level.Progress(label).c_str());
        }
        if (tty) std::fprintf(stderr, "\r%-100s\r", "");
      });
    }
    absl::Status ran;
    if (l.mode == "closed") {
      ran = driver.RunClosed(&level, l.concurrency, warmup_s, duration_s, num_requests);
    } else {
      driver.RunOpen(&level, l.rate_rps, arrival == "poisson", warmup_s, duration_s, num_requests,
                     absl::GetFlag(FLAGS_max_outstanding), t.seed);
    }
    running.store(false);
    if (progress_thread.joinable()) progress_thread.join();
    if (!ran.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s: %s\n", label.c_str(),
                   std::string(ran.message()).c_str());
      rc = 1;
      break;
    }
    const bool measured = level.window_opened();
    l.interrupted = g_interrupted.load();
    if (!measured) break;  // stopped in its warm-up: nothing to report
    done.push_back(std::move(l));
    if (!write_reports(done)) rc = 1;
  }

  // The last write says whether the run was cut short (also when no level got measured: a file
  // left by an earlier run must not pass for this one's).
  run.interrupted = g_interrupted.load();
  if (!write_reports(done)) rc = 1;
  std::printf("%s", FormatTable(run, done).c_str());
  std::fflush(stdout);
  if (answers != nullptr) {
    // Every call has ended (each level waits for its answers), so no completion writes after this.
    if (absl::Status s = answers->Close(); !s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
      rc = 1;
    } else {
      std::fprintf(stderr, "hstu_loadgen: recorded %lld answers to %s\n",
                   static_cast<long long>(answers->lines()), absl::GetFlag(FLAGS_record).c_str());
    }
  }
  if (run.interrupted) {
    std::fprintf(stderr, "hstu_loadgen: stopped by a signal after %zu of %zu levels\n", done.size(),
                 levels->size());
    rc = 1;
  }
  // A level that no request got through measured nothing, and one with more failures than
  // --max_error_rate measured a failing server: say so in the exit status, so that a script
  // driving the server does not take such a run (a wrong target model, deadlines too short for
  // the device, a server that died) as a result.
  const double max_error_rate = absl::GetFlag(FLAGS_max_error_rate);
  for (const LevelResult& l : done) {
    if (max_error_rate >= 1) break;  // errors are what the run studies
    const int64_t errors = l.error_count();
    const double share = static_cast<double>(errors) / static_cast<double>(std::max<int64_t>(1, errors + l.requests));
    if (l.requests == 0) {
      std::fprintf(stderr, "hstu_loadgen: no request succeeded at %s (%lld errors)\n",
                   LevelLabel(l).c_str(), static_cast<long long>(errors));
      rc = 1;
    } else if (share > max_error_rate) {
      std::fprintf(stderr,
                   "hstu_loadgen: %s: %lld of %lld calls failed or were not sent (%.2f %%, above "
                   "--max_error_rate %.2f %%)\n",
                   LevelLabel(l).c_str(), static_cast<long long>(errors),
                   static_cast<long long>(errors + l.requests), 100 * share, 100 * max_error_rate);
      rc = 1;
    }
  }
  return rc;
}

}  // namespace
}  // namespace hstu::loadgen

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load generator for hstu_server.\n"
      "  hstu_loadgen --target=HOST:PORT [--concurrency=8 | --concurrency=1:64:x2 | "
      "--rate=500 --arrival=poisson]\n"
      "               [--duration=10 | --requests=N] [--users=1000 --zipf=1.0] [--json=F --csv=F]\n"
      "Exit status: 0 when every load level ran and answered within --max_error_rate; 1 when a\n"
      "level answered no request or failed more calls than that, or the server could not be\n"
      "reached, or a report file could not be written, or a signal stopped the run (the levels\n"
      "measured are still printed and written), or a flag does not parse; 2 for a flag value out\n"
      "of range, a word that is no flag, or a report file in a directory that cannot be written.");
  absl::FlagsUsageConfig usage;
  // --help lists this program's flags (absl's default matches files named after the binary).
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "loadgen_main");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  auto args = hstu::NormalizeFlagDashes(argc, argv);
  auto argv2 = hstu::ArgvOf(args);
  if (!hstu::OnlyFlagsGiven(hstu::ParseFlags(argv2))) {
    return 2;
  }
  return hstu::loadgen::Main();
}
