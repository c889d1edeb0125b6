// hstu_bench gemm_algos (see bench_gemm.cc) and gemm_search (bench_gemm_search.cc).
#pragma once

#include <cublasLt.h>

#include <cstdio>
#include <cstdlib>

#include "nlohmann/json.hpp"

// A GEMM benchmark cannot report a number after a failed cuBLAS(Lt) call: print where and exit.
#define HSTU_BENCH_CHECK_LT(expr)                                                      \
  do {                                                                                 \
    const cublasStatus_t st_ = (expr);                                                 \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #expr, \
                   static_cast<int>(st_));                                             \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

namespace hstu::bench {

nlohmann::json BenchGemmAlgos(int reps);
nlohmann::json BenchGemmSearch(int reps);

}  // namespace hstu::bench
