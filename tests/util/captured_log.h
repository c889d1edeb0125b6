// spdlog's default logger sent to a string while a test runs, then put back: for tests of what
// the code logs. Thread-safe: threads may log while the test reads.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "spdlog/sinks/base_sink.h"
#include "spdlog/spdlog.h"

namespace hstu::testing {

class CapturedLog {
 public:
  // `pattern`: spdlog's, e.g. "%v" (the message only) or "[%l] %v".
  explicit CapturedLog(const std::string& pattern = "%v")
      : sink_(std::make_shared<StringSink>()), previous_(spdlog::default_logger()) {
    auto logger = std::make_shared<spdlog::logger>("captured", sink_);
    logger->set_pattern(pattern);
    logger->set_level(spdlog::level::trace);
    spdlog::set_default_logger(std::move(logger));
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  CapturedLog(const CapturedLog&) = delete;
  CapturedLog& operator=(const CapturedLog&) = delete;

  std::string str() const { return sink_->Text(); }
  std::vector<std::string> Lines() const {
    return absl::StrSplit(sink_->Text(), '\n', absl::SkipEmpty());
  }
  void Clear() { sink_->Clear(); }

 private:
  class StringSink final : public spdlog::sinks::base_sink<std::mutex> {
   public:
    std::string Text() {
      std::lock_guard<std::mutex> lock(mutex_);
      return text_;
    }
    void Clear() {
      std::lock_guard<std::mutex> lock(mutex_);
      text_.clear();
    }

   protected:
    void sink_it_(const spdlog::details::log_msg& msg) override {  // under mutex_
      spdlog::memory_buf_t formatted;
      formatter_->format(msg, formatted);
      text_.append(formatted.data(), formatted.size());
    }
    void flush_() override {}

   private:
    std::string text_;
  };

  std::shared_ptr<StringSink> sink_;
  std::shared_ptr<spdlog::logger> previous_;
};

}  // namespace hstu::testing
