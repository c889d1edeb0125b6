// Host KV tier policy (DESIGN §6) on the cache's metadata: offload, eviction, onload, prefetch.
// host_tier_engine_test.cc runs the same policy through the CPU engine.
#include "gtest/gtest.h"
#include "kvcache/cache_manager.h"

namespace hstu {
namespace {

std::vector<uint64_t> Keys(int n, int salt) {
  std::vector<uint64_t> k(n);
  for (int i = 0; i < n; ++i) k[i] = TokenKey(i % 2 == 1, 1000 * salt + i);
  return k;
}

void AcquireCommitComplete(CacheManager& m, uint64_t user, const std::vector<uint64_t>& keys) {
  auto r = m.Acquire(user, keys);
  ASSERT_TRUE(r.ok()) << r.status();
  m.Commit(*r, keys);
  m.OffloadsComplete();
}

TEST(HostTier, AFailedPartlyMatchingAcquireKeepsBothTiersWhole) {
  // The cut to the 2 matching pages freed 2 GPU pages and 2 host copies; the allocation of the
  // rest then failed, and both tiers get their pages back.
  CacheManager m(4, 6, 16);
  const std::vector<uint64_t> cached = Keys(16, 1);
  AcquireCommitComplete(m, 1, cached);
  ASSERT_EQ(m.Stats().host_pages_free, 12);
  std::vector<uint64_t> edited = Keys(28, 1);
  edited[9] = TokenKey(false, 99999);  // page 2 changes: pages 0-1 match, 5 more needed
  auto failed = m.Acquire(1, edited);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  CacheStats s = m.Stats();
  EXPECT_EQ(m.CachedTokens(1), 16);
  EXPECT_EQ(s.pages_free, 2);
  EXPECT_EQ(s.host_pages_free, 12);
  std::vector<uint64_t> grown = cached;
  grown.push_back(TokenKey(true, 5));
  auto next = m.Acquire(1, grown);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->result, LookupResult::kHit);
  EXPECT_EQ(next->reused_tokens, 16);
  m.Commit(*next, grown);
  m.OffloadsComplete();
  s = m.Stats();
  EXPECT_EQ(s.host_pages_free, 12);  // page 4 is partial: no new host copy
  EXPECT_EQ(s.pages_free, 1);
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
  m.Release(*back);  // the failed request keeps the host copy of page 0
  EXPECT_EQ(m.CachedTokens(1), 4);
  edited[0] = TokenKey(false, 4242);
  auto r3 = m.Acquire(1, edited);
  EXPECT_EQ(r3->result, LookupResult::kMismatch);
}

TEST(HostTier, FullHostTierDropsLeastRecentlyUsedUnpinnedCopies) {
  CacheManager m(4, 2, 4);  // GPU one user of 8; host two users of 8
  AcquireCommitComplete(m, 1, Keys(8, 1));
  AcquireCommitComplete(m, 2, Keys(8, 2));  // user 1 now on the host only
  // User 1 comes back (onloaded from the host): its copy is now the more recently used, though
  // user 2's was written later.
  auto back = m.Acquire(1, Keys(8, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->reused_tokens, 8);
  m.Commit(*back, Keys(8, 1));
  m.OffloadsComplete();
  // User 3's host copy needs room: the least recently used copy, user 2's, is dropped.
  AcquireCommitComplete(m, 3, Keys(8, 3));
  const CacheStats s = m.Stats();
  EXPECT_EQ(s.host_evictions, 1u);
  EXPECT_EQ(s.dropped_entries, 1u);
  EXPECT_EQ(m.CachedTokens(1), 8);
  EXPECT_EQ(m.CachedTokens(2), 0);
  EXPECT_EQ(m.CachedTokens(3), 8);
}

TEST(HostTier, PinnedEntriesKeepTheirHostCopies) {
  CacheManager m(4, 8, 2);  // host holds one user of 8
  AcquireCommitComplete(m, 1, Keys(8, 1));
  auto pinned = m.Acquire(1, Keys(8, 1));
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  auto r2 = m.Acquire(2, Keys(8, 2));
  ASSERT_TRUE(r2.ok()) << r2.status();
  PageCopies c2 = m.Commit(*r2, Keys(8, 2));
  EXPECT_TRUE(c2.empty());  // no room: user 1's copy is pinned, user 2 stays GPU-only
  m.Commit(*pinned, Keys(8, 1));
  m.OffloadsComplete();
  const CacheStats s = m.Stats();
  EXPECT_EQ(s.host_evictions, 0u);
  EXPECT_EQ(s.dropped_entries, 0u);
  EXPECT_EQ(m.CachedTokens(1), 8);
  // The copy is whole: with user 1 pushed off the GPU, its next visit is a host hit of all 8.
  AcquireCommitComplete(m, 3, Keys(32, 3));  // the whole GPU pool
  auto back = m.Acquire(1, Keys(8, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_EQ(back->reused_tokens, 8);
  EXPECT_FALSE(back->onload.empty());
}

TEST(HostTier, InFlightOffloadsHoldTheirPagesUntilComplete) {
  CacheManager m(4, 4, 16);
  auto r = m.Acquire(1, Keys(8, 1));
  ASSERT_EQ(m.Commit(*r, Keys(8, 1)).src.size(), 2u);
  EXPECT_TRUE(m.offloads_in_flight());
  // A visit that would reuse less of it must wait: the copy still reads its GPU pages.
  auto edited = Keys(10, 1);
  edited[2] = TokenKey(false, 999);
  EXPECT_EQ(m.Acquire(1, edited).status().code(), absl::StatusCode::kUnavailable);
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

TEST(HostTier, ReturningUserExtendsAnEntryWhoseOffloadIsInFlight) {
  CacheManager m(4, 16, 32);
  auto r = m.Acquire(1, Keys(8, 1));
  ASSERT_EQ(m.Commit(*r, Keys(8, 1)).src.size(), 2u);
  // The user is back before the copy completed: a GPU hit, nothing waits.
  auto back = m.Acquire(1, Keys(13, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->result, LookupResult::kHit);
  EXPECT_EQ(back->reused_tokens, 8);
  // Its commit offloads the one new full page, beside the copy still in flight.
  const PageCopies more = m.Commit(*back, Keys(13, 1));
  ASSERT_EQ(more.src.size(), 1u);
  EXPECT_EQ(more.src[0], back->page_ids[2]);
  // Still not evictable (user 2 needs the whole pool), until every copy is complete.
  EXPECT_EQ(m.Acquire(2, Keys(64, 2)).status().code(), absl::StatusCode::kResourceExhausted);
  m.OffloadsComplete();
  EXPECT_FALSE(m.offloads_in_flight());
  auto r2 = m.Acquire(2, Keys(64, 2));
  ASSERT_TRUE(r2.ok()) << r2.status();
  m.Commit(*r2, Keys(64, 2));
  m.OffloadsComplete();
  // User 1 lives on the host now, with all three full pages.
  auto again = m.Acquire(1, Keys(13, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->result, LookupResult::kHostHit);
  EXPECT_EQ(again->reused_tokens, 12);
  EXPECT_EQ(again->onload.src.size(), 3u);
}

TEST(HostTier, FailedRequestKeepsTheFullPagesAnOffloadStillReads) {
  CacheManager m(4, 16, 16);
  auto r = m.Acquire(1, Keys(10, 1));
  ASSERT_EQ(m.Commit(*r, Keys(10, 1)).src.size(), 2u);
  auto back = m.Acquire(1, Keys(20, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  const int64_t free_before = m.Stats().pages_free;
  m.Release(*back);  // the forward failed
  // The two offloaded pages stay (the copy reads them); the partial page and the new ones are freed.
  EXPECT_EQ(m.CachedTokens(1), 8);
  EXPECT_EQ(m.Stats().pages_free, free_before + 3);
  m.OffloadsComplete();
  auto again = m.Acquire(1, Keys(20, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->reused_tokens, 8);
  m.Commit(*again, Keys(20, 1));
}

TEST(HostTier, AFailedRequestKeepsItsUsersCompletedHostCopy) {
  // Before: the entry was dropped, host copy and all, and counted as dropped; the user's next
  // visit was a miss.
  CacheManager m(4, 5, 16);  // GPU: two users of 8 tokens and a page
  for (int u = 1; u <= 3; ++u) AcquireCommitComplete(m, u, Keys(8, u));  // user 1: host only
  const CacheStats before = m.Stats();
  // A host hit whose forward failed (its onload may not have landed): the host copy stays.
  auto r = m.Acquire(1, Keys(12, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->result, LookupResult::kHostHit);
  m.Release(*r);
  EXPECT_EQ(m.CachedTokens(1), 8);
  // A GPU hit with complete host copies: its GPU pages go (the forward may have written them),
  // the host copy stays.
  auto g = m.Acquire(3, Keys(10, 3));
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->result, LookupResult::kHit);
  m.Release(*g);
  EXPECT_EQ(m.CachedTokens(3), 8);
  CacheStats s = m.Stats();
  EXPECT_EQ(s.dropped_entries, 0u);
  EXPECT_EQ(s.host_pages_free, before.host_pages_free);
  EXPECT_EQ(s.pages_pinned, 0);
  EXPECT_EQ(s.pages_free, 5);  // user 2 was evicted for user 1's request; 1 and 3 are host-only
  for (uint64_t u : {1, 3}) {
    auto back = m.Acquire(u, Keys(12, static_cast<int>(u)));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->result, LookupResult::kHostHit) << u;
    EXPECT_EQ(back->reused_tokens, 8) << u;
    m.Commit(*back, Keys(12, static_cast<int>(u)));
    m.OffloadsComplete();
  }
}

TEST(HostTier, ClearForgetsTheHostCopiesOfEntriesInUse) {
  // Clear() follows a failed copy: no host page can be trusted. An entry pinned by a request in
  // flight survives it; were its host copy kept, a failure of that request would keep it too (a
  // failed request keeps its completed host copy) and serve it.
  CacheManager m(4, 16, 16);
  AcquireCommitComplete(m, 1, Keys(8, 1));  // two pages offloaded
  AcquireCommitComplete(m, 2, Keys(8, 2));
  auto r = m.Acquire(1, Keys(12, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  m.Clear();
  EXPECT_EQ(m.Stats().host_pages_free, 16);
  EXPECT_EQ(m.Stats().dropped_entries, 1u);  // user 2 (before: not counted)
  m.Release(*r);  // its forward failed
  EXPECT_EQ(m.CachedTokens(1), 0);
}

TEST(HostTier, ANewUsersFailedRequestDropsNothingCached) {
  CacheManager m(4, 16, 16);
  auto r = m.Acquire(9, Keys(10, 9));
  ASSERT_TRUE(r.ok()) << r.status();
  m.Release(*r);
  EXPECT_EQ(m.Stats().dropped_entries, 0u);
  EXPECT_EQ(m.Stats().entries, 0);
  EXPECT_EQ(m.Stats().pages_free, 16);
  // The control: a cached user's failed request (no host copy to keep) is a dropped entry.
  AcquireCommitComplete(m, 5, Keys(3, 5));  // a partial page only: nothing offloaded
  auto again = m.Acquire(5, Keys(6, 5));
  ASSERT_TRUE(again.ok());
  m.Release(*again);
  EXPECT_EQ(m.Stats().dropped_entries, 1u);
  EXPECT_EQ(m.CachedTokens(5), 0);
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

TEST(HostTier, DeclinedOnloadIsAMissThatKeepsTheHostCopy) {
  CacheManager m(4, 4, 16);  // GPU: two users of 8 tokens
  for (int u = 1; u <= 3; ++u) {  // user 1 ends up on the host only
    auto r = m.Acquire(u, Keys(8, u));
    m.Commit(*r, Keys(8, u));
    m.OffloadsComplete();
  }
  const CacheStats before = m.Stats();
  std::vector<int64_t> asked;
  const OnloadFilter decline = [&](int64_t pages, int64_t tokens) {
    EXPECT_EQ(tokens, pages * 4);
    asked.push_back(pages);
    return false;
  };
  auto r = m.Acquire(1, Keys(12, 1), decline);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(asked, std::vector<int64_t>{2});
  EXPECT_EQ(r->result, LookupResult::kHostRecompute);
  EXPECT_EQ(r->reused_tokens, 0);
  EXPECT_TRUE(r->onload.empty());
  EXPECT_EQ(r->page_ids.size(), 3u);
  CacheStats s = m.Stats();
  EXPECT_EQ(s.pages_onloaded, before.pages_onloaded);
  EXPECT_EQ(s.lookups[static_cast<int>(LookupResult::kHostRecompute)], 1u);
  EXPECT_EQ(s.lookups[static_cast<int>(LookupResult::kHostHit)], 0u);
  EXPECT_EQ(s.tokens_computed, before.tokens_computed + 12);
  EXPECT_EQ(s.tokens_reused, before.tokens_reused);
  // The request recomputed the same keys: the host pages 0-1 stay its copy, only page 2 is new.
  const PageCopies c = m.Commit(*r, Keys(12, 1));
  ASSERT_EQ(c.src.size(), 1u);
  EXPECT_EQ(c.src[0], r->page_ids[2]);
  m.OffloadsComplete();
  EXPECT_EQ(m.Stats().pages_offloaded, before.pages_offloaded + 1);
  // Evicted again, it comes back whole from those copies.
  for (int u = 2; u <= 3; ++u) {
    auto o = m.Acquire(u, Keys(8, u));
    ASSERT_TRUE(o.ok()) << o.status();
    m.Commit(*o, Keys(8, u));
    m.OffloadsComplete();
  }
  auto back = m.Acquire(1, Keys(12, 1), [](int64_t, int64_t) { return true; });
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_EQ(back->reused_tokens, 12);
  EXPECT_EQ(back->onload.src.size(), 3u);
  m.Commit(*back, Keys(12, 1));
}

TEST(HostTier, OnloadFilterIsAskedOnlyForHostOnlyUsers) {
  CacheManager m(4, 8, 16);
  int asked = 0;
  const OnloadFilter count = [&](int64_t, int64_t) {
    ++asked;
    return false;
  };
  auto r = m.Acquire(1, Keys(8, 1), count);  // miss
  m.Commit(*r, Keys(8, 1));
  m.OffloadsComplete();
  auto hit = m.Acquire(1, Keys(10, 1), count);  // on the GPU
  EXPECT_EQ(hit->result, LookupResult::kHit);
  m.Commit(*hit, Keys(10, 1));
  EXPECT_EQ(asked, 0);
}

TEST(HostTierPrefetch, APrefetchThatCannotFitEvictsNobody) {
  // A (8 pages) on the host, B (4) and C (8) on a 12-page pool; A's prefetch needs 8 pages and
  // may take only B's 4 (C runs next). Before: B was moved to the host, then nothing started.
  CacheManager m(4, 12, 64);
  for (const auto& [user, tokens] : std::vector<std::pair<uint64_t, int>>{{1, 32}, {2, 16}, {3, 32}}) {
    auto r = m.Acquire(user, Keys(tokens, static_cast<int>(user)));
    ASSERT_TRUE(r.ok()) << r.status();
    m.Commit(*r, Keys(tokens, static_cast<int>(user)));
    m.OffloadsComplete();
  }
  ASSERT_EQ(m.Stats().evictions, 1u);
  ASSERT_TRUE(m.PrefetchCandidate(1));
  EXPECT_TRUE(m.Prefetch(1, Keys(32, 1), std::vector<uint64_t>{3}).empty());
  EXPECT_EQ(m.Stats().evictions, 1u);
  EXPECT_FALSE(m.PrefetchCandidate(2));  // still on the GPU
  auto b = m.Acquire(2, Keys(20, 2));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->result, LookupResult::kHit);
  m.Commit(*b, Keys(20, 2));
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
  EXPECT_TRUE(m.PrefetchCandidate(1));   // host only
  EXPECT_FALSE(m.PrefetchCandidate(3));  // GPU-resident
  EXPECT_FALSE(m.PrefetchCandidate(9));  // unknown
  EXPECT_TRUE(m.Prefetch(1, Keys(10, 1), running).empty());
  EXPECT_EQ(m.Stats().evictions, 1u);
  PageCopies c = m.Prefetch(1, Keys(10, 1), std::vector<uint64_t>{3});  // user 2 moves to the host
  ASSERT_EQ(c.src.size(), 2u);
  EXPECT_EQ(m.Stats().evictions, 2u);
  EXPECT_EQ(m.CachedTokens(2), 8);  // still cached, on the host
  EXPECT_TRUE(m.prefetches_pending());
  EXPECT_FALSE(m.PrefetchCandidate(1));  // has GPU pages now
  EXPECT_TRUE(m.PrefetchCandidate(2));   // moved to the host
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

TEST(HostTierPrefetch, DeclinedPrefetchStartsNothingAndEvictsNobody) {
  CacheManager m(4, 4, 16);
  for (int u = 1; u <= 3; ++u) {  // user 1 on the host only; users 2 and 3 fill the GPU
    auto r = m.Acquire(u, Keys(8, u));
    m.Commit(*r, Keys(8, u));
    m.OffloadsComplete();
  }
  const CacheStats before = m.Stats();
  int64_t asked = 0;
  EXPECT_TRUE(m.Prefetch(1, Keys(10, 1), {}, [&](int64_t pages, int64_t tokens) {
    EXPECT_EQ(tokens, pages * 4);
    asked = pages;
    return false;
  }).empty());
  EXPECT_EQ(asked, 2);
  EXPECT_FALSE(m.prefetches_pending());
  const CacheStats s = m.Stats();
  EXPECT_EQ(s.evictions, before.evictions);  // users 2 and 3 were not moved for it
  EXPECT_EQ(s.pages_prefetched, 0u);
  EXPECT_EQ(s.pages_onloaded, before.pages_onloaded);
  // Still a host-only entry: its next Acquire decides again.
  auto back = m.Acquire(1, Keys(10, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->result, LookupResult::kHostHit);
  EXPECT_FALSE(back->prefetched);
  EXPECT_EQ(back->onload.src.size(), 2u);
  m.Commit(*back, Keys(10, 1));
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

TEST(HostTierPrefetch, FailedPrefetchDropsTheEntry) {
  // The copy into the prefetched GPU pages failed: they hold whatever was there before, so the
  // next visit must not reuse them (it did: a host hit on pages never written).
  CacheManager m(4, 8, 16);
  AcquireCommitComplete(m, 1, Keys(8, 1));
  AcquireCommitComplete(m, 2, Keys(32, 2));  // user 1 to the host
  auto again = m.Acquire(2, Keys(32, 2));      // user 2 leaves the GPU pool empty
  ASSERT_TRUE(again.ok());
  m.Release(*again);
  ASSERT_EQ(m.Prefetch(1, Keys(8, 1)).src.size(), 2u);
  m.PrefetchFailed(1);
  m.PrefetchesComplete();
  EXPECT_EQ(m.CachedTokens(1), 0);
  auto back = m.Acquire(1, Keys(10, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->result, LookupResult::kMiss);
  EXPECT_EQ(back->reused_tokens, 0);
  EXPECT_TRUE(back->onload.empty());
  m.Commit(*back, Keys(10, 1));
  m.OffloadsComplete();
  EXPECT_EQ(m.Stats().pages_free + m.Stats().pages_pinned, 8 - 3);  // only user 1's 3 pages held
}

}  // namespace
}  // namespace hstu
