// hstu_bench gemm_algos: the two GEMMs of a layer (UVQK: bf16 out, beta 0; output projection: fp32
// residual out, beta 1; and the output projection without the residual, fp32 or bf16 out, to see
// what accumulating into the fp32 residual costs) at the decode step's row counts, timed as the engine runs them
// (cublasGemmEx, default algorithm) and with every algorithm cuBLASLt's heuristic offers for the
// same shape (up to 64, 32 MiB workspace), each timed on its own: whether choosing the algorithm
// ourselves would pay, before the engine does it.
#include "client/bench_gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "client/bench_util.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_tuner.h"

namespace hstu::bench {
namespace {

struct Shape {
  const char* name;
  int64_t n, k;
  bool c_f32;
  float beta;
};

}  // namespace

nlohmann::json BenchGemmAlgos(int reps) {
  nlohmann::json rows = nlohmann::json::array();
  GemmBenchContext ctx;  // the tuner in it is what the engine runs (gemm_tuner.h)
  cuda::Stream& stream = ctx.stream;
  cublasHandle_t blas = ctx.blas;
  cublasLtHandle_t lt = ctx.lt;
  const size_t ws_bytes = GemmBenchContext::kWorkspaceBytes;
  cuda::DeviceBuffer& ws = ctx.ws;
  cuda::GemmTuner& tuner = ctx.tuner;
  const Shape shapes[] = {{"UVQK (bf16 out)", 4096, 1024, false, 0.f},
                          {"output + residual (fp32 out, beta 1)", 1024, 1024, true, 1.f},
                          {"output alone (fp32 out, beta 0)", 1024, 1024, true, 0.f},
                          {"output alone (bf16 out, beta 0)", 1024, 1024, false, 0.f}};
  std::printf("\n### GEMM algorithms (row-major C[m, n] = A[m, k] · W[k, n]; bf16 in, fp32 accumulate; "
              "median of %d)\n\n", reps);
  std::printf("| rows m | GEMM | cublasGemmEx (us) | TFLOP/s | best cuBLASLt (us) | TFLOP/s | "
              "best algo (tile id, split-k, index) | best of the first 16 (us) | slowest (us) | "
              "algos | GemmTuner, as the engine (us) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const int64_t m : {int64_t{384}, int64_t{3072}, int64_t{4096}, int64_t{34816}}) {
    for (const Shape& sh : shapes) {
      cuda::DeviceBuffer a, w, c;
      HSTU_BENCH_CHECK_CUDA(a.Reserve(m * sh.k * 2));
      HSTU_BENCH_CHECK_CUDA(w.Reserve(sh.k * sh.n * 2));
      HSTU_BENCH_CHECK_CUDA(c.Reserve(m * sh.n * (sh.c_f32 ? 4 : 2)));
      FillRandom(a.as<cuda::bf16>(), m * sh.k, 1);
      FillRandom(w.as<cuda::bf16>(), sh.k * sh.n, 2);
      HSTU_BENCH_CHECK_CUDA(cudaMemset(c.get(), 0, m * sh.n * (sh.c_f32 ? 4 : 2)));
      const double flops = 2.0 * m * sh.n * sh.k;
      const float ex_ms = TimeMs(stream.get(), reps, [&] {
        HSTU_BENCH_CHECK_LT(cuda::GemmBf16(blas, a.as<cuda::bf16>(), w.as<cuda::bf16>(), c.get(),
                                           sh.c_f32, m, sh.n, sh.k, sh.beta));
      });
      const LtGemmDescs descs(m, sh.n, sh.k, sh.c_f32 ? CUDA_R_32F : CUDA_R_16BF);
      cublasLtMatmulDesc_t op = descs.op;
      cublasLtMatrixLayout_t lw = descs.w, la = descs.a, lc = descs.c;
      cublasLtMatmulPreference_t pref = nullptr;
      HSTU_BENCH_CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
      HSTU_BENCH_CHECK_LT(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
      // Up to kWide of the heuristic's algorithms: whether any past the first 16 (what the engine's
      // tuner times) is faster.
      constexpr int kWide = 64;
      cublasLtMatmulHeuristicResult_t res[kWide];
      int found = 0;
      HSTU_BENCH_CHECK_LT(
          cublasLtMatmulAlgoGetHeuristic(lt, op, lw, la, lc, lc, pref, kWide, res, &found));
      const float alpha = 1.f;
      float best = 1e30f, worst = 0.f, best16 = 1e30f;
      int best_i = -1, tried = 0;
      for (int i = 0; i < found; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > ws_bytes) continue;
        ++tried;
        const float ms = TimeMs(stream.get(), reps, [&] {
          HSTU_BENCH_CHECK_LT(cublasLtMatmul(lt, op, &alpha, w.get(), lw, a.get(), la, &sh.beta,
                                             c.get(), lc, c.get(), lc, &res[i].algo, ws.get(),
                                             ws_bytes, stream.get()));
        });
        if (ms < best) best = ms, best_i = i;
        if (i < 16) best16 = std::min(best16, ms);
        worst = std::max(worst, ms);
      }
      int tile = -1, splitk = -1;
      if (best_i >= 0) {
        size_t got = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&res[best_i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                             sizeof(tile), &got);
        cublasLtMatmulAlgoConfigGetAttribute(&res[best_i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                             &splitk, sizeof(splitk), &got);
      }
      const float tuned_ms = TimeMs(stream.get(), reps, [&] {
        HSTU_BENCH_CHECK_LT(tuner.Run(a.as<cuda::bf16>(), w.as<cuda::bf16>(), c.get(), sh.c_f32, m,
                                      sh.n, sh.k, sh.beta, stream.get()));
      });
      std::printf("| %lld | %s | %.1f | %.0f | %.1f | %.0f | %d, %d, %d | %.1f | %.1f | %d | "
                  "%.1f |\n",
                  static_cast<long long>(m), sh.name, ex_ms * 1e3, flops / (ex_ms * 1e-3) / 1e12,
                  best * 1e3, flops / (best * 1e-3) / 1e12, tile, splitk, best_i, best16 * 1e3,
                  worst * 1e3, tried, tuned_ms * 1e3);
      rows.push_back({{"rows", m}, {"gemm", sh.name}, {"gemmex_us", ex_ms * 1e3},
                      {"best_lt_us", best * 1e3}, {"best_tile_id", tile}, {"best_splitk", splitk},
                      {"best_index", best_i}, {"best_of_16_us", best16 * 1e3},
                      {"slowest_lt_us", worst * 1e3}, {"algos", tried},
                      {"tuner_us", tuned_ms * 1e3}});
      cublasLtMatmulPreferenceDestroy(pref);
    }
  }
  return rows;
}

}  // namespace hstu::bench
