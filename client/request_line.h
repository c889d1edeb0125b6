// The JSONL request lines that hstu_rank scores and hstu_loadgen --replay sends: one request a
// line, optionally with the scores a server answered it (what hstu_loadgen --record writes).
//   {"user_id": 7, "history_item_ids": [101, 205], "history_actions": [0, 1],
//    "candidate_item_ids": [11, 12], "expected_scores": [[0.1, 0.2], [0.3, 0.4]],
//    "cache_result": "gpu_hit"}
// Strict: a field that is not one of these, or one given twice, is an error (a misspelt
// "history_items" would otherwise send no history), and so is an id that does not fit its type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hstu::client {

struct RequestLine {
  uint64_t user_id = 0;
  std::vector<int64_t> history_item_ids;  // oldest first
  std::vector<int32_t> history_actions;   // as long as history_item_ids in a valid request
  std::vector<int64_t> candidate_item_ids;
  std::optional<std::vector<std::vector<float>>> expected_scores;  // [candidates][tasks]
  std::string cache_result;  // how the recording server's cache served it ("" when not given)
};

// A line of spaces, tabs and CRs only (skipped: neither a request nor an error).
bool IsBlankRequestLine(const std::string& line);

// Parses one line; the error names the field. The request's values are not checked against a
// model (the engine or the server does that).
absl::StatusOr<RequestLine> ParseRequestLine(const std::string& line);

}  // namespace hstu::client
