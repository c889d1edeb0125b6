#include "server/log_format.h"

#include <time.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/spdlog.h"

namespace hstu::server {
namespace {

// The length of the well-formed UTF-8 sequence at `s[i]` (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF), or 0.
size_t Utf8Length(std::string_view s, size_t i) {
  const auto at = [&s](size_t j) { return static_cast<uint8_t>(s[j]); };
  const uint8_t b = at(i);
  size_t n = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size() || at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t j = 2; j < n; ++j) {
    if (at(i + j) < 0x80 || at(i + j) > 0xBF) return 0;
  }
  return n;
}

// The members of the innermost ScopedLogFields of this thread, or none.
thread_local const std::string* t_fields = nullptr;

}  // namespace

ScopedLogFields::ScopedLogFields(std::string members)
    : members_(std::move(members)), previous_(t_fields) {
  t_fields = &members_;
}

ScopedLogFields::~ScopedLogFields() { t_fields = previous_; }

void JsonFields::Key(std::string_view key) {
  if (!members_.empty()) members_.push_back(',');
  members_.push_back('"');
  AppendJsonEscaped(key, &members_);
  members_.append("\":");
}

JsonFields& JsonFields::AddString(std::string_view key, std::string_view text) {
  Key(key);
  members_.push_back('"');
  AppendJsonEscaped(text, &members_);
  members_.push_back('"');
  return *this;
}

JsonFields& JsonFields::AddInt(std::string_view key, int64_t value) {
  Key(key);
  absl::StrAppend(&members_, value);
  return *this;
}

JsonFields& JsonFields::AddBool(std::string_view key, bool value) {
  Key(key);
  members_.append(value ? "true" : "false");
  return *this;
}

JsonFields& JsonFields::AddFixed(std::string_view key, double value, int decimals) {
  Key(key);
  if (std::isfinite(value)) {
    absl::StrAppend(&members_, absl::StrFormat("%.*f", decimals, value));
  } else {
    members_.append("null");
  }
  return *this;
}

void AppendJsonEscaped(std::string_view text, std::string* out) {
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<uint8_t>(text[i]);
    if (c >= 0x80) {
      const size_t n = Utf8Length(text, i);
      if (n == 0) {
        out->append("\\ufffd");
        ++i;
      } else {
        out->append(text.substr(i, n));
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (c < 0x20 || c == 0x7F) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
    ++i;
  }
}

void JsonLogFormatter::format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  const auto since_epoch = msg.time.time_since_epoch();
  const time_t seconds = std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
  const int64_t ms = duration_cast<milliseconds>(since_epoch).count() % 1000;
  tm utc{};
  gmtime_r(&seconds, &utc);
  char time_text[64];
  std::snprintf(time_text, sizeof(time_text), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ",
                utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min,
                utc.tm_sec, static_cast<int>(ms));
  const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
  std::string line = absl::StrCat("{\"time\":\"", time_text, "\",\"level\":\"",
                                  std::string(level.data(), level.size()),
                                  "\",\"thread\":", msg.thread_id, ",\"message\":\"");
  AppendJsonEscaped(std::string_view(msg.payload.data(), msg.payload.size()), &line);
  line.push_back('"');
  if (t_fields != nullptr && !t_fields->empty()) {
    line.push_back(',');
    line.append(*t_fields);
  }
  line.append("}\n");
  dest.append(line.data(), line.data() + line.size());
}

std::unique_ptr<spdlog::formatter> JsonLogFormatter::clone() const {
  return std::make_unique<JsonLogFormatter>();
}

absl::Status SetLogFormat(const std::string& format) {
  if (format == "json") {
    spdlog::set_formatter(std::make_unique<JsonLogFormatter>());
  } else if (format == "text") {
    spdlog::set_formatter(std::make_unique<spdlog::pattern_formatter>());  // spdlog's default
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--log_format=", format, ": want text or json"));
  }
  return absl::OkStatus();
}

}  // namespace hstu::server
