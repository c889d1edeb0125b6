// The slow-request log (--slow_request_ms): one line for each Rank call that spent at least the
// threshold in the server, with what an operator needs to tell why (the queue, the batch it ran
// in, the user's cache), so that a client's "request X was slow" can be looked up by its
// request_id. Off by default (DESIGN §8: no per-request lines by default); a threshold of 0 logs
// every call, an access log.
//
// A line, at info level (the request_id C-escaped but for its UTF-8, so that a client cannot
// forge log lines):
//   slow request: total_ms=12.310 queue_ms=10.020 compute_ms=2.100 batch=8 code=OK
//   request_id="a1" user_id=42 events=200 candidates=256 reused_tokens=396 computed_tokens=4
//   cache=gpu_hit
// (one line; wrapped here). A call refused before the queue (invalid, queue full) has no queue,
// batch or cache fields; one answered from the queue (expired, cancelled) has its queue time
// only; a failed one ends with its error message. The calls logged are those
// hstu_requests_total counts (not the refusals while the model loads or the server drains, nor
// those gRPC refuses before the service sees them, such as a message over --max_message_bytes).
//
// At most `max_lines_per_s` lines a second; the lines held back are counted and summed up in one
// line once their second is over (FlushEnded), with the next line written, or at Flush() (the
// server's shutdown). The lines are written after the call is answered.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/grpc_log.h"

namespace hstu::server {

struct RequestLogOptions {
  // Calls whose time in the server (arrival to answer) is at least this many milliseconds are
  // logged. < 0: none; 0: every call.
  double slow_request_ms = -1;
  // Most lines a second; 0: no limit.
  int32_t max_lines_per_s = 10;
};

// The range of each (errors name the flag): a finite threshold, at most a day; the rate >= 0.
absl::Status CheckRequestLogOptions(const RequestLogOptions& options);

// What one call's line says. Fields of parts the call did not reach stay at their defaults and
// are left out of the line. The views must outlive the Write() of the record.
struct RequestRecord {
  double total_seconds = 0;
  absl::StatusCode code = absl::StatusCode::kOk;
  absl::string_view error;  // the status message of a failed call
  bool parsed = false;      // the request parsed: the request fields below are set
  absl::string_view request_id;
  uint64_t user_id = 0;
  int64_t num_events = 0;
  int64_t num_candidates = 0;
  bool queued = false;  // it reached the scheduler: queue_seconds is set
  double queue_seconds = 0;
  int32_t batch_size = 0;  // > 0 when it ran on the engine: compute_seconds is set
  double compute_seconds = 0;
  bool answered = false;  // the engine scored it: the token and cache fields are set
  uint32_t reused_tokens = 0;
  uint32_t computed_tokens = 0;
  absl::string_view cache_result;
};

// The line for `record`, without the "slow request: " prefix (tests read it).
std::string FormatRequestRecord(const RequestRecord& record);

// The same fields as keys of the JSON line (--log_format=json; ScopedLogFields), beside
// "event":"slow_request": total_ms, queue_ms, compute_ms, batch, code, request_id (cut past 256
// bytes, with "request_id_cut":true then; bytes that are not UTF-8 as U+FFFD), user_id (a
// string: exact past 2^53), events, candidates, reused_tokens, computed_tokens, cache, error.
// Numbers are numbers. The count of lines held back is
// "event":"slow_requests_not_written","lines":N.
std::string RequestRecordJsonFields(const RequestRecord& record);

// Thread-safe.
class RequestLog {
 public:
  using Clock = LogRateLimiter::Clock;

  // The rate limit is gRPC's log lines' limiter (server/grpc_log.h): one kind, windows of 1 s.
  explicit RequestLog(const RequestLogOptions& options)
      : options_(options),
        limiter_(std::max(1, options.max_lines_per_s), std::chrono::seconds(1)) {}
  ~RequestLog() { Flush(); }
  RequestLog(const RequestLog&) = delete;
  RequestLog& operator=(const RequestLog&) = delete;

  // Whether a call that spent `total_seconds` in the server gets a line (the caller then fills
  // a record and calls Write).
  bool Slow(double total_seconds) const {
    return options_.slow_request_ms >= 0 && total_seconds * 1e3 >= options_.slow_request_ms;
  }
  // Writes the line, within the rate limit.
  void Write(const RequestRecord& record, Clock::time_point now = Clock::now());
  // Writes the count of lines held back since the last line written, if any.
  void Flush();
  // The same once the second the lines were held back in is over (the server calls it a few
  // times a second, so that a burst's count is written without waiting for the next line).
  void FlushEnded(Clock::time_point now = Clock::now());

 private:
  // Writes the count of the lines held back, if any.
  void WriteHeldBack(const std::vector<LogRateLimiter::Suppressed>& held_back) const;

  const RequestLogOptions options_;
  LogRateLimiter limiter_;  // used with max_lines_per_s > 0
};

}  // namespace hstu::server
