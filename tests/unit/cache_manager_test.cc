// Hash-chain reuse rules, page allocation, pinning and LRU eviction (metadata only, no memory).
#include <random>

#include "gtest/gtest.h"
#include "kvcache/cache_manager.h"

namespace hstu {
namespace {

std::vector<uint64_t> Keys(int n, int salt = 0) {
  std::vector<uint64_t> k(n);
  for (int i = 0; i < n; ++i) k[i] = TokenKey(i % 2 == 1, 1000 * salt + i);
  return k;
}

Reservation AcquireCommit(CacheManager& m, uint64_t user, const std::vector<uint64_t>& keys) {
  auto r = m.Acquire(user, keys);
  EXPECT_TRUE(r.ok()) << r.status();
  m.Commit(*r, keys);
  return *r;
}

TEST(PageAllocator, AllocatesAllOrNothing) {
  PageAllocator a(5);
  std::vector<int32_t> got;
  EXPECT_TRUE(a.Allocate(3, &got));
  EXPECT_FALSE(a.Allocate(3, &got));
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(a.num_free(), 2);
  a.Free(got.data(), 3);
  EXPECT_EQ(a.num_free(), 5);
  EXPECT_DEATH(a.Free(got.data(), 1), "not in use");
}

TEST(CacheManager, MissThenFullHitThenGrowth) {
  CacheManager m(4, 64);
  auto k = Keys(10);
  Reservation r1 = AcquireCommit(m, 1, k);
  EXPECT_EQ(r1.result, LookupResult::kMiss);
  EXPECT_EQ(r1.reused_tokens, 0);
  EXPECT_EQ(r1.page_ids.size(), 3u);
  // Same history: everything reused.
  Reservation r2 = AcquireCommit(m, 1, k);
  EXPECT_EQ(r2.result, LookupResult::kHit);
  EXPECT_EQ(r2.reused_tokens, 10);
  // Grown history (partial last page reused too): the old prefix is reused, pages extend.
  auto k2 = Keys(14);
  Reservation r3 = AcquireCommit(m, 1, k2);
  EXPECT_EQ(r3.result, LookupResult::kHit);
  EXPECT_EQ(r3.reused_tokens, 10);
  EXPECT_EQ(r3.total_tokens, 14);
  EXPECT_EQ(r3.page_ids.size(), 4u);
  EXPECT_EQ(std::vector<int32_t>(r3.page_ids.begin(), r3.page_ids.begin() + 3), r1.page_ids);
  EXPECT_EQ(m.CachedTokens(1), 14);
}

TEST(CacheManager, EditedHistoryReusesLongestMatchingPagePrefix) {
  for (int ps : {1, 3, 7, 17}) {
    CacheManager m(ps, 256);
    auto k = Keys(60);
    AcquireCommit(m, 1, k);
    auto edited = k;
    edited[40] = TokenKey(false, 999999);
    auto r = m.Acquire(1, edited);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->reused_tokens, 40 / ps * ps) << "page size " << ps;
    EXPECT_EQ(r->result, 40 / ps > 0 ? LookupResult::kPartial : LookupResult::kMismatch);
    m.Commit(*r, edited);
    EXPECT_EQ(m.Acquire(1, edited)->reused_tokens, 60);
  }
}

// Commit hashes only the pages after the reused prefix; over many visits that grow, edit and
// shorten one user's history, every Acquire must reuse exactly what a full rehash would allow:
// all of the last committed history when the new one extends it, else the longest matching run
// of full pages.
TEST(CacheManager, IncrementalHashesReuseExactlyTheMatchingPrefix) {
  for (int page_size : {1, 3, 4, 32}) {
    CacheManager m(page_size, 4096);
    std::mt19937 rng(static_cast<uint32_t>(page_size));
    std::vector<uint64_t> last, keys;
    for (int visit = 0; visit < 300; ++visit) {
      keys = last;
      const int op = static_cast<int>(rng() % 10);
      if (op < 6) {  // grow
        for (int i = 0, n = 1 + static_cast<int>(rng() % 70); i < n; ++i) keys.push_back(rng() % 50);
      } else if (op < 8 && !keys.empty()) {  // edit one token, maybe grow
        keys[rng() % keys.size()] ^= 1 + rng() % 7;
        if (rng() % 2) keys.push_back(rng() % 50);
      } else if (!keys.empty()) {  // shorten
        keys.resize(rng() % keys.size());
      }
      if (keys.size() > 600) keys.erase(keys.begin(), keys.begin() + 300);  // truncation
      size_t common = 0;
      while (common < last.size() && common < keys.size() && last[common] == keys[common]) ++common;
      const size_t want = common == last.size() ? last.size() : common / page_size * page_size;
      auto r = m.Acquire(7, keys);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(static_cast<size_t>(r->reused_tokens), want)
          << "page " << page_size << " visit " << visit << " op " << op;
      EXPECT_EQ(r->page_hashes, PageChainHashes(keys, page_size));
      m.Commit(*r, keys);
      last = keys;
    }
  }
}

// The chain hash (kvcache/cache_manager.cc) must tell apart the edits a returning user's history
// can plausibly see: one key changed anywhere (any lane, any page, the partial last page), two
// keys swapped, a key dropped or added. Each must change the prefix hash and every page hash from
// the first changed key's page on, and leave the pages before it alone.
TEST(ChainHash, EveryEditChangesTheChainFromItsPageOn) {
  std::mt19937_64 rng(11);
  for (int32_t page_size : {1, 4, 7, 32, 64}) {
    std::vector<uint64_t> keys(200 + rng() % 100);
    for (auto& k : keys) k = TokenKey(rng() % 2 == 1, static_cast<int64_t>(rng() % 1000));
    const std::vector<uint64_t> base = PageChainHashes(keys, page_size);
    const uint64_t base_prefix = PrefixHash(keys, page_size);
    auto check = [&](const std::vector<uint64_t>& edited, const char* what) {
      size_t first_changed = 0;
      while (first_changed < edited.size() && edited[first_changed] == keys[first_changed]) {
        ++first_changed;
      }
      SCOPED_TRACE(testing::Message() << what << " at " << first_changed << ", page size "
                                      << page_size);
      EXPECT_NE(PrefixHash(edited, page_size), base_prefix);
      const std::vector<uint64_t> got = PageChainHashes(edited, page_size);
      const size_t page = first_changed / page_size;
      for (size_t p = 0; p < std::min(got.size(), base.size()); ++p) {
        if (p < page) {
          EXPECT_EQ(got[p], base[p]) << "page " << p;
        } else {
          EXPECT_NE(got[p], base[p]) << "page " << p;
        }
      }
    };
    for (size_t i = 0; i < keys.size(); ++i) {
      std::vector<uint64_t> e = keys;
      e[i] ^= uint64_t{1} << (rng() % 64);
      check(e, "one bit flipped");
      e = keys;
      e[i] += 2;  // the neighbouring id of the same kind
      check(e, "id changed");
      if (i + 1 < keys.size() && keys[i] != keys[i + 1]) {
        e = keys;
        std::swap(e[i], e[i + 1]);
        check(e, "swapped with the next");
      }
      if (i + 8 < keys.size() && keys[i] != keys[i + 8]) {
        e = keys;
        std::swap(e[i], e[i + 8]);  // the same lane of the content hash
        check(e, "swapped with the key 8 on");
      }
      e = keys;
      e.erase(e.begin() + static_cast<std::ptrdiff_t>(i));
      check(e, "dropped");
    }
    // A key appended changes the prefix hash but no full page before it.
    std::vector<uint64_t> longer = keys;
    longer.push_back(keys.back() ^ 2);
    EXPECT_NE(PrefixHash(longer, page_size), base_prefix);
    const std::vector<uint64_t> got = PageChainHashes(longer, page_size);
    for (size_t p = 0; p < base.size(); ++p) EXPECT_EQ(got[p], base[p]);
  }
}

TEST(CacheManager, ShortenedHistoryIsNeverServedFromStaleKv) {
  CacheManager m(4, 64);
  auto k = Keys(20);
  AcquireCommit(m, 1, k);
  std::vector<uint64_t> shorter(k.begin(), k.begin() + 10);
  auto r = m.Acquire(1, shorter);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->reused_tokens, 8);  // two full pages match; the rest is recomputed
  EXPECT_EQ(r->result, LookupResult::kPartial);
  EXPECT_EQ(r->page_ids.size(), 3u);
  m.Commit(*r, shorter);
  EXPECT_EQ(m.Stats().pages_free, 64 - 3);
}

TEST(CacheManager, FirstTokenEditedIsAMismatch) {
  CacheManager m(4, 64);
  auto k = Keys(12);
  AcquireCommit(m, 1, k);
  auto other = Keys(12, 5);
  auto r = m.Acquire(1, other);
  EXPECT_EQ(r->reused_tokens, 0);
  EXPECT_EQ(r->result, LookupResult::kMismatch);
  m.Release(*r);
  EXPECT_EQ(m.CachedTokens(1), 0);
  EXPECT_EQ(m.Stats().pages_free, 64);
  EXPECT_EQ(m.Stats().dropped_entries, 1u);
}

// Keys edited so that the chain hash does not change: in a lane step rotl((lane ^ key) * C, 29),
// flipping bit 63 of one key flips bit 28 of the lane, which flipping bit 28 of the lane's next
// key (8 slots on) undoes. A client can send such ids on purpose.
std::vector<uint64_t> CollidingEdit(std::vector<uint64_t> keys, size_t slot) {
  keys[slot] ^= uint64_t{1} << 63;
  keys[slot + 8] ^= uint64_t{1} << 28;
  return keys;
}

TEST(CacheManager, AHistoryCraftedToCollideWithTheHashIsRecomputed) {
  const int32_t ps = 16;
  const auto k = Keys(44);
  // The edit in page 0, page 1, and in the partial last page.
  for (const size_t slot : {size_t{2}, size_t{17}, size_t{33}}) {
    SCOPED_TRACE(slot);
    const auto edited = CollidingEdit(k, slot);
    ASSERT_EQ(PageChainHashes(edited, ps), PageChainHashes(k, ps));  // the hashes cannot tell
    ASSERT_EQ(PrefixHash(edited, ps), PrefixHash(k, ps));
    CacheManager m(ps, 64);
    AcquireCommit(m, 1, k);
    auto r = m.Acquire(1, edited);
    ASSERT_TRUE(r.ok()) << r.status();
    // Only the pages before the edit are reused (before: all 44 tokens, a GPU hit).
    EXPECT_EQ(r->reused_tokens, static_cast<int32_t>(slot / ps * ps));
    EXPECT_EQ(r->result, slot < ps ? LookupResult::kMismatch : LookupResult::kPartial);
    m.Commit(*r, edited);
    // The entry now holds the edited history: the original is the one that no longer matches.
    auto back = m.Acquire(1, k);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back->reused_tokens, static_cast<int32_t>(slot / ps * ps));
    m.Release(*back);
  }
  // A host-only entry is not prefetched for a colliding history.
  CacheManager m(ps, 3, 16);
  AcquireCommit(m, 1, Keys(32));
  m.OffloadsComplete();
  AcquireCommit(m, 2, Keys(48, 2));  // 3 pages: user 1 to the host
  m.OffloadsComplete();
  EXPECT_TRUE(m.Prefetch(1, CollidingEdit(Keys(32), 1)).src.empty());
  EXPECT_EQ(m.Prefetch(1, Keys(32)).src.size(), 2u);
}

TEST(CacheManager, LruEvictionSkipsPinnedAndRecentUsers) {
  CacheManager m(4, 6);  // room for three users of 8 tokens
  AcquireCommit(m, 1, Keys(8, 1));
  AcquireCommit(m, 2, Keys(8, 2));
  AcquireCommit(m, 3, Keys(8, 3));
  AcquireCommit(m, 1, Keys(8, 1));  // user 1 becomes most recent
  auto pinned = m.Acquire(2, Keys(8, 2));  // user 2 in flight
  ASSERT_TRUE(pinned.ok());
  AcquireCommit(m, 4, Keys(8, 4));  // must evict user 3 (LRU, unpinned)
  EXPECT_EQ(m.CachedTokens(3), 0);
  EXPECT_EQ(m.CachedTokens(1), 8);
  EXPECT_EQ(m.CachedTokens(2), 8);
  EXPECT_EQ(m.Stats().evictions, 1u);
  // A user that needs more than every unpinned page fails without evicting anyone.
  auto big = m.Acquire(5, Keys(20, 5));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.CachedTokens(1), 8);
  EXPECT_EQ(m.CachedTokens(4), 8);
  // Two requests of one user at once are refused.
  EXPECT_EQ(m.Acquire(2, Keys(8, 2)).status().code(), absl::StatusCode::kFailedPrecondition);
  m.Commit(*pinned, Keys(8, 2));
  EXPECT_EQ(m.Stats().pages_pinned, 0);
}

TEST(CacheManager, TemporaryReservationsReturnTheirPages) {
  CacheManager m(8, 10);
  auto r = m.AcquireTemporary(1, 30);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->page_ids.size(), 4u);
  EXPECT_EQ(m.Stats().pages_free, 6);
  m.Commit(*r, Keys(30));
  EXPECT_EQ(m.Stats().pages_free, 10);
  EXPECT_EQ(m.CachedTokens(1), 0);
}

TEST(CacheManager, UsersWithoutHistoryLeaveNoEntry) {
  // An entry without pages is never evicted: kept, cold-start users would grow the map forever.
  CacheManager m(4, 8);
  for (uint64_t u = 0; u < 1000; ++u) AcquireCommit(m, u, {});
  EXPECT_EQ(m.Stats().entries, 0);
  AcquireCommit(m, 7, Keys(6, 7));
  AcquireCommit(m, 7, {});  // the history went away: nothing is left to reuse
  EXPECT_EQ(m.Stats().entries, 0);
  EXPECT_EQ(m.Stats().pages_free, 8);
}

TEST(CacheManager, PinnedUserWithAnOffloadInFlightIsNotCountedTwice) {
  // User 1 is pinned again while its offload is in flight: its pages are both pinned and in
  // flight. Room for user 3 exists (2 free + user 2's 2), so nothing may fail.
  CacheManager m(4, 6, 16);
  AcquireCommit(m, 2, Keys(8, 2));
  m.OffloadsComplete();
  AcquireCommit(m, 1, Keys(8, 1));  // its offload stays in flight
  auto again = m.Acquire(1, Keys(8, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  auto third = m.Acquire(3, Keys(16, 3));
  EXPECT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(m.Stats().evictions, 1u);
}

TEST(CacheManager, FailedAcquireOfAPrefetchedUserKeepsItsPrefetch) {
  // A prefetched user's request does not fit. Its retry is still a host hit whose pages may still
  // be being copied (the failed Acquire reset both: the retry read as a GPU hit, its prefetch as
  // done, and the entry was evictable while the copy was writing into it).
  CacheManager m(4, 4, 16);
  AcquireCommit(m, 1, Keys(8, 1));
  m.OffloadsComplete();
  AcquireCommit(m, 2, Keys(12, 2));  // 3 pages: user 1 to the host
  m.OffloadsComplete();
  ASSERT_EQ(m.Prefetch(1, Keys(8, 1)).src.size(), 2u);  // user 2 to the host for it
  auto big = m.Acquire(1, Keys(24, 1));                  // 6 pages: more than the pool
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(m.prefetches_pending());
  auto other = m.Acquire(3, Keys(16, 3));  // 4 pages: only by evicting user 1's prefetch
  EXPECT_EQ(other.status().code(), absl::StatusCode::kResourceExhausted);
  auto retry = m.Acquire(1, Keys(10, 1));
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->result, LookupResult::kHostHit);
  EXPECT_EQ(retry->reused_tokens, 8);
  EXPECT_TRUE(retry->prefetched);
  EXPECT_TRUE(retry->onload.empty());
}

TEST(CacheManager, AFailedMismatchedAcquireKeepsTheEntryWhole) {
  // Before: the mismatch cut the entry to its matching prefix (here nothing) before the
  // allocation failed, so the user's next visit, extending the cached history, recomputed it all.
  CacheManager m(4, 6);
  const std::vector<uint64_t> cached = Keys(8, 1);
  AcquireCommit(m, 1, cached);
  std::vector<uint64_t> edited = Keys(28, 1);
  edited[0] = TokenKey(false, 99999);  // page 0 changes: nothing matches, 7 pages needed
  auto failed = m.Acquire(1, edited);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.CachedTokens(1), 8);
  EXPECT_EQ(m.Stats().pages_free, 4);
  std::vector<uint64_t> grown = cached;
  grown.push_back(TokenKey(true, 5));
  auto next = m.Acquire(1, grown);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->result, LookupResult::kHit);
  EXPECT_EQ(next->reused_tokens, 8);
  m.Commit(*next, grown);
  EXPECT_EQ(m.Stats().dropped_entries, 0u);
}

TEST(CacheManager, RetryAfterAFailedPartialAcquireIsStillAPartialHit) {
  // The failed Acquire left user 1's entry whole. Its retry (the engine runs it once the batch's
  // other users committed) cuts the stale page, reuses the page left, and reports the lookup as
  // partial.
  CacheManager m(4, 4);
  AcquireCommit(m, 1, Keys(8, 1));
  auto pinned = m.Acquire(2, Keys(8, 2));
  ASSERT_TRUE(pinned.ok());
  std::vector<uint64_t> edited = Keys(12, 1);
  edited[5] = TokenKey(false, 99999);  // page 1 changes
  auto cut = m.Acquire(1, edited);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kResourceExhausted);
  m.Commit(*pinned, Keys(8, 2));
  auto retry = m.Acquire(1, edited);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->result, LookupResult::kPartial);
  EXPECT_EQ(retry->reused_tokens, 4);
  m.Commit(*retry, edited);
  auto next = m.Acquire(1, edited);  // and the visit after it is a plain hit again
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->result, LookupResult::kHit);
  m.Release(*next);
}

TEST(CacheManager, NoPagesLeakUnderRandomTraffic) {
  CacheManager m(3, 40);
  std::mt19937 rng(9);
  std::vector<std::vector<uint64_t>> hist(12);
  for (int step = 0; step < 2000; ++step) {
    const int u = rng() % 12;
    auto& h = hist[u];
    const int op = rng() % 10;
    if (op < 6) {
      for (int i = 0; i < 2; ++i) h.push_back(TokenKey(i, rng() % 100));
    } else if (op < 8 && h.size() > 4) {
      h[rng() % h.size()] = TokenKey(false, rng());
    } else if (h.size() > 6) {
      h.resize(h.size() - 4);
    }
    if (h.size() > 60) h.erase(h.begin(), h.begin() + 30);
    auto r = m.Acquire(u, h);
    if (!r.ok()) continue;
    if (rng() % 20 == 0) {
      m.Release(*r);
    } else {
      m.Commit(*r, h);
    }
  }
  CacheStats s = m.Stats();
  EXPECT_EQ(s.pages_pinned, 0);
  m.Clear();
  EXPECT_EQ(m.Stats().pages_free, 40);
}

}  // namespace
}  // namespace hstu
