// The layer GEMMs with the cuBLASLt algorithm chosen by measurement (docs/cuda_kernels.md, "GEMM
// algorithm choice"). cublasGemmEx's default algorithm leaves 5–20 % on the table for some of our
// shapes (the output projection at 3072 and 34816 rows); the heuristic's first answer is not
// always the fastest either, so each shape class is timed once.
//
// Shape class: (n, k, output type, beta ≠ 0) and the row count rounded up to a class bound (256,
// 384, 512, 768, ... : 2^i and 1.5·2^i, the graph buckets' row counts). The first call of a class
// outside a stream capture times cublasGemmEx and up to kCandidates heuristic algorithms on the
// call's own operands and keeps the fastest for every later call of the class, eager or captured,
// so a graph replay and an eager run of the same rows use the same algorithm. The timing run
// writes its output to scratch when beta ≠ 0 (the call accumulates into c) and to c itself
// otherwise (the real call overwrites it). A class first seen inside a capture (the backend warms
// every graph bucket up first, so this does not happen there) uses cublasGemmEx without tuning it.
//
// HSTU_GEMM_TUNE=0 in the environment turns tuning off (cublasGemmEx everywhere), for A/B runs.
// Not thread-safe: one per stream owner (the CUDA backend).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "kernels/cuda/device_buffer.h"
#include "kernels/params.h"

namespace hstu::cuda {

class GemmTuner {
 public:
  static constexpr int kCandidates = 16;

  GemmTuner() = default;
  ~GemmTuner();
  GemmTuner(const GemmTuner&) = delete;
  GemmTuner& operator=(const GemmTuner&) = delete;

  // `blas` runs the cublasGemmEx path (its stream and workspace already set); `workspace` of
  // `workspace_bytes` is what the cuBLASLt algorithms may use (it may be blas's own workspace:
  // both run in order on one stream).
  cublasStatus_t Init(cublasHandle_t blas, void* workspace, size_t workspace_bytes);

  // As GemmBf16 (gemm.h): row-major c[m, n] = a[m, k] · b[k, n] + beta · c; a, b bf16; c bf16 or
  // fp32. Runs on `stream` (the stream blas is bound to).
  cublasStatus_t Run(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, bool c_is_f32,
                     int64_t m, int64_t n, int64_t k, float beta, cudaStream_t stream);

  // The UVQK projection's route for this call, c = append.uvqk [m, n]: a config of
  // LaunchGemmBiasSilu (≥ 0: c = SiLU(a·b + bias) in one kernel, then LaunchAppendKvFromRows) or −1
  // (Run() for c = a·b, then LaunchBiasSiluAppendKv). Chosen per (row class, n, k) by timing both
  // whole routes, GEMM and append, on this call's operands (the interleaved rounds of Run's
  // tuning; a fused config must be 5 % faster, 10 % below 1024 rows: gemm_tuner.cc says why).
  // −1 when tuning is off, when the fused kernel is unavailable or turned off (HSTU_GEMM_FUSED=0
  // in the environment when the tuner is initialised), and for a class first seen inside a
  // capture. HSTU_GEMM_FUSED=force takes the last fused config for every class without timing
  // (tests, A/B runs). The timing runs write c and append's page slots with the values the real
  // call then writes again, so the pages must be ready for the append (HasBiasSiluRoute says
  // whether this call will time).
  // append_runs false: the caller's step would not launch the fused route's append (every user's
  // new K/V go through the rows, AppendKvParams::new_kv_from_rows), so that route is timed as its
  // GEMM alone.
  int BiasSiluRoute(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* bias,
                    const AppendKvParams<__nv_bfloat16>& append, int64_t m, int64_t n, int64_t k,
                    cudaStream_t stream, bool append_runs = true);
  bool HasBiasSiluRoute(int64_t m, int64_t n, int64_t k) const;

  // The class bound of m rows.
  static int64_t RowClass(int64_t m);

  int num_tuned() const { return static_cast<int>(choice_.size()); }
  bool fused_available() const { return fused_available_; }
  // The UVQK routes chosen so far, one per row class ("3072 rows: fused (config 1)"), or why the
  // fused route is not in play; for start-up logs and benchmark reports.
  std::string BiasSiluRoutes() const;
  bool enabled() const { return enabled_; }

 private:
  struct Choice {
    bool use_lt = false;  // false: cublasGemmEx
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool>;  // row class, n, k, f32 out, beta≠0

  // Times the candidates on this call's operands (synchronises the stream).
  Choice Tune(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, bool c_is_f32, int64_t m,
              int64_t n, int64_t k, float beta, cudaStream_t stream);
  cublasStatus_t RunLt(const cublasLtMatmulAlgo_t& algo, const __nv_bfloat16* a,
                       const __nv_bfloat16* b, void* c, bool c_is_f32, int64_t m, int64_t n,
                       int64_t k, float beta, cudaStream_t stream);

  cublasHandle_t blas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool enabled_ = true;
  std::map<Key, Choice> choice_;
  bool fused_available_ = false;                                  // LaunchGemmBiasSilu usable
  bool fused_forced_ = false;                                     // HSTU_GEMM_FUSED=force
  std::map<std::tuple<int64_t, int64_t, int64_t>, int> silu_route_;  // (row class, n, k) → route
  DeviceBuffer scratch_;  // the timing runs' output when the real call accumulates (freed after)
};

}  // namespace hstu::cuda
