// hstu_bench gemm_algos (see bench_gemm.cc) and gemm_search (bench_gemm_search.cc).
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "client/bench_util.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm_tuner.h"
#include "nlohmann/json.hpp"

namespace hstu::bench {

// What both GEMM benchmarks run on: a stream, a cuBLAS handle bound to it with a 32 MiB workspace,
// a cuBLASLt handle, and the engine's GemmTuner on the same workspace.
struct GemmBenchContext {
  static constexpr size_t kWorkspaceBytes = 32u << 20;
  cuda::Stream stream;
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  cuda::DeviceBuffer ws;
  cuda::GemmTuner tuner;

  GemmBenchContext() {
    HSTU_BENCH_CHECK_CUDA(stream.Create());
    HSTU_BENCH_CHECK_LT(cublasCreate(&blas));
    HSTU_BENCH_CHECK_LT(cublasSetStream(blas, stream.get()));
    HSTU_BENCH_CHECK_LT(cublasLtCreate(&lt));
    HSTU_BENCH_CHECK_CUDA(ws.Reserve(kWorkspaceBytes));
    HSTU_BENCH_CHECK_LT(cublasSetWorkspace(blas, ws.get(), kWorkspaceBytes));
    HSTU_BENCH_CHECK_LT(tuner.Init(blas, ws.get(), kWorkspaceBytes));
  }
  ~GemmBenchContext() {
    cublasLtDestroy(lt);
    cublasDestroy(blas);
  }
  GemmBenchContext(const GemmBenchContext&) = delete;
  GemmBenchContext& operator=(const GemmBenchContext&) = delete;
};

// The row-major GEMM C[m, n] = A[m, k] · W[k, n] as cuBLASLt sees it, column-major
// Cᵀ[n, m] = Wᵀ[n, k] · Aᵀ[k, m]: the operation (fp32 compute) and the bf16 W and A and the C
// layouts, destroyed with it.
struct LtGemmDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, a = nullptr, c = nullptr;

  LtGemmDescs(int64_t m, int64_t n, int64_t k, cudaDataType_t c_type) {
    HSTU_BENCH_CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    HSTU_BENCH_CHECK_LT(cublasLtMatrixLayoutCreate(&w, CUDA_R_16BF, n, k, n));
    HSTU_BENCH_CHECK_LT(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, m, k));
    HSTU_BENCH_CHECK_LT(cublasLtMatrixLayoutCreate(&c, c_type, n, m, n));
  }
  ~LtGemmDescs() {
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(w);
    cublasLtMatmulDescDestroy(op);
  }
  LtGemmDescs(const LtGemmDescs&) = delete;
  LtGemmDescs& operator=(const LtGemmDescs&) = delete;
};

nlohmann::json BenchGemmAlgos(int reps);
nlohmann::json BenchGemmSearch(int reps);

}  // namespace hstu::bench
