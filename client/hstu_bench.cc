// hstu_bench: GPU benchmarks of DESIGN §11 (eager).
//   hstu_bench attention [--json FILE]   paged HSTU attention alone, base shapes, batch 1 and 8
//   hstu_bench kernels   [--json FILE]   every kernel of one decode-step layer, TFLOP/s and GB/s
//   hstu_bench block     [--json FILE]   the 8-layer stack through the CUDA backend
//                                        (--sustained_ms N: also under N ms of sustained load)
//   hstu_bench block_graphs              the decode step eager vs CUDA-graph replay
//   hstu_bench timeline                  the decode step's kernels as the device ran them (CUPTI)
//   hstu_bench e2e                       Engine::Rank over growing histories: baseline/cache/graphs
//   hstu_bench offload                   host tier onload/offload time and GB/s, onload overlap
// Timing: CUDA events, warm-up first, median of many reps, random (non-zero) inputs; attention
// rotates over several KV sets so that repeated runs do not measure a warm L2.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/bench_attention_layer.h"
#include "client/bench_gemm.h"
#include "client/bench_util.h"
#include "client/cli_util.h"
#include "client/gpu_monitor.h"
#include "client/kernel_timeline.h"
#include "engine/cuda_backend.h"
#include "engine/engine.h"
#include "engine/model_file.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_bias_silu.h"
#include "kernels/cuda/gemm_tuner.h"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/ops.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, json, "", "write the results as JSON to this file");
ABSL_FLAG(int32_t, reps, 50, "timed repetitions (median reported)");
ABSL_FLAG(int32_t, page_size, 32, "tokens per KV page");
ABSL_FLAG(int32_t, window, 0,
          "sliding window (max_attn_len) of the base model in block, block_graphs, timeline, e2e "
          "and offload; 0 = none");
ABSL_FLAG(std::string, batches, "1,8", "batch sizes (users)");
ABSL_FLAG(int32_t, cached, 3968,
          "kernels, timeline, attention_trace: history tokens per user already in the pages, of "
          "4096 (0 = the "
          "no-cache block's layer: 4096 new history rows + 256 candidates per user)");
ABSL_FLAG(bool, no_cache_only, false,
          "block: only the no-cache rows with 256 candidates (pages kept and not, alternated three "
          "times), e.g. to profile or A/B them");
ABSL_FLAG(int32_t, sustained_ms, 0,
          "block, kernels: also run each row's forward (each kernel) back to back for at least "
          "this long and report its time, SM clock and energy under that sustained load; e2e: "
          "warm each mode up with its own sequences for at least this long before timing it, so "
          "that each is timed in the thermal state its own load keeps the GPU in (0 = off)");
ABSL_FLAG(std::string, attn_slots, "0",
          "attention: CTA slots the work plan assumes, a list (0 = the GPU's SMs x CTAs per SM); "
          "smaller values give fewer, longer chunks per tile, to separate a CTA's fixed cost from "
          "its per-block cost");

namespace {

using hstu::cuda::bf16;
using json = nlohmann::json;
using hstu::bench::FillRandom;
using hstu::bench::GpuMonitor;
using hstu::bench::GpuName;
using hstu::bench::Median;
using hstu::bench::TimeMs;


// A comma-separated list of integers >= `min`, or an error naming `flag`.
absl::StatusOr<std::vector<int>> ParseList(const char* flag, const std::string& s, int min) {
  std::vector<int> v;
  for (absl::string_view item : absl::StrSplit(s, ',')) {
    int x = 0;
    if (!absl::SimpleAtoi(item, &x) || x < min) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", s, ": want a comma-separated "
                                                     "list of integers >= ", min));
    }
    v.push_back(x);
  }
  return v;
}

// The decode-step shape of the anchors: per user `cached` history tokens in the pages,
// `num_new` new history rows and `cand` candidates; base model heads (4 × 256).
struct AttnSetup {
  int B = 1, H = 4, D = 256, cached = 3968, num_new = 128, cand = 256, page_size = 32, sets = 0;
  hstu::cuda::DeviceBuffer pool, uvqk, out, meta, partials;
  std::vector<hstu::AttentionParams<bf16>> params;  // one per KV set
  std::vector<const hstu::cuda::AttentionWorkItem*> items;
  hstu::cuda::AttentionPlan plan;
  double flops = 0, min_bytes = 0;
  int rows() const { return B * (num_new + cand); }
};

void BuildAttention(AttnSetup& a, int concurrent_ctas) {
  const int hist = a.cached + a.num_new;
  const int pages_per_user = (hist + a.page_size - 1) / a.page_size;
  const int64_t page_elems = 2LL * a.page_size * a.H * a.D;
  const int64_t kv_bytes_per_set = static_cast<int64_t>(a.B) * pages_per_user * page_elems * 2;
  // Enough sets that they do not fit in L2 together (50–60 MB on H100/H200).
  a.sets = static_cast<int>(std::max<int64_t>(2, (256LL << 20) / std::max<int64_t>(kv_bytes_per_set, 1)));
  a.sets = std::min(a.sets, 16);
  const int64_t num_pages = static_cast<int64_t>(a.sets) * a.B * pages_per_user;
  HSTU_BENCH_CHECK_CUDA(a.pool.Reserve(num_pages * page_elems * sizeof(bf16)));
  FillRandom(a.pool.as<bf16>(), num_pages * page_elems, 7);
  const int64_t hd = static_cast<int64_t>(a.H) * a.D;
  HSTU_BENCH_CHECK_CUDA(a.uvqk.Reserve(static_cast<size_t>(a.rows()) * 4 * hd * sizeof(bf16)));
  FillRandom(a.uvqk.as<bf16>(), static_cast<size_t>(a.rows()) * 4 * hd, 8);
  HSTU_BENCH_CHECK_CUDA(a.out.Reserve(static_cast<size_t>(a.rows()) * hd * sizeof(bf16)));

  std::vector<int32_t> row_offsets = {0}, num_new(a.B, a.num_new), num_tokens(a.B, hist), indptr = {0};
  for (int b = 0; b < a.B; ++b) {
    row_offsets.push_back(row_offsets.back() + a.num_new + a.cand);
    indptr.push_back(indptr.back() + pages_per_user);
  }
  // Cluster plans as the engine makes them (HSTU_ATTN_CLUSTER=0 turns them off, for A/B runs).
  int cluster = 0, max_clusters = 0;
  const char* no_cluster = std::getenv("HSTU_ATTN_CLUSTER");
  if (a.D == 256 && a.page_size % 8 == 0 && (no_cluster == nullptr || std::string(no_cluster) != "0") &&
      hstu::cuda::HstuAttentionMaxClusters(hstu::cuda::kMaxAttnCluster, &max_clusters) == cudaSuccess &&
      max_clusters > 0) {
    cluster = hstu::cuda::kMaxAttnCluster;
  }
  cudaGetLastError();
  a.plan = hstu::cuda::PlanHstuAttention(row_offsets.data(), num_new.data(), num_tokens.data(), a.B,
                                         0, a.H, concurrent_ctas, 64, cluster, max_clusters);
  // Meta: [row_offsets | num_new | num_tokens | indptr | items | page_ids per set].
  std::vector<int32_t> words;
  auto append = [&](const void* p, size_t bytes) {
    const size_t at = words.size();
    words.resize(at + (bytes + 3) / 4);
    std::memcpy(words.data() + at, p, bytes);
    return at;
  };
  const size_t o_ro = append(row_offsets.data(), 4 * row_offsets.size());
  const size_t o_nn = append(num_new.data(), 4 * num_new.size());
  const size_t o_nt = append(num_tokens.data(), 4 * num_tokens.size());
  const size_t o_ip = append(indptr.data(), 4 * indptr.size());
  while (words.size() % 4) words.push_back(0);
  const size_t o_items = append(a.plan.items.data(), sizeof(hstu::cuda::AttentionWorkItem) * a.plan.items.size());
  std::vector<size_t> o_pages;
  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(3));
  for (int s = 0; s < a.sets; ++s) {
    o_pages.push_back(append(perm.data() + static_cast<int64_t>(s) * a.B * pages_per_user,
                             4LL * a.B * pages_per_user));
  }
  HSTU_BENCH_CHECK_CUDA(a.meta.Reserve(words.size() * 4));
  HSTU_BENCH_CHECK_CUDA(cudaMemcpy(a.meta.get(), words.data(), words.size() * 4, cudaMemcpyHostToDevice));
  const int32_t* m = a.meta.as<int32_t>();
  HSTU_BENCH_CHECK_CUDA(a.partials.Reserve(std::max<size_t>(1, static_cast<size_t>(a.plan.num_partials) * a.H *
                                                        hstu::cuda::kAttnBlockM * a.D) * 4));
  for (int s = 0; s < a.sets; ++s) {
    hstu::AttentionParams<bf16> p;
    p.uvqk = a.uvqk.as<bf16>();
    p.uvqk_row_stride = 4 * hd;
    p.out = a.out.as<bf16>();
    p.num_rows = a.rows();
    p.row_offsets = m + o_ro;
    p.num_new = m + o_nn;
    p.kv = hstu::MakePagedKvView(a.pool.as<bf16>(), a.page_size, a.H, a.D, a.B, m + o_ip,
                                 m + o_pages[s], m + o_nt);
    p.alpha = 1.f / std::sqrt(static_cast<float>(a.D));
    p.inv_norm = 1.f / 4352.f;
    a.params.push_back(p);
  }
  a.items.assign(1, reinterpret_cast<const hstu::cuda::AttentionWorkItem*>(m + o_items));
  // FLOPs over allowed pairs (QKᵀ and PV: 4·D per pair and head); bytes: KV once, q/k/v rows, out.
  double pairs = 0;
  for (int i = 0; i < a.num_new; ++i) pairs += a.cached + i + 1;
  pairs += static_cast<double>(a.cand) * (hist + 1);
  a.flops = pairs * a.B * a.H * 4.0 * a.D;
  a.min_bytes = static_cast<double>(a.B) * hist * hd * 2 * 2 + a.rows() * hd * 2 * (3 + 1);
}

void RunAttention(AttnSetup& a, cudaStream_t s) {
  for (int k = 0; k < a.sets; ++k) {
    // As an eager engine step: no reduction kernel without split tiles.
    HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchHstuAttention(
        a.params[k], a.items[0], static_cast<int32_t>(a.plan.items.size()), a.plan.num_split_tiles,
        a.plan.num_split_tiles > 0 ? a.partials.as<float>() : nullptr, s, a.plan.cluster));
  }
}

int ConcurrentCtas(int head_dim) {
  cudaDeviceProp p{};
  HSTU_BENCH_CHECK_CUDA(cudaGetDeviceProperties(&p, 0));
  int per_sm = 1;
  HSTU_BENCH_CHECK_CUDA(hstu::cuda::HstuAttentionCtasPerSm(head_dim, &per_sm));
  return p.multiProcessorCount * std::max(per_sm, 1);
}

json BenchAttention(int reps, int page_size, const std::vector<int>& batches,
                    const std::vector<int>& slot_list) {
  json rows = json::array();
  std::printf("\n### attention (paged HSTU, fused; 3968 cached + 128 new + 256 candidates per user, N = 4352)\n\n");
  std::printf("| batch | H x D | queries x keys | time (us) | TFLOP/s | GB/s (min bytes) | CTAs | chunk (keys) |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  hstu::cuda::Stream stream;
  HSTU_BENCH_CHECK_CUDA(stream.Create());
  struct HD { int H, D; };
  for (HD hd : {HD{4, 256}, HD{8, 128}, HD{16, 64}}) {
    for (int B : batches) {
      for (int slots : slot_list) {
        if (slots > 0 && hd.D != 256) continue;
        AttnSetup a;
        a.B = B;
        a.H = hd.H;
        a.D = hd.D;
        a.page_size = page_size;
        BuildAttention(a, slots > 0 ? slots : ConcurrentCtas(hd.D));
        const float ms = TimeMs(stream.get(), reps, a.sets, [&] { RunAttention(a, stream.get()); });
        const double us = ms * 1e3;
        const double tflops = a.flops / (ms * 1e-3) / 1e12;
        const double gbs = a.min_bytes / (ms * 1e-3) / 1e9;
        const int ctas = static_cast<int>(a.plan.items.size()) * a.H;
        const std::string cta_text =
            a.plan.cluster > 0 ? absl::StrFormat("%d (clusters of %d)", ctas, a.plan.cluster)
                               : std::to_string(ctas);
        std::printf("| %d | %d x %d | %d x %d | %.1f | %.1f | %.0f | %s | %d |\n", B, hd.H, hd.D,
                    a.num_new + a.cand, a.cached + a.num_new, us, tflops, gbs, cta_text.c_str(),
                    a.plan.chunk_blocks * hstu::cuda::kAttnBlockN);
        rows.push_back({{"batch", B}, {"heads", hd.H}, {"head_dim", hd.D}, {"queries", a.num_new + a.cand},
                        {"keys", a.cached + a.num_new}, {"time_us", us}, {"tflops", tflops},
                        {"gbps_min_bytes", gbs}, {"ctas", ctas}, {"cluster", a.plan.cluster},
                        {"kv_sets_rotated", a.sets},
                        {"chunk_keys", a.plan.chunk_blocks * hstu::cuda::kAttnBlockN}});
      }
    }
  }
  return rows;
}

// Where a CTA of the warp-specialised attention kernel spends its time (builds configured with
// -DHSTU_ATTN_TRACE=ON): one launch per configuration is stamped (ReadHstuAttentionTrace) and
// summarised per CTA — waiting for the previous kernel, Q load, first K/V tile, the key loop (per
// 64-key block), the epilogue — with the kernel's span and the event-timed attention (kernel +
// split reduction, back to back as in `attention`). `cached` of 4096 history tokens are in the pages.
json BenchAttentionTrace(int reps, int page_size, const std::vector<int>& batches,
                         const std::vector<int>& slot_list, int cached) {
  json rows = json::array();
  std::vector<uint64_t> trace;
  if (hstu::cuda::ReadHstuAttentionTrace(&trace) == cudaErrorNotSupported) {
    std::fprintf(stderr, "hstu_bench attention_trace: build with -DHSTU_ATTN_TRACE=ON\n");
    std::exit(2);
  }
  hstu::cuda::Stream stream;
  HSTU_BENCH_CHECK_CUDA(stream.Create());
  std::printf("\n### attention timeline per CTA (4 x 256, %d cached + %d new + 256 candidates per user; "
              "us, mean / max over CTAs)\n\n", cached, 4096 - cached);
  std::printf("| batch | slots | CTAs | blocks / CTA | event time | kernel span | PDL wait | Q | first K/V "
              "| loop | per block | epilogue | of it to the cluster sync | CTA total | CTAs' busy share of span |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int B : batches) {
    for (int slots : slot_list) {
      AttnSetup a;
      a.B = B;
      a.cached = cached;
      a.num_new = 4096 - cached;
      a.page_size = page_size;
      BuildAttention(a, slots > 0 ? slots : ConcurrentCtas(256));
      const float ms = TimeMs(stream.get(), reps, a.sets, [&] { RunAttention(a, stream.get()); });
      HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
      HSTU_BENCH_CHECK_CUDA(hstu::cuda::ReadHstuAttentionTrace(&trace));  // zeroes it
      // As RunAttention launches it (a cluster plan's items launched without clusters would
      // write partials past the buffer, which a cluster plan does not size).
      HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchHstuAttention(
          a.params[0], a.items[0], static_cast<int32_t>(a.plan.items.size()), a.plan.num_split_tiles,
          a.partials.as<float>(), stream.get(), a.plan.cluster));
      HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
      HSTU_BENCH_CHECK_CUDA(hstu::cuda::ReadHstuAttentionTrace(&trace));
      const int ctas = std::min<int>(static_cast<int>(a.plan.items.size()) * a.H, hstu::cuda::kAttnTraceCtas);
      auto at = [&](int cta, int f) { return trace[static_cast<size_t>(cta) * hstu::cuda::kAttnTraceFields + f]; };
      uint64_t first = UINT64_MAX, last = 0;
      double sum[6] = {}, mx[6] = {}, blocks = 0, busy = 0, sync_sum = 0, sync_max = 0;
      for (int c = 0; c < ctas; ++c) {
        first = std::min(first, at(c, hstu::cuda::kTraceEntry));
        last = std::max(last, at(c, hstu::cuda::kTraceEnd));
        const double d[6] = {
            1e-3 * (at(c, hstu::cuda::kTraceReady) - at(c, hstu::cuda::kTraceEntry)),
            1e-3 * (at(c, hstu::cuda::kTraceQ) - at(c, hstu::cuda::kTraceReady)),
            1e-3 * (at(c, hstu::cuda::kTraceFirstKv) - at(c, hstu::cuda::kTraceReady)),
            1e-3 * (at(c, hstu::cuda::kTraceLoopEnd) - at(c, hstu::cuda::kTraceFirstKv)),
            1e-3 * (at(c, hstu::cuda::kTraceEnd) - at(c, hstu::cuda::kTraceLoopEnd)),
            1e-3 * (at(c, hstu::cuda::kTraceEnd) - at(c, hstu::cuda::kTraceEntry))};
        for (int k = 0; k < 6; ++k) sum[k] += d[k], mx[k] = std::max(mx[k], d[k]);
        if (at(c, hstu::cuda::kTraceClusterSynced) != 0) {  // cluster plans only
          const double to_sync = 1e-3 * (at(c, hstu::cuda::kTraceClusterSynced) - at(c, hstu::cuda::kTraceLoopEnd));
          sync_sum += to_sync, sync_max = std::max(sync_max, to_sync);
        }
        blocks += static_cast<double>(at(c, hstu::cuda::kTraceSmAndBlocks) >> 32);
        busy += d[5] - d[0];
      }
      const double span = 1e-3 * (last - first);
      const double n = std::max(ctas, 1);
      int sms = 0;
      HSTU_BENCH_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      std::printf("| %d | %d | %d | %.1f | %.1f | %.1f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.1f / %.1f "
                  "| %.3f | %.2f / %.2f | %.2f / %.2f | %.1f / %.1f | %.0f %% |\n",
                  B, slots, ctas, blocks / n, ms * 1e3, span, sum[0] / n, mx[0], sum[1] / n, mx[1],
                  sum[2] / n, mx[2], sum[3] / n, mx[3], sum[3] / std::max(blocks, 1.0), sum[4] / n, mx[4],
                  sync_sum / n, sync_max, sum[5] / n, mx[5], 100.0 * busy / (span * std::min<double>(sms, n)));
      json cta_rows = json::array();
      for (int c = 0; c < ctas && c < 2048; ++c) {
        json r = json::array();
        for (int f = 0; f < hstu::cuda::kAttnTraceFields; ++f) r.push_back(at(c, f));
        cta_rows.push_back(r);
      }
      rows.push_back({{"batch", B}, {"slots", slots}, {"ctas", ctas}, {"event_us", ms * 1e3},
                      {"span_us", span}, {"trace", cta_rows}});
    }
  }
  return rows;
}

// Every kernel of one layer (base model: d 1024, 4 x 256), batch B, of a step with `cached` of
// 4096 history tokens per user in the pages (3968: the decode step; 0: the no-cache block).
// A piece of work under sustained load: `run` enqueues `units` units back to back, waits for
// them and returns their GPU time in ms. The time a unit then takes, the board's energy a unit and
// the clocks meanwhile (NaN energy, no samples, without a monitor or an energy counter).
struct Sustained {
  double ms = NAN, joules = NAN, watts = NAN;
  GpuMonitor::Summary clocks;
};
Sustained MeasureSustained(const GpuMonitor* monitor, double units,
                           const std::function<double()>& run) {
  const std::optional<double> e0 = monitor ? monitor->EnergyJoules() : std::nullopt;
  const auto t0 = GpuMonitor::Clock::now();
  const double total_ms = run();
  const std::optional<double> e1 = monitor ? monitor->EnergyJoules() : std::nullopt;
  Sustained out;
  out.ms = total_ms / units;
  if (monitor != nullptr) out.clocks = monitor->Between(t0, GpuMonitor::Clock::now());
  if (e0 && e1) {
    out.joules = (*e1 - *e0) / units;
    out.watts = (*e1 - *e0) / (total_ms * 1e-3);
  }
  return out;
}

// `fn` (enqueueing `per_call` units on `s`) back to back for at least `span_ms`, given that a unit
// takes about `unit_ms`.
Sustained RunSustained(const GpuMonitor* monitor, cudaStream_t s, int span_ms, double unit_ms,
                       int per_call, const std::function<void()>& fn) {
  const int calls = std::max(1, static_cast<int>(std::ceil(span_ms / (unit_ms * per_call))));
  return MeasureSustained(monitor, static_cast<double>(calls) * per_call, [&] {
    hstu::cuda::Event start, stop;
    HSTU_BENCH_CHECK_CUDA(start.Create());
    HSTU_BENCH_CHECK_CUDA(stop.Create());
    HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(s));
    HSTU_BENCH_CHECK_CUDA(cudaEventRecord(start.get(), s));
    for (int c = 0; c < calls; ++c) fn();
    HSTU_BENCH_CHECK_CUDA(cudaEventRecord(stop.get(), s));
    HSTU_BENCH_CHECK_CUDA(cudaEventSynchronize(stop.get()));
    float total_ms = 0;
    HSTU_BENCH_CHECK_CUDA(cudaEventElapsedTime(&total_ms, start.get(), stop.get()));
    return static_cast<double>(total_ms);
  });
}

json BenchKernels(int reps, int page_size, const std::vector<int>& batches, int cached,
                  const GpuMonitor* monitor) {
  json rows = json::array();
  const int hist = 4096;
  if (cached < 0 || cached >= hist) {
    std::fprintf(stderr, "hstu_bench kernels: --cached must be in [0, %d), got %d\n", hist, cached);
    std::exit(2);
  }
  std::printf("\n### kernels of one layer (d 1024, 4 x 256; %d cached + %d new history tokens + 256 "
              "candidates per user)\n\n", cached, hist - cached);
  const int sustained_ms = monitor != nullptr ? absl::GetFlag(FLAGS_sustained_ms) : 0;
  if (sustained_ms > 0) {
    std::printf("Sustained: each kernel again, back to back for >= %d ms: its time, the board's "
                "mean power and energy a launch (NVML), and the SM clock meanwhile.\n\n",
                sustained_ms);
  }
  std::printf("| batch | kernel | time (us) | TFLOP/s | GB/s |%s\n|---|---|---|---|---|%s\n",
              sustained_ms > 0 ? " sustained (us) | W | mJ | SM MHz |" : "",
              sustained_ms > 0 ? "---|---|---|---|" : "");
  hstu::cuda::Stream stream;
  HSTU_BENCH_CHECK_CUDA(stream.Create());
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) std::exit(1);
  cublasSetStream(h, stream.get());
  // The GEMMs as the engine runs them: the algorithm measured per row class (gemm_tuner.h).
  hstu::cuda::DeviceBuffer gemm_ws;
  HSTU_BENCH_CHECK_CUDA(gemm_ws.Reserve(32u << 20));
  cublasSetWorkspace(h, gemm_ws.get(), gemm_ws.bytes());
  hstu::cuda::GemmTuner gemm;
  if (gemm.Init(h, gemm_ws.get(), gemm_ws.bytes()) != CUBLAS_STATUS_SUCCESS) std::exit(1);
  const int d = 1024, H = 4, D = 256, hd = H * D;
  for (int B : batches) {
    AttnSetup a;
    a.B = B;
    a.H = H;
    a.D = D;
    a.page_size = page_size;
    a.cached = cached;
    a.num_new = hist - cached;
    BuildAttention(a, ConcurrentCtas(D));
    const int64_t T = a.rows();
    hstu::cuda::DeviceBuffer x, n, w_uvqk, w_out, y, ln_w, ln_b, bias, ln2_w, ln2_b;
    HSTU_BENCH_CHECK_CUDA(x.Reserve(T * d * 4));
    HSTU_BENCH_CHECK_CUDA(n.Reserve(T * d * 2));
    HSTU_BENCH_CHECK_CUDA(y.Reserve(T * hd * 2));
    HSTU_BENCH_CHECK_CUDA(w_uvqk.Reserve(static_cast<size_t>(d) * 4 * hd * 2));
    HSTU_BENCH_CHECK_CUDA(w_out.Reserve(static_cast<size_t>(hd) * d * 2));
    FillRandom(n.as<bf16>(), T * d, 1);
    FillRandom(y.as<bf16>(), T * hd, 2);
    FillRandom(w_uvqk.as<bf16>(), static_cast<size_t>(d) * 4 * hd, 3);
    FillRandom(w_out.as<bf16>(), static_cast<size_t>(hd) * d, 4);
    std::vector<float> ones(4 * hd, 0.5f);
    for (auto* buf : {&ln_w, &ln_b, &bias, &ln2_w, &ln2_b}) {
      HSTU_BENCH_CHECK_CUDA(buf->Reserve(4 * hd * 4));
      HSTU_BENCH_CHECK_CUDA(cudaMemcpy(buf->get(), ones.data(), 4 * hd * 4, cudaMemcpyHostToDevice));
    }
    HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchBf16ToF32(n.as<bf16>(), T * d, x.as<float>(), stream.get()));
    hstu::cuda::DeviceBuffer head_w, head_out;  // the base head's first layer, on the candidate rows
    HSTU_BENCH_CHECK_CUDA(head_w.Reserve(static_cast<size_t>(d) * 512 * 4));
    HSTU_BENCH_CHECK_CUDA(head_out.Reserve(static_cast<size_t>(B) * 256 * 512 * 4));
    HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchBf16ToF32(w_out.as<bf16>(), static_cast<int64_t>(d) * 512,
                                                      head_w.as<float>(), stream.get()));
    hstu::AppendKvParams<bf16> ap;
    ap.uvqk = a.uvqk.as<bf16>();
    ap.uvqk_row_stride = 4 * hd;
    ap.row_offsets = a.params[0].row_offsets;
    ap.num_new = a.params[0].num_new;
    ap.kv = a.params[0].kv;
    // Once per forward: the embedding gather with layer 0's LayerNorm fused. One table of 2^17 rows
    // (256 MB, so that the gathered rows come from DRAM) serves items and the 128 actions.
    const int64_t table_rows = int64_t{1} << 17;
    hstu::cuda::DeviceBuffer table, token_meta;
    HSTU_BENCH_CHECK_CUDA(table.Reserve(table_rows * d * 2));
    HSTU_BENCH_CHECK_CUDA(cudaMemset(table.get(), 0x3F, table_rows * d * 2));
    std::vector<int64_t> ids(T);
    std::vector<int32_t> types(T), positions(T, 0);
    std::mt19937 id_rng(11);
    for (int64_t r = 0; r < T; ++r) {
      types[r] = r % 2 ? hstu::kActionToken : hstu::kItemToken;
      ids[r] = r % 2 ? id_rng() % 128 : id_rng() % table_rows;
    }
    HSTU_BENCH_CHECK_CUDA(token_meta.Reserve(T * 16));
    HSTU_BENCH_CHECK_CUDA(cudaMemcpy(token_meta.get(), ids.data(), T * 8, cudaMemcpyHostToDevice));
    HSTU_BENCH_CHECK_CUDA(cudaMemcpy(token_meta.as<uint8_t>() + T * 8, types.data(), T * 4, cudaMemcpyHostToDevice));
    HSTU_BENCH_CHECK_CUDA(cudaMemcpy(token_meta.as<uint8_t>() + T * 12, positions.data(), T * 4, cudaMemcpyHostToDevice));
    hstu::EmbeddingParams<bf16> ep;
    ep.item_table = table.as<bf16>();
    ep.action_table = table.as<bf16>();
    ep.item_rows = table_rows;
    ep.action_rows = 128;
    ep.hidden_dim = d;
    ep.num_rows = static_cast<int32_t>(T);
    ep.token_ids = token_meta.as<int64_t>();
    ep.token_types = reinterpret_cast<const int32_t*>(token_meta.as<uint8_t>() + T * 8);
    ep.positions = reinterpret_cast<const int32_t*>(token_meta.as<uint8_t>() + T * 12);
    // Bytes: what each kernel must move at least (weights and bias vectors are L2-resident and
    // left out). The fused bias + SiLU + append reads every uvqk row once and writes it once: in
    // place, except the new history rows' K and V, which go to their pages instead.
    struct K { const char* name; double flops, bytes; std::function<void()> fn; int per_call; bool in_layer; };
    std::vector<K> ks = {
        {"LayerNorm (fp32 -> bf16)", 0, T * d * 6.0, [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchLayerNorm(x.as<float>(), T, d, ln_w.as<float>(), ln_b.as<float>(), 1e-5f, n.as<bf16>(), stream.get())); }, 1, true},
        {"UVQK GEMM (cuBLAS)", 2.0 * T * d * 4 * hd, (T * d + d * 4.0 * hd + T * 4.0 * hd) * 2, [&] { gemm.Run(n.as<bf16>(), w_uvqk.as<bf16>(), a.uvqk.get(), false, T, 4 * hd, d, 0.f, stream.get()); }, 1, true},
        {"bias + SiLU + append K/V", 0, T * 4.0 * hd * 4, [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchBiasSiluAppendKv(a.uvqk.as<bf16>(), T, 4 * hd, bias.as<float>(), ap, stream.get())); }, 1, true},
        {"paged attention", a.flops, a.min_bytes, [&] { RunAttention(a, stream.get()); }, a.sets, true},
        {"LayerNorm * u", 0, T * hd * 2.0 * 3, [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchNormMulU(a.out.as<bf16>(), a.uvqk.as<bf16>(), 4 * hd, T, hd, ln2_w.as<float>(), ln2_b.as<float>(), 1e-5f, y.as<bf16>(), stream.get())); }, 1, true},
        {"output GEMM + residual (cuBLAS)", 2.0 * T * hd * d, T * hd * 2.0 + hd * d * 2.0 + T * d * 8.0, [&] { gemm.Run(y.as<bf16>(), w_out.as<bf16>(), x.get(), true, T, d, hd, 1.f, stream.get()); }, 1, true},
        {"UVQK GEMM + bias + SiLU, CUTLASS fused, 128x256 cooperative (alternative route, not in the sum)", 2.0 * T * d * 4 * hd, (T * d + d * 4.0 * hd + T * 4.0 * hd) * 2, [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchGemmBiasSilu(n.as<bf16>(), w_uvqk.as<bf16>(), bias.as<float>(), a.uvqk.as<bf16>(), T, 4 * hd, d, 0, stream.get())); }, 1, false},
        {"UVQK GEMM + bias + SiLU, CUTLASS fused, 128x128 ping-pong (alternative route, not in the sum)", 2.0 * T * d * 4 * hd, (T * d + d * 4.0 * hd + T * 4.0 * hd) * 2, [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchGemmBiasSilu(n.as<bf16>(), w_uvqk.as<bf16>(), bias.as<float>(), a.uvqk.as<bf16>(), T, 4 * hd, d, 1, stream.get())); }, 1, false},
        {"append K/V from the rows (with the fused GEMM; not in the sum)", 0, static_cast<double>(a.B) * a.num_new * hd * 2.0 * 4, [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchAppendKvFromRows(T, ap, stream.get())); }, 1, false},
        {"head layer 1, 1024 -> 512 fp32 (once per forward, candidate rows, not in the sum)", 2.0 * B * 256 * d * 512, B * 256.0 * (d + 512) * 4, [&] { if (hstu::cuda::GemmF32(h, x.as<float>(), head_w.as<float>(), head_out.as<float>(), B * 256, 512, d, 0.f, false) != CUBLAS_STATUS_SUCCESS) std::exit(1); }, 1, false},
        {"head layer 1, 1024 -> 512 TF32 (once per forward, candidate rows, not in the sum)", 2.0 * B * 256 * d * 512, B * 256.0 * (d + 512) * 4, [&] { if (hstu::cuda::GemmF32(h, x.as<float>(), head_w.as<float>(), head_out.as<float>(), B * 256, 512, d, 0.f, true) != CUBLAS_STATUS_SUCCESS) std::exit(1); }, 1, false},
        {"embedding gather + LayerNorm (once per forward, not in the sum)", 0, T * (d * 8.0 + 12), [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchEmbeddingGather(ep, x.as<float>(), ln_w.as<float>(), ln_b.as<float>(), 1e-5f, n.as<bf16>(), stream.get())); }, 1, false},
        {"embedding gather alone (unfused, for comparison; not in the sum)", 0, T * (d * 6.0 + 12), [&] { HSTU_BENCH_CHECK_CUDA(hstu::cuda::LaunchEmbeddingGather(ep, x.as<float>(), nullptr, nullptr, 1e-5f, nullptr, stream.get())); }, 1, false},
    };
    double total_us = 0;
    const bool fused_ok = hstu::cuda::GemmBiasSiluAvailable();
    double unfused_us = 0, fused_us[2] = {0, 0}, append_us = 0;  // the two routes of the UVQK step
    for (K& k : ks) {
      const std::string name = k.name;
      if (name.find("CUTLASS") != std::string::npos && !fused_ok) continue;
      const float ms = TimeMs(stream.get(), reps, k.per_call, k.fn);
      const double us = ms * 1e3;
      if (k.in_layer) total_us += us;
      if (name.rfind("UVQK GEMM (cuBLAS)", 0) == 0 || name.rfind("bias + SiLU", 0) == 0) unfused_us += us;
      if (name.find("128x256 cooperative") != std::string::npos) fused_us[0] = us;
      if (name.find("128x128 ping-pong") != std::string::npos) fused_us[1] = us;
      if (name.rfind("append K/V from the rows", 0) == 0) append_us = us;
      json row = {{"batch", B}, {"kernel", k.name}, {"time_us", us},
                  {"tflops", k.flops / (ms * 1e-3) / 1e12}, {"gbps", k.bytes / (ms * 1e-3) / 1e9}};
      std::string sustained;
      if (sustained_ms > 0) {
        const Sustained su =
            RunSustained(monitor, stream.get(), sustained_ms, ms, k.per_call, k.fn);
        sustained = absl::StrFormat(" %.1f | %.0f | %.3f | %.0f |", su.ms * 1e3, su.watts,
                                    su.joules * 1e3, su.clocks.sm_mhz_median);
        row["sustained"] = {{"time_us", su.ms * 1e3}, {"watts", su.watts},
                            {"joules", std::isnan(su.joules) ? json(nullptr) : json(su.joules)},
                            {"sm_mhz_median", su.clocks.sm_mhz_median}};
      }
      std::printf("| %d | %s | %.1f | %s | %.0f |%s\n", B, k.name, us,
                  k.flops > 0 ? absl::StrFormat("%.1f", k.flops / (ms * 1e-3) / 1e12).c_str() : "-",
                  k.bytes / (ms * 1e-3) / 1e9, sustained.c_str());
      rows.push_back(std::move(row));
    }
    std::printf("| %d | **sum of one layer** | %.1f | | |\n", B, total_us);
    if (fused_ok) {
      const double fused = std::min(fused_us[0], fused_us[1]) + append_us;
      std::printf("| %d | **sum of one layer, fused UVQK route** (best CUTLASS config + append; cuBLAS + pass: %.1f) | %.1f | | |\n",
                  B, unfused_us, total_us - unfused_us + fused);
      rows.push_back({{"batch", B}, {"kernel", "sum of one layer, fused UVQK route"}, {"time_us", total_us - unfused_us + fused}});
    }
  }
  cublasDestroy(h);
  return rows;
}

json ClocksJson(const GpuMonitor::Summary& c) {
  return {{"samples", c.samples},
          {"sm_mhz_median", c.sm_mhz_median},
          {"sm_mhz_min", c.sm_mhz_min},
          {"power_w_median", c.power_w_median},
          {"power_w_max", c.power_w_max},
          {"power_capped_share", c.power_capped_share},
          {"thermal_share", c.thermal_share}};
}

json BenchBlock(int reps, int page_size, const std::vector<int>& batches,
                const GpuMonitor* monitor) {
  json rows = json::array();
  auto config = hstu::PresetConfig("base");
  if (!config.ok()) std::exit(1);
  config->max_attn_len = absl::GetFlag(FLAGS_window);
  config->item_rows = 100000;  // the table size does not change the block's time; keeps start-up short
  const hstu::ModelWeights weights = hstu::RandomModel(*config, 1);
  const int hist = 4096;
  const int max_b = *std::max_element(batches.begin(), batches.end());
  const int pages_per_user = (hist + page_size - 1) / page_size;
  auto backend = hstu::CreateCudaBackendExt(weights, page_size, static_cast<int64_t>(max_b) * pages_per_user, 0);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", std::string(backend.status().message()).c_str());
    std::exit(1);
  }
  hstu::CudaBackend& be = **backend;
  std::printf("\n### block (8 layers, eager; embedding gather included, head excluded; history 4096 tokens per user)\n\n");
  std::printf("Attention: %s.\n\n", be.attention_kernel().c_str());
  const int sustained_ms = absl::GetFlag(FLAGS_sustained_ms);
  if (sustained_ms > 0) {
    std::printf("Sustained: each row's forward again, back to back for >= %d ms; its time a "
                "forward, the SM clock meanwhile and the board's energy a forward (NVML).\n\n",
                sustained_ms);
  }
  std::printf("| batch | cached | new | candidates | time (ms) | speedup vs 0 cached | attention / layer (us) | SM MHz |%s\n"
              "|---|---|---|---|---|---|---|---|%s\n",
              sustained_ms > 0 ? " sustained (ms) | sustained SM MHz | J / forward |" : "",
              sustained_ms > 0 ? "---|---|---|" : "");
  std::mt19937 rng(5);
  const bool no_cache_only = absl::GetFlag(FLAGS_no_cache_only);
  for (int B : batches) {
    for (int cand : {0, 256}) {
      if (no_cache_only && cand == 0) continue;
      double base_ms = 0;
      // cached 0 twice: the pages kept (a miss with the cache on), then not (the cache off).
      std::vector<std::pair<int, bool>> runs = {{0, true},    {0, false},   {2048, true},
                                                {3072, true}, {3584, true}, {3840, true},
                                                {3968, true}};
      // Profiling or A/B timing: the two no-cache runs only, three times alternated.
      if (no_cache_only) runs = {{0, true}, {0, false}, {0, true}, {0, false}, {0, true}, {0, false}};
      for (const auto& [cached, keep] : runs) {
        hstu::ForwardBatch fb;
        fb.num_users = B;
        fb.keep_kv = keep;
        fb.row_offsets = {0};
        fb.page_indptr = {0};
        for (int b = 0; b < B; ++b) {
          const int nnew = hist - cached;
          for (int t = cached; t < hist; ++t) {
            fb.token_ids.push_back(t % 2 ? rng() % 128 : rng() % 100000);
            fb.token_types.push_back(t % 2 ? hstu::kActionToken : hstu::kItemToken);
            fb.positions.push_back(t);
          }
          for (int c = 0; c < cand; ++c) {
            fb.token_ids.push_back(rng() % 100000);
            fb.token_types.push_back(hstu::kItemToken);
            fb.positions.push_back(hist);
          }
          fb.num_new.push_back(nnew);
          fb.num_tokens.push_back(hist);
          fb.row_offsets.push_back(fb.row_offsets.back() + nnew + cand);
          for (int p = 0; p < pages_per_user; ++p) fb.page_ids.push_back(b * pages_per_user + p);
          fb.page_indptr.push_back(static_cast<int32_t>(fb.page_ids.size()));
        }
        auto st = be.Stage(fb);
        if (!st.ok()) { std::fprintf(stderr, "%s\n", st.ToString().c_str()); std::exit(1); }
        const auto c0 = GpuMonitor::Clock::now();
        auto t = be.Time([&] { return be.EnqueueLayerStack(); }, 2, std::max(5, reps / 5));
        if (!t.ok()) { std::fprintf(stderr, "%s\n", t.status().ToString().c_str()); std::exit(1); }
        const GpuMonitor::Summary clocks = monitor != nullptr
                                               ? monitor->Between(c0, GpuMonitor::Clock::now())
                                               : GpuMonitor::Summary();
        auto ta = be.Time([&] { return be.EnqueueAttention(0); }, 2, reps);
        if (!ta.ok()) { std::fprintf(stderr, "%s\n", ta.status().ToString().c_str()); std::exit(1); }
        const double ms = Median(*t), att_us = Median(*ta) * 1e3;
        if (cached == 0 && keep) base_ms = ms;
        json row = {{"batch", B}, {"cached", cached}, {"pages_kept", keep},
                    {"new", hist - cached}, {"candidates", cand},
                    {"time_ms", ms}, {"speedup_vs_uncached", base_ms / ms},
                    {"attention_layer0_us", att_us}, {"attention_ctas", be.attention_items() * 4},
                    {"clocks", ClocksJson(clocks)}};
        std::string sustained;
        if (sustained_ms > 0) {
          // Forwards back to back for the span asked for: the time a forward takes, and the
          // energy it draws, once the power cap has settled the clock.
          const int forwards = std::max(1, static_cast<int>(std::ceil(sustained_ms / ms)));
          const Sustained su = MeasureSustained(monitor, forwards, [&] {
            auto ts = be.Time(
                [&]() -> absl::Status {
                  for (int f = 0; f < forwards; ++f) {
                    if (absl::Status st = be.EnqueueLayerStack(); !st.ok()) return st;
                  }
                  return absl::OkStatus();
                },
                0, 1);
            if (!ts.ok()) {
              std::fprintf(stderr, "%s\n", ts.status().ToString().c_str());
              std::exit(1);
            }
            return static_cast<double>((*ts)[0]);
          });
          sustained = absl::StrFormat(
              " %.3f | %.0f | %s |", su.ms, su.clocks.sm_mhz_median,
              std::isnan(su.joules) ? "-" : absl::StrFormat("%.2f", su.joules));
          row["sustained"] = {{"forwards", forwards}, {"time_ms", su.ms},
                              {"joules_per_forward",
                               std::isnan(su.joules) ? json(nullptr) : json(su.joules)},
                              {"clocks", ClocksJson(su.clocks)}};
        }
        std::printf("| %d | %d%s | %d | %d | %.3f | %.2fx | %.1f | %s |%s\n", B, cached,
                    keep ? "" : " (pages not kept)", hist - cached, cand, ms, base_ms / ms, att_us,
                    clocks.samples > 0 ? absl::StrFormat("%.0f", clocks.sm_mhz_median).c_str() : "-",
                    sustained.c_str());
        rows.push_back(std::move(row));
      }
    }
  }
  return rows;
}

// ---- Decode step with CUDA graphs, e2e through the Engine, host-tier transfers (issue 5) ----

// What a mode runs (the model, or the part of it), and whether --page_size and --window reach it:
// stated with every run's results (DESIGN §11).
struct ModeModel {
  std::string model;
  bool takes_page_size = true;
  bool takes_window = false;
};
ModeModel ModelOf(const std::string& mode) {
  if (mode == "attention_sweep") {
    return {"one attention layer, H x D = 1024 (4 x 256, 8 x 128, 16 x 64), page size 64", false,
            false};
  }
  if (mode == "layer") return {"one HSTU layer (d 1024, 4 x 256), batch 32, no cache", false, false};
  if (mode == "gemm_algos" || mode == "gemm_search") {
    return {"the layer GEMMs of hstu-base (d 1024, 4 x 256)", false, false};
  }
  const bool whole_model = mode == "block" || mode == "block_graphs" || mode == "timeline" ||
                           mode == "e2e" || mode == "offload";
  return {"hstu-base (8 layers, d 1024, 4 x 256, N 4352)", true, whole_model};
}

hstu::ModelWeights BaseWeights() {
  auto config = hstu::PresetConfig("base");
  if (!config.ok()) std::exit(1);
  config->max_attn_len = absl::GetFlag(FLAGS_window);
  config->item_rows = 100000;  // the table size does not change the step's time; keeps start-up short
  return hstu::RandomModel(*config, 1);
}

template <typename T>
T OrDie(absl::StatusOr<T> v) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s\n", v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}
void OrDie(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(1);
  }
}

double WallMs(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double MedianD(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// B users with `hist` history tokens of which the first `cached` are in their pages (user b owns
// pages [b·ppu, (b+1)·ppu)), plus `cand` candidates each.
hstu::ForwardBatch DecodeBatch(int B, int hist, int cached, int cand, int pages_per_user,
                               std::mt19937* rng) {
  hstu::ForwardBatch fb;
  fb.num_users = B;
  fb.row_offsets = {0};
  fb.page_indptr = {0};
  for (int b = 0; b < B; ++b) {
    for (int t = cached; t < hist; ++t) {
      fb.token_ids.push_back(t % 2 ? (*rng)() % 128 : (*rng)() % 100000);
      fb.token_types.push_back(t % 2 ? hstu::kActionToken : hstu::kItemToken);
      fb.positions.push_back(t);
    }
    for (int c = 0; c < cand; ++c) {
      fb.token_ids.push_back((*rng)() % 100000);
      fb.token_types.push_back(hstu::kItemToken);
      fb.positions.push_back(hist);
    }
    fb.num_new.push_back(hist - cached);
    fb.num_tokens.push_back(hist);
    fb.row_offsets.push_back(fb.row_offsets.back() + hist - cached + cand);
    for (int p = 0; p < pages_per_user; ++p) fb.page_ids.push_back(b * pages_per_user + p);
    fb.page_indptr.push_back(static_cast<int32_t>(fb.page_ids.size()));
  }
  return fb;
}

// The decode step (gather → 8 layers → head) of 3968 cached + 128 new tokens + 256 candidates,
// eager vs replayed from a CUDA graph; GPU time between CUDA events, and the wall time of a whole
// Forward (staging, metadata upload, step, score read-back).
json BenchStepGraphs(int reps, int page_size, const std::vector<int>& batches) {
  json rows = json::array();
  const hstu::ModelWeights weights = BaseWeights();
  const int hist = 4096, cached = 3968, cand = 256;
  const int max_b = *std::max_element(batches.begin(), batches.end());
  const int ppu = (hist + page_size - 1) / page_size;
  hstu::GraphOptions go;
  go.enable = true;  // default buckets
  std::unique_ptr<hstu::CudaBackend> be_ptr;
  const double create_ms = WallMs([&] {
    be_ptr = OrDie(hstu::CreateCudaBackendExt(weights, page_size, int64_t{max_b} * ppu, 0, go));
  });
  const double create_eager_ms = WallMs([&] {
    OrDie(hstu::CreateCudaBackendExt(weights, page_size, int64_t{max_b} * ppu, 0).status());
  });
  hstu::CudaBackend& be = *be_ptr;
  std::printf("\n### decode step with CUDA graphs (3968 cached + 128 new + 256 candidates per user; "
              "gather, 8 layers and head; default buckets, %d graphs)\n\n", be.num_graphs());
  std::printf("| batch | rows | eager GPU (ms) | graph GPU (ms) | speedup | eager Forward wall (ms) | "
              "graph Forward wall (ms) | eager / graph GPU a step, 10 back to back (ms) | "
              "host: stage / enqueue / wait, eager (ms) | the same, graph (ms) |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(11);
  hstu::ForwardOutput out;
  // Prefix: every user's first 3968 tokens computed once (untimed), so the pages hold real K/V.
  OrDie(be.Forward(DecodeBatch(max_b, cached, 0, 0, ppu, &rng), false, &out));
  for (int B : batches) {
    const hstu::ForwardBatch fb = DecodeBatch(B, hist, cached, cand, ppu, &rng);
    double gpu_ms[2], wall_ms[2], b2b_ms[2];
    std::string phases[2];
    for (int graph = 0; graph < 2; ++graph) {
      const bool staged_graph = OrDie(be.StageStep(fb, graph == 1));
      if (graph == 1 && !staged_graph) std::fprintf(stderr, "batch %d fits no graph bucket\n", B);
      const auto t = OrDie(be.Time([&] { return be.EnqueueStep(); }, 5, reps));
      gpu_ms[graph] = Median(t);
      // The same step enqueued kBackToBack times between two events: the host runs ahead, so a
      // step's launch latency (the time from the stream being ready to its first kernel) and any
      // host-bound gap are hidden; the difference to the single step is what they cost.
      constexpr int kBackToBack = 10;
      const auto t_b2b = OrDie(be.Time(
          [&] {
            for (int i = 0; i < kBackToBack; ++i) {
              if (absl::Status st = be.EnqueueStep(); !st.ok()) return st;
            }
            return absl::OkStatus();
          },
          1, std::max(3, reps / 10)));
      b2b_ms[graph] = Median(t_b2b) / kBackToBack;
      // Forward's wall time (staging, metadata upload, step, score read-back) with graph replay
      // on or off (off: Forward runs the step eagerly on the bucket's padded buffers); then the
      // host's phases of the step above done by hand: staging, enqueueing, the wait.
      be.SetGraphReplay(graph == 1);
      std::vector<double> wall, stage, enqueue, wait;
      for (int i = 0; i < reps; ++i) {
        wall.push_back(WallMs([&] { OrDie(be.Forward(fb, false, &out)); }));
        stage.push_back(WallMs([&] { OrDie(be.StageStep(fb, graph == 1).status()); }));
        enqueue.push_back(WallMs([&] { OrDie(be.EnqueueStep()); }));
        wait.push_back(WallMs([&] {  // an empty timed call: returns once the stream is done
          OrDie(be.Time([] { return absl::OkStatus(); }, 0, 1).status());
        }));
      }
      be.SetGraphReplay(true);
      phases[graph] = absl::StrFormat("%.3f / %.3f / %.3f", MedianD(stage), MedianD(enqueue),
                                      MedianD(wait));
      wall_ms[graph] = MedianD(wall);
    }
    std::printf("| %d | %d | %.3f | %.3f | %.2fx | %.3f | %.3f | %.3f / %.3f | %s | %s |\n", B,
                fb.num_rows(), gpu_ms[0], gpu_ms[1], gpu_ms[0] / gpu_ms[1], wall_ms[0], wall_ms[1],
                b2b_ms[0], b2b_ms[1], phases[0].c_str(), phases[1].c_str());
    rows.push_back({{"batch", B}, {"rows", fb.num_rows()}, {"eager_gpu_ms", gpu_ms[0]},
                    {"graph_gpu_ms", gpu_ms[1]}, {"eager_wall_ms", wall_ms[0]},
                    {"graph_wall_ms", wall_ms[1]}, {"eager_back_to_back_ms", b2b_ms[0]},
                    {"graph_back_to_back_ms", b2b_ms[1]}});
  }
  std::printf("\ngraph replays %llu, fallbacks %llu; backend creation %.0f ms with %d graphs "
              "(warm-up + capture), %.0f ms without\n",
              static_cast<unsigned long long>(be.graph_replays()),
              static_cast<unsigned long long>(be.graph_fallbacks()), create_ms, be.num_graphs(),
              create_eager_ms);
  std::printf("captured graphs: %s\n", be.graph_summary().c_str());
  std::printf("UVQK GEMM route per row class: %s\n", be.gemm_routes().c_str());
  rows.push_back({{"backend_create_ms", create_ms}, {"backend_create_no_graphs_ms", create_eager_ms},
                  {"graphs", be.num_graphs()}, {"graph_summary", be.graph_summary()}});
  return rows;
}

// The decode step's kernels as the device ran them (CUPTI, not serialised): per (batch, eager or
// graph) the span from the first kernel's start to the last one's end, the time some kernel ran,
// the idle gaps between kernels and the programmatic-launch overlap; then each kernel's share and
// the gap before it, summed per kernel name, and layer 0's sequence kernel by kernel. Medians
// over `reps` steps, each run alone (the stream synchronised between steps).
json BenchStepTimeline(int reps, int page_size, const std::vector<int>& batches, int cached) {
  json rows = json::array();
  hstu::bench::KernelTimeline timeline;  // before the backend: its warm-ups are recorded too
  const hstu::ModelWeights weights = BaseWeights();
  const int hist = 4096, cand = 256;
  const int max_b = *std::max_element(batches.begin(), batches.end());
  const int ppu = (hist + page_size - 1) / page_size;
  hstu::GraphOptions go;
  go.enable = true;
  auto be_ptr = OrDie(hstu::CreateCudaBackendExt(weights, page_size, int64_t{max_b} * ppu, 0, go));
  hstu::CudaBackend& be = *be_ptr;
  std::mt19937 rng(11);
  hstu::ForwardOutput out;
  if (cached > 0) OrDie(be.Forward(DecodeBatch(max_b, cached, 0, 0, ppu, &rng), false, &out));
  std::printf("\n### step timeline (CUPTI kernel records; %d cached + %d new + 256 candidates per "
              "user; median of %d steps)\n\n", cached, hist - cached, reps);
  for (int B : batches) {
    hstu::ForwardBatch fb = DecodeBatch(B, hist, cached, cand, ppu, &rng);
    fb.keep_kv = cached > 0;  // as the engine with its cache off: nothing reads the pages after
    for (int graph = 0; graph < 2; ++graph) {
      const char* mode = graph ? "graph" : "eager";
      if (OrDie(be.StageStep(fb, graph == 1)) != (graph == 1)) {
        std::fprintf(stderr, "batch %d fits no graph bucket\n", B);
        continue;
      }
      OrDie(be.Time([&] { return be.EnqueueStep(); }, 5, 1).status());
      std::vector<std::vector<hstu::bench::KernelSpan>> steps;
      std::vector<double> event_ms;
      for (int r = 0; r < reps; ++r) {
        timeline.Clear();
        event_ms.push_back(OrDie(be.Time([&] { return be.EnqueueStep(); }, 0, 1))[0]);
        steps.push_back(timeline.Take());
      }
      // Per step: span, busy (union of the kernels' intervals), gaps, overlap; per position in the
      // step (the same kernel sequence every step): duration and the gap before it.
      const size_t n = steps[0].size();
      bool same = n > 0;
      for (const auto& s : steps) same = same && s.size() == n;
      if (!same) {
        std::fprintf(stderr, "batch %d %s: the steps ran different kernel counts\n", B, mode);
        continue;
      }
      std::vector<double> span, busy, gaps, overlap;
      std::vector<std::vector<double>> dur(n), gap(n);
      for (const auto& s : steps) {
        uint64_t reach = s[0].start_ns, busy_ns = 0, gap_ns = 0, sum_ns = 0;
        for (size_t i = 0; i < n; ++i) {
          const int64_t g = static_cast<int64_t>(s[i].start_ns) - static_cast<int64_t>(reach);
          if (i > 0) gap[i].push_back(g * 1e-3);
          dur[i].push_back((s[i].end_ns - s[i].start_ns) * 1e-3);
          if (g > 0) gap_ns += g;
          const uint64_t from = std::max(reach, s[i].start_ns);
          if (s[i].end_ns > from) busy_ns += s[i].end_ns - from;
          reach = std::max(reach, s[i].end_ns);
          sum_ns += s[i].end_ns - s[i].start_ns;
        }
        span.push_back((reach - s[0].start_ns) * 1e-3);
        busy.push_back(busy_ns * 1e-3);
        gaps.push_back(gap_ns * 1e-3);
        overlap.push_back((static_cast<double>(sum_ns) - busy_ns) * 1e-3);
      }
      std::printf("#### batch %d, %s: %zu kernels; span %.1f us (CUDA events %.1f us), a kernel "
                  "running %.1f us, idle gaps %.1f us, programmatic overlap %.1f us\n\n",
                  B, mode, n, MedianD(span), 1e3 * MedianD(event_ms), MedianD(busy),
                  MedianD(gaps), MedianD(overlap));
      // Per kernel name, in order of first appearance.
      std::vector<std::string> names;
      std::vector<double> tot_dur, tot_gap, tot_neg;
      std::vector<int> count;
      for (size_t i = 0; i < n; ++i) {
        const std::string nm = hstu::bench::ShortKernelName(steps[0][i].name);
        size_t k = std::find(names.begin(), names.end(), nm) - names.begin();
        if (k == names.size()) {
          names.push_back(nm);
          tot_dur.push_back(0), tot_gap.push_back(0), tot_neg.push_back(0), count.push_back(0);
        }
        ++count[k];
        tot_dur[k] += MedianD(dur[i]);
        const double g = i > 0 ? MedianD(gap[i]) : 0;
        (g > 0 ? tot_gap[k] : tot_neg[k]) += g;
      }
      std::printf("| kernel | per step | us a step | us each | idle before it, us a step | "
                  "overlapped with the one before, us a step |\n|---|---|---|---|---|---|\n");
      json kinds = json::array();
      for (size_t k = 0; k < names.size(); ++k) {
        std::printf("| %s | %d | %.1f | %.2f | %.1f | %.1f |\n", names[k].c_str(), count[k],
                    tot_dur[k], tot_dur[k] / count[k], tot_gap[k], -tot_neg[k]);
        kinds.push_back({{"kernel", names[k]}, {"count", count[k]}, {"us", tot_dur[k]},
                         {"idle_before_us", tot_gap[k]}, {"overlap_us", -tot_neg[k]}});
      }
      // The step's first 16 kernels (the gather, layer 0 and the start of layer 1), one by one.
      std::printf("\n| # | kernel | grid | start (us) | us | gap before (us) |\n|---|---|---|---|---|---|\n");
      const size_t show = std::min<size_t>(n, 16);
      for (size_t i = 0; i < show; ++i) {
        std::printf("| %zu | %s | %d | %.1f | %.2f | %.2f |\n", i,
                    hstu::bench::ShortKernelName(steps[0][i].name).c_str(), steps[0][i].grid,
                    (steps[0][i].start_ns - steps[0][0].start_ns) * 1e-3, MedianD(dur[i]),
                    i > 0 ? MedianD(gap[i]) : 0.0);
      }
      std::printf("\n");
      rows.push_back({{"batch", B}, {"mode", mode}, {"kernels", n}, {"span_us", MedianD(span)},
                      {"event_us", 1e3 * MedianD(event_ms)}, {"busy_us", MedianD(busy)},
                      {"idle_gaps_us", MedianD(gaps)}, {"overlap_us", MedianD(overlap)},
                      {"per_kernel", kinds}});
    }
  }
  std::printf("UVQK GEMM route per row class: %s\n", be.gemm_routes().c_str());
  return rows;
}

// DESIGN §11 e2e: U users; step s (1..16) sends each a history of 256·s tokens (128·s items) and
// 256 candidates, through Engine::Rank (embedding, layers, head, cache, planning, read-back).
json BenchE2e(int reps, int page_size) {
  json rows = json::array();
  const hstu::ModelWeights weights = BaseWeights();
  struct Mode { const char* name; bool cache, graphs; };
  const Mode modes[] = {{"baseline (no cache, no graphs)", false, false},
                        {"cache", true, false},
                        {"cache + graphs", true, true}};
  std::vector<std::unique_ptr<hstu::Engine>> engines;
  for (const Mode& m : modes) {
    hstu::EngineOptions o;
    o.device = "cuda:0";
    o.page_size = page_size;
    o.enable_cache = m.cache;
    o.use_cuda_graphs = m.graphs;
    engines.push_back(OrDie(hstu::Engine::Create(o, weights)));
  }
  const int steps = 16, cand = 256;
  std::printf("\n### e2e (Engine::Rank; %d steps, history 256 -> 4096 tokens + %d candidates per "
              "user; median of %d sequences)\n\n", steps, cand, reps);
  if (absl::GetFlag(FLAGS_sustained_ms) > 0) {
    std::printf("Each mode is warmed up with its own sequences for >= %d ms before it is timed.\n\n",
                absl::GetFlag(FLAGS_sustained_ms));
  }
  std::printf("| users | mode | total (ms) | per step (ms) | of which outside the forward (ms) | "
              "device busy (ms) | speedup | speedup of the device time |\n"
              "|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(21);
  uint64_t next_user = 1;
  // One visit: `events` more history events (128 = 256 tokens a step) and fresh candidates.
  auto visit = [&](hstu::RankRequest& r, int events) {
    for (int i = 0; i < events; ++i) {
      r.history_item_ids.push_back(rng() % 100000);
      r.history_actions.push_back(rng() % 128);
    }
    r.candidate_item_ids.resize(cand);
    for (auto& id : r.candidate_item_ids) id = rng() % 100000;
  };
  // At the most users, each step's wall and device time per mode (medians over the sequences).
  std::vector<std::vector<double>> step_wall(engines.size()), step_device(engines.size());
  for (int U : {1, 2, 4, 8}) {
    double base_ms = 0, base_device_ms = 0;
    for (size_t mi = 0; mi < engines.size(); ++mi) {
      hstu::Engine& e = *engines[mi];
      // host: Rank's wall time outside backend forwards; device: the GPU's time on the steps.
      std::vector<double> totals, host, device;
      std::vector<std::vector<double>> wall_at(steps), device_at(steps);
      const hstu::EngineStats before = e.Stats();
      // Warm-up (rep -1): one sequence, or with --sustained_ms sequences until that long has
      // passed (the mode's own load brings the GPU to the clock it sustains under it).
      const auto warm_start = std::chrono::steady_clock::now();
      const int sustained_ms = absl::GetFlag(FLAGS_sustained_ms);
      for (int rep = -1; rep < reps; ++rep) {
        if (rep == 0 && sustained_ms > 0 &&
            std::chrono::steady_clock::now() - warm_start < std::chrono::milliseconds(sustained_ms)) {
          rep = -1;  // another warm-up sequence
        }
        std::vector<hstu::RankRequest> users(U);
        for (auto& r : users) r.user_id = next_user++;
        double total = 0;
        const hstu::EngineStats at0 = e.Stats();
        for (int s = 1; s <= steps; ++s) {
          for (auto& r : users) visit(r, 128);
          const double device0 = e.Stats().device_seconds;
          const double ms = WallMs([&] {
            for (auto& res : e.Rank(users)) OrDie(res.status());
          });
          total += ms;
          if (rep >= 0) {
            wall_at[s - 1].push_back(ms);
            device_at[s - 1].push_back((e.Stats().device_seconds - device0) * 1e3);
          }
        }
        if (rep >= 0) {
          const hstu::EngineStats at1 = e.Stats();
          totals.push_back(total);
          host.push_back(total - (at1.compute_seconds - at0.compute_seconds) * 1e3);
          device.push_back((at1.device_seconds - at0.device_seconds) * 1e3);
        }
      }
      const double ms = MedianD(totals), host_ms = MedianD(host), device_ms = MedianD(device);
      if (U == 8) {
        step_wall[mi].clear();
        step_device[mi].clear();
        for (int s = 0; s < steps; ++s) {
          step_wall[mi].push_back(MedianD(wall_at[s]));
          step_device[mi].push_back(MedianD(device_at[s]));
        }
      }
      const hstu::EngineStats after = e.Stats();
      if (modes[mi].graphs) {
        std::fprintf(stderr, "e2e %d users: %llu of %llu forward passes replayed from graphs\n", U,
                     static_cast<unsigned long long>(after.graph_replays - before.graph_replays),
                     static_cast<unsigned long long>(after.forward_passes - before.forward_passes));
      }
      if (mi == 0) {
        base_ms = ms;
        base_device_ms = device_ms;
      }
      // The device-time ratio leaves out the host's share of each step (the engine's work before
      // and after the GPU's); 0 on the CPU backend, which has no device time.
      const double device_speedup = device_ms > 0 ? base_device_ms / device_ms : 0;
      std::printf("| %d | %s | %.2f | %.3f | %.3f | %.3f | %.2fx | %.2fx |\n", U, modes[mi].name,
                  ms, ms / steps, host_ms / steps, device_ms / steps, base_ms / ms,
                  device_speedup);
      rows.push_back({{"users", U}, {"mode", modes[mi].name}, {"total_ms", ms},
                      {"per_step_ms", ms / steps}, {"outside_forward_ms_per_step", host_ms / steps},
                      {"device_ms_per_step", device_ms / steps}, {"speedup", base_ms / ms},
                      {"device_speedup", device_speedup}});
    }
  }
  std::printf("\n8 users, each step (ms; wall / device busy, medians):\n\n| step | cached tokens "
              "| baseline | cache | cache + graphs | speedup |\n|---|---|---|---|---|---|\n");
  for (int s = 0; s < steps; ++s) {
    std::printf("| %d | %d |", s + 1, 256 * s);
    for (size_t mi = 0; mi < engines.size(); ++mi) {
      std::printf(" %.3f / %.3f |", step_wall[mi][s], step_device[mi][s]);
    }
    std::printf(" %.2fx |\n", step_wall[0][s] / step_wall[2][s]);
    rows.push_back({{"users", 8}, {"step", s + 1}, {"baseline_ms", step_wall[0][s]},
                    {"baseline_device_ms", step_device[0][s]}, {"cache_ms", step_wall[1][s]},
                    {"cache_device_ms", step_device[1][s]}, {"cache_graphs_ms", step_wall[2][s]},
                    {"cache_graphs_device_ms", step_device[2][s]}});
  }
  // The same steps with the users out of phase (user k starts 16k/U steps in and starts over as a
  // new user after 4096 tokens), as a server's batches mix returning users of every length.
  std::printf("\n| users | mode | total (ms) | per step (ms) |\n|---|---|---|---|\n");
  for (int U : {4, 8}) {
    hstu::Engine& e = *engines[2];
    std::vector<double> totals;
    for (int rep = -1; rep < reps; ++rep) {
      std::vector<hstu::RankRequest> users(U);
      std::vector<int> phase(U);
      for (int k = 0; k < U; ++k) phase[k] = (k * steps) / U;
      double total = 0;
      for (int s = 0; s < steps + steps; ++s) {  // the first `steps` are warm-up: every phase filled
        for (int k = 0; k < U; ++k) {
          hstu::RankRequest& r = users[k];
          if (r.history_item_ids.empty() || r.history_item_ids.size() >= 128u * steps) {
            r = hstu::RankRequest();
            r.user_id = next_user++;
          }
          // The first visit skips ahead to the user's phase.
          visit(r, s == 0 ? 128 * (1 + phase[k]) : 128);
        }
        const double ms = WallMs([&] {
          for (auto& res : e.Rank(users)) OrDie(res.status());
        });
        if (s >= steps) total += ms;
      }
      if (rep >= 0) totals.push_back(total);
    }
    const double ms = MedianD(totals);
    std::printf("| %d | cache + graphs, users out of phase | %.2f | %.3f |\n", U, ms, ms / steps);
    rows.push_back({{"users", U}, {"mode", "cache + graphs, out of phase"}, {"total_ms", ms},
                    {"per_step_ms", ms / steps}});
  }
  std::printf("\ngraph replays (cache + graphs engine): %llu\n",
              static_cast<unsigned long long>(engines[2]->Stats().graph_replays));
  return rows;
}

// Host tier transfers: one user's pages of 1K..4K tokens (1 MiB per 32 tokens on the base model),
// scattered page ids on both sides (as the allocators hand them out) or one contiguous run; time
// of CopyPages + WaitCopies (wall clock, median), per copy method. Then the onload overlap: a
// decode step whose 3968-token prefix must first come back from the host.
json BenchOffload(int reps, int page_size) {
  json rows = json::array();
  const hstu::ModelWeights weights = BaseWeights();
  const int max_tokens = 4096, ppu = max_tokens / page_size;
  const int64_t pool = 4LL * ppu;
  hstu::GraphOptions go;  // the overlap step below replays a graph, as the engine's would
  go.enable = true;
  go.buckets = {{1, 384}};
  auto be_ptr = OrDie(hstu::CreateCudaBackendExt(weights, page_size, pool, 0, go));
  hstu::CudaBackend& be = *be_ptr;
  OrDie(be.CreateHostPool(pool));
  const double page_bytes = static_cast<double>(be.page_bytes());
  std::printf("\n### offload / onload (one user; page %d tokens = %.0f KiB over 8 layers; "
              "median of %d)\n\n", page_size, page_bytes / 1024, reps);
  std::printf("| tokens | MiB | page ids | method | onload (ms) | onload GB/s | offload (ms) | "
              "offload GB/s |\n|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(31);
  std::vector<int32_t> gpu_ids(pool), host_ids(pool);
  std::iota(gpu_ids.begin(), gpu_ids.end(), 0);
  std::iota(host_ids.begin(), host_ids.end(), 0);
  hstu::ForwardOutput out;
  OrDie(be.Forward(DecodeBatch(1, max_tokens, 0, 0, ppu, &rng), false, &out));  // non-zero K/V
  for (int tokens : {1024, 2048, 3072, 4096}) {
    const int n = tokens / page_size;
    for (int scattered = 1; scattered >= 0; --scattered) {
      std::vector<int32_t> g(gpu_ids), h(host_ids);
      if (scattered) {
        std::shuffle(g.begin(), g.end(), rng);
        std::shuffle(h.begin(), h.end(), rng);
      }
      g.resize(n);
      h.resize(n);
      for (auto method : {hstu::CudaBackend::CopyMethod::kPerRun, hstu::CudaBackend::CopyMethod::kBatch}) {
        be.SetCopyMethod(method);
        std::vector<double> on, off;
        for (int i = -2; i < reps; ++i) {
          const double t_off = WallMs([&] {
            OrDie(be.CopyPages(hstu::CopyKind::kDeviceToHost, g, h));
            OrDie(be.WaitCopies());
          });
          const double t_on = WallMs([&] {
            OrDie(be.CopyPages(hstu::CopyKind::kHostToDevice, h, g));
            OrDie(be.WaitCopies());
          });
          if (i >= 0) {
            on.push_back(t_on);
            off.push_back(t_off);
          }
        }
        const double bytes = n * page_bytes, ms_on = MedianD(on), ms_off = MedianD(off);
        const char* mname = method == hstu::CudaBackend::CopyMethod::kBatch ? "batch" : "per run";
        std::printf("| %d | %.0f | %s | %s | %.3f | %.1f | %.3f | %.1f |\n", tokens, bytes / (1 << 20),
                    scattered ? "scattered" : "contiguous", mname, ms_on, bytes / ms_on / 1e6, ms_off,
                    bytes / ms_off / 1e6);
        rows.push_back({{"tokens", tokens}, {"bytes", bytes}, {"scattered", scattered != 0},
                        {"method", mname}, {"onload_ms", ms_on}, {"onload_gbps", bytes / ms_on / 1e6},
                        {"offload_ms", ms_off}, {"offload_gbps", bytes / ms_off / 1e6}});
      }
    }
  }
  be.SetCopyMethod(hstu::CudaBackend::CopyMethod::kBatch);

  // Onload overlap: user 1's 3968-token prefix lives in GPU pages [ppu, 2·ppu) after an onload
  // from the host; the step (128 new + 256 candidates) is issued right after CopyPages.
  const int cached = 3968, prefix_pages = cached / page_size;
  std::vector<int32_t> src_gpu(prefix_pages), host(prefix_pages), dst_gpu(prefix_pages);
  for (int p = 0; p < prefix_pages; ++p) {
    src_gpu[p] = p;
    host[p] = 2 * p % static_cast<int>(pool);
    dst_gpu[p] = ppu + p;
  }
  OrDie(be.CopyPages(hstu::CopyKind::kDeviceToHost, src_gpu, host));
  OrDie(be.WaitCopies());
  hstu::ForwardBatch step = DecodeBatch(2, max_tokens, cached, 256, ppu, &rng);
  // Only user 1 (pages [ppu, 2·ppu)).
  hstu::ForwardBatch one;
  one.num_users = 1;
  one.row_offsets = {0, step.row_offsets[2] - step.row_offsets[1]};
  one.num_new = {step.num_new[1]};
  one.num_tokens = {step.num_tokens[1]};
  one.page_indptr = {0, ppu};
  one.page_ids.assign(step.page_ids.begin() + ppu, step.page_ids.end());
  one.token_ids.assign(step.token_ids.begin() + step.row_offsets[1], step.token_ids.end());
  one.token_types.assign(step.token_types.begin() + step.row_offsets[1], step.token_types.end());
  one.positions.assign(step.positions.begin() + step.row_offsets[1], step.positions.end());
  std::vector<double> alone, copy_only, serial, overlapped;
  for (int i = -2; i < reps; ++i) {
    const double a = WallMs([&] { OrDie(be.Forward(one, false, &out)); });
    const double c = WallMs([&] {
      OrDie(be.CopyPages(hstu::CopyKind::kHostToDevice, host, dst_gpu));
      OrDie(be.WaitCopies());
    });
    const double s = WallMs([&] {
      OrDie(be.CopyPages(hstu::CopyKind::kHostToDevice, host, dst_gpu));
      OrDie(be.WaitCopies());
      OrDie(be.Forward(one, false, &out));
    });
    const double o = WallMs([&] {
      OrDie(be.CopyPages(hstu::CopyKind::kHostToDevice, host, dst_gpu));
      OrDie(be.Forward(one, false, &out));
      OrDie(be.WaitCopies());
    });
    if (i >= 0) {
      alone.push_back(a);
      copy_only.push_back(c);
      serial.push_back(s);
      overlapped.push_back(o);
    }
  }
  const double a = MedianD(alone), c = MedianD(copy_only), s = MedianD(serial), o = MedianD(overlapped);
  std::printf("\n### onload overlap (batch 1: 3968-token prefix onloaded, then 128 new + 256 "
              "candidates; wall ms, median of %d; graphs %s)\n\n", reps,
              be.num_graphs() > 0 ? "on" : "off");
  std::printf("| step alone | onload alone | onload, wait, step | onload + step with per-layer waits | "
              "step time not hidden by the onload |\n|---|---|---|---|---|\n");
  std::printf("| %.3f | %.3f | %.3f | %.3f | %.3f (%.0f%% of the step) |\n", a, c, s, o, o - c,
              100.0 * (o - c) / a);
  rows.push_back({{"overlap", true}, {"step_ms", a}, {"onload_ms", c}, {"serial_ms", s},
                  {"overlapped_ms", o}});
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr const char* kModes =
      "attention | attention_trace | kernels | block | attention_sweep | layer | block_graphs | "
      "timeline | e2e | offload | gemm_algos | gemm_search";
  absl::SetProgramUsageMessage(absl::StrCat("hstu_bench MODE [--json FILE] [--reps N] [--batches 1,8]\n"
                                            "MODE: ", kModes));
  auto flag_args = hstu::NormalizeFlagDashes(argc, argv);
  auto flag_argv = hstu::ArgvOf(flag_args);
  std::vector<char*> args = hstu::ParseFlags(flag_argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "usage: hstu_bench MODE [--json FILE]; MODE: %s\n", kModes);
    return 2;
  }
  const std::string mode = args[1];
  // Everything the flags say is checked before the GPU is touched.
  const std::vector<std::string> modes = absl::StrSplit(kModes, " | ");
  if (std::find(modes.begin(), modes.end(), mode) == modes.end()) {
    std::fprintf(stderr, "unknown mode '%s' (%s)\n", mode.c_str(), kModes);
    return 2;
  }
  const absl::StatusOr<std::vector<int>> batches_or =
      ParseList("batches", absl::GetFlag(FLAGS_batches), 1);
  const absl::StatusOr<std::vector<int>> slots_or =
      ParseList("attn_slots", absl::GetFlag(FLAGS_attn_slots), 0);
  for (const absl::Status& s : {batches_or.status(), slots_or.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  const std::vector<int>& batches = *batches_or;
  const std::vector<int>& slots = *slots_or;
  if (absl::GetFlag(FLAGS_reps) < 1) {
    std::fprintf(stderr, "--reps=%d: must be >= 1\n", absl::GetFlag(FLAGS_reps));
    return 2;
  }
  if (const int ps = absl::GetFlag(FLAGS_page_size); ps < 1 || ps > 4096 || (ps & (ps - 1)) != 0) {
    std::fprintf(stderr, "--page_size=%d: must be a power of two in [1, 4096]\n", ps);
    return 2;
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "hstu_bench: no CUDA device present\n");
    return 1;
  }
  const int reps = absl::GetFlag(FLAGS_reps), page_size = absl::GetFlag(FLAGS_page_size);
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  const bool with_graphs =
      mode == "block_graphs" || mode == "timeline" || mode == "e2e" || mode == "offload";
  const ModeModel what = ModelOf(mode);
  const int window = absl::GetFlag(FLAGS_window);
  std::string settings = what.takes_page_size ? absl::StrCat("page size ", page_size) : "";
  if (what.takes_window) {
    absl::StrAppend(&settings, settings.empty() ? "" : ", ",
                    window > 0 ? absl::StrCat("window ", window) : "no window");
  }
  std::printf("GPU: %s | model: %s | bf16, %s | %s%smedian of %d reps | CUDA runtime %d, driver "
              "%d\n",
              GpuName().c_str(), what.model.c_str(),
              with_graphs ? "eager and CUDA graphs (per table)" : "eager", settings.c_str(),
              settings.empty() ? "" : " | ", reps, runtime, driver);
  json j = {{"gpu", GpuName()}, {"mode", mode}, {"model", what.model}, {"reps", reps},
            {"cuda_runtime", runtime}, {"cuda_driver", driver}};
  if (what.takes_page_size) j["page_size"] = page_size;
  if (what.takes_window) j["window"] = window;
  // The clock and power through the whole mode (and per row where a mode reports it).
  std::string no_monitor;
  const std::unique_ptr<GpuMonitor> monitor =
      GpuMonitor::Start(0, std::chrono::milliseconds(10), &no_monitor);
  if (monitor == nullptr) std::printf("(no clock samples: %s)\n", no_monitor.c_str());
  const auto mode_start = GpuMonitor::Clock::now();
  if (mode == "attention") {
    j["results"] = BenchAttention(reps, page_size, batches, slots);
  } else if (mode == "attention_trace") {
    j["results"] = BenchAttentionTrace(reps, page_size, batches, slots, absl::GetFlag(FLAGS_cached));
  } else if (mode == "kernels") {
    j["results"] =
        BenchKernels(reps, page_size, batches, absl::GetFlag(FLAGS_cached), monitor.get());
  } else if (mode == "block") {
    j["results"] = BenchBlock(reps, page_size, batches, monitor.get());
  } else if (mode == "attention_sweep") {
    j["results"] = hstu::bench::BenchAttentionSweep(reps);
  } else if (mode == "layer") {
    j["results"] = hstu::bench::BenchLayer(reps);
  } else if (mode == "block_graphs") {
    j["results"] = BenchStepGraphs(reps, page_size, batches);
  } else if (mode == "timeline") {
    j["results"] = BenchStepTimeline(reps, page_size, batches, absl::GetFlag(FLAGS_cached));
  } else if (mode == "e2e") {
    j["results"] = BenchE2e(std::max(1, reps / 10), page_size);
  } else if (mode == "offload") {
    j["results"] = BenchOffload(reps, page_size);
  } else if (mode == "gemm_algos") {
    j["results"] = hstu::bench::BenchGemmAlgos(reps);
  } else if (mode == "gemm_search") {
    j["results"] = hstu::bench::BenchGemmSearch(reps);
  } else {
    std::fprintf(stderr, "unknown mode '%s' (%s)\n", mode.c_str(), kModes);
    return 2;
  }
  if (monitor != nullptr) {
    const GpuMonitor::Summary all = monitor->Between(mode_start, GpuMonitor::Clock::now());
    std::printf("\nGPU during this run: %s\n", hstu::bench::DescribeClocks(all).c_str());
    j["clocks"] = ClocksJson(all);
  }
  const std::string path = absl::GetFlag(FLAGS_json);
  if (!path.empty()) {
    if (absl::Status s = hstu::WriteFileAtomically(path, j.dump(2) + "\n"); !s.ok()) {
      std::fprintf(stderr, "hstu_bench: the results to --json: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  return 0;
}
