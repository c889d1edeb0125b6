// The start-up's warm-up of the eager step shapes (GPU). A batch larger than the CUDA graphs'
// buckets (misses, mostly) runs eagerly, and the GEMM tuner times a row class of the GEMMs at its
// first call: the base model's first such batches on an H100 took 50-82 ms each, in the first
// second of traffic (docs/benchmarks.md, thirty-eighth session). The warm-up runs one batch of
// misses for each row class up to the largest batch the scheduler forms, before serving.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/request.h"

namespace hstu {

// One warm-up batch: its users, each of `num_events` history events (2 rows each) and
// `num_candidates` candidates.
struct EagerWarmupBatch {
  struct User {
    int64_t num_events = 0;
    int64_t num_candidates = 0;
  };
  std::vector<User> users;

  int64_t num_rows() const;
  // The requests: user ids at the top of the range, below the server's warm-up request's (2^64-1).
  std::vector<RankRequest> Requests() const;
};

// One batch of misses for each row class of the GEMM tuner (kernels/row_classes.h: 256, 384,
// 512, 768, ...) up to the most rows the scheduler puts in one batch (max_batch_size users of the
// model's longest history, within max_batch_tokens; one such user always), each of its class's
// bound in rows or up to two fewer (the last: that most). Full-history users, then one of the
// rows left.
std::vector<EagerWarmupBatch> EagerWarmupBatches(int64_t max_history_tokens, int64_t num_candidates,
                                                 int32_t max_batch_size, int64_t max_batch_tokens);

struct EagerWarmupSummary {
  int64_t num_batches = 0;
  int64_t most_rows = 0;
  int64_t num_kept = 0;  // warm-up users whose entries could not be forgotten (still in use)
};

// Runs EagerWarmupBatches for `engine`'s model (candidates within its --max_candidates), forgets
// every warm-up user, then sets the onload rule's measured rates back to their start values (the
// tuner's timings inflated them). From the thread that calls Rank(), before serving. An error
// names the batch that failed.
absl::StatusOr<EagerWarmupSummary> WarmUpEagerSteps(Engine& engine, int32_t max_batch_size,
                                                    int64_t max_batch_tokens);

}  // namespace hstu
