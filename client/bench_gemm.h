// hstu_bench gemm_algos (see bench_gemm.cc) and gemm_search (bench_gemm_search.cc).
#pragma once

#include "nlohmann/json.hpp"

namespace hstu::bench {

nlohmann::json BenchGemmAlgos(int reps);
nlohmann::json BenchGemmSearch(int reps);

}  // namespace hstu::bench
