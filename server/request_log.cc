#include "server/request_log.h"

#include <cmath>
#include <string_view>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/log_format.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace hstu::server {
namespace {

// An error message is cut to this many bytes in a line (validation errors quote sizes, not
// payloads, but a line stays a line), a request_id to the longest the server takes.
constexpr size_t kMaxErrorBytes = 300;

// The rate limiter's one kind of line.
constexpr char kKind[] = "slow request";

// `text` cut at a character's start once past `max_bytes` (`text` itself when it fits).
absl::string_view Prefix(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return text.substr(0, cut);
}

// Debian's abseil has a string_view of its own.
std::string_view Std(absl::string_view text) { return {text.data(), text.size()}; }

// `text` C-escaped but for its UTF-8 (a non-ASCII request_id stays readable and greppable), cut
// at a character's start once past `max_bytes`, with "..." then.
std::string EscapedPrefix(absl::string_view text, size_t max_bytes) {
  const absl::string_view prefix = Prefix(text, max_bytes);
  return absl::StrCat(absl::Utf8SafeCEscape(prefix), prefix.size() < text.size() ? "..." : "");
}

}  // namespace

absl::Status CheckRequestLogOptions(const RequestLogOptions& options) {
  constexpr double kDayMs = 86400e3;
  if (!std::isfinite(options.slow_request_ms) || options.slow_request_ms > kDayMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("--slow_request_ms=", absl::StrFormat("%.15g", options.slow_request_ms),
                     ": must be a number of milliseconds up to a day (86400000), or < 0 for no "
                     "slow-request log"));
  }
  if (options.max_lines_per_s < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--slow_request_log_per_s=", options.max_lines_per_s, ": must be >= 0 (0: no limit)"));
  }
  return absl::OkStatus();
}

std::string FormatRequestRecord(const RequestRecord& r) {
  std::string line = absl::StrFormat("total_ms=%.3f", r.total_seconds * 1e3);
  if (r.queued) absl::StrAppendFormat(&line, " queue_ms=%.3f", r.queue_seconds * 1e3);
  if (r.batch_size > 0) {
    absl::StrAppendFormat(&line, " compute_ms=%.3f batch=%d", r.compute_seconds * 1e3,
                          r.batch_size);
  }
  absl::StrAppend(&line, " code=", absl::StatusCodeToString(r.code));
  if (r.parsed) {
    absl::StrAppend(&line, " request_id=\"", EscapedPrefix(r.request_id, kMaxRequestIdBytes),
                    "\" user_id=", r.user_id, " events=", r.num_events,
                    " candidates=", r.num_candidates);
  }
  if (r.answered) {
    absl::StrAppend(&line, " reused_tokens=", r.reused_tokens,
                    " computed_tokens=", r.computed_tokens, " cache=", r.cache_result);
  }
  if (r.code != absl::StatusCode::kOk) {
    absl::StrAppend(&line, " error=\"", EscapedPrefix(r.error, kMaxErrorBytes), "\"");
  }
  return line;
}

std::string RequestRecordJsonFields(const RequestRecord& r) {
  JsonFields fields;
  fields.AddString("event", "slow_request").AddFixed("total_ms", r.total_seconds * 1e3, 3);
  if (r.queued) fields.AddFixed("queue_ms", r.queue_seconds * 1e3, 3);
  if (r.batch_size > 0) {
    fields.AddFixed("compute_ms", r.compute_seconds * 1e3, 3).AddInt("batch", r.batch_size);
  }
  fields.AddString("code", absl::StatusCodeToString(r.code));
  if (r.parsed) {
    const absl::string_view id = Prefix(r.request_id, kMaxRequestIdBytes);
    fields.AddString("request_id", Std(id));
    if (id.size() < r.request_id.size()) fields.AddBool("request_id_cut", true);
    // A string: a JSON number past 2^53 loses digits in most parsers.
    fields.AddString("user_id", absl::StrCat(r.user_id))
        .AddInt("events", r.num_events)
        .AddInt("candidates", r.num_candidates);
  }
  if (r.answered) {
    fields.AddInt("reused_tokens", r.reused_tokens)
        .AddInt("computed_tokens", r.computed_tokens)
        .AddString("cache", Std(r.cache_result));
  }
  if (r.code != absl::StatusCode::kOk) {
    const absl::string_view error = Prefix(r.error, kMaxErrorBytes);
    fields.AddString(
        "error", error.size() < r.error.size() ? absl::StrCat(error, "...") : std::string(error));
  }
  return fields.Take();
}

void RequestLog::Write(const RequestRecord& record, Clock::time_point now) {
  std::vector<LogRateLimiter::Suppressed> ended;
  const bool admitted = options_.max_lines_per_s == 0 || limiter_.Admit(kKind, "", 0, now, &ended);
  // Only the decision is made under the limiter's lock; the lines are written outside it.
  WriteHeldBack(ended);
  if (admitted) {
    const ScopedLogFields fields(RequestRecordJsonFields(record));
    spdlog::info("slow request: {}", FormatRequestRecord(record));
  }
}

void RequestLog::FlushEnded(Clock::time_point now) { WriteHeldBack(limiter_.TakeEnded(now)); }

void RequestLog::Flush() { WriteHeldBack(limiter_.TakeAll()); }

void RequestLog::WriteHeldBack(const std::vector<LogRateLimiter::Suppressed>& held_back) const {
  for (const LogRateLimiter::Suppressed& s : held_back) {
    const ScopedLogFields fields(JsonFields()
                                     .AddString("event", "slow_requests_not_written")
                                     .AddInt("lines", static_cast<int64_t>(s.lines))
                                     .Take());
    spdlog::info(
        "slow request: {} more slow-request {} not written (at most {} a second, "
        "--slow_request_log_per_s)",
        s.lines, s.lines == 1 ? "line was" : "lines were", options_.max_lines_per_s);
  }
}

}  // namespace hstu::server
