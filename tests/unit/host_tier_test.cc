// Host KV tier policy (DESIGN §6) on metadata and on the CPU engine, where a host copy is a memcpy.
#include <random>

#include "engine/engine.h"
#include "engine/model_file.h"
#include "gtest/gtest.h"
#include "kvcache/cache_manager.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

std::vector<uint64_t> Keys(int n, int salt) {
  std::vector<uint64_t> k(n);
  for (int i = 0; i < n; ++i) k[i] = TokenKey(i % 2 == 1, 1000 * salt + i);
  return k;
}

TEST(HostTier, CommitOffloadsNewFullPagesOnly) {
  CacheManager m(4, 16, 16);
  auto r = m.Acquire(1, Keys(10, 1));
  PageCopies c = m.Commit(*r, Keys(10, 1));
  m.OffloadsComplete();
  ASSERT_EQ(c.src.size(), 2u);  // tokens 0-7; the partial page (8, 9) stays GPU-only
  EXPECT_EQ(c.src, std::vector<int32_t>(r->page_ids.begin(), r->page_ids.begin() + 2));
  auto r2 = m.Acquire(1, Keys(13, 1));
  PageCopies c2 = m.Commit(*r2, Keys(13, 1));
  m.OffloadsComplete();
  ASSERT_EQ(c2.src.size(), 1u);  // only page 2 is new and full
  EXPECT_EQ(c2.src[0], r2->page_ids[2]);
  EXPECT_EQ(m.Stats().pages_offloaded, 3u);
  EXPECT_EQ(m.Stats().host_pages_free, 13);
}

TEST(HostTier, GpuEvictionKeepsHostCopyAndNextVisitOnloads) {
  CacheManager m(4, 4, 16);  // GPU: two users of 8 tokens
  for (int u = 1; u <= 2; ++u) {
    auto r = m.Acquire(u, Keys(8, u));
    m.Commit(*r, Keys(8, u));
    m.OffloadsComplete();
  }
  auto r3 = m.Acquire(3, Keys(8, 3));  // evicts user 1 from the GPU (LRU)
  m.Commit(*r3, Keys(8, 3));
  m.OffloadsComplete();
  EXPECT_EQ(m.Stats().evictions, 1u);
  EXPECT_EQ(m.Stats().dropped_entries, 0u);
  EXPECT_EQ(m.CachedTokens(1), 8);  // still cached, on the host
  auto back = m.Acquire(1, Keys(10, 1));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_EQ(back->reused_tokens, 8);
  ASSERT_EQ(back->onload.src.size(), 2u);
  EXPECT_EQ(back->onload.dst, std::vector<int32_t>(back->page_ids.begin(), back->page_ids.begin() + 2));
  m.Commit(*back, Keys(10, 1));
  m.OffloadsComplete();
  EXPECT_EQ(m.Stats().pages_onloaded, 2u);
}

TEST(HostTier, PartialLastPageIsRecomputedAfterEviction) {
  CacheManager m(4, 3, 16);
  auto r = m.Acquire(1, Keys(10, 1));  // 3 pages, 2 full
  m.Commit(*r, Keys(10, 1));
  m.OffloadsComplete();
  auto r2 = m.Acquire(2, Keys(4, 2));  // evicts user 1
  m.Commit(*r2, Keys(4, 2));
  m.OffloadsComplete();
  auto back = m.Acquire(1, Keys(10, 1));
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_EQ(back->reused_tokens, 8);
}

TEST(HostTier, HashMismatchAfterEvictionIsDetected) {
  CacheManager m(4, 4, 16);
  auto r = m.Acquire(1, Keys(8, 1));
  m.Commit(*r, Keys(8, 1));
  m.OffloadsComplete();
  auto r2 = m.Acquire(2, Keys(16, 2));  // evicts user 1 to the host
  m.Commit(*r2, Keys(16, 2));
  m.OffloadsComplete();
  auto edited = Keys(8, 1);
  edited[5] = TokenKey(true, 4242);
  auto back = m.Acquire(1, edited);
  EXPECT_EQ(back->result, LookupResult::kHostHit);  // page 0 still matches
  EXPECT_EQ(back->reused_tokens, 4);
  EXPECT_EQ(back->onload.src.size(), 1u);
  m.Release(*back);
  edited[0] = TokenKey(false, 4242);
  auto r3 = m.Acquire(1, edited);
  EXPECT_EQ(r3->result, LookupResult::kMiss);  // the failed request dropped the entry
}

TEST(HostTier, FullHostTierDropsLeastRecentlyUsedUnpinnedCopies) {
  CacheManager m(4, 2, 4);  // GPU one user of 8; host two users of 8
  for (int u = 1; u <= 3; ++u) {
    auto r = m.Acquire(u, Keys(8, u));
    m.Commit(*r, Keys(8, u));
    m.OffloadsComplete();
  }
  // User 1: host only, oldest. User 2: host only. User 3: GPU, its host copy evicted user 1's.
  const CacheStats s = m.Stats();
  EXPECT_EQ(s.host_evictions, 1u);
  EXPECT_EQ(s.dropped_entries, 1u);
  EXPECT_EQ(m.CachedTokens(1), 0);
  EXPECT_EQ(m.CachedTokens(2), 8);
  EXPECT_EQ(m.CachedTokens(3), 8);
}

TEST(HostTier, PinnedEntriesKeepTheirHostCopies) {
  CacheManager m(4, 8, 2);  // host holds one user of 8
  auto r = m.Acquire(1, Keys(8, 1));
  m.Commit(*r, Keys(8, 1));
  m.OffloadsComplete();
  auto pinned = m.Acquire(1, Keys(8, 1));
  auto r2 = m.Acquire(2, Keys(8, 2));
  PageCopies c2 = m.Commit(*r2, Keys(8, 2));
  EXPECT_TRUE(c2.empty());  // no room: user 1's copy is pinned, user 2 stays GPU-only
  m.Commit(*pinned, Keys(8, 1));
  m.OffloadsComplete();
  EXPECT_EQ(m.Stats().host_evictions, 0u);
}

TEST(HostTier, InFlightOffloadsHoldTheirPagesUntilComplete) {
  CacheManager m(4, 4, 16);
  auto r = m.Acquire(1, Keys(8, 1));
  ASSERT_EQ(m.Commit(*r, Keys(8, 1)).src.size(), 2u);
  EXPECT_TRUE(m.offloads_in_flight());
  // Its own next visit must wait: the copy still reads its GPU pages.
  EXPECT_EQ(m.Acquire(1, Keys(10, 1)).status().code(), absl::StatusCode::kUnavailable);
  // Nobody may evict it either: user 2 needs all four pages.
  EXPECT_EQ(m.Acquire(2, Keys(16, 2)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.CachedTokens(1), 8);
  m.OffloadsComplete();
  EXPECT_FALSE(m.offloads_in_flight());
  auto r2 = m.Acquire(2, Keys(16, 2));  // now user 1 moves to the host
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(m.Stats().evictions, 1u);
  EXPECT_EQ(m.CachedTokens(1), 8);
}

TEST(HostTier, OffloadBacklogIsBounded) {
  CacheManager m(4, 64, 64, /*max_inflight_pages=*/3);
  auto r = m.Acquire(1, Keys(8, 1));
  EXPECT_EQ(m.Commit(*r, Keys(8, 1)).src.size(), 2u);
  auto r2 = m.Acquire(2, Keys(8, 2));
  EXPECT_TRUE(m.Commit(*r2, Keys(8, 2)).empty());  // 2 + 2 > 3: stays GPU-only for now
  EXPECT_EQ(m.Stats().offloads_skipped, 2u);
  m.OffloadsComplete();
  auto r3 = m.Acquire(2, Keys(10, 2));
  EXPECT_EQ(m.Commit(*r3, Keys(10, 2)).src.size(), 2u);  // picked up by the next commit
}

ModelConfig SmallConfig() {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 2;
  c.hidden_dim = 16;
  c.num_heads = 2;
  c.head_dim = 8;
  c.max_history_tokens = 64;
  c.position_rows = 64;
  c.attention_norm_len = 80;
  c.num_tasks = 2;
  c.head_dims = {16, 8, 2};
  return c;
}

// The reference for the engine tests: same model and page size, no cache, every history recomputed.
absl::StatusOr<std::unique_ptr<Engine>> RecomputingEngine(EngineOptions o, uint64_t seed) {
  o.enable_cache = false;
  o.host_cache_pages = 0;
  o.cache_pages = 64;
  return Engine::Create(o, RandomModel(SmallConfig(), seed));
}

TEST(HostTierEngine, UsersRestoredFromTheHostScoreLikeAFullRecompute) {
  EngineOptions o;
  o.page_size = 4;
  o.cache_pages = 24;        // ~2 users of 40 tokens on the "GPU"
  o.host_cache_pages = 40;   // ~4 users on the host; the working set of 8 users fits nowhere whole
  o.keep_hidden = true;
  auto cached = Engine::Create(o, RandomModel(SmallConfig(), 5));
  ASSERT_TRUE(cached.ok()) << cached.status();
  auto full = RecomputingEngine(o, 5);
  ASSERT_TRUE(full.ok());
  std::mt19937 rng(11);
  std::vector<RankRequest> users(8);
  for (int u = 0; u < 8; ++u) users[u].user_id = u;
  for (int step = 0; step < 200; ++step) {
    RankRequest& r = users[rng() % 8];
    const int add = 1 + rng() % 3;
    for (int i = 0; i < add; ++i) {
      r.history_item_ids.push_back(rng() % 500);
      r.history_actions.push_back(rng() % 16);
    }
    if (rng() % 15 == 0) r.history_item_ids[rng() % r.history_item_ids.size()] = 7;
    r.candidate_item_ids = {static_cast<int64_t>(rng() % 500), static_cast<int64_t>(rng() % 500)};
    auto a = (*cached)->Rank({&r, 1});
    auto b = (*full)->Rank({&r, 1});
    ASSERT_TRUE(a[0].ok()) << a[0].status();
    ASSERT_TRUE(b[0].ok());
    ASSERT_LE(test::MaxAbsDiff(a[0]->scores, b[0]->scores), test::kF32Abs) << "step " << step;
    ASSERT_LE(test::RelL2(a[0]->hidden, b[0]->hidden), test::kF32RelL2) << "step " << step;
  }
  const EngineStats s = (*cached)->Stats();
  EXPECT_GT(s.cache.lookups[static_cast<int>(LookupResult::kHostHit)], 0u);
  EXPECT_GT(s.cache.evictions, 0u);
  EXPECT_GT(s.cache.host_evictions, 0u);
  EXPECT_GT(s.kv_onload_bytes, 0u);
  EXPECT_EQ(s.kv_offload_bytes, s.cache.pages_offloaded * static_cast<uint64_t>(s.kv_page_bytes));
  EXPECT_EQ(s.cache.pages_pinned, 0);
}

TEST(HostTierPrefetch, QueuedHostUserIsOnloadedEarlyAndReportedAsHostHit) {
  CacheManager m(4, 4, 16);
  for (int u = 1; u <= 2; ++u) {  // user 1 ends up on the host only
    auto r = m.Acquire(u, Keys(8, u));
    m.Commit(*r, Keys(8, u));
    m.OffloadsComplete();
  }
  auto r3 = m.Acquire(3, Keys(4, 3));  // frees nothing: pool 4 = user 2 (2) + user 3 (1) + 1 free
  m.Commit(*r3, Keys(4, 3));
  m.OffloadsComplete();
  ASSERT_EQ(m.CachedTokens(1), 8);
  // Needs 2 pages, 1 is free; users 2 and 3 would make room losslessly (their pages all have
  // host copies) but they are in the batch about to run.
  const std::vector<uint64_t> running = {2, 3};
  EXPECT_TRUE(m.Prefetch(1, Keys(10, 1), running).empty());
  EXPECT_EQ(m.Stats().evictions, 1u);
  PageCopies c = m.Prefetch(1, Keys(10, 1), std::vector<uint64_t>{3});  // user 2 moves to the host
  ASSERT_EQ(c.src.size(), 2u);
  EXPECT_EQ(m.Stats().evictions, 2u);
  EXPECT_EQ(m.CachedTokens(2), 8);  // still cached, on the host
  EXPECT_TRUE(m.prefetches_pending());
  EXPECT_TRUE(m.Prefetch(1, Keys(10, 1)).empty());  // already on its way
  // While in flight, nobody evicts it: user 5 needs more than the unpinned, unprefetched pages.
  EXPECT_EQ(m.Acquire(5, Keys(16, 5)).status().code(), absl::StatusCode::kResourceExhausted);
  auto back = m.Acquire(1, Keys(10, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_TRUE(back->prefetched);
  EXPECT_TRUE(back->onload.empty());  // the copies were issued by the prefetch
  EXPECT_EQ(back->reused_tokens, 8);
  EXPECT_EQ(std::vector<int32_t>(back->page_ids.begin(), back->page_ids.begin() + 2), c.dst);
  m.Commit(*back, Keys(10, 1));
  m.OffloadsComplete();
  m.PrefetchesComplete();
  EXPECT_EQ(m.Stats().pages_prefetched, 2u);
  auto again = m.Acquire(1, Keys(12, 1));
  EXPECT_EQ(again->result, LookupResult::kHit);  // on the GPU now
  m.Commit(*again, Keys(12, 1));
}

TEST(HostTierPrefetch, ChangedHistoryWaitsForThePrefetchBeforeFreeingItsPages) {
  CacheManager m(4, 8, 16);
  auto r = m.Acquire(1, Keys(8, 1));
  m.Commit(*r, Keys(8, 1));
  m.OffloadsComplete();
  auto big = m.Acquire(2, Keys(32, 2));  // evicts user 1 to the host
  m.Commit(*big, Keys(32, 2));
  m.OffloadsComplete();
  auto freed = m.Acquire(2, Keys(32, 2));
  m.Release(*freed);
  ASSERT_EQ(m.Prefetch(1, Keys(8, 1)).src.size(), 2u);
  auto edited = Keys(8, 1);
  edited[6] = TokenKey(false, 777);
  EXPECT_EQ(m.Acquire(1, edited).status().code(), absl::StatusCode::kUnavailable);
  m.PrefetchesComplete();
  auto r2 = m.Acquire(1, edited);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->reused_tokens, 4);  // page 0 still matches
  m.Commit(*r2, edited);
}

TEST(HostTierPrefetchEngine, PrefetchedUsersScoreLikeAFullRecompute) {
  EngineOptions o;
  o.page_size = 4;
  o.cache_pages = 40;
  o.host_cache_pages = 80;
  auto cached = Engine::Create(o, RandomModel(SmallConfig(), 6));
  ASSERT_TRUE(cached.ok()) << cached.status();
  auto full = RecomputingEngine(o, 6);
  ASSERT_TRUE(full.ok());
  std::mt19937 rng(21);
  std::vector<RankRequest> users(10);
  for (int u = 0; u < 10; ++u) users[u].user_id = u;
  for (int step = 0; step < 150; ++step) {
    RankRequest& r = users[rng() % 10];
    for (int i = 0, n = 1 + rng() % 3; i < n; ++i) {
      r.history_item_ids.push_back(rng() % 500);
      r.history_actions.push_back(rng() % 16);
    }
    r.candidate_item_ids = {static_cast<int64_t>(rng() % 500)};
    // As the scheduler does: prefetch a few "queued" users (here: random ones, often this one).
    std::vector<RankRequest> queued = {users[rng() % 10], users[rng() % 10], r};
    (*cached)->Prefetch({&r, 1}, queued);
    auto a = (*cached)->Rank({&r, 1});
    auto b = (*full)->Rank({&r, 1});
    ASSERT_TRUE(a[0].ok()) << a[0].status();
    ASSERT_LE(test::MaxAbsDiff(a[0]->scores, b[0]->scores), test::kF32Abs) << "step " << step;
  }
  const EngineStats s = (*cached)->Stats();
  EXPECT_GT(s.cache.pages_prefetched, 0u);
  EXPECT_GT(s.cache.lookups[static_cast<int>(LookupResult::kHostHit)], 0u);
  EXPECT_EQ(s.cache.pages_pinned, 0);
}

}  // namespace
}  // namespace hstu
