// The engine on the GPU (EngineOptions.device = "cuda:0") against the engine on the CPU, and the
// GPU engine with its KV cache against the GPU engine without one, over returning users.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "engine/engine.h"
#include "engine/gpu_telemetry.h"
#include "engine/model_file.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

std::unique_ptr<Engine> MakeEngine(const std::string& device, bool cache, const ModelWeights& w) {
  EngineOptions o;
  o.device = device;
  o.enable_cache = cache;
  o.page_size = 16;
  o.keep_hidden = true;
  o.wrap_backend = test::PoisonedKv;
  auto e = Engine::Create(o, w);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

// One batch on the CPU engine, the GPU engine and the GPU engine without a cache: the GPU's
// scores and hidden rows within bf16 tolerance of both, its worst differences from the CPU in
// *worst. Fills the GPU engine's results, and the cache-less one's, in batch order.
struct Worst {
  double score = 0, hidden = 0;
};
void RankOnAll(Engine& cpu, Engine& gpu, Engine& gpu_nocache,
               const std::vector<RankRequest>& batch, const std::string& what,
               std::vector<RankResult>* with_cache, std::vector<RankResult>* without,
               Worst* worst) {
  auto rc = cpu.Rank(batch);
  auto rg = gpu.Rank(batch);
  auto rn = gpu_nocache.Rank(batch);
  for (size_t i = 0; i < batch.size(); ++i) {
    const std::string who = what + " user " + std::to_string(i);
    ASSERT_TRUE(rc[i].ok() && rg[i].ok() && rn[i].ok()) << rg[i].status() << rn[i].status();
    ASSERT_TRUE(test::AllFinite(rg[i]->scores) && test::AllFinite(rg[i]->hidden)) << who;
    EXPECT_LT(test::MaxAbsDiff(rg[i]->scores, rc[i]->scores), test::kBf16ScoreAbs) << who;
    EXPECT_LT(test::RelL2(rg[i]->hidden, rc[i]->hidden), test::kBf16RelL2) << who;
    EXPECT_LT(test::MaxAbsDiff(rg[i]->scores, rn[i]->scores), test::kBf16ScoreAbs) << who;
    EXPECT_LT(test::RelL2(rg[i]->hidden, rn[i]->hidden), test::kBf16RelL2) << who;
    worst->score = std::max(worst->score, test::MaxAbsDiff(rg[i]->scores, rc[i]->scores));
    worst->hidden = std::max(worst->hidden, test::RelL2(rg[i]->hidden, rc[i]->hidden));
    with_cache->push_back(*std::move(rg[i]));
    without->push_back(*std::move(rn[i]));
  }
}

TEST(CudaEngine, MatchesCpuEngineAndCacheMatchesNoCache) {
  HSTU_SKIP_WITHOUT_GPU();
  const ModelWeights w = RandomModel(test::SmallGpuModelConfig(), 21);
  auto cpu = MakeEngine("cpu", true, w);
  auto gpu = MakeEngine("cuda:0", true, w);
  auto gpu_nocache = MakeEngine("cuda:0", false, w);
  ASSERT_TRUE(cpu && gpu && gpu_nocache);
  EXPECT_NE(gpu->device_name().find("cuda:0"), std::string::npos) << gpu->device_name();

  std::mt19937 rng(9);
  Worst worst;
  std::vector<RankRequest> users(7);
  for (size_t u = 0; u < users.size(); ++u) users[u].user_id = 1000 + u;
  for (int visit = 0; visit < 4; ++visit) {
    std::vector<RankRequest> batch;
    for (size_t u = 0; u < users.size(); ++u) {
      RankRequest& r = users[u];
      const int add = visit == 0 ? static_cast<int>(rng() % 60) : static_cast<int>(rng() % 9);
      for (int i = 0; i < add; ++i) {
        r.history_item_ids.push_back(rng() % 500);
        r.history_actions.push_back(rng() % 6);
      }
      r.candidate_item_ids.clear();
      const int nc = u == 2 ? 1 : 1 + static_cast<int>(rng() % 20);
      for (int i = 0; i < nc; ++i) r.candidate_item_ids.push_back(rng() % 500);
      batch.push_back(r);
    }
    const std::string what = "visit " + std::to_string(visit);
    std::vector<RankResult> rg, rn;
    RankOnAll(*cpu, *gpu, *gpu_nocache, batch, what, &rg, &rn, &worst);
    ASSERT_EQ(rg.size(), batch.size()) << what;
    for (size_t i = 0; i < batch.size(); ++i) {
      if (visit > 0 && !users[i].history_item_ids.empty()) {
        EXPECT_GT(rg[i].reused_tokens, 0u) << what << " user " << i
                                           << ": the GPU engine did not reuse its cache";
      }
      EXPECT_EQ(rn[i].reused_tokens, 0u) << what << " user " << i;
    }
  }
  std::printf("  GPU vs CPU engine (fp32 weights on the CPU): worst hidden rel L2 %.2e, worst score "
              "abs %.2e\n", worst.hidden, worst.score);
}

// A sliding window (DESIGN §2.2): the cache releases the pages behind it after each commit, and
// the page table's dead slots point at a live page that the kernels must not read. Returning
// users with histories far longer than the window score as without the cache and as on the CPU.
TEST(CudaEngine, PagesReleasedBehindTheWindowAreNeverRead) {
  HSTU_SKIP_WITHOUT_GPU();
  ModelConfig c = test::SmallGpuModelConfig();
  c.max_attn_len = 40;
  const ModelWeights w = RandomModel(c, 23);
  auto cpu = MakeEngine("cpu", true, w);
  auto gpu = MakeEngine("cuda:0", true, w);
  auto gpu_nocache = MakeEngine("cuda:0", false, w);
  ASSERT_TRUE(cpu && gpu && gpu_nocache);
  std::mt19937 rng(4);
  std::vector<RankRequest> users(5);
  for (size_t u = 0; u < users.size(); ++u) users[u].user_id = 2000 + u;
  uint64_t reused = 0;
  // Ten visits: histories of ~200-230 tokens, past the window (40) and the cache's slack (2 pages
  // of 16 + 64 tokens) by several pages.
  for (int visit = 0; visit < 10; ++visit) {
    std::vector<RankRequest> batch;
    for (size_t u = 0; u < users.size(); ++u) {
      RankRequest& r = users[u];
      for (int i = 0; i < 8 + static_cast<int>(rng() % 12); ++i) {
        r.history_item_ids.push_back(rng() % 500);
        r.history_actions.push_back(rng() % 6);
      }
      r.candidate_item_ids.assign(1 + rng() % 12, 0);
      for (auto& id : r.candidate_item_ids) id = rng() % 500;
      batch.push_back(r);
    }
    std::vector<RankResult> rg, rn;
    Worst worst;
    RankOnAll(*cpu, *gpu, *gpu_nocache, batch, "visit " + std::to_string(visit), &rg, &rn, &worst);
    ASSERT_EQ(rg.size(), batch.size());
    for (const RankResult& g : rg) reused += g.reused_tokens;
  }
  const CacheStats s = gpu->Stats().cache;
  std::printf("  window 40: %llu GPU pages released, %llu tokens reused\n",
              static_cast<unsigned long long>(s.window_pages_released),
              static_cast<unsigned long long>(reused));
  EXPECT_GT(s.window_pages_released, 0u);
  EXPECT_GT(reused, 0u);
}

// With the cache off the engine tells the backend that no page is read after the wave
// (ForwardBatch::keep_kv), except when a user's candidates take more than one pass: the later
// passes read the pages of the first. Head dim 256 runs the attention kernel that then skips
// the page writes; scores against the CPU engine either way.
TEST(CudaEngine, CacheOffScoresSingleAndMultiPassWaves) {
  HSTU_SKIP_WITHOUT_GPU();
  ModelConfig c = test::SmallGpuModelConfig();
  c.head_dim = 256;
  c.max_candidates = 8;
  const ModelWeights w = RandomModel(c, 23);
  auto cpu = MakeEngine("cpu", false, w);
  auto gpu = MakeEngine("cuda:0", false, w);
  ASSERT_TRUE(cpu && gpu);
  std::mt19937 rng(31);
  for (int max_cands : {8, 20}) {  // one pass for every user; then up to three passes
    std::vector<RankRequest> batch(5);
    for (size_t u = 0; u < batch.size(); ++u) {
      RankRequest& r = batch[u];
      r.user_id = 50 + u;
      const int events = u == 1 ? 0 : 1 + static_cast<int>(rng() % 120);
      for (int i = 0; i < events; ++i) {
        r.history_item_ids.push_back(rng() % 500);
        r.history_actions.push_back(rng() % 6);
      }
      const int nc = u == 0 ? max_cands : 1 + static_cast<int>(rng() % max_cands);
      for (int i = 0; i < nc; ++i) r.candidate_item_ids.push_back(rng() % 500);
    }
    auto rc = cpu->Rank(batch);
    auto rg = gpu->Rank(batch);
    for (size_t i = 0; i < batch.size(); ++i) {
      ASSERT_TRUE(rc[i].ok() && rg[i].ok()) << rg[i].status();
      const std::string what =
          "max candidates " + std::to_string(max_cands) + " user " + std::to_string(i);
      ASSERT_TRUE(test::AllFinite(rg[i]->scores)) << what;
      EXPECT_LT(test::MaxAbsDiff(rg[i]->scores, rc[i]->scores), test::kBf16ScoreAbs) << what;
      EXPECT_LT(test::RelL2(rg[i]->hidden, rc[i]->hidden), test::kBf16RelL2) << what;
    }
  }
}

// DESIGN §2.4's own test, on the `base` shapes (8 layers, d 1024, 4 x 256, head 1024-512-4; 4000
// item rows instead of 1M): the GPU engine is as close to the fp32 CPU engine as the CPU engine
// rounded where the GPU stores bf16 ("cpu-bf16") is, on the mean and the worst score difference
// and on the hidden rows. On these shapes neither is within 2e-3 of fp32 (round 31 in
// docs/kernel_rounds.md: the bf16 weights alone cost ~4.5e-3), so the small models' absolute check
// is not the one that applies.
TEST(CudaEngine, BaseShapesAsCloseToFp32AsTheBf16Emulation) {
  HSTU_SKIP_WITHOUT_GPU();
  ModelConfig c = *PresetConfig("base");
  c.item_rows = 4000;
  const ModelWeights w = RandomModel(c, 5);
  auto cpu = MakeEngine("cpu", true, w);
  auto emu = MakeEngine("cpu-bf16", true, w);
  auto gpu = MakeEngine("cuda:0", true, w);
  ASSERT_TRUE(cpu && emu && gpu);
  std::mt19937 rng(12);
  std::vector<RankRequest> users(3);
  for (size_t u = 0; u < users.size(); ++u) users[u].user_id = 300 + u;
  std::vector<double> d_gpu, d_emu;
  double hidden_gpu = 0, hidden_emu = 0;
  for (int visit = 0; visit < 2; ++visit) {
    for (RankRequest& r : users) {
      const int add = visit == 0 ? 150 + static_cast<int>(rng() % 100) : 40;
      for (int i = 0; i < add; ++i) {
        r.history_item_ids.push_back(rng() % 4000);
        r.history_actions.push_back(rng() % 128);
      }
      r.candidate_item_ids.assign(64, 0);
      for (auto& id : r.candidate_item_ids) id = rng() % 4000;
    }
    auto rc = cpu->Rank(users);
    auto re = emu->Rank(users);
    auto rg = gpu->Rank(users);
    for (size_t i = 0; i < users.size(); ++i) {
      ASSERT_TRUE(rc[i].ok() && re[i].ok() && rg[i].ok()) << rg[i].status() << re[i].status();
      ASSERT_TRUE(test::AllFinite(rg[i]->scores) && test::AllFinite(rg[i]->hidden));
      ASSERT_EQ(rg[i]->scores.size(), rc[i]->scores.size());
      if (visit > 0) {
        EXPECT_GT(rg[i]->reused_tokens, 0u) << "user " << i;
      }
      for (size_t j = 0; j < rc[i]->scores.size(); ++j) {
        d_gpu.push_back(std::abs(double(rg[i]->scores[j]) - rc[i]->scores[j]));
        d_emu.push_back(std::abs(double(re[i]->scores[j]) - rc[i]->scores[j]));
      }
      hidden_gpu = std::max(hidden_gpu, test::RelL2(rg[i]->hidden, rc[i]->hidden));
      hidden_emu = std::max(hidden_emu, test::RelL2(re[i]->hidden, rc[i]->hidden));
    }
  }
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s / static_cast<double>(v.size());
  };
  auto worst = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  std::printf("  base shapes, %zu scores, against the fp32 CPU engine: GPU mean %.2e worst %.2e "
              "hidden rel L2 %.2e; cpu-bf16 mean %.2e worst %.2e hidden rel L2 %.2e\n",
              d_gpu.size(), mean(d_gpu), worst(d_gpu), hidden_gpu, mean(d_emu), worst(d_emu),
              hidden_emu);
  constexpr double kSlack = 1.25;  // as tools/compare_rank_outputs.py --bf16
  EXPECT_GT(worst(d_emu), 1e-4) << "the emulation does not round";
  EXPECT_LE(mean(d_gpu), kSlack * mean(d_emu));
  EXPECT_LE(worst(d_gpu), kSlack * worst(d_emu));
  EXPECT_LE(hidden_gpu, kSlack * hidden_emu);
  // And bounds of their own, so that a worse emulation cannot widen the GPU's: the issue's
  // hidden-state criterion, and the base model's score bound.
  EXPECT_LT(hidden_gpu, test::kBf16RelL2);
  EXPECT_LT(worst(d_gpu), test::kBf16BaseScoreAbs);
}

// The sources of the server's GPU metrics: the engine's device memory split (weights within the
// total), and GpuTelemetry on the engine's GPU, whose readings are sane and whose energy counter
// moves while the GPU works.
TEST(CudaEngine, ARecoverableCudaErrorLeavesLaterRequestsServed) {
  // A failed allocation (here one too large for any GPU) leaves an ordinary error as the thread's
  // last error. The launchers' cudaPeekAtLastError returned it for every later step: the engine
  // answered INTERNAL forever while it reported itself healthy.
  HSTU_SKIP_WITHOUT_GPU();
  const ModelWeights w = RandomModel(test::SmallGpuModelConfig(), 3);
  auto gpu = MakeEngine("cuda:0", true, w);
  auto cpu = MakeEngine("cpu", true, w);
  ASSERT_TRUE(gpu && cpu);
  RankRequest r{5, {}, {}, {1, 2, 3}};
  for (int i = 0; i < 40; ++i) {
    r.history_item_ids.push_back(i * 3 % 500);
    r.history_actions.push_back(i % 6);
  }
  ASSERT_TRUE(gpu->Rank({r})[0].ok());
  ASSERT_TRUE(cpu->Rank({r})[0].ok());
  void* p = nullptr;
  ASSERT_NE(cudaMalloc(&p, size_t{1} << 50), cudaSuccess);
  r.history_item_ids.push_back(17);
  r.history_actions.push_back(2);
  auto got = gpu->Rank({r});
  auto want = cpu->Rank({r});
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  ASSERT_TRUE(want[0].ok());
  EXPECT_LT(test::MaxAbsDiff(got[0]->scores, want[0]->scores), test::kBf16ScoreAbs);
  EXPECT_TRUE(gpu->health().ok());
}

TEST(CudaEngine, GpuMetricSources) {
  HSTU_SKIP_WITHOUT_GPU();
  const ModelWeights w = RandomModel(test::SmallGpuModelConfig(), 3);
  auto gpu = MakeEngine("cuda:0", false, w);
  ASSERT_TRUE(gpu);
  const EngineStats stats = gpu->Stats();
  EXPECT_GT(stats.weight_bytes, 0);
  EXPECT_GT(stats.kv_pool_bytes, 0);
  EXPECT_LT(stats.weight_bytes + stats.kv_pool_bytes, stats.device_memory_bytes + 1);
  const std::string bus_id = gpu->device_pci_bus_id();
  ASSERT_FALSE(bus_id.empty());
  auto t = GpuTelemetry::Open(bus_id);
  ASSERT_TRUE(t.ok()) << t.status();
  auto r0 = (*t)->Read();
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_GT(r0->sm_clock_hz, 1e8);
  EXPECT_LT(r0->sm_clock_hz, 5e9);
  EXPECT_GT(r0->power_watts, 5);
  EXPECT_LT(r0->power_watts, 2000);
  std::vector<RankRequest> batch(8);
  for (size_t u = 0; u < batch.size(); ++u) {
    batch[u].user_id = 70 + u;
    for (int i = 0; i < 200; ++i) {
      batch[u].history_item_ids.push_back((i * 7 + u) % 500);
      batch[u].history_actions.push_back(i % 6);
    }
    batch[u].candidate_item_ids.assign(32, 11);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < until) {
    for (const auto& r : gpu->Rank(batch)) ASSERT_TRUE(r.ok()) << r.status();
  }
  auto r1 = (*t)->Read();
  ASSERT_TRUE(r1.ok()) << r1.status();
  std::printf("  %s: SM clock %.0f MHz, %.0f W, energy %.1f J, throttled by power %.1f s, by "
              "temperature %.1f s since the driver loaded\n",
              bus_id.c_str(), r1->sm_clock_hz * 1e-6, r1->power_watts, r1->energy_joules,
              r1->power_throttled_seconds, r1->thermal_throttled_seconds);
  if (r0->energy_joules >= 0) {
    EXPECT_GT(r1->energy_joules, r0->energy_joules);
  }
  if (r0->power_throttled_seconds >= 0) {
    EXPECT_GE(r1->power_throttled_seconds, r0->power_throttled_seconds);
  }
}

}  // namespace
}  // namespace hstu
