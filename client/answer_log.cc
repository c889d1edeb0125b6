#include "client/answer_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/stop_signal.h"
#include "engine/atomic_file.h"

namespace hstu::loadgen {
namespace {

template <typename T>
void AppendArray(std::string* out, std::span<const T> values) {
  out->push_back('[');
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, values[i]);
  }
  out->push_back(']');
}

}  // namespace

std::string AnswerLine(uint64_t user_id, std::span<const int64_t> history_item_ids,
                       std::span<const int32_t> history_actions,
                       std::span<const int64_t> candidate_item_ids, std::span<const float> scores,
                       int num_tasks, std::string_view cache_result) {
  std::string out = absl::StrCat("{\"user_id\":", user_id, ",\"history_item_ids\":");
  AppendArray(&out, history_item_ids);
  out += ",\"history_actions\":";
  AppendArray(&out, history_actions);
  out += ",\"candidate_item_ids\":";
  AppendArray(&out, candidate_item_ids);
  out += ",\"expected_scores\":[";
  const size_t tasks = num_tasks > 0 ? static_cast<size_t>(num_tasks) : 1;
  for (size_t c = 0; c * tasks < scores.size(); ++c) {
    if (c > 0) out.push_back(',');
    out.push_back('[');
    for (size_t t = 0; t < tasks && c * tasks + t < scores.size(); ++t) {
      if (t > 0) out.push_back(',');
      // %.9g: every float reads back as itself. A score that is not finite (which our server
      // never answers) is null: JSON has no NaN, and hstu_rank reports a null as not a number.
      const float score = scores[c * tasks + t];
      absl::StrAppend(&out, std::isfinite(score) ? absl::StrFormat("%.9g", score) : "null");
    }
    out.push_back(']');
  }
  // The cache result is one of the server's enum names (letters and '_'), no escaping needed;
  // anything else is dropped rather than written as broken JSON.
  std::string result;
  for (char ch : cache_result) {
    if ((ch >= 'a' && ch <= 'z') || ch == '_') result.push_back(ch);
  }
  absl::StrAppend(&out, "],\"cache_result\":\"", result, "\"}");
  return out;
}

absl::StatusOr<std::unique_ptr<AnswerLog>> AnswerLog::Open(const std::string& path, int64_t every) {
  if (every < 1) return absl::InvalidArgumentError(absl::StrCat("answer log: every ", every, " < 1"));
  // /dev/stdout and the like: a copy of the descriptor (which Close() closes), written at its
  // offset: opening the path would truncate the file a shell redirected it to, `>>` included.
  // Else the file, created or truncated in place; a FIFO's reader may open it just after us
  // (`--record=f & hstu_rank --input=f`), so it gets kReaderWait, and none by then is an error,
  // not a wait that never ends.
  const std::optional<int> own = OwnDescriptor(path);
  absl::StatusOr<int> fd;
  if (own.has_value()) {
    const int copy = ::fcntl(*own, F_DUPFD_CLOEXEC, 0);
    fd = copy >= 0 ? absl::StatusOr<int>(copy) : absl::InvalidArgumentError(std::strerror(errno));
  } else {
    const auto give_up = std::chrono::steady_clock::now() + kReaderWait;
    while (absl::IsUnavailable(
               (fd = OpenWithoutWaiting(path, O_WRONLY | O_CREAT | O_TRUNC)).status()) &&
           std::chrono::steady_clock::now() < give_up && !Interrupted()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (!fd.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--record=", path, ": cannot create it: ", fd.status().message(),
        absl::IsUnavailable(fd.status())
            ? absl::StrCat(", after waiting ", absl::FormatDuration(absl::FromChrono(kReaderWait)))
            : ""));
  }
  std::FILE* f = ::fdopen(*fd, "w");
  if (f == nullptr) {
    const int err = errno;
    ::close(*fd);
    return absl::InvalidArgumentError(
        absl::StrCat("--record=", path, ": cannot create it: ", std::strerror(err)));
  }
  return std::unique_ptr<AnswerLog>(new AnswerLog(path, f, every));
}

AnswerLog::~AnswerLog() { (void)Close(); }

bool AnswerLog::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  return file_ != nullptr && offered_++ % every_ == 0;
}

void AnswerLog::Write(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr || failed_) return;
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() ||
      std::fputc('\n', file_) == EOF) {
    failed_ = true;  // reported by Close; later lines are not written after a gap
    error_ = errno;
    return;
  }
  ++lines_;
}

absl::Status AnswerLog::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return absl::OkStatus();
  const bool flushed = std::fflush(file_) == 0 && !std::ferror(file_);
  if (!flushed && error_ == 0) error_ = errno;
  const bool closed = std::fclose(file_) == 0;
  if (!closed && error_ == 0) error_ = errno;
  file_ = nullptr;
  if (failed_ || !flushed || !closed) {
    // EPIPE: the reader of a pipe or FIFO went away; ENOSPC: a full disk.
    return absl::DataLossError(absl::StrCat("--record=", path_, ": writing failed (",
                                            error_ != 0 ? std::strerror(error_) : "an I/O error",
                                            "), the recording is incomplete"));
  }
  return absl::OkStatus();
}

int64_t AnswerLog::lines() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lines_;
}

}  // namespace hstu::loadgen
