// hstu_bench gemm_algos (see bench_gemm.cc).
#pragma once

#include "nlohmann/json.hpp"

namespace hstu::bench {

nlohmann::json BenchGemmAlgos(int reps);

}  // namespace hstu::bench
