// Benchmarks of DESIGN §11 items 3 (`layer`) and 4 (`attention_sweep`), called from hstu_bench.
#pragma once

#include "nlohmann/json.hpp"

namespace hstu::bench {

// Fused paged attention vs the materialised baseline, one user, T = 128 … 32768, H x D = 1024.
nlohmann::json BenchAttentionSweep(int reps);
// One layer, batch 32, T = 1K … 8K per user, base model (d 1024, 4 x 256): fused vs unfused.
nlohmann::json BenchLayer(int reps);

}  // namespace hstu::bench
