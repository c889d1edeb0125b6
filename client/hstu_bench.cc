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
#include "client/bench_engine.h"
#include "client/bench_gemm.h"
#include "client/bench_util.h"
#include "client/cli_util.h"
#include "client/gpu_monitor.h"
#include "client/kernel_timeline.h"
#include "engine/atomic_file.h"
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

// The decode-step shapes' history per user (tokens), and the most users a batch list may name.
constexpr int kHistory = 4096;
constexpr int kMaxBatch = 1024;

using hstu::cuda::bf16;
using json = nlohmann::json;
using hstu::bench::FillRandom;
using hstu::bench::GpuMonitor;
using hstu::bench::GpuName;
using hstu::bench::Median;
using hstu::bench::TimeMs;


// A comma-separated list of integers in [min, max], or an error naming `flag`.
absl::StatusOr<std::vector<int>> ParseList(const char* flag, const std::string& s, int min,
                                           int max) {
  std::vector<int> v;
  for (absl::string_view item : absl::StrSplit(s, ',')) {
    int x = 0;
    if (!absl::SimpleAtoi(item, &x) || x < min || x > max) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", s, ": want a comma-separated "
                                                     "list of integers in [", min, ", ", max, "]"));
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
              "us, mean / max over CTAs)\n\n", cached, kHistory - cached);
  std::printf("| batch | slots | CTAs | blocks / CTA | event time | kernel span | PDL wait | Q | first K/V "
              "| loop | per block | epilogue | of it to the cluster sync | CTA total | CTAs' busy share of span |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int B : batches) {
    for (int slots : slot_list) {
      AttnSetup a;
      a.B = B;
      a.cached = cached;
      a.num_new = kHistory - cached;
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
  const int hist = kHistory;  // main() checked --cached against it
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
  bool takes_window = false;  // the whole model's modes
  bool with_graphs = false;
};
ModeModel ModelOf(const std::string& mode) {
  if (mode == "attention_sweep") {
    return {"one attention layer, H x D = 1024 (4 x 256, 8 x 128, 16 x 64), page size 64", false,
            false};
  }
  if (mode == "layer") return {"one HSTU layer (d 1024, 4 x 256), batch 32, no cache", false, false};
  if (mode == "attention") {
    return {"the paged HSTU attention alone, H x D = 4 x 256, 8 x 128, 16 x 64, N 4352", true,
            false};
  }
  if (mode == "attention_trace") {
    return {"the paged HSTU attention alone, H x D = 4 x 256, N 4352", true, false};
  }
  if (mode == "kernels") {
    return {"the kernels of one hstu-base layer (d 1024, 4 x 256, N 4352)", true, false};
  }
  if (mode == "gemm_algos" || mode == "gemm_search") {
    return {"the layer GEMMs of hstu-base (d 1024, 4 x 256)", false, false};
  }
  const bool with_graphs =
      mode == "block_graphs" || mode == "timeline" || mode == "e2e" || mode == "offload";
  return {"hstu-base (8 layers, d 1024, 4 x 256, N 4352)", true, with_graphs || mode == "block",
          with_graphs};
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
      ParseList("batches", absl::GetFlag(FLAGS_batches), 1, kMaxBatch);
  const absl::StatusOr<std::vector<int>> slots_or =
      ParseList("attn_slots", absl::GetFlag(FLAGS_attn_slots), 0, 1 << 20);
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
  if (const int cached = absl::GetFlag(FLAGS_cached); cached < 0 || cached >= kHistory) {
    std::fprintf(stderr, "--cached=%d: must be in [0, %d) (history tokens of the %d in the pages)\n",
                 cached, kHistory, kHistory);
    return 2;
  }
  if (const int window = absl::GetFlag(FLAGS_window); window < 0) {
    std::fprintf(stderr, "--window=%d: must be >= 0 (0: no window)\n", window);
    return 2;
  }
  if (const int ms = absl::GetFlag(FLAGS_sustained_ms); ms < 0 || ms > 600000) {
    std::fprintf(stderr, "--sustained_ms=%d: must be in [0, 600000] (0: off)\n", ms);
    return 2;
  }
  // A results file that cannot be written fails now, not after the run.
  if (const std::string json_path = absl::GetFlag(FLAGS_json); !json_path.empty()) {
    if (absl::Status s = hstu::CheckWritable(json_path); !s.ok()) {
      std::fprintf(stderr, "--json=%s: %s\n", json_path.c_str(), std::string(s.message()).c_str());
      return 2;
    }
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
              what.with_graphs ? "eager and CUDA graphs (per table)" : "eager", settings.c_str(),
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
    j["results"] = hstu::bench::BenchStepGraphs(reps, page_size, batches);
  } else if (mode == "timeline") {
    j["results"] = hstu::bench::BenchStepTimeline(reps, page_size, batches, absl::GetFlag(FLAGS_cached));
  } else if (mode == "e2e") {
    j["results"] = hstu::bench::BenchE2e(std::max(1, reps / 10), page_size);
  } else if (mode == "offload") {
    j["results"] = hstu::bench::BenchOffload(reps, page_size);
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
    if (absl::Status s = hstu::WriteFileAtomically(
            path, j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"); !s.ok()) {
      std::fprintf(stderr, "hstu_bench: the results to --json: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  return 0;
}
