// The engine-level benchmarks of hstu_bench (issue 5): the decode step eager and replayed from
// CUDA graphs, the step's kernels as the device ran them (CUPTI), Engine::Rank end to end in its
// three modes, and the host tier's transfers. Flags: hstu_bench.cc.
#include "client/bench_engine.h"

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

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/bench_util.h"
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

ABSL_DECLARE_FLAG(int32_t, window);
ABSL_DECLARE_FLAG(int32_t, sustained_ms);

namespace hstu::bench {

using json = nlohmann::json;

namespace {

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

}  // namespace

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


}  // namespace hstu::bench
