// The CUDA host KV tier: page copies GPU → host → GPU are bit-exact (every layer, K and V, odd
// page sizes, merged and scattered runs, both copy methods); a forward issued right after an
// onload reads the onloaded pages; an engine whose GPU pool is far smaller than its users restores
// them from the host with the CPU engine's scores, or recomputes them when the onload policy says
// the copy is too slow; 10,000 random requests leak no page.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include "engine/cuda_backend.h"
#include "engine/engine.h"
#include "engine/model_file.h"
#include "kernels/params.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

// One user's whole history as new rows (plus `cand` candidates) in `pages`.
ForwardBatch OneUser(int hist, int cached, int cand, const std::vector<int32_t>& pages,
                     std::mt19937* rng) {
  ForwardBatch fb;
  fb.num_users = 1;
  fb.row_offsets = {0, hist - cached + cand};
  fb.num_new = {hist - cached};
  fb.num_tokens = {hist};
  fb.page_ids = pages;
  fb.page_indptr = {0, static_cast<int32_t>(pages.size())};
  for (int t = cached; t < hist; ++t) {
    fb.token_ids.push_back(t % 2 ? (*rng)() % 6 : (*rng)() % 500);
    fb.token_types.push_back(t % 2 ? kActionToken : kItemToken);
    fb.positions.push_back(t);
  }
  for (int c = 0; c < cand; ++c) {
    fb.token_ids.push_back((*rng)() % 500);
    fb.token_types.push_back(kItemToken);
    fb.positions.push_back(hist);
  }
  return fb;
}

TEST(CudaHostTier, RoundTripIsBitExact) {
  HSTU_SKIP_WITHOUT_GPU();
  const ModelWeights w = RandomModel(test::SmallGpuModelConfig(), 3);
  for (int page_size : {7, 16}) {
    for (auto method : {CudaBackend::CopyMethod::kPerRun, CudaBackend::CopyMethod::kBatch}) {
      const std::string what = "page size " + std::to_string(page_size) +
                               (method == CudaBackend::CopyMethod::kBatch ? " batch" : " per run");
      const int hist = 101, pages = (hist + page_size - 1) / page_size;
      const int num_pages = 4 * pages, host_pages = 3 * pages;
      auto be = CreateCudaBackendExt(w, page_size, num_pages, 0);
      ASSERT_TRUE(be.ok()) << be.status();
      CudaBackend& b = **be;
      b.SetCopyMethod(method);
      ASSERT_TRUE(b.CreateHostPool(host_pages).ok());
      EXPECT_FALSE(b.CreateHostPool(host_pages).ok());
      ASSERT_TRUE(b.SetDebugPoison(true).ok());  // unwritten GPU pages read as NaN
      std::mt19937 rng(page_size);
      // Source pages: a consecutive run, then scattered ids.
      std::vector<int32_t> all(num_pages);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin() + 3, all.end(), rng);
      const std::vector<int32_t> src(all.begin(), all.begin() + pages);
      const std::vector<int32_t> dst(all.begin() + pages, all.begin() + 2 * pages);
      ForwardOutput out;
      ASSERT_TRUE(b.Forward(OneUser(hist, 0, 3, src, &rng), false, &out).ok());
      std::vector<float> ref, got;
      ASSERT_TRUE(b.ReadKv(src, hist, &ref).ok());
      ASSERT_TRUE(test::AllFinite(ref)) << what;
      // Host pages: consecutive pairs and gaps, so runs merge on one side only.
      std::vector<int32_t> host(pages);
      for (int i = 0; i < pages; ++i) host[i] = (i / 2) * 5 % host_pages + i % 2 + (i % 3 == 2 ? 2 : 0);
      std::sort(host.begin(), host.end());
      host.erase(std::unique(host.begin(), host.end()), host.end());
      for (int32_t next = 0; static_cast<int>(host.size()) < pages; ++next) {
        if (!std::binary_search(host.begin(), host.end(), next)) host.push_back(next);
      }
      std::shuffle(host.begin() + pages / 2, host.end(), rng);
      ASSERT_TRUE(b.CopyPages(CopyKind::kDeviceToHost, src, host).ok()) << what;
      ASSERT_TRUE(b.WaitCopies().ok());
      ASSERT_TRUE(b.CopyPages(CopyKind::kHostToDevice, host, dst).ok()) << what;
      ASSERT_TRUE(b.WaitCopies().ok());
      ASSERT_TRUE(b.ReadKv(dst, hist, &got).ok());
      EXPECT_TRUE(test::BitEqual(ref, got)) << what << ": onloaded pages differ from the offloaded ones";

      // A forward right after the onload (no WaitCopies) reads the onloaded pages: the same step
      // on the original and on the restored pages scores bit for bit alike.
      const std::vector<int32_t> dst2(all.begin() + 2 * pages, all.begin() + 3 * pages);
      ASSERT_TRUE(b.CopyPages(CopyKind::kHostToDevice, host, dst2).ok());
      std::mt19937 r1(7), r2(7);
      ForwardBatch step_a = OneUser(hist, hist - 1, 9, src, &r1);
      ForwardBatch step_b = OneUser(hist, hist - 1, 9, dst2, &r2);
      ForwardOutput oa, ob;
      ASSERT_TRUE(b.Forward(step_b, true, &ob).ok());
      ASSERT_TRUE(b.Forward(step_a, true, &oa).ok());
      ASSERT_TRUE(test::AllFinite(ob.scores) && test::AllFinite(ob.hidden)) << what;
      EXPECT_TRUE(test::BitEqual(oa.scores, ob.scores)) << what;
      EXPECT_TRUE(test::BitEqual(oa.hidden, ob.hidden)) << what;

      EXPECT_FALSE(b.CopyPages(CopyKind::kHostToDevice, {host_pages}, {0}).ok());
      EXPECT_FALSE(b.CopyPages(CopyKind::kDeviceToHost, {0}, {host_pages}).ok());
      EXPECT_FALSE(b.CopyPages(CopyKind::kDeviceToHost, {0, 1}, {0}).ok());
    }
  }
}

EngineOptions AlwaysOnload() {
  EngineOptions o;
  o.onload_policy = OnloadPolicy::kAlways;
  return o;
}

// kAlways unless told otherwise: these tests are about the onload path itself.
std::unique_ptr<Engine> TierEngine(const std::string& device, const ModelWeights& w,
                                   int64_t gpu_pages, int64_t host_pages,
                                   EngineOptions o = AlwaysOnload()) {
  o.device = device;
  o.page_size = 16;
  o.cache_pages = gpu_pages;
  o.host_cache_pages = host_pages;
  o.wrap_backend = test::PoisonedKv;
  auto e = Engine::Create(o, w);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

// Users cycle through a GPU pool far smaller than the working set; with `prefetch`, the next
// batch's users are prefetched (as the scheduler does) before each batch runs. With
// `slow_copies`, the cost policy is told the link is slow, so every host hit is recomputed.
// `graphs` false: every step eager (the onload waits are then stream waits, not graph nodes).
void RestoreUsersAndCompareWithCpu(bool prefetch, bool slow_copies = false, bool graphs = true) {
  const ModelWeights w = RandomModel(test::SmallGpuModelConfig(), 11);
  // 12 users of up to 16 pages; the GPU pool holds about three of them, the host all.
  EngineOptions o;
  o.onload_policy = slow_copies ? OnloadPolicy::kCost : OnloadPolicy::kAlways;
  if (slow_copies) o.onload_bytes_per_second = 1;
  o.use_cuda_graphs = graphs;
  auto gpu = TierEngine("cuda:0", w, 48, 400, o);
  auto cpu = TierEngine("cpu", w, 0, 0);
  ASSERT_TRUE(gpu && cpu);
  std::mt19937 rng(5);
  std::vector<RankRequest> users(12);
  for (size_t u = 0; u < users.size(); ++u) users[u].user_id = 500 + u;
  double worst = 0;
  for (int visit = 0; visit < 5; ++visit) {
    for (size_t first = 0; first < users.size(); first += 3) {
      std::vector<RankRequest> batch;
      for (size_t u = first; u < first + 3; ++u) {
        RankRequest& r = users[u];
        const int add = visit == 0 ? 40 + static_cast<int>(rng() % 60) : 1 + static_cast<int>(rng() % 8);
        for (int i = 0; i < add; ++i) {
          r.history_item_ids.push_back(rng() % 500);
          r.history_actions.push_back(rng() % 6);
        }
        r.candidate_item_ids.clear();
        for (int i = 0, n = 1 + static_cast<int>(rng() % 20); i < n; ++i) {
          r.candidate_item_ids.push_back(rng() % 500);
        }
        batch.push_back(r);
      }
      if (prefetch && first + 3 < users.size()) {
        std::vector<const RankRequest*> running, next;
        for (const RankRequest& r : batch) running.push_back(&r);
        for (size_t i = first + 3; i < std::min(first + 6, users.size()); ++i) next.push_back(&users[i]);
        gpu->Prefetch(running, next);
      }
      auto rg = gpu->Rank(batch);
      auto rc = cpu->Rank(batch);
      for (size_t i = 0; i < batch.size(); ++i) {
        ASSERT_TRUE(rg[i].ok() && rc[i].ok()) << rg[i].status() << rc[i].status();
        ASSERT_TRUE(test::AllFinite(rg[i]->scores));
        worst = std::max(worst, test::MaxAbsDiff(rg[i]->scores, rc[i]->scores));
        EXPECT_LT(test::MaxAbsDiff(rg[i]->scores, rc[i]->scores), test::kBf16ScoreAbs)
            << "visit " << visit << " user " << batch[i].user_id;
      }
    }
  }
  const EngineStats s = gpu->Stats();
  const uint64_t host_hits = s.cache.lookups[static_cast<int>(LookupResult::kHostHit)];
  const uint64_t host_recomputes = s.cache.lookups[static_cast<int>(LookupResult::kHostRecompute)];
  std::printf("  host hits %llu, host recomputes %llu, pages offloaded %llu, onloaded %llu, GPU "
              "evictions %llu, graph replays %llu, worst score abs %.2e; onload %.3g B/s, "
              "recompute %.3g s/token\n",
              static_cast<unsigned long long>(host_hits),
              static_cast<unsigned long long>(host_recomputes),
              static_cast<unsigned long long>(s.cache.pages_offloaded),
              static_cast<unsigned long long>(s.cache.pages_onloaded),
              static_cast<unsigned long long>(s.cache.evictions),
              static_cast<unsigned long long>(s.graph_replays), worst, s.onload_bytes_per_second,
              s.recompute_seconds_per_token);
  EXPECT_GT(s.cache.evictions, 0u);
  EXPECT_GT(s.recompute_seconds_per_token, 0);
  EXPECT_NE(s.recompute_seconds_per_token, OnloadCostModel::kStartSecondsPerToken);
  // Every forward that waited for copies reported its stall, timed on the device: at least 0,
  // within the steps' device time, one observation each.
  const std::vector<double> waits = gpu->TakeOnloadWaits();
  std::printf("  forwards that waited for onloads %llu (%.3f ms stalled in all), graphs %s\n",
              static_cast<unsigned long long>(s.onload_waits), 1e3 * s.onload_wait_seconds,
              graphs ? "on" : "off");
  EXPECT_EQ(waits.size(), s.onload_waits);
  double sum = 0;
  for (const double x : waits) {
    EXPECT_TRUE(std::isfinite(x));
    EXPECT_GE(x, 0);
    sum += x;
  }
  EXPECT_NEAR(sum, s.onload_wait_seconds, 1e-9);
  EXPECT_LE(s.onload_wait_seconds, s.device_seconds);
  EXPECT_TRUE(gpu->TakeOnloadWaits().empty());  // taken
  if (slow_copies) {
    EXPECT_EQ(s.onload_waits, 0u);  // nothing copied, nothing waited for
    EXPECT_EQ(host_hits, 0u);
    EXPECT_GT(host_recomputes, 0u);
    EXPECT_EQ(s.cache.pages_onloaded, 0u);
    EXPECT_EQ(s.cache.pages_prefetched, 0u);
    return;
  }
  if (!prefetch) {
    // The onloads were timed on the copy stream (plausible for a PCIe link and small pages);
    // prefetches are not timed, so with them every host hit may have come without an onload.
    EXPECT_NE(s.onload_bytes_per_second, OnloadCostModel::kStartBytesPerSecond);
    EXPECT_GT(s.onload_bytes_per_second, 1e6);
    EXPECT_LT(s.onload_bytes_per_second, 1e12);
  }
  EXPECT_EQ(host_recomputes, 0u);
  EXPECT_GT(host_hits, 0u);
  EXPECT_GT(s.onload_waits, 0u);
  EXPECT_GT(s.cache.pages_onloaded, 0u);
  EXPECT_GT(s.cache.tokens_reused, 0u);
  EXPECT_EQ(s.kv_onload_bytes, s.cache.pages_onloaded * static_cast<uint64_t>(s.kv_page_bytes));
  if (prefetch) {
    std::printf("  pages prefetched %llu\n", static_cast<unsigned long long>(s.cache.pages_prefetched));
    EXPECT_GT(s.cache.pages_prefetched, 0u);
  }
}

TEST(CudaHostTier, RestoredUsersScoreLikeCpuEngine) {
  HSTU_SKIP_WITHOUT_GPU();
  RestoreUsersAndCompareWithCpu(/*prefetch=*/false);
}

TEST(CudaHostTier, RestoredUsersScoreLikeCpuEngineEagerSteps) {
  HSTU_SKIP_WITHOUT_GPU();
  RestoreUsersAndCompareWithCpu(/*prefetch=*/false, /*slow_copies=*/false, /*graphs=*/false);
}

TEST(CudaHostTier, PrefetchedUsersScoreLikeCpuEngine) {
  HSTU_SKIP_WITHOUT_GPU();
  RestoreUsersAndCompareWithCpu(/*prefetch=*/true);
}

TEST(CudaHostTier, SlowCopiesRecomputeHostHitsWithCpuScores) {
  HSTU_SKIP_WITHOUT_GPU();
  RestoreUsersAndCompareWithCpu(/*prefetch=*/true, /*slow_copies=*/true);
}

TEST(CudaHostTier, NoPageLeakAfter10000RandomRequests) {
  HSTU_SKIP_WITHOUT_GPU();
  const ModelConfig c = test::SmallGpuModelConfig();
  const ModelWeights w = RandomModel(c, 13);
  const int64_t gpu_pages = 48, host_pages = 160;  // 3 and 10 users of max history
  auto e = TierEngine("cuda:0", w, gpu_pages, host_pages);
  ASSERT_TRUE(e);
  std::mt19937 rng(17);
  std::vector<RankRequest> users(40);
  for (size_t u = 0; u < users.size(); ++u) users[u].user_id = 1 + u;
  int served = 0, failed = 0;
  while (served + failed < 10000) {
    std::vector<RankRequest> batch;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < n; ++i) {
      RankRequest& r = users[rng() % users.size()];
      const int kind = static_cast<int>(rng() % 10);
      if (kind == 0) {  // the user's history changes (hash mismatch)
        r.history_item_ids.assign(1 + rng() % 20, 0);
        for (auto& id : r.history_item_ids) id = rng() % 500;
        r.history_actions.assign(r.history_item_ids.size(), 1);
      } else {
        for (int k = 0, add = static_cast<int>(rng() % 12); k < add; ++k) {
          r.history_item_ids.push_back(rng() % 500);
          r.history_actions.push_back(rng() % 6);
        }
      }
      r.candidate_item_ids.assign(1 + rng() % 40, 0);  // > max_candidates: a second pass
      for (auto& id : r.candidate_item_ids) id = rng() % 500;
      batch.push_back(r);
    }
    for (auto& res : e->Rank(batch)) {
      if (res.ok()) {
        ++served;
        ASSERT_TRUE(test::AllFinite(res->scores));
      } else {
        ++failed;
        ASSERT_EQ(res.status().code(), absl::StatusCode::kResourceExhausted) << res.status();
      }
    }
  }
  EngineStats s = e->Stats();
  std::printf("  %d served, %d refused; pages free %lld of %lld, host free %lld of %lld, "
              "onloaded %llu, offloaded %llu, graph replays %llu\n",
              served, failed, static_cast<long long>(s.cache.pages_free),
              static_cast<long long>(s.cache.pages_total), static_cast<long long>(s.cache.host_pages_free),
              static_cast<long long>(s.cache.host_pages_total),
              static_cast<unsigned long long>(s.cache.pages_onloaded),
              static_cast<unsigned long long>(s.cache.pages_offloaded),
              static_cast<unsigned long long>(s.graph_replays));
  EXPECT_EQ(s.cache.pages_pinned, 0);
  EXPECT_EQ(s.cache.pages_total, gpu_pages);
  EXPECT_EQ(s.cache.host_pages_total, host_pages);
  EXPECT_GT(s.cache.pages_onloaded, 0u);
  EXPECT_GT(s.cache.host_evictions, 0u);
  EXPECT_LT(failed, served / 10);  // the run exercised the tiers, not the refusals (CPU: none)
  // Every GPU page can still be handed out: three new users of max history fill the pool exactly.
  std::vector<RankRequest> fill(3);
  for (size_t u = 0; u < fill.size(); ++u) {
    fill[u].user_id = 100000 + u;
    fill[u].history_item_ids.assign(c.max_history_tokens / 2, 7);
    fill[u].history_actions.assign(c.max_history_tokens / 2, 1);
    fill[u].candidate_item_ids = {1, 2, 3};
  }
  for (auto& res : e->Rank(fill)) EXPECT_TRUE(res.ok()) << res.status() << " (a leaked page?)";
  s = e->Stats();
  EXPECT_EQ(s.cache.pages_free, 0);
  EXPECT_EQ(s.cache.pages_pinned, 0);
  // Every host page can still be handed out: ten more new users of max history, three at a time,
  // then the host tier holds the last ten users' copies (160 pages), so the seven of them no
  // longer on the GPU come back whole. A leaked host page would have dropped the oldest.
  std::vector<RankRequest> more(10);
  for (size_t u = 0; u < more.size(); ++u) {
    more[u] = fill[0];
    more[u].user_id = 200000 + u;
    more[u].history_item_ids[0] = static_cast<int64_t>(u);  // a history of its own
  }
  for (size_t u = 0; u < more.size(); u += 3) {
    const size_t n = std::min<size_t>(3, more.size() - u);
    for (auto& res : e->Rank({more.data() + u, n})) ASSERT_TRUE(res.ok()) << res.status();
  }
  for (size_t u = 0; u < 7; u += 3) {
    const size_t n = std::min<size_t>(3, 7 - u);
    const auto back = e->Rank({more.data() + u, n});
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(back[i].ok()) << back[i].status();
      EXPECT_EQ(back[i]->cache_result, LookupResult::kHostHit) << "user " << u + i;
      EXPECT_EQ(back[i]->reused_tokens, static_cast<uint32_t>(c.max_history_tokens))
          << "user " << u + i;
    }
  }
}

}  // namespace
}  // namespace hstu
