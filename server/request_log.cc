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

namespace {

// Each field of `r` that the call reached, in the line's order, to `sink`: numbers of
// milliseconds (Fixed), counts (Int), the user id (Id), names from a fixed set (Word), and text
// the client sent (ClientText: the request_id) or the server wrote (ServerText: the error), each
// cut at `max_bytes`. The text line and the JSON keys are both written from this one list.
template <typename Sink>
void VisitFields(const RequestRecord& r, Sink& sink) {
  sink.Fixed("total_ms", r.total_seconds * 1e3);
  if (r.queued) sink.Fixed("queue_ms", r.queue_seconds * 1e3);
  if (r.batch_size > 0) {
    sink.Fixed("compute_ms", r.compute_seconds * 1e3);
    sink.Int("batch", r.batch_size);
  }
  sink.Word("code", absl::StatusCodeToString(r.code));
  if (r.parsed) {
    sink.ClientText("request_id", r.request_id, kMaxRequestIdBytes);
    sink.Id("user_id", r.user_id);
    sink.Int("events", r.num_events);
    sink.Int("candidates", r.num_candidates);
  }
  if (r.answered) {
    sink.Int("reused_tokens", r.reused_tokens);
    sink.Int("computed_tokens", r.computed_tokens);
    sink.Word("cache", r.cache_result);
  }
  if (r.code != absl::StatusCode::kOk) sink.ServerText("error", r.error, kMaxErrorBytes);
}

// `key=value` pairs joined by spaces; text quoted and C-escaped (EscapedPrefix).
struct TextSink {
  void Pair(absl::string_view key, absl::string_view value) {
    absl::StrAppend(&line, line.empty() ? "" : " ", key, "=", value);
  }
  void Fixed(absl::string_view key, double ms) { Pair(key, absl::StrFormat("%.3f", ms)); }
  void Int(absl::string_view key, int64_t value) { Pair(key, absl::StrCat(value)); }
  void Id(absl::string_view key, uint64_t value) { Pair(key, absl::StrCat(value)); }
  void Word(absl::string_view key, absl::string_view word) { Pair(key, word); }
  void ClientText(absl::string_view key, absl::string_view text, size_t max_bytes) {
    Pair(key, absl::StrCat("\"", EscapedPrefix(text, max_bytes), "\""));
  }
  void ServerText(absl::string_view key, absl::string_view text, size_t max_bytes) {
    ClientText(key, text, max_bytes);
  }
  std::string line;
};

// JSON members (JsonFields). The user id is a string: a JSON number past 2^53 loses digits in
// most parsers. A cut request_id is its exact prefix and "request_id_cut":true (the id is looked
// up, so nothing is appended to it); a cut error ends in "...".
struct JsonSink {
  void Fixed(std::string_view key, double ms) { fields.AddFixed(key, ms, 3); }
  void Int(std::string_view key, int64_t value) { fields.AddInt(key, value); }
  void Id(std::string_view key, uint64_t value) { fields.AddString(key, absl::StrCat(value)); }
  void Word(std::string_view key, absl::string_view word) { fields.AddString(key, Std(word)); }
  void ClientText(std::string_view key, absl::string_view text, size_t max_bytes) {
    const absl::string_view prefix = Prefix(text, max_bytes);
    fields.AddString(key, Std(prefix));
    if (prefix.size() < text.size()) fields.AddBool(std::string(key) + "_cut", true);
  }
  void ServerText(std::string_view key, absl::string_view text, size_t max_bytes) {
    const absl::string_view prefix = Prefix(text, max_bytes);
    fields.AddString(key, absl::StrCat(prefix, prefix.size() < text.size() ? "..." : ""));
  }
  JsonFields fields;
};

}  // namespace

std::string FormatRequestRecord(const RequestRecord& r) {
  TextSink sink;
  VisitFields(r, sink);
  return std::move(sink.line);
}

std::string RequestRecordJsonFields(const RequestRecord& r) {
  JsonSink sink;
  sink.fields.AddString("event", "slow_request");
  VisitFields(r, sink);
  return sink.fields.Take();
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
