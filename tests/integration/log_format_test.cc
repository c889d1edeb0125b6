// JSON log lines (server/log_format.h): every line is one JSON object with the fields the docs
// name, whatever bytes the message holds.

#include "server/log_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace hstu::server {
namespace {

std::string Escaped(const std::string& text) {
  std::string out;
  AppendJsonEscaped(text, &out);
  return out;
}

TEST(JsonLog, EscapesWhatJsonStringsCannotHold) {
  EXPECT_EQ(Escaped("plain text, 7 words"), "plain text, 7 words");
  EXPECT_EQ(Escaped("a \"quoted\" \\ path"), "a \\\"quoted\\\" \\\\ path");
  EXPECT_EQ(Escaped("two\nlines\r\tand\x01\x1f\x7f"), "two\\nlines\\r\\tand\\u0001\\u001f\\u007f");
  EXPECT_EQ(Escaped(std::string("nul\0byte", 8)), "nul\\u0000byte");
  // Well-formed UTF-8 stays as it is; what is not becomes U+FFFD, a byte at a time.
  EXPECT_EQ(Escaped("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
            "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(Escaped("\xff"), "\\ufffd");
  EXPECT_EQ(Escaped("\xc3"), "\\ufffd");                                   // cut short
  EXPECT_EQ(Escaped("\xc0\xaf"), "\\ufffd\\ufffd");                        // overlong '/'
  EXPECT_EQ(Escaped("\xed\xa0\x80"), "\\ufffd\\ufffd\\ufffd");             // a surrogate
  EXPECT_EQ(Escaped("\xf4\x90\x80\x80"), "\\ufffd\\ufffd\\ufffd\\ufffd");  // past U+10FFFF
}

TEST(JsonLog, EachLineIsAJsonObjectWithTimeLevelThreadAndMessage) {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>(
      "test", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  logger->set_formatter(std::make_unique<JsonLogFormatter>());
  logger->set_level(spdlog::level::trace);
  const std::string hostile = std::string("request_id \"x\"\n\xff") + '\0' + " end";
  logger->warn("user {} sent {}", 7, hostile);
  logger->info("second line");
  std::istringstream lines(out.str());
  std::string line;
  ASSERT_TRUE(std::getline(lines, line));
  const auto j = nlohmann::json::parse(line, nullptr, false);
  ASSERT_TRUE(j.is_object()) << line;
  EXPECT_EQ(j["level"], "warning");
  EXPECT_EQ(j["message"],
            std::string("user 7 sent request_id \"x\"\n\xef\xbf\xbd") + '\0' + " end");
  EXPECT_TRUE(j["thread"].is_number_unsigned());
  const std::string time = j["time"];
  ASSERT_EQ(time.size(), 24u) << time;  // 2026-11-27T17:14:53.123Z
  EXPECT_EQ(time[10], 'T');
  EXPECT_EQ(time.back(), 'Z');
  ASSERT_TRUE(std::getline(lines, line));
  EXPECT_EQ(nlohmann::json::parse(line)["message"], "second line");
  EXPECT_FALSE(std::getline(lines, line));
}

TEST(JsonLog, SetLogFormatSwitchesEveryLoggerAndBack) {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>(
      "switched", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  spdlog::register_logger(logger);
  ASSERT_TRUE(SetLogFormat("json").ok());
  logger->info("as json");
  ASSERT_TRUE(SetLogFormat("text").ok());
  logger->info("as text");
  spdlog::drop("switched");
  std::istringstream lines(out.str());
  std::string json_line, text_line;
  ASSERT_TRUE(std::getline(lines, json_line));
  ASSERT_TRUE(std::getline(lines, text_line));
  EXPECT_EQ(nlohmann::json::parse(json_line)["message"], "as json");
  EXPECT_EQ(text_line.front(), '[') << text_line;  // spdlog's pattern: "[2026-11-27 ...] [..."
  EXPECT_NE(text_line.find("] as text"), std::string::npos) << text_line;
}

// Keys of a line's own follow its message while their scope lives, the innermost scope's alone
// (not merged with the outer's); text lines do not show them.
TEST(JsonLog, ScopedFieldsAreKeysOfTheLinesLoggedInTheirScope) {
  std::ostringstream json_out, text_out;
  auto json = std::make_shared<spdlog::logger>(
      "json", std::make_shared<spdlog::sinks::ostream_sink_mt>(json_out));
  json->set_formatter(std::make_unique<JsonLogFormatter>());
  auto text = std::make_shared<spdlog::logger>(
      "text", std::make_shared<spdlog::sinks::ostream_sink_mt>(text_out));
  text->set_pattern("%v");
  json->info("before");
  {
    const ScopedLogFields outer(JsonFields()
                                    .AddString("event", "a \"b\"\n")
                                    .AddInt("n", -7)
                                    .AddBool("cut", true)
                                    .AddFixed("ms", 1.23456, 3)
                                    .AddFixed("nan", std::nan(""), 3)
                                    .Take());
    json->info("outer");
    text->info("outer");
    {
      const ScopedLogFields inner(JsonFields().AddInt("n", 1).Take());
      json->info("inner");
    }
    json->info("outer again");
  }
  json->info("after");
  const std::vector<std::string> lines = absl::StrSplit(json_out.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 5u) << json_out.str();
  EXPECT_EQ(nlohmann::json::parse(lines[0]).size(), 4u)
      << lines[0];  // time, level, thread, message
  const auto outer = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(outer["message"], "outer");
  EXPECT_EQ(outer["event"], "a \"b\"\n");
  EXPECT_EQ(outer["n"], -7);
  EXPECT_EQ(outer["cut"], true);
  EXPECT_EQ(outer["ms"], 1.235);
  EXPECT_TRUE(outer["nan"].is_null());
  const auto inner = nlohmann::json::parse(lines[2]);
  EXPECT_EQ(inner["n"], 1);
  EXPECT_FALSE(inner.contains("event")) << lines[2];
  EXPECT_EQ(nlohmann::json::parse(lines[3])["n"], -7);
  EXPECT_EQ(nlohmann::json::parse(lines[4]).size(), 4u) << lines[4];
  EXPECT_EQ(text_out.str(), "outer\n");
}

TEST(JsonLog, OnlyTextAndJsonAreFormats) {
  EXPECT_TRUE(SetLogFormat("text").ok());
  const absl::Status xml = SetLogFormat("xml");
  EXPECT_EQ(xml.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(xml.message(), "--log_format=xml: want text or json");
}

}  // namespace
}  // namespace hstu::server
