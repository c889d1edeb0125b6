// The engine-level benchmarks of DESIGN §11 (issue 5), called from hstu_bench: the decode step with
// CUDA graphs, its kernel timeline, e2e in three modes, and the host tier's transfers. All use the
// base model with hstu_bench's --window; e2e also its --sustained_ms.
#pragma once

#include <vector>

#include "nlohmann/json.hpp"

namespace hstu::bench {

// The decode step (3968 cached + 128 new + 256 candidates a user), eager against graph replay.
nlohmann::json BenchStepGraphs(int reps, int page_size, const std::vector<int>& batches);
// The decode step's kernels as the device ran them (CUPTI records), `cached` tokens a user.
nlohmann::json BenchStepTimeline(int reps, int page_size, const std::vector<int>& batches,
                                 int cached);
// Engine::Rank over growing histories for 1, 2, 4, 8 users: baseline, cache, cache + graphs.
nlohmann::json BenchE2e(int reps, int page_size);
// Host tier onload/offload time and GB/s for 1K–4K-token users, and the onload's overlap.
nlohmann::json BenchOffload(int reps, int page_size);

}  // namespace hstu::bench
