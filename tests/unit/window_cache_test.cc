// The sliding window's bound on the cache (DESIGN §2.2): pages that no request reads again are
// released on both tiers, and a prefix that would need them is recomputed, never served.
#include <random>

#include "engine/engine.h"
#include "engine/model_file.h"
#include "gtest/gtest.h"
#include "kvcache/cache_manager.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

constexpr int32_t kPage = 4, kWindow = 10;

std::vector<uint64_t> Keys(int n, int salt = 1) {
  std::vector<uint64_t> k(n);
  for (int i = 0; i < n; ++i) k[i] = TokenKey(i % 2 == 1, 1000 * salt + i);
  return k;
}

// Pages wholly before T − W − the slack (here two pages of 4 and one 64-key block: 72 tokens) are
// dead after a commit of T tokens.
int32_t DeadAfter(int32_t tokens) {
  return std::max(0, (tokens - kWindow - CacheManager::kWindowSlackPages * kPage -
                      CacheManager::kWindowKeyBlock) / kPage);
}

void ExpectDeadPrefix(const Reservation& r, int32_t dead) {
  ASSERT_EQ(r.dead_pages, dead);
  for (size_t i = 0; i < r.page_ids.size(); ++i) {
    if (static_cast<int32_t>(i) < dead) {
      EXPECT_EQ(r.page_ids[i], kDeadPage) << i;
    } else {
      EXPECT_GE(r.page_ids[i], 0) << i;
    }
  }
}

TEST(WindowCache, CommitReleasesThePagesBehindTheWindow) {
  CacheManager m(kPage, 64, 0, 0, kWindow);
  EXPECT_EQ(m.WindowSlackTokens(), 72);
  auto r1 = m.Acquire(1, Keys(120));
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->dead_pages, 0);
  m.Commit(*r1, Keys(120));
  ASSERT_EQ(DeadAfter(120), 9);  // tokens 0-35: the first query of a reuse (120) reads from 64 on
  EXPECT_EQ(m.Stats().pages_free, 64 - (30 - 9));
  EXPECT_EQ(m.Stats().window_pages_released, 9u);

  // The grown history reuses everything: its first query (token 120) reads from token 110 on.
  auto r2 = m.Acquire(1, Keys(128));
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->result, LookupResult::kHit);
  EXPECT_EQ(r2->reused_tokens, 120);
  ASSERT_EQ(r2->page_ids.size(), 32u);
  ExpectDeadPrefix(*r2, 9);
  EXPECT_EQ(std::vector<int32_t>(r2->page_ids.begin() + 9, r2->page_ids.begin() + 30),
            std::vector<int32_t>(r1->page_ids.begin() + 9, r1->page_ids.end()));
  EXPECT_EQ(r2->pinned_pages, 23);
  EXPECT_EQ(m.Stats().pages_pinned, 23);
  m.Commit(*r2, Keys(128));
  EXPECT_EQ(m.Stats().pages_pinned, 0);
  EXPECT_EQ(m.Stats().window_pages_released, static_cast<uint64_t>(DeadAfter(128)));
  EXPECT_EQ(m.Stats().pages_free, 64 - (32 - DeadAfter(128)));

  // Without a window nothing is released.
  CacheManager plain(kPage, 64);
  auto p = plain.Acquire(1, Keys(128));
  plain.Commit(*p, Keys(128));
  EXPECT_EQ(plain.Stats().pages_free, 64 - 32);
  EXPECT_EQ(plain.Stats().window_pages_released, 0u);
}

TEST(WindowCache, PrefixThatWouldReadReleasedPagesIsRecomputed) {
  CacheManager m(kPage, 64, 0, 0, kWindow);
  auto r = m.Acquire(1, Keys(128));
  m.Commit(*r, Keys(128));
  const int32_t dead = DeadAfter(128);  // 11 pages: tokens 0-43
  ASSERT_EQ(dead, 11);

  // Token 125 edited: 31 pages match, and their first new query (token 124) reads the block of
  // token 114, keys 64 on.
  std::vector<uint64_t> late = Keys(128);
  late[125] = TokenKey(false, 99999);
  auto a = m.Acquire(1, late);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->result, LookupResult::kPartial);
  EXPECT_EQ(a->reused_tokens, 124);
  ExpectDeadPrefix(*a, dead);
  m.Commit(*a, late);

  // Token 70 edited: 17 pages match, but a query at token 68 would read the block of token 58,
  // keys 0-63, released up to 43.
  std::vector<uint64_t> early = late;
  early[70] = TokenKey(false, 88888);
  auto b = m.Acquire(1, early);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->result, LookupResult::kMismatch);
  EXPECT_EQ(b->reused_tokens, 0);
  ExpectDeadPrefix(*b, 0);  // recomputed from token 0 into real pages
  EXPECT_EQ(b->page_ids.size(), 32u);
  m.Commit(*b, early);
  EXPECT_EQ(m.Stats().pages_free, 64 - (32 - dead));

  // A shorter history whose prefix is too short for the released pages: recomputed, not stale.
  auto c = m.Acquire(1, std::vector<uint64_t>(early.begin(), early.begin() + 60));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->reused_tokens, 0);
  ExpectDeadPrefix(*c, 0);
  m.Release(*c);
  EXPECT_EQ(m.Stats().pages_free, 64);
}

// Users 1 (120 tokens) then 2 (128 tokens) on a 40-page GPU pool: user 2 evicts user 1 to the
// host.
void UserOneOnTheHostOnly(CacheManager& m, PageCopies* user_one_offload) {
  auto r1 = m.Acquire(1, Keys(120, 1));
  *user_one_offload = m.Commit(*r1, Keys(120, 1));
  m.OffloadsComplete();
  auto r2 = m.Acquire(2, Keys(128, 2));
  ASSERT_TRUE(r2.ok()) << r2.status();
  m.Commit(*r2, Keys(128, 2));
  m.OffloadsComplete();
  ASSERT_EQ(m.Stats().evictions, 1u);
  ASSERT_EQ(m.CachedTokens(1), 120);
}

TEST(WindowCache, HostCopiesHoldOnlyLivePagesAndOnloadOnlyThose) {
  CacheManager m(kPage, 40, 128, 0, kWindow);
  PageCopies off;
  UserOneOnTheHostOnly(m, &off);
  // User 1's commit released pages 0-8 before offloading: only pages 9-29 went to the host.
  ASSERT_EQ(off.src.size(), 21u);
  auto back = m.Acquire(1, Keys(124, 1));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_EQ(back->reused_tokens, 120);
  ExpectDeadPrefix(*back, 9);
  EXPECT_EQ(back->onload.src, off.dst);
  EXPECT_EQ(back->onload.dst, std::vector<int32_t>(back->page_ids.begin() + 9,
                                                   back->page_ids.begin() + 30));
  EXPECT_EQ(m.Stats().pages_onloaded, 21u);
  m.Commit(*back, Keys(124, 1));
  m.OffloadsComplete();
  m.Clear();
  EXPECT_EQ(m.Stats().pages_free, 40);
  EXPECT_EQ(m.Stats().host_pages_free, 128);
}

TEST(WindowCache, DeclinedOnloadRecomputesEveryPageAndDropsTheHostCopy) {
  CacheManager m(kPage, 40, 128, 0, kWindow);
  PageCopies off;
  UserOneOnTheHostOnly(m, &off);
  const int64_t host_free = m.Stats().host_pages_free;
  int64_t asked = -1, recompute = -1;
  auto r = m.Acquire(1, Keys(124, 1), [&](int64_t pages, int64_t tokens) {
    asked = pages;
    recompute = tokens;
    return false;
  });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(asked, 21);       // the live pages it would have copied
  EXPECT_EQ(recompute, 120);  // the tokens a decline recomputes: the whole prefix
  EXPECT_EQ(r->result, LookupResult::kHostRecompute);
  EXPECT_EQ(r->reused_tokens, 0);
  ExpectDeadPrefix(*r, 0);
  EXPECT_EQ(r->page_ids.size(), 31u);
  EXPECT_TRUE(r->onload.empty());
  EXPECT_EQ(m.Stats().host_pages_free, host_free + 21);
  PageCopies again = m.Commit(*r, Keys(124, 1));
  EXPECT_EQ(again.src.size(), static_cast<size_t>(31 - DeadAfter(124)));
}

TEST(WindowCache, ADeclinedOnloadThatCannotFitKeepsTheHostCopy) {
  // Before: the declined host copy was dropped before the pages for the recompute were
  // allocated, so a request that could not fit lost its own user's cache.
  CacheManager m(kPage, 40, 128, 0, kWindow);
  PageCopies off;
  UserOneOnTheHostOnly(m, &off);
  const int64_t host_free = m.Stats().host_pages_free;
  auto held = m.Acquire(2, Keys(132, 2));  // user 2's request in flight pins its pages
  ASSERT_TRUE(held.ok()) << held.status();
  auto r = m.Acquire(1, Keys(124, 1), [](int64_t, int64_t) { return false; });
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(m.CachedTokens(1), 120);
  EXPECT_EQ(m.Stats().host_pages_free, host_free);
  m.Commit(*held, Keys(132, 2));
  m.OffloadsComplete();
  auto back = m.Acquire(1, Keys(124, 1), [](int64_t, int64_t) { return true; });
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_EQ(back->reused_tokens, 120);
  EXPECT_EQ(back->onload.src, off.dst);
  m.Commit(*back, Keys(124, 1));
}

TEST(WindowCache, PrefetchCopiesOnlyLivePages) {
  CacheManager m(kPage, 40, 128, 0, kWindow);
  PageCopies off;
  UserOneOnTheHostOnly(m, &off);
  int64_t asked = -1, recompute = -1;
  PageCopies pre = m.Prefetch(1, Keys(124, 1), {}, [&](int64_t pages, int64_t tokens) {
    asked = pages;
    recompute = tokens;
    return true;
  });
  EXPECT_EQ(asked, 21);
  EXPECT_EQ(recompute, 120);
  EXPECT_EQ(pre.src, off.dst);
  ASSERT_EQ(pre.dst.size(), 21u);
  m.PrefetchesComplete();
  auto r = m.Acquire(1, Keys(124, 1));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->result, LookupResult::kHostHit);
  EXPECT_TRUE(r->onload.empty());
  ExpectDeadPrefix(*r, 9);
  EXPECT_EQ(std::vector<int32_t>(r->page_ids.begin() + 9, r->page_ids.begin() + 30), pre.dst);
  m.Commit(*r, Keys(124, 1));
}

TEST(WindowCache, PrefetchedUserDoesNotMakeARequestThatCannotFitEvictOthers) {
  // User 1's prefetch holds 21 live pages behind 9 dead slots. A request of 32 pages cannot fit
  // (9 free + 21 evictable), so it must fail without evicting anyone. (The prefetch count was
  // lowered by 30, dead slots included, when user 1 acquired: the check saw more pages than there
  // were and evicted user 1 for nothing.)
  CacheManager m(kPage, 32, 64, 0, kWindow);
  for (uint64_t u : {1, 2}) {
    const int n = u == 1 ? 120 : 8;
    auto r = m.Acquire(u, Keys(n, static_cast<int>(u)));
    ASSERT_TRUE(r.ok()) << r.status();
    m.Commit(*r, Keys(n, static_cast<int>(u)));
    m.OffloadsComplete();
  }
  auto big = m.Acquire(3, Keys(128, 3));  // 32 pages: both users to the host
  ASSERT_TRUE(big.ok()) << big.status();
  m.Release(*big);
  ASSERT_EQ(m.Prefetch(1, Keys(120, 1)).src.size(), 21u);
  ASSERT_EQ(m.Prefetch(2, Keys(8, 2)).src.size(), 2u);
  auto r1 = m.Acquire(1, Keys(120, 1));
  ASSERT_TRUE(r1.ok()) << r1.status();
  m.Commit(*r1, Keys(120, 1));
  const uint64_t evictions = m.Stats().evictions;
  auto r4 = m.Acquire(4, Keys(128, 4));
  EXPECT_EQ(r4.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.Stats().evictions, evictions);
  EXPECT_EQ(m.CachedTokens(1), 120);
}

// The slack is a page cut plus a key block, not the larger of the two. With their maximum (64
// tokens here), a history of T tokens whose last event changed was recomputed whole for 2 % of the
// T at page size 1, and with a page size that does not divide the block a failed request's cut
// released the pages an offload in flight was still reading.
TEST(WindowCache, AnEditedLastEventKeepsItsPrefixAtPageSizeOne) {
  for (int tokens = 200; tokens < 300; ++tokens) {
    CacheManager m(/*page_size=*/1, 1000, 0, 0, /*window_tokens=*/100);
    std::vector<uint64_t> k(tokens);
    for (int i = 0; i < tokens; ++i) k[i] = TokenKey(i % 2 == 1, 1000 + i);
    auto first = m.Acquire(1, k);
    ASSERT_TRUE(first.ok());
    m.Commit(*first, k);
    k[tokens - 2] = TokenKey(false, 7);  // the last event (item, action) changed
    k[tokens - 1] = TokenKey(true, 7);
    auto edited = m.Acquire(1, k);
    ASSERT_TRUE(edited.ok());
    EXPECT_EQ(edited->result, LookupResult::kPartial) << tokens;  // before: a mismatch at 229
    EXPECT_EQ(edited->reused_tokens, tokens - 2) << tokens;
    m.Release(*edited);
  }
}

TEST(WindowCache, AFailedRequestKeepsTheHostCopyAnOffloadInFlightWrites) {
  // Page size 17, window 1: the commit of 133 tokens offloads its live full pages; the user's
  // next request (a GPU hit) fails while that offload is in flight. Before: the cut behind the
  // window emptied the entry, freeing the pages the offload was still reading and writing.
  CacheManager m(/*page_size=*/17, 40, 40, 0, /*window_tokens=*/1);
  auto first = m.Acquire(6, Keys(133));
  ASSERT_TRUE(first.ok());
  const PageCopies off = m.Commit(*first, Keys(133));
  ASSERT_FALSE(off.empty());
  auto again = m.Acquire(6, Keys(163));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->result, LookupResult::kHit);
  m.Release(*again);
  ASSERT_TRUE(m.offloads_in_flight());
  EXPECT_EQ(m.CachedTokens(6), 7 * 17);
  // The offload's pages are still the entry's: none is free to hand out.
  EXPECT_LE(m.Stats().pages_free, 40 - static_cast<int64_t>(off.src.size()));
  EXPECT_LE(m.Stats().host_pages_free, 40 - static_cast<int64_t>(off.dst.size()));
  m.OffloadsComplete();
  m.Clear();
  EXPECT_EQ(m.Stats().pages_free, 40);
  EXPECT_EQ(m.Stats().host_pages_free, 40);
}

// Random edits, truncations, failures, evictions to a host tier, prefetches and offloads that
// complete late: a reused prefix never needs a released page, and every page comes back.
TEST(WindowCache, NoPagesLeakAndNoReuseReadsAReleasedPage) {
  CacheManager m(3, 90, 150, 0, 7);
  std::mt19937 rng(11);
  std::vector<std::vector<uint64_t>> hist(12);
  uint64_t reused_with_dead = 0;
  for (int step = 0; step < 4000; ++step) {
    const int u = rng() % 12;
    auto& h = hist[u];
    const int op = rng() % 10;
    if (op < 6) {
      for (int i = 0; i < 4; ++i) h.push_back(TokenKey(i % 2, rng() % 100));
    } else if (op < 8 && h.size() > 4) {
      h[h.size() - 1 - rng() % std::min<size_t>(h.size(), 12)] = TokenKey(false, rng());
    } else if (h.size() > 6) {
      h.resize(h.size() - 4);
    }
    if (h.size() > 200) h.erase(h.begin(), h.begin() + 60);
    if (rng() % 7 == 0) m.Prefetch(rng() % 12, hist[rng() % 12]);
    if (rng() % 3 == 0) m.PrefetchesComplete();
    if (rng() % 4 == 0) m.OffloadsComplete();
    auto r = m.Acquire(u, h);
    if (!r.ok()) {
      m.OffloadsComplete();
      m.PrefetchesComplete();
      continue;
    }
    if (r->dead_pages > 0) {
      ++reused_with_dead;
      // The first new query reads from the 64-key block holding reused − W.
      EXPECT_GE((r->reused_tokens - 7) / 64 * 64, r->dead_pages * 3) << "step " << step;
    }
    for (size_t i = r->dead_pages; i < r->page_ids.size(); ++i) ASSERT_GE(r->page_ids[i], 0);
    if (rng() % 20 == 0) {
      m.Release(*r);
    } else {
      m.Commit(*r, h);
    }
  }
  EXPECT_GT(reused_with_dead, 100u);
  EXPECT_GT(m.Stats().window_pages_released, 0u);
  EXPECT_EQ(m.Stats().pages_pinned, 0);
  m.OffloadsComplete();
  m.PrefetchesComplete();
  m.Clear();
  EXPECT_EQ(m.Stats().pages_free, 90);
  EXPECT_EQ(m.Stats().host_pages_free, 150);
}

ModelConfig WindowConfig() {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 2;
  c.hidden_dim = 16;
  c.num_heads = 2;
  c.head_dim = 8;
  c.max_history_tokens = 160;
  c.max_candidates = 8;
  c.attention_norm_len = 168;
  c.max_attn_len = 12;
  c.position_encoding = false;
  c.position_rows = 0;
  c.item_rows = 97;
  c.action_rows = 5;
  c.num_tasks = 2;
  c.head_dims = {16, 8, 2};
  return c;
}

std::unique_ptr<Engine> WindowEngine(bool cache, int64_t pages) {
  EngineOptions o;
  o.enable_cache = cache;
  o.page_size = kPage;
  o.cache_pages = pages;
  o.host_cache_pages = 0;
  auto e = Engine::Create(o, RandomModel(WindowConfig(), 5));
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

// Six users growing to 160 tokens need 240 pages of 4 tokens without the window's release; 150
// hold them all with it, so every return visit is a GPU hit, and the scores are a full
// recompute's.
TEST(WindowCacheEngine, PoolBoundedByTheWindowKeepsEveryUserAndScoresLikeNoCache) {
  auto cached = WindowEngine(true, 150);
  auto full = WindowEngine(false, 0);
  std::mt19937 rng(3);
  std::vector<RankRequest> users(6);
  for (int u = 0; u < 6; ++u) users[u].user_id = 40 + u;
  int returns = 0;
  for (int visit = 0; visit < 20; ++visit) {
    for (auto& r : users) {
      for (int i = 0; i < 4; ++i) {
        r.history_item_ids.push_back(rng() % 97);
        r.history_actions.push_back(rng() % 5);
      }
      r.candidate_item_ids = {static_cast<int64_t>(rng() % 97), static_cast<int64_t>(rng() % 97)};
      auto a = cached->Rank({&r, 1});
      auto b = full->Rank({&r, 1});
      ASSERT_TRUE(a[0].ok() && b[0].ok()) << a[0].status() << b[0].status();
      EXPECT_LE(test::MaxAbsDiff(a[0]->scores, b[0]->scores), test::kF32Abs);
      if (visit > 0) {
        ++returns;
        EXPECT_EQ(a[0]->cache_result, LookupResult::kHit) << "visit " << visit;
        EXPECT_EQ(a[0]->computed_tokens, 8u);
      }
    }
  }
  EXPECT_EQ(returns, 6 * 19);
  const CacheStats s = cached->Stats().cache;
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_GT(s.window_pages_released, 0u);
}

// Returning users cycle through a GPU pool and a host tier both smaller than the working set,
// with edits and histories past the model's maximum (truncation), under both onload outcomes:
// every score is a full recompute's. (The cache-level test above checks that no page leaks.)
class WindowHostTierEngine : public ::testing::TestWithParam<bool> {};

TEST_P(WindowHostTierEngine, ScoresLikeAFullRecompute) {
  const bool onload = GetParam();
  EngineOptions o;
  o.page_size = kPage;
  o.cache_pages = 60;
  o.host_cache_pages = 100;
  o.onload_policy = onload ? OnloadPolicy::kAlways : OnloadPolicy::kCost;
  if (!onload) {
    o.onload_bytes_per_second = 1;  // a copy takes minutes: every host hit is recomputed
    o.recompute_seconds_per_token = 1e-6;
  }
  auto cached = Engine::Create(o, RandomModel(WindowConfig(), 7));
  ASSERT_TRUE(cached.ok()) << cached.status();
  auto reference = Engine::Create([] {
    EngineOptions r;
    r.enable_cache = false;
    r.page_size = kPage;
    return r;
  }(), RandomModel(WindowConfig(), 7));
  ASSERT_TRUE(reference.ok());
  std::mt19937 rng(onload ? 21 : 22);
  std::vector<RankRequest> users(8);
  for (int u = 0; u < 8; ++u) users[u].user_id = 70 + u;
  for (int step = 0; step < 400; ++step) {
    RankRequest& r = users[rng() % 8];
    const int add = 1 + rng() % 6;
    for (int i = 0; i < add; ++i) {
      r.history_item_ids.push_back(rng() % 97);
      r.history_actions.push_back(rng() % 5);
    }
    const size_t n = r.history_item_ids.size();
    if (rng() % 8 == 0) r.history_item_ids[n - 1 - rng() % std::min<size_t>(n, 6)] = 3;
    if (rng() % 25 == 0) r.history_item_ids[rng() % n] = 5;
    if (n > 100) {  // longer than the model keeps: truncation moves the start in strides
      r.history_item_ids.erase(r.history_item_ids.begin(), r.history_item_ids.begin() + 30);
      r.history_actions.erase(r.history_actions.begin(), r.history_actions.begin() + 30);
    }
    r.candidate_item_ids = {static_cast<int64_t>(rng() % 97), static_cast<int64_t>(rng() % 97)};
    auto a = (*cached)->Rank({&r, 1});
    auto b = (*reference)->Rank({&r, 1});
    ASSERT_TRUE(a[0].ok() && b[0].ok()) << a[0].status() << " step " << step;
    EXPECT_LE(test::MaxAbsDiff(a[0]->scores, b[0]->scores), test::kF32Abs) << "step " << step;
  }
  const CacheStats s = (*cached)->Stats().cache;
  const uint64_t host_hits = s.lookups[static_cast<int>(LookupResult::kHostHit)];
  const uint64_t host_recomputes = s.lookups[static_cast<int>(LookupResult::kHostRecompute)];
  EXPECT_GT(onload ? host_hits : host_recomputes, 0u);
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(s.window_pages_released, 0u);
  EXPECT_EQ(s.pages_pinned, 0);
}

INSTANTIATE_TEST_SUITE_P(OnloadOrRecompute, WindowHostTierEngine, ::testing::Bool());

}  // namespace
}  // namespace hstu
