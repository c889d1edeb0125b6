#include "engine/warmup.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/row_classes.h"

namespace hstu {

int64_t EagerWarmupBatch::num_rows() const {
  int64_t rows = 0;
  for (const User& u : users) rows += 2 * u.num_events + u.num_candidates;
  return rows;
}

std::vector<RankRequest> EagerWarmupBatch::Requests() const {
  std::vector<RankRequest> batch(users.size());
  for (size_t u = 0; u < users.size(); ++u) {
    RankRequest& r = batch[u];
    r.user_id = ~uint64_t{0} - 1 - u;
    for (int64_t e = 0; e < users[u].num_events; ++e) {
      r.history_item_ids.push_back(1 + static_cast<int64_t>((e + u) % 1000));
      r.history_actions.push_back(0);
    }
    for (int64_t c = 0; c < users[u].num_candidates; ++c) r.candidate_item_ids.push_back(1 + c);
  }
  return batch;
}

std::vector<EagerWarmupBatch> EagerWarmupBatches(int64_t max_history_tokens, int64_t num_candidates,
                                                 int32_t max_batch_size, int64_t max_batch_tokens) {
  const int64_t full_events = std::max<int64_t>(1, max_history_tokens / 2);
  const int64_t candidates = std::max<int64_t>(1, num_candidates);
  // A miss's rows in a step: its history tokens and its candidates (the scheduler's tokens too).
  const int64_t user_rows = 2 * full_events + candidates;
  // The most rows the scheduler puts in one batch (one user always runs, however large).
  const int64_t most_rows =
      std::max(user_rows, std::min(int64_t{max_batch_size} * user_rows, max_batch_tokens));
  std::vector<EagerWarmupBatch> batches;
  for (int64_t bound = row_classes::kFirst;; bound = row_classes::Next(bound)) {
    // Full-history users while they fit, then one of the rows left (candidates first, at least
    // one event), until fewer than 3 rows are left.
    EagerWarmupBatch batch;
    const int64_t rows = std::min(bound, most_rows);
    for (int64_t left = rows; left >= 3;) {
      const int64_t c = std::min(candidates, left - 2);
      const int64_t events = std::min(full_events, (left - c) / 2);
      batch.users.push_back({.num_events = events, .num_candidates = c});
      left -= 2 * events + c;
    }
    batches.push_back(std::move(batch));
    if (rows == most_rows) break;
  }
  return batches;
}

absl::StatusOr<EagerWarmupSummary> WarmUpEagerSteps(Engine& engine, int32_t max_batch_size,
                                                    int64_t max_batch_tokens) {
  const ModelConfig& c = engine.config();
  // Within the server's --max_candidates, which Rank checks each request against.
  const int64_t limit = engine.options().limits.max_candidates;
  const int64_t candidates =
      limit > 0 ? std::min<int64_t>(c.max_candidates, limit) : int64_t{c.max_candidates};
  EagerWarmupSummary summary;
  for (const EagerWarmupBatch& shape :
       EagerWarmupBatches(c.max_history_tokens, candidates, max_batch_size, max_batch_tokens)) {
    const std::vector<RankRequest> batch = shape.Requests();
    for (const absl::StatusOr<RankResult>& r : engine.Rank(batch)) {
      if (!r.ok()) {
        return absl::Status(r.status().code(), absl::StrCat("warm-up batch of ", shape.num_rows(),
                                                            " rows: ", r.status().message()));
      }
    }
    for (const RankRequest& r : batch) summary.num_kept += engine.Forget(r.user_id) ? 0 : 1;
    ++summary.num_batches;
    summary.most_rows = std::max(summary.most_rows, shape.num_rows());
  }
  engine.ResetMeasuredRates();
  return summary;
}

}  // namespace hstu
