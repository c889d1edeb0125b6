// hstu_bench gemm_search: how far the layer GEMMs' cuBLASLt algorithm could go beyond what the
// heuristic offers (the engine's GemmTuner times the heuristic's answers only). For each shape of
// the decode step and the no-cache block it enumerates cuBLASLt's configurations: the heuristic's
// answers, the heuristic restricted to each algorithm id, and a grid of each id's tiles × split-k
// (× reduction scheme) × cluster shapes, each accepted by cublasLtMatmulAlgoCheck. Every config is
// timed with the weights rotated over buffers larger than L2 (a layer's weights are cold in the
// step), a screen of all of them and then the fastest again with more samples; the fastest few are
// checked against cublasGemmEx's output (split-k sums in another order: relative error reported).
#include "client/bench_gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "client/bench_util.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_tuner.h"

namespace hstu::bench {
namespace {

// A configuration's attributes, for de-duplication and the report.
struct Attrs {
  int id = 0, tile = 0, splitk = 1, reduction = 0, swizzle = 0, custom = 0, stages = 0, inner = 0,
      cluster = 0;
  auto Tie() const {
    return std::tie(id, tile, splitk, reduction, swizzle, custom, stages, inner, cluster);
  }
  bool operator<(const Attrs& o) const { return Tie() < o.Tie(); }
  std::string Str() const {
    char buf[160];
    std::snprintf(buf, sizeof(buf),
                  "id %d, tile %d, split-k %d (red %d), stages %d, cluster %d, swizzle %d, "
                  "custom %d, inner %d",
                  id, tile, splitk, reduction, stages, cluster, swizzle, custom, inner);
    return buf;
  }
};

template <typename T>
T ConfigGet(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t got = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &got);
  return v;
}

Attrs AttrsOf(const cublasLtMatmulAlgo_t& algo) {
  Attrs a;
  a.id = ConfigGet<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID);
  a.tile = static_cast<int>(ConfigGet<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
  a.splitk = static_cast<int>(ConfigGet<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM));
  a.reduction = static_cast<int>(ConfigGet<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME));
  a.swizzle = static_cast<int>(ConfigGet<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
  a.custom = static_cast<int>(ConfigGet<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION));
  a.stages = static_cast<int>(ConfigGet<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID));
  a.inner = static_cast<int>(ConfigGet<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID));
  a.cluster = static_cast<int>(ConfigGet<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
  return a;
}

std::vector<uint32_t> CapArray(const cublasLtMatmulAlgo_t& algo,
                               cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t need = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &need) != CUBLAS_STATUS_SUCCESS ||
      need == 0) {
    return {};
  }
  std::vector<uint32_t> v(need / sizeof(uint32_t));
  size_t got = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), need, &got);
  return v;
}

template <typename T>
T CapGet(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  T v{};
  size_t got = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &v, sizeof(v), &got);
  return v;
}

struct Shape {
  const char* name;
  int64_t m, n, k;
  bool c_f32;
  float beta;
};

struct Candidate {
  cublasLtMatmulAlgo_t algo;
  Attrs attrs;
  size_t workspace = 0;
  const char* source = "";
  float us = 1e30f;
};

}  // namespace

nlohmann::json BenchGemmSearch(int reps) {
  nlohmann::json rows = nlohmann::json::array();
  GemmBenchContext ctx;
  cuda::Stream& stream = ctx.stream;
  cublasHandle_t blas = ctx.blas;
  cublasLtHandle_t lt = ctx.lt;
  size_t ws_bytes = GemmBenchContext::kWorkspaceBytes;  // a preference attribute takes its address
  cuda::DeviceBuffer& ws = ctx.ws;
  cuda::GemmTuner& tuner = ctx.tuner;

  const Shape shapes[] = {
      {"UVQK, batch 1", 384, 4096, 1024, false, 0.f},
      {"output + residual, batch 1", 384, 1024, 1024, true, 1.f},
      {"UVQK, batch 8", 3072, 4096, 1024, false, 0.f},
      {"output + residual, batch 8", 3072, 1024, 1024, true, 1.f},
      {"UVQK, e2e step (8 x 512 rows)", 4096, 4096, 1024, false, 0.f},
      {"output + residual, e2e step", 4096, 1024, 1024, true, 1.f},
      {"UVQK, no cache, batch 8", 34816, 4096, 1024, false, 0.f},
      {"output + residual, no cache, batch 8", 34816, 1024, 1024, true, 1.f},
  };
  std::printf(
      "\n### cuBLASLt configuration search (row-major C[m, n] = A[m, k] · W[k, n], bf16 in, "
      "fp32 accumulate; weights rotated over > 64 MiB; µs, median of %d samples of 4 "
      "calls)\n\n",
      reps);
  std::printf(
      "| GEMM | m | cublasGemmEx | GemmTuner (heuristic's best) | searched best | its config "
      "| its source | configs timed | max rel. diff vs GemmEx |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  const cudaDataType_t kBf16 = CUDA_R_16BF;
  for (const Shape& sh : shapes) {
    const cudaDataType_t ct = sh.c_f32 ? CUDA_R_32F : CUDA_R_16BF;
    const size_t c_elem = sh.c_f32 ? 4 : 2;
    const int64_t w_elems = sh.k * sh.n;
    const int num_w =
        static_cast<int>(std::max<int64_t>(2, (int64_t{64} << 20) / (w_elems * 2) + 1));
    cuda::DeviceBuffer a, w, c, ref, got;
    HSTU_BENCH_CHECK_CUDA(a.Reserve(sh.m * sh.k * 2));
    HSTU_BENCH_CHECK_CUDA(w.Reserve(num_w * w_elems * 2));
    HSTU_BENCH_CHECK_CUDA(c.Reserve(sh.m * sh.n * c_elem));
    HSTU_BENCH_CHECK_CUDA(ref.Reserve(sh.m * sh.n * c_elem));
    HSTU_BENCH_CHECK_CUDA(got.Reserve(sh.m * sh.n * c_elem));
    FillRandom(a.as<cuda::bf16>(), sh.m * sh.k, 1);
    FillRandom(w.as<cuda::bf16>(), num_w * w_elems, 2);
    HSTU_BENCH_CHECK_CUDA(cudaMemset(c.get(), 0, sh.m * sh.n * c_elem));
    const cuda::bf16* w0 = w.as<cuda::bf16>();
    int rot = 0;
    auto next_w = [&] {
      rot = (rot + 1) % num_w;
      return w0 + rot * w_elems;
    };

    const LtGemmDescs descs(sh.m, sh.n, sh.k, ct);
    cublasLtMatmulDesc_t op = descs.op;
    cublasLtMatrixLayout_t lw = descs.w, la = descs.a, lc = descs.c;
    const float alpha = 1.f;

    std::vector<Candidate> cands;
    std::set<Attrs> seen;
    auto add = [&](const cublasLtMatmulAlgo_t& algo, const char* source) {
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(lt, op, lw, la, lc, lc, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > ws_bytes) {
        return;
      }
      const Attrs at = AttrsOf(algo);
      if (!seen.insert(at).second) return;
      cands.push_back({algo, at, check.workspaceSize, source});
    };
    // 1. The heuristic's answers (what the tuner sees: its first 16).
    cublasLtMatmulPreference_t pref = nullptr;
    HSTU_BENCH_CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    HSTU_BENCH_CHECK_LT(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    constexpr int kWide = 64;
    std::vector<cublasLtMatmulHeuristicResult_t> res(kWide);
    int found = 0;
    HSTU_BENCH_CHECK_LT(
        cublasLtMatmulAlgoGetHeuristic(lt, op, lw, la, lc, lc, pref, kWide, res.data(), &found));
    for (int i = 0; i < found; ++i) {
      if (res[i].state == CUBLAS_STATUS_SUCCESS) add(res[i].algo, "heuristic");
    }
    const size_t heuristic_count = cands.size();
    // 2. The heuristic restricted to each algorithm id; 3. each id's grid.
    int ids[256];
    int num_ids = 0;
    HSTU_BENCH_CHECK_LT(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, kBf16, kBf16,
                                                  ct, ct, 256, ids, &num_ids));
    cublasLtMatmulPreference_t pref_id = nullptr;
    HSTU_BENCH_CHECK_LT(cublasLtMatmulPreferenceCreate(&pref_id));
    HSTU_BENCH_CHECK_LT(cublasLtMatmulPreferenceSetAttribute(
        pref_id, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    const uint32_t by_id = CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID;
    HSTU_BENCH_CHECK_LT(cublasLtMatmulPreferenceSetAttribute(
        pref_id, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &by_id, sizeof(by_id)));
    for (int t = 0; t < num_ids; ++t) {
      cublasLtMatmulAlgo_t base;
      if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, kBf16, kBf16, ct, ct, ids[t],
                                 &base) != CUBLAS_STATUS_SUCCESS) {
        continue;
      }
      for (auto& r : res) r.algo = base;
      int n_id = 0;
      if (cublasLtMatmulAlgoGetHeuristic(lt, op, lw, la, lc, lc, pref_id, kWide, res.data(),
                                         &n_id) == CUBLAS_STATUS_SUCCESS) {
        for (int i = 0; i < n_id; ++i) {
          if (res[i].state == CUBLAS_STATUS_SUCCESS) add(res[i].algo, "heuristic by id");
        }
      }
      std::vector<uint32_t> tiles = CapArray(base, CUBLASLT_ALGO_CAP_TILE_IDS);
      if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
      const bool splitk_ok = CapGet<int32_t>(base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != 0;
      const uint32_t red_mask = CapGet<uint32_t>(base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
      for (const uint32_t tile : tiles) {
        for (const uint32_t splitk : {1u, 2u, 3u, 4u, 6u, 8u}) {
          if (splitk > 1 && !splitk_ok) continue;
          for (const uint32_t red : {0u, 1u, 2u, 4u}) {
            if ((splitk == 1) != (red == 0)) continue;
            if (red != 0 && (red_mask & red) == 0) continue;
            for (const uint16_t cluster : {uint16_t{0}, uint16_t{2}, uint16_t{3}, uint16_t{5}}) {
              cublasLtMatmulAlgo_t algo = base;
              cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                                   sizeof(tile));
              cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                                   sizeof(splitk));
              cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                   &red, sizeof(red));
              cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                                   &cluster, sizeof(cluster));
              add(algo, "grid");
            }
          }
        }
      }
    }
    // The timed call: 4 launches back to back, each on the next weight buffer.
    auto run = [&](const Candidate& cand, void* out) {
      for (int i = 0; i < 4; ++i) {
        HSTU_BENCH_CHECK_LT(cublasLtMatmul(lt, op, &alpha, next_w(), lw, a.get(), la, &sh.beta,
                                            out, lc, out, lc, &cand.algo, ws.get(), ws_bytes,
                                            stream.get()));
      }
    };
    auto time_us = [&](int samples, auto&& fn) {
      return TimeMs(stream.get(), samples, 4, fn) * 1e3f;
    };
    for (auto& cand : cands) cand.us = time_us(3, [&] { run(cand, c.get()); });
    std::sort(cands.begin(), cands.end(),
              [](const Candidate& x, const Candidate& y) { return x.us < y.us; });
    const size_t top = std::min<size_t>(12, cands.size());
    for (size_t i = 0; i < top; ++i) cands[i].us = time_us(reps, [&] { run(cands[i], c.get()); });
    std::sort(cands.begin(), cands.begin() + static_cast<std::ptrdiff_t>(top),
              [](const Candidate& x, const Candidate& y) { return x.us < y.us; });
    const float gemmex_us = time_us(reps, [&] {
      for (int i = 0; i < 4; ++i) {
        HSTU_BENCH_CHECK_LT(cuda::GemmBf16(blas, a.as<cuda::bf16>(), next_w(), c.get(), sh.c_f32,
                                            sh.m, sh.n, sh.k, sh.beta));
      }
    });
    const float tuner_us = time_us(reps, [&] {
      for (int i = 0; i < 4; ++i) {
        HSTU_BENCH_CHECK_LT(tuner.Run(a.as<cuda::bf16>(), next_w(), c.get(), sh.c_f32, sh.m, sh.n,
                                       sh.k, sh.beta, stream.get()));
      }
    });
    // The fastest configs' output against cublasGemmEx's (beta 0, weight buffer 0).
    auto to_host = [&](const cuda::DeviceBuffer& buf) {
      std::vector<float> out(sh.m * sh.n);
      if (sh.c_f32) {
        HSTU_BENCH_CHECK_CUDA(
            cudaMemcpy(out.data(), buf.get(), out.size() * 4, cudaMemcpyDeviceToHost));
      } else {
        std::vector<cuda::bf16> tmp(out.size());
        HSTU_BENCH_CHECK_CUDA(
            cudaMemcpy(tmp.data(), buf.get(), tmp.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < out.size(); ++i) out[i] = __bfloat162float(tmp[i]);
      }
      return out;
    };
    HSTU_BENCH_CHECK_LT(
        cuda::GemmBf16(blas, a.as<cuda::bf16>(), w0, ref.get(), sh.c_f32, sh.m, sh.n, sh.k, 0.f));
    HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
    const std::vector<float> ref_h = to_host(ref);
    double ref_norm = 0;
    for (const float v : ref_h) ref_norm = std::max(ref_norm, std::fabs(static_cast<double>(v)));
    const float zero = 0.f;
    std::vector<double> diffs;
    for (size_t i = 0; i < std::min<size_t>(3, top); ++i) {
      HSTU_BENCH_CHECK_LT(cublasLtMatmul(lt, op, &alpha, w0, lw, a.get(), la, &zero, got.get(), lc,
                                          got.get(), lc, &cands[i].algo, ws.get(), ws_bytes,
                                          stream.get()));
      HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
      const std::vector<float> got_h = to_host(got);
      double d = 0;
      for (size_t e = 0; e < got_h.size(); ++e) {
        d = std::max(d, std::fabs(static_cast<double>(got_h[e]) - ref_h[e]));
      }
      diffs.push_back(d / std::max(ref_norm, 1e-30));
    }
    const Candidate& best = cands.front();
    std::printf("| %s | %lld | %.2f | %.2f | %.2f | %s | %s | %zu (%zu heuristic) | %.1e |\n",
                sh.name, static_cast<long long>(sh.m), gemmex_us, tuner_us, best.us,
                best.attrs.Str().c_str(), best.source, cands.size(), heuristic_count,
                diffs.empty() ? 0.0 : *std::max_element(diffs.begin(), diffs.end()));
    std::printf("|  | runners-up |");
    for (size_t i = 1; i < std::min<size_t>(5, top); ++i) {
      std::printf(" %.2f (%s; %s)%s", cands[i].us, cands[i].attrs.Str().c_str(), cands[i].source,
                  i + 1 < std::min<size_t>(5, top) ? ";" : "");
    }
    std::printf(" | | | | | | |\n");
    std::fflush(stdout);
    nlohmann::json top_json = nlohmann::json::array();
    for (size_t i = 0; i < top; ++i) {
      top_json.push_back({{"us", cands[i].us},
                          {"config", cands[i].attrs.Str()},
                          {"source", cands[i].source},
                          {"workspace", cands[i].workspace}});
    }
    rows.push_back({{"gemm", sh.name},
                    {"m", sh.m},
                    {"n", sh.n},
                    {"k", sh.k},
                    {"gemmex_us", gemmex_us},
                    {"tuner_us", tuner_us},
                    {"configs", cands.size()},
                    {"heuristic_configs", heuristic_count},
                    {"top", top_json}});
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatmulPreferenceDestroy(pref_id);
  }
  return rows;
}

}  // namespace hstu::bench
