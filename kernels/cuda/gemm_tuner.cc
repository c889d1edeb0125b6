#include "kernels/cuda/gemm_tuner.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_bias_silu.h"
#include "kernels/cuda/ops.h"
#include "kernels/row_classes.h"

namespace hstu::cuda {
namespace {

// The descriptors of one call, initialised in place (no allocation): C[m, n] row-major is the
// column-major Cᵀ[n, m] = Bᵀ[n, k] · Aᵀ[k, m].
struct LtCall {
  cublasLtMatmulDescOpaque_t op;
  cublasLtMatrixLayoutOpaque_t lb, la, lc;

  cublasStatus_t Init(bool c_is_f32, int64_t m, int64_t n, int64_t k) {
    cublasStatus_t st = cublasLtMatmulDescInit(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutInit(&lb, CUDA_R_16BF, n, k, n);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutInit(&la, CUDA_R_16BF, k, m, k);
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = cublasLtMatrixLayoutInit(&lc, c_is_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, n);
    }
    return st;
  }
};

bool EnvNotZero(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// Times each candidate (run(i) enqueues candidate i on `stream`; false: it failed) in interleaved
// rounds — one warm-up round, then kRounds timed ones — and returns the median milliseconds per
// candidate (+inf for one that failed). A clock that ramps or sags during tuning favours none of
// them. Synchronises the stream.
template <class RunFn>
std::vector<float> TimeCandidates(size_t count, cudaStream_t stream, RunFn run) {
  constexpr float kFailed = 1e30f;
  std::vector<float> result(count, kFailed);
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    if (start != nullptr) cudaEventDestroy(start);
    cudaGetLastError();
    return result;
  }
  constexpr int kRounds = 5;
  std::vector<std::vector<float>> ms(count);
  std::vector<bool> failed(count, false);
  for (int round = -1; round < kRounds; ++round) {
    for (size_t i = 0; i < count; ++i) {
      if (failed[i]) continue;
      cudaEventRecord(start, stream);
      failed[i] = !run(i);
      cudaEventRecord(stop, stream);
      float t = 0.f;
      failed[i] = failed[i] || cudaEventSynchronize(stop) != cudaSuccess ||
                  cudaEventElapsedTime(&t, start, stop) != cudaSuccess;
      if (round >= 0 && !failed[i]) ms[i].push_back(t);
    }
  }
  for (size_t i = 0; i < count; ++i) {
    if (failed[i]) continue;
    std::sort(ms[i].begin(), ms[i].end());
    result[i] = ms[i][ms[i].size() / 2];
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();  // a candidate that failed to launch leaves no error behind
  return result;
}

// The index of the fastest candidate, candidate 0 (the default) unless another is faster by more
// than `margin` (2 %), so noise does not pick the algorithm.
size_t Fastest(const std::vector<float>& ms, float margin = 0.02f) {
  size_t best = 0;
  for (size_t i = 1; i < ms.size(); ++i) {
    if (ms[i] < (1.f - margin) * ms[best]) best = i;
  }
  return best;
}

// The UVQK route's margin: a fused config must beat cuBLAS + the pass by 5 %, and by 10 % below
// 1024 rows. Timed alone, the routes differ by a few percent at the decode step's row counts, and
// at batch 1 the timing does not carry over into the step: at 384 rows a fused config timed 2.3 %
// faster made the batch-1 graph replay 40 µs slower (H200), as it had in rounds 15 and 24, and
// one was timed 6.3 % faster on an H100 (docs/kernel_rounds.md, round 27). At 3072 rows and up the
// fused configs were timed 7-22 % faster (H200 and H100), where the margin does not decide.
float FusedRouteMargin(int64_t rows) { return rows < 1024 ? 0.10f : 0.05f; }

// HSTU_GEMM_TUNE_LOG=1: each tuning decision to stderr (shape, every candidate's median, the
// choice), to see whether two runs of one binary chose alike.
void LogTuning(const char* what, int64_t m, int64_t n, int64_t k, const std::vector<float>& ms,
               int chosen) {
  static const bool on = [] {
    const char* v = std::getenv("HSTU_GEMM_TUNE_LOG");
    return v != nullptr && std::strcmp(v, "0") != 0;
  }();
  if (!on) return;
  std::string line;
  for (size_t i = 0; i < ms.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%.1f", i == 0 ? "" : " ", ms[i] * 1e3f);
    line += buf;
  }
  std::fprintf(stderr, "gemm tuning: %s m=%lld n=%lld k=%lld candidates (us) [%s] chose %d\n", what,
               static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
               line.c_str(), chosen);
}

}  // namespace

GemmTuner::~GemmTuner() {
  if (lt_ != nullptr) cublasLtDestroy(lt_);
}

cublasStatus_t GemmTuner::Init(cublasHandle_t blas, void* workspace, size_t workspace_bytes) {
  blas_ = blas;
  workspace_ = workspace;
  workspace_bytes_ = workspace_bytes;
  enabled_ = EnvNotZero("HSTU_GEMM_TUNE");
  // The fused UVQK route: timed per class by default; HSTU_GEMM_FUSED=0 turns it off, =force takes
  // it for every class without timing (tests, A/B runs).
  const char* fused = std::getenv("HSTU_GEMM_FUSED");
  fused_forced_ = fused != nullptr && std::strcmp(fused, "force") == 0;
  fused_available_ = enabled_ && EnvNotZero("HSTU_GEMM_FUSED") && GemmBiasSiluAvailable();
  return enabled_ ? cublasLtCreate(&lt_) : CUBLAS_STATUS_SUCCESS;
}

int64_t GemmTuner::RowClass(int64_t m) { return row_classes::Of(m); }

cublasStatus_t GemmTuner::RunLt(const cublasLtMatmulAlgo_t& algo, const __nv_bfloat16* a,
                                const __nv_bfloat16* b, void* c, bool c_is_f32, int64_t m,
                                int64_t n, int64_t k, float beta, cudaStream_t stream) {
  LtCall call;
  if (cublasStatus_t st = call.Init(c_is_f32, m, n, k); st != CUBLAS_STATUS_SUCCESS) return st;
  const float alpha = 1.f;
  return cublasLtMatmul(lt_, &call.op, &alpha, b, &call.lb, a, &call.la, &beta, c, &call.lc, c,
                        &call.lc, &algo, workspace_, workspace_bytes_, stream);
}

GemmTuner::Choice GemmTuner::Tune(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c,
                                  bool c_is_f32, int64_t m, int64_t n, int64_t k, float beta,
                                  cudaStream_t stream) {
  Choice best;  // cublasGemmEx unless an algorithm beats it
  void* out = c;
  if (beta != 0.f) {
    // The call accumulates into c: the timing runs write elsewhere. Without room for that, the
    // class keeps cublasGemmEx.
    if (scratch_.Reserve(static_cast<size_t>(m) * n * (c_is_f32 ? 4 : 2)) != cudaSuccess) {
      cudaGetLastError();
      return best;
    }
    out = scratch_.get();
  }
  LtCall call;
  if (call.Init(c_is_f32, m, n, k) != CUBLAS_STATUS_SUCCESS) return best;
  cublasLtMatmulPreferenceOpaque_t pref;
  if (cublasLtMatmulPreferenceInit(&pref) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes_, sizeof(workspace_bytes_)) !=
          CUBLAS_STATUS_SUCCESS) {
    return best;
  }
  cublasLtMatmulHeuristicResult_t found[kCandidates];
  int num_found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(lt_, &call.op, &call.lb, &call.la, &call.lc, &call.lc, &pref,
                                     kCandidates, found, &num_found) != CUBLAS_STATUS_SUCCESS) {
    return best;
  }
  // Candidate 0 is cublasGemmEx, then the heuristic's algorithms.
  std::vector<const cublasLtMatmulAlgo_t*> algos = {nullptr};
  for (int i = 0; i < num_found; ++i) {
    if (found[i].state == CUBLAS_STATUS_SUCCESS && found[i].workspaceSize <= workspace_bytes_) {
      algos.push_back(&found[i].algo);
    }
  }
  const std::vector<float> ms = TimeCandidates(algos.size(), stream, [&](size_t i) {
    const cublasStatus_t st = algos[i] == nullptr
                                  ? GemmBf16(blas_, a, b, out, c_is_f32, m, n, k, beta)
                                  : RunLt(*algos[i], a, b, out, c_is_f32, m, n, k, beta, stream);
    return st == CUBLAS_STATUS_SUCCESS;
  });
  const size_t fastest = Fastest(ms);
  LogTuning(beta != 0.f ? "GEMM (accumulating)" : "GEMM", m, n, k, ms, static_cast<int>(fastest));
  if (fastest > 0) {
    best.use_lt = true;
    best.algo = *algos[fastest];
  }
  scratch_ = DeviceBuffer();  // tuning is rare: give the memory back
  return best;
}

cublasStatus_t GemmTuner::Run(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c,
                              bool c_is_f32, int64_t m, int64_t n, int64_t k, float beta,
                              cudaStream_t stream) {
  if (m < 0 || n <= 0 || k <= 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0) return CUBLAS_STATUS_SUCCESS;
  if (!enabled_ || lt_ == nullptr) return GemmBf16(blas_, a, b, c, c_is_f32, m, n, k, beta);
  const Key key{RowClass(m), n, k, c_is_f32, beta != 0.f};
  auto it = choice_.find(key);
  if (it == choice_.end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      return GemmBf16(blas_, a, b, c, c_is_f32, m, n, k, beta);  // no timing inside a capture
    }
    it = choice_.emplace(key, Tune(a, b, c, c_is_f32, m, n, k, beta, stream)).first;
  }
  if (it->second.use_lt) {
    const cublasStatus_t st = RunLt(it->second.algo, a, b, c, c_is_f32, m, n, k, beta, stream);
    // An algorithm timed at another row count of the class may not take this one: NOT_SUPPORTED,
    // or INVALID_VALUE when it would need more workspace there (a split-K reduction grows with
    // m · n). Both are refusals before any work, so cublasGemmEx, which chooses for this exact
    // shape, may run instead; another failure (work may have started on c) is returned.
    if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE) return st;
  }
  return GemmBf16(blas_, a, b, c, c_is_f32, m, n, k, beta);
}

std::string GemmTuner::BiasSiluRoutes() const {
  if (!enabled_) return "cuBLAS + bias/SiLU/append pass (GEMM tuning off: HSTU_GEMM_TUNE=0)";
  if (!fused_available_) {
    return GemmBiasSiluAvailable()
               ? "cuBLAS + bias/SiLU/append pass (fused GEMM off: HSTU_GEMM_FUSED=0)"
               : "cuBLAS + bias/SiLU/append pass (fused GEMM not in this build or not a compute "
                 "capability 9.0 GPU)";
  }
  if (silu_route_.empty()) return "none chosen yet (chosen per row class on first use)";
  std::string out;
  for (const auto& [key, route] : silu_route_) {
    if (!out.empty()) out += ", ";
    const char* fused = route == 0 ? "fused (128x256 cooperative)" : "fused (128x128 ping-pong)";
    out += std::to_string(std::get<0>(key)) + " rows: " + (route < 0 ? "cuBLAS + pass" : fused);
  }
  return out;
}

bool GemmTuner::HasBiasSiluRoute(int64_t m, int64_t n, int64_t k) const {
  return !fused_available_ || m <= 0 || silu_route_.count({RowClass(m), n, k}) > 0;
}

int GemmTuner::BiasSiluRoute(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* bias,
                             const AppendKvParams<__nv_bfloat16>& append, int64_t m, int64_t n,
                             int64_t k, cudaStream_t stream, bool append_runs) {
  if (!fused_available_ || m <= 0) return -1;
  const std::tuple<int64_t, int64_t, int64_t> key{RowClass(m), n, k};
  if (auto it = silu_route_.find(key); it != silu_route_.end()) return it->second;
  if (fused_forced_) return silu_route_[key] = kGemmBiasSiluConfigs - 1;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    return -1;  // no timing inside a capture
  }
  // Candidate 0: the plain GEMM (Run: cuBLAS, itself tuned on the warm-up round) + the fused
  // bias + SiLU + append pass; candidate 1 + i: fused config i + the append alone, where the step
  // launches it.
  __nv_bfloat16* c = const_cast<__nv_bfloat16*>(append.uvqk);
  const std::vector<float> ms = TimeCandidates(1 + kGemmBiasSiluConfigs, stream, [&](size_t i) {
    if (i == 0) {
      return Run(a, b, c, /*c_is_f32=*/false, m, n, k, 0.f, stream) == CUBLAS_STATUS_SUCCESS &&
             LaunchBiasSiluAppendKv(c, m, n, bias, append, stream) == cudaSuccess;
    }
    return LaunchGemmBiasSilu(a, b, bias, c, m, n, k, static_cast<int>(i) - 1, stream) ==
               cudaSuccess &&
           (!append_runs || LaunchAppendKvFromRows(m, append, stream) == cudaSuccess);
  });
  const int route = static_cast<int>(Fastest(ms, FusedRouteMargin(std::get<0>(key)))) - 1;
  LogTuning("UVQK route (0: cuBLAS + pass, i: fused config i-1)", m, n, k, ms, route + 1);
  silu_route_.emplace(key, route);
  return route;
}

}  // namespace hstu::cuda
