// hstu_bench attention_sweep | layer (DESIGN §11, items 3 and 4): the fused paged HSTU attention
// against a materialised baseline (cuBLAS S = Q·Kᵀ into [T, T] per user and head, one element-wise
// SiLU + causal-mask pass, cuBLAS P·V), alone over sequence lengths and inside one whole layer.
// Timing: CUDA events, 3 warm-ups, median of the reps; inputs uniform(-1, 1). Peak memory is the
// device memory each variant holds while it runs (its buffers, measured by cudaMemGetInfo around
// their allocation, plus the inputs they share). A baseline that cannot allocate is reported as OOM.
#include "client/bench_attention_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/bench_util.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/hstu_attention_materialized.h"
#include "kernels/cuda/ops.h"

namespace hstu::bench {
namespace {

using cuda::bf16;
using json = nlohmann::json;





size_t UsedBytes() {
  size_t free_b = 0, total_b = 0;
  HSTU_BENCH_CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}

std::vector<float> DownloadF32(const bf16* d, size_t n) {
  std::vector<bf16> h(n);
  HSTU_BENCH_CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// B users of T new history tokens each (no cache, causal), H heads of dim D. Owns the pages (filled
// from the uvqk rows by LaunchBiasSiluAppendKv, as in the engine, with the rows activated by
// LaunchBiasSilu, so fused and baseline see the same K/V), the plan and the fused kernel's
// workspace.
struct FusedAttention {
  int B = 1, T = 0, H = 0, D = 0, page_size = 64;
  float alpha = 0, inv_norm = 0;
  cuda::DeviceBuffer pool, meta, partials, zero_bias;
  bf16* rows = nullptr;  // p.uvqk, writable: bias + SiLU runs on it in place
  AttentionParams<bf16> p;
  cuda::AttentionPlan plan;
  const cuda::AttentionWorkItem* items = nullptr;
  size_t bytes = 0;  // device memory held by this object

  // uvqk: [B*T, 4*H*D], taken as the UVQK GEMM's output: Build fills the pages from it and
  // applies SiLU (bias 0) to it in place. out: [B*T, H*D].
  void Build(bf16* uvqk, bf16* out, int concurrent_ctas, cudaStream_t s) {
    const size_t before = UsedBytes();
    const int64_t hd = static_cast<int64_t>(H) * D;
    const int pages_per_user = (T + page_size - 1) / page_size;
    const int64_t page_elems = 2LL * page_size * hd;
    HSTU_BENCH_CHECK_CUDA(pool.Reserve(static_cast<size_t>(B) * pages_per_user * page_elems * sizeof(bf16)));
    std::vector<int32_t> row_offsets = {0}, num_new(B, T), num_tokens(B, T), indptr = {0}, page_ids;
    for (int b = 0; b < B; ++b) {
      row_offsets.push_back(row_offsets.back() + T);
      indptr.push_back(indptr.back() + pages_per_user);
    }
    page_ids.resize(static_cast<size_t>(B) * pages_per_user);
    for (size_t i = 0; i < page_ids.size(); ++i) page_ids[i] = static_cast<int32_t>(i);
    std::shuffle(page_ids.begin(), page_ids.end(), std::mt19937(3));
    plan = cuda::PlanHstuAttention(row_offsets.data(), num_new.data(), num_tokens.data(), B, 0, H,
                                   concurrent_ctas);
    std::vector<int32_t> words;
    auto append = [&](const void* src, size_t n_bytes) {
      const size_t at = words.size();
      // insert() rather than resize(): GCC 12 reports a bogus -Wstringop-overflow for the latter.
      words.insert(words.end(), (n_bytes + 3) / 4, 0);
      if (n_bytes > 0) std::memcpy(words.data() + at, src, n_bytes);
      return at;
    };
    const size_t o_ro = append(row_offsets.data(), 4 * row_offsets.size());
    const size_t o_nn = append(num_new.data(), 4 * num_new.size());
    const size_t o_nt = append(num_tokens.data(), 4 * num_tokens.size());
    const size_t o_ip = append(indptr.data(), 4 * indptr.size());
    const size_t o_pg = append(page_ids.data(), 4 * page_ids.size());
    while (words.size() % 4) words.push_back(0);
    const size_t o_it = append(plan.items.data(), sizeof(cuda::AttentionWorkItem) * plan.items.size());
    HSTU_BENCH_CHECK_CUDA(meta.Reserve(words.size() * 4));
    HSTU_BENCH_CHECK_CUDA(cudaMemcpy(meta.get(), words.data(), words.size() * 4, cudaMemcpyHostToDevice));
    const int32_t* m = meta.as<int32_t>();
    if (plan.num_partials > 0) {
      HSTU_BENCH_CHECK_CUDA(partials.Reserve(static_cast<size_t>(plan.num_partials) * H *
                                        cuda::kAttnBlockM * D * 4));
    }
    p.uvqk = uvqk;
    p.uvqk_row_stride = 4 * hd;
    p.out = out;
    p.num_rows = B * T;
    p.row_offsets = m + o_ro;
    p.num_new = m + o_nn;
    p.kv = MakePagedKvView(pool.as<bf16>(), page_size, H, D, B, m + o_ip, m + o_pg, m + o_nt);
    p.alpha = alpha;
    p.inv_norm = inv_norm;
    items = reinterpret_cast<const cuda::AttentionWorkItem*>(m + o_it);
    HSTU_BENCH_CHECK_CUDA(zero_bias.Reserve(4 * hd * sizeof(float)));
    HSTU_BENCH_CHECK_CUDA(cudaMemset(zero_bias.get(), 0, zero_bias.bytes()));
    {
      // The append writes the new rows' K/V to the pages only, so it runs on a copy; the rows are
      // then activated whole (same rounding), for the baseline, which reads K/V from them.
      const size_t row_bytes = static_cast<size_t>(B) * T * 4 * hd * sizeof(bf16);
      cuda::DeviceBuffer copy;
      HSTU_BENCH_CHECK_CUDA(copy.Reserve(row_bytes));
      HSTU_BENCH_CHECK_CUDA(cudaMemcpyAsync(copy.get(), uvqk, row_bytes, cudaMemcpyDeviceToDevice, s));
      rows = copy.as<bf16>();
      BiasSiluAppendKv(zero_bias.as<float>(), s);
      HSTU_BENCH_CHECK_CUDA(cuda::LaunchBiasSilu(uvqk, static_cast<int64_t>(B) * T, 4 * hd,
                                                 zero_bias.as<float>(), s));
      HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(s));
    }
    rows = uvqk;
    bytes = UsedBytes() - before;
  }
  // The engine's step after the UVQK GEMM: rows = SiLU(rows + bias), K/V of every row into the pages.
  void BiasSiluAppendKv(const float* bias, cudaStream_t s) const {
    AppendKvParams<bf16> ap;
    ap.uvqk = rows;
    ap.uvqk_row_stride = p.uvqk_row_stride;
    ap.row_offsets = p.row_offsets;
    ap.num_new = p.num_new;
    ap.kv = p.kv;
    HSTU_BENCH_CHECK_CUDA(cuda::LaunchBiasSiluAppendKv(rows, static_cast<int64_t>(B) * T,
                                                       p.uvqk_row_stride, bias, ap, s));
  }
  void Run(cudaStream_t s) {
    HSTU_BENCH_CHECK_CUDA(cuda::LaunchHstuAttention(
        p, items, static_cast<int32_t>(plan.items.size()), plan.num_split_tiles,
        plan.num_partials > 0 ? partials.as<float>() : nullptr, s));
  }
};

// The baseline's workspace: S for every (user, head) and the cuBLAS pointer arrays. Reserve fails
// (OOM) when the device cannot hold B·H·T² bf16.
struct Materialized {
  cuda::DeviceBuffer s, ptrs;
  bool ready = false;
  size_t bytes = 0;
  bool Build(int B, int T, int H) {
    const size_t before = UsedBytes();
    const size_t s_bytes = static_cast<size_t>(B) * H * T * static_cast<size_t>(T) * sizeof(bf16);
    if (s.Reserve(s_bytes) != cudaSuccess || ptrs.Reserve(6ull * B * H * sizeof(void*)) != cudaSuccess) {
      cudaGetLastError();  // clear the allocation error
      return false;
    }
    bytes = UsedBytes() - before;
    return true;
  }
  void Run(cublasHandle_t h, const bf16* uvqk, bf16* out, int B, int T, int H, int D, float alpha,
           float inv_norm, cudaStream_t stream) {
    if (cuda::MaterializedHstuAttention(h, uvqk, out, s.as<bf16>(),
                                        const_cast<const void**>(reinterpret_cast<void**>(ptrs.get())),
                                        ready, B, T, H, D, alpha, inv_norm,
                                        stream) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "materialised attention: cuBLAS failed\n");
      std::exit(1);
    }
    ready = true;
  }
};

int ConcurrentCtas(int head_dim) {
  cudaDeviceProp prop{};
  HSTU_BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int per_sm = 1;
  HSTU_BENCH_CHECK_CUDA(cuda::HstuAttentionCtasPerSm(head_dim, &per_sm));
  return prop.multiProcessorCount * std::max(per_sm, 1);
}

double CausalPairs(int T) { return 0.5 * static_cast<double>(T) * (T + 1); }

}  // namespace

json BenchAttentionSweep(int reps) {
  json rows = json::array();
  std::printf("\n### attention sweep (one user, T new history tokens, causal; H x D = 1024; "
              "fused paged (page size 64) vs materialised cuBLAS + SiLU/mask + cuBLAS)\n\n");
  std::printf("| T | H x D | fused (us) | fused TFLOP/s | fused peak (MB) | baseline (us) | "
              "baseline TFLOP/s | baseline peak (MB) | speedup | rel L2 fused vs baseline |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  cuda::Stream stream;
  HSTU_BENCH_CHECK_CUDA(stream.Create());
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) std::exit(1);
  cublasSetStream(h, stream.get());
  struct HD { int H, D; };
  for (HD hd : {HD{4, 256}, HD{8, 128}, HD{16, 64}}) {
    for (int T = 128; T <= 32768; T *= 2) {
      const int64_t hdim = static_cast<int64_t>(hd.H) * hd.D;
      const float alpha = 1.f / std::sqrt(static_cast<float>(hd.D)), inv_norm = 1.f / T;
      const size_t before = UsedBytes();
      cuda::DeviceBuffer uvqk, out_f, out_b;
      HSTU_BENCH_CHECK_CUDA(uvqk.Reserve(static_cast<size_t>(T) * 4 * hdim * sizeof(bf16)));
      HSTU_BENCH_CHECK_CUDA(out_f.Reserve(static_cast<size_t>(T) * hdim * sizeof(bf16)));
      HSTU_BENCH_CHECK_CUDA(out_b.Reserve(static_cast<size_t>(T) * hdim * sizeof(bf16)));
      FillRandom(uvqk.as<bf16>(), static_cast<size_t>(T) * 4 * hdim, T + hd.D);
      const size_t io_bytes = UsedBytes() - before;
      const int t_reps = T >= 8192 ? std::max(5, reps / 5) : reps;
      const double flops = CausalPairs(T) * hd.H * 4.0 * hd.D;

      FusedAttention f;
      f.B = 1;
      f.T = T;
      f.H = hd.H;
      f.D = hd.D;
      f.alpha = alpha;
      f.inv_norm = inv_norm;
      f.Build(uvqk.as<bf16>(), out_f.as<bf16>(), ConcurrentCtas(hd.D), stream.get());
      const float f_ms = TimeMs(stream.get(), t_reps, [&] { f.Run(stream.get()); });
      const double f_peak_mb = (io_bytes + f.bytes) / 1048576.0;
      f.pool = cuda::DeviceBuffer();  // free the pages before the baseline allocates

      Materialized m;
      json row = {{"T", T}, {"heads", hd.H}, {"head_dim", hd.D}, {"fused_us", f_ms * 1e3},
                  {"fused_tflops", flops / (f_ms * 1e-3) / 1e12}, {"fused_peak_mb", f_peak_mb}};
      if (!m.Build(1, T, hd.H)) {
        std::printf("| %d | %d x %d | %.1f | %.1f | %.0f | OOM | – | OOM | – | – |\n", T, hd.H, hd.D,
                    f_ms * 1e3, flops / (f_ms * 1e-3) / 1e12, f_peak_mb);
        row["baseline"] = "OOM";
      } else {
        const float b_ms = TimeMs(stream.get(), t_reps, [&] {
          m.Run(h, uvqk.as<bf16>(), out_b.as<bf16>(), 1, T, hd.H, hd.D, alpha, inv_norm, stream.get());
        });
        HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
        const double err = RelL2(DownloadF32(out_f.as<bf16>(), T * hdim),
                                 DownloadF32(out_b.as<bf16>(), T * hdim));
        const double b_peak_mb = (io_bytes + m.bytes) / 1048576.0;
        std::printf("| %d | %d x %d | %.1f | %.1f | %.0f | %.1f | %.1f | %.0f | %.2fx | %.1e |\n", T,
                    hd.H, hd.D, f_ms * 1e3, flops / (f_ms * 1e-3) / 1e12, f_peak_mb, b_ms * 1e3,
                    flops / (b_ms * 1e-3) / 1e12, b_peak_mb, b_ms / f_ms, err);
        row["baseline_us"] = b_ms * 1e3;
        row["baseline_tflops"] = flops / (b_ms * 1e-3) / 1e12;
        row["baseline_peak_mb"] = b_peak_mb;
        row["speedup"] = b_ms / f_ms;
        row["rel_l2_fused_vs_baseline"] = err;
        // The two compute the same attention in bf16 (measured 1.2e-3 to 2.5e-3): a gap past
        // bf16's tolerance means one of them is wrong, and its timing with it.
        constexpr double kAgreementRelL2 = 1e-2;
        if (!(err < kAgreementRelL2)) {
          std::fprintf(stderr, "attention sweep: T %d, %d x %d: the fused kernel and the "
                       "materialised baseline differ by rel L2 %.2e (> %.0e)\n", T, hd.H, hd.D,
                       err, kAgreementRelL2);
          std::exit(1);
        }
      }
      rows.push_back(row);
    }
  }
  cublasDestroy(h);
  return rows;
}

json BenchLayer(int reps) {
  json rows = json::array();
  const int B = 32, d = 1024, H = 4, D = 256;
  const int64_t hd = H * D;
  std::printf("\n### layer (one HSTU layer, batch %d, T new history tokens per user, no cache; "
              "d %d, %d x %d; LayerNorm, UVQK GEMM, bias+SiLU, attention, LayerNorm*u, output "
              "GEMM + residual)\n\n", B, d, H, D);
  std::printf("| T | fused (ms) | fused peak (GB) | unfused (ms) | unfused peak (GB) | speedup | "
              "attention fused (ms) | attention unfused (ms) |\n|---|---|---|---|---|---|---|---|\n");
  cuda::Stream stream;
  HSTU_BENCH_CHECK_CUDA(stream.Create());
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) std::exit(1);
  cublasSetStream(h, stream.get());
  const float alpha = 1.f / std::sqrt(static_cast<float>(D));
  for (int T : {1024, 2048, 4096, 8192}) {
    const int64_t rows_n = static_cast<int64_t>(B) * T;
    const float inv_norm = 1.f / T;
    const size_t before = UsedBytes();
    cuda::DeviceBuffer x, n, uvqk, attn, y, w_uvqk, w_out, vecs;
    HSTU_BENCH_CHECK_CUDA(x.Reserve(rows_n * d * 4));
    HSTU_BENCH_CHECK_CUDA(n.Reserve(rows_n * d * 2));
    HSTU_BENCH_CHECK_CUDA(uvqk.Reserve(rows_n * 4 * hd * 2));
    HSTU_BENCH_CHECK_CUDA(attn.Reserve(rows_n * hd * 2));
    HSTU_BENCH_CHECK_CUDA(y.Reserve(rows_n * hd * 2));
    HSTU_BENCH_CHECK_CUDA(w_uvqk.Reserve(static_cast<size_t>(d) * 4 * hd * 2));
    HSTU_BENCH_CHECK_CUDA(w_out.Reserve(static_cast<size_t>(hd) * d * 2));
    HSTU_BENCH_CHECK_CUDA(vecs.Reserve(4 * 4 * hd * 4));
    FillRandom(n.as<bf16>(), rows_n * d, 1);
    FillRandom(w_uvqk.as<bf16>(), static_cast<size_t>(d) * 4 * hd, 3);
    FillRandom(w_out.as<bf16>(), static_cast<size_t>(hd) * d, 4);
    std::vector<float> v(4 * 4 * hd);
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> u(0.5f, 1.5f);
    for (float& e : v) e = u(rng);
    HSTU_BENCH_CHECK_CUDA(cudaMemcpy(vecs.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    const float* ln_w = vecs.as<float>();
    const float* ln_b = ln_w + 4 * hd;
    const float* bias = ln_b + 4 * hd;
    const float* ln2_w = bias + 4 * hd;
    const float* ln2_b = ln2_w + hd;
    HSTU_BENCH_CHECK_CUDA(cuda::LaunchBf16ToF32(n.as<bf16>(), rows_n * d, x.as<float>(), stream.get()));
    const size_t common_bytes = UsedBytes() - before;

    // LayerNorm and the UVQK GEMM; bias + SiLU follows, fused with the append for the paged
    // attention, alone for the baseline (which has no pages).
    auto pre = [&] {
      HSTU_BENCH_CHECK_CUDA(cuda::LaunchLayerNorm(x.as<float>(), rows_n, d, ln_w, ln_b, 1e-5f, n.as<bf16>(), stream.get()));
      HSTU_BENCH_CHECK_LT(
          cuda::GemmBf16(h, n.as<bf16>(), w_uvqk.as<bf16>(), uvqk.get(), false, rows_n, 4 * hd, d, 0.f));
    };
    auto bias_silu = [&] {
      HSTU_BENCH_CHECK_CUDA(cuda::LaunchBiasSilu(uvqk.as<bf16>(), rows_n, 4 * hd, bias, stream.get()));
    };
    auto post = [&] {
      HSTU_BENCH_CHECK_CUDA(cuda::LaunchNormMulU(attn.as<bf16>(), uvqk.as<bf16>(), 4 * hd, rows_n, hd, ln2_w, ln2_b, 1e-5f, y.as<bf16>(), stream.get()));
      HSTU_BENCH_CHECK_LT(
          cuda::GemmBf16(h, y.as<bf16>(), w_out.as<bf16>(), x.get(), true, rows_n, d, hd, 1.f));
    };
    pre();
    FusedAttention f;
    f.B = B;
    f.T = T;
    f.H = H;
    f.D = D;
    f.alpha = alpha;
    f.inv_norm = inv_norm;
    f.Build(uvqk.as<bf16>(), attn.as<bf16>(), ConcurrentCtas(D), stream.get());
    const int t_reps = std::max(5, reps / 5);
    // The fused layer appends the new K/V rows into their pages, as the engine does.
    const float f_ms = TimeMs(stream.get(), t_reps, [&] { pre(); f.BiasSiluAppendKv(bias, stream.get()); f.Run(stream.get()); post(); });
    const float fa_ms = TimeMs(stream.get(), t_reps, [&] { f.Run(stream.get()); });
    const double f_peak = (common_bytes + f.bytes) / 1e9;
    f.pool = cuda::DeviceBuffer();
    f.partials = cuda::DeviceBuffer();
    json row = {{"T", T}, {"batch", B}, {"fused_ms", f_ms}, {"fused_peak_gb", f_peak},
                {"attention_fused_ms", fa_ms}};
    Materialized m;
    if (!m.Build(B, T, H)) {
      std::printf("| %d | %.3f | %.2f | OOM | OOM | – | %.3f | OOM |\n", T, f_ms, f_peak, fa_ms);
      row["unfused"] = "OOM";
    } else {
      auto attn_b = [&] { m.Run(h, uvqk.as<bf16>(), attn.as<bf16>(), B, T, H, D, alpha, inv_norm, stream.get()); };
      const float b_ms = TimeMs(stream.get(), t_reps, [&] { pre(); bias_silu(); attn_b(); post(); });
      const float ba_ms = TimeMs(stream.get(), t_reps, attn_b);
      const double b_peak = (common_bytes + m.bytes) / 1e9;
      std::printf("| %d | %.3f | %.2f | %.3f | %.2f | %.2fx | %.3f | %.3f |\n", T, f_ms, f_peak, b_ms,
                  b_peak, b_ms / f_ms, fa_ms, ba_ms);
      row["unfused_ms"] = b_ms;
      row["unfused_peak_gb"] = b_peak;
      row["speedup"] = b_ms / f_ms;
      row["attention_unfused_ms"] = ba_ms;
    }
    rows.push_back(row);
  }
  cublasDestroy(h);
  return rows;
}

}  // namespace hstu::bench
