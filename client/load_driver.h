// hstu_loadgen's load levels: a level's tally (Level), the closed- and open-loop senders (Driver),
// and the stop signals that end a level early. The flags, the plan of levels and the report are in
// loadgen_main.cc.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/answer_log.h"
#include "client/report.h"
#include "client/stop_signal.h"
#include "client/traffic.h"
#include "hstu/v1/ranking.grpc.pb.h"

namespace hstu::loadgen {

using Clock = std::chrono::steady_clock;
using hstu::v1::Ranker;

double Since(Clock::time_point t);


// The gRPC code's name ("OK", "DEADLINE_EXCEEDED", ...).
const char* CodeName(grpc::StatusCode code);

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
      const char* code = CodeName(status.error_code());
      ++result_->errors[code];
      result_->error_latency[code].Record(latency_s);
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
  Driver(std::vector<std::unique_ptr<Ranker::Stub>> stubs, VisitSource* traffic, int64_t timeout_ms,
         AnswerLog* answers)
      : stubs_(std::move(stubs)), traffic_(traffic), timeout_ms_(timeout_ms), answers_(answers) {}

  // Closed loop: `concurrency` threads, each with one synchronous call outstanding. A stop
  // signal ends the level early (the window closes then); an error only when its threads could
  // not all start.
  absl::Status RunClosed(Level* level, int32_t concurrency, double warmup_s, double duration_s,
                         int64_t num_requests);

  // Open loop: one sender on a schedule; answers arrive on gRPC's callback threads.
  void RunOpen(Level* level, double rate, bool poisson, double warmup_s, double duration_s,
               int64_t num_requests, int64_t max_outstanding, uint64_t seed);

 private:
  hstu::v1::RankRequest MakeRequest(const Visit& v);
  void PrepareContext(grpc::ClientContext* ctx, uint64_t user_id, Clock::time_point start);
  Ranker::Stub* NextStub();
  void Record(const hstu::v1::RankRequest& req, const grpc::Status& status,
              const hstu::v1::RankResponse& resp);

  std::vector<std::unique_ptr<Ranker::Stub>> stubs_;
  VisitSource* traffic_;
  const int64_t timeout_ms_;
  AnswerLog* const answers_;
  std::atomic<uint64_t> next_stub_{0};
  std::atomic<uint64_t> next_id_{0};
};

}  // namespace hstu::loadgen
