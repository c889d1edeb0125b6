// The server's log lines as JSON, for log pipelines that parse them (--log_format=json): one
// object a line,
//   {"time":"2026-11-27T17:14:53.123Z","level":"info","thread":1234,"message":"..."}
// with the level as spdlog names it (trace, debug, info, warning, error, critical), the time in
// UTC to the millisecond, and the message escaped: quotes, backslashes and control characters,
// and bytes that are not UTF-8 as U+FFFD, so that every line parses whatever a message holds.
//
// Thread-safety: spdlog calls the formatter under its sink's lock; AppendJsonEscaped is a pure
// function.
#pragma once

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

// Every logger's lines from now on: "text" (spdlog's pattern, as before) or "json". Another
// value: InvalidArgument naming the flag.
absl::Status SetLogFormat(const std::string& format);

}  // namespace hstu::server
