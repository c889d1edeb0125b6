// hstu_loadgen --record: the server's OK answers as JSONL lines that hstu_rank reads back, each
// request with the scores it was answered ("expected_scores") and how the cache served it
// ("cache_result"). `hstu_rank --no_cache --input=FILE` recomputes every line from its whole
// history and compares: a check of the cache's reuse under real traffic (docs/server.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hstu::loadgen {

// One line, without its newline:
//   {"user_id":7,"history_item_ids":[...],"history_actions":[...],"candidate_item_ids":[...],
//    "expected_scores":[[t0,...],...],"cache_result":"gpu_hit"}
// scores: [candidates, num_tasks], candidate-major, as RankResponse.scores. Scores are written
// with 9 significant digits, which read back as the same float; one that is not finite as null.
std::string AnswerLine(uint64_t user_id, std::span<const int64_t> history_item_ids,
                       std::span<const int32_t> history_actions,
                       std::span<const int64_t> candidate_item_ids, std::span<const float> scores,
                       int num_tasks, std::string_view cache_result);

// The file of answers, one line each for every `every`-th answer offered. Thread-safe: the
// callers and gRPC's callback threads offer answers concurrently; each line is written whole
// under a lock, so lines never interleave.
class AnswerLog {
 public:
  // How long Open waits for a FIFO's reader.
  static constexpr std::chrono::seconds kReaderWait{5};

  // Creates (truncates) `path`, in place; a FIFO's reader is waited for up to kReaderWait (or
  // until a stop signal). An error names the path.
  static absl::StatusOr<std::unique_ptr<AnswerLog>> Open(const std::string& path, int64_t every);
  ~AnswerLog();
  AnswerLog(const AnswerLog&) = delete;
  AnswerLog& operator=(const AnswerLog&) = delete;

  // Whether the next answer offered is one to write (and counts it as offered): the line is built
  // only for those.
  bool Take();
  void Write(const std::string& line);
  // Flushes and closes; an error (a full disk) names the path. Lines written (handed to the
  // file; all of them are in it when Close succeeded): lines().
  absl::Status Close();
  int64_t lines() const;

 private:
  AnswerLog(std::string path, std::FILE* file, int64_t every)
      : path_(std::move(path)), file_(file), every_(every) {}

  const std::string path_;
  mutable std::mutex mu_;
  std::FILE* file_;  // null once closed
  const int64_t every_;
  int64_t offered_ = 0;
  int64_t lines_ = 0;
  bool failed_ = false;
  int error_ = 0;  // errno of the first failed write, flush or close
};

}  // namespace hstu::loadgen
