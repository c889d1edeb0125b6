// What the engine scores: one user's request and its result (the engine-side twin of the proto).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/model.h"
#include "kvcache/cache_manager.h"

namespace hstu {

struct RankRequest {
  uint64_t user_id = 0;
  std::vector<int64_t> history_item_ids;  // oldest first
  std::vector<int32_t> history_actions;   // same length as history_item_ids
  std::vector<int64_t> candidate_item_ids;
};

struct RankResult {
  int32_t num_tasks = 0;
  std::vector<float> scores;       // [num_candidates, num_tasks], candidate-major, in (0, 1)
  uint32_t reused_tokens = 0;      // history tokens served from the cache
  uint32_t computed_tokens = 0;    // history tokens computed for this request
  LookupResult cache_result = LookupResult::kMiss;  // how the KV cache served it
  std::vector<float> hidden;       // [num_candidates, d] final hidden rows (only with keep_hidden)
};

// Limits a caller may tighten (the server's --max_candidates); 0 = no limit beyond the model's
// (each checked only when > 0).
struct RequestLimits {
  int64_t max_candidates = 1024;
  int64_t max_history_events = 1 << 20;  // longer histories are rejected, not truncated
};

// Validates a request against the model; INVALID_ARGUMENT naming the field otherwise.
// Histories longer than the model's maximum are accepted (truncated, DESIGN §4).
absl::Status ValidateRankRequest(const RankRequest& request, const ModelConfig& config,
                                 const RequestLimits& limits);

}  // namespace hstu
