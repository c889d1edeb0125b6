// The server's log lines as JSON, for log pipelines that parse them (--log_format=json): one
// object a line,
//   {"time":"2026-11-27T17:14:53.123Z","level":"info","thread":1234,"message":"..."}
// with the level as spdlog names it (trace, debug, info, warning, error, critical), the time in
// UTC to the millisecond, and the message escaped: quotes, backslashes and control characters,
// and bytes that are not UTF-8 as U+FFFD, so that every line parses whatever a message holds.
// Some lines carry keys of their own after the message (ScopedLogFields: the slow-request log's).
//
// Thread-safety: spdlog calls the formatter under its sink's lock; AppendJsonEscaped is a pure
// function.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "spdlog/formatter.h"

namespace hstu::server {

class JsonLogFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override;
  std::unique_ptr<spdlog::formatter> clone() const override;
};

// Appends `text` to `out` as the inside of a JSON string.
void AppendJsonEscaped(std::string_view text, std::string* out);

// Keys of their own for the lines logged on this thread while it lives: with --log_format=json
// they follow "message" in the line's object, for pipelines that filter on them (text lines do
// not show them; their message says the same). `members` is JSON object members without the
// braces, `"key":value,...`, each key once and none of the four keys above; JsonFields builds
// them. A scope inside another replaces its fields until it ends (they are not merged). The
// JSON formatter runs on the logging thread: spdlog's synchronous loggers, the server's.
class ScopedLogFields {
 public:
  explicit ScopedLogFields(std::string members);
  ~ScopedLogFields();
  ScopedLogFields(const ScopedLogFields&) = delete;
  ScopedLogFields& operator=(const ScopedLogFields&) = delete;

 private:
  const std::string members_;
  const std::string* const previous_;
};

// Builds ScopedLogFields' members, each key once, in the order added.
class JsonFields {
 public:
  JsonFields& AddString(std::string_view key, std::string_view text);  // escaped
  JsonFields& AddInt(std::string_view key, int64_t value);
  JsonFields& AddBool(std::string_view key, bool value);
  // A number with `decimals` digits after the point; a value that is not finite is null.
  JsonFields& AddFixed(std::string_view key, double value, int decimals);
  std::string Take() { return std::move(members_); }

 private:
  void Key(std::string_view key);
  std::string members_;
};

// Every logger's lines from now on: "text" (spdlog's pattern, as before) or "json". Another
// value: InvalidArgument naming the flag.
absl::Status SetLogFormat(const std::string& format);

}  // namespace hstu::server
