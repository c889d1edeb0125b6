// Host KV tier policy (DESIGN §6) on the CPU engine, where a host copy is a memcpy: scores of
// restored users, the onload-or-recompute rules, prefetch. host_tier_test.cc tests the metadata.
#include <cmath>
#include <random>

#include "engine/engine.h"
#include "engine/model_file.h"
#include "gtest/gtest.h"
#include "tests/util/faulty_backend.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

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

// Users cycle through a "GPU" pool and a host tier that are both smaller than the working set;
// every result is checked against the recomputing engine. Returns the cached engine's stats and
// fills `results` with its results in request order.
EngineStats RunHostTierTraffic(EngineOptions o, std::vector<RankResult>* results = nullptr) {
  o.page_size = 4;
  o.cache_pages = 24;        // ~2 users of 40 tokens on the "GPU"
  o.host_cache_pages = 40;   // ~4 users on the host; the working set of 8 users fits nowhere whole
  o.keep_hidden = true;
  auto cached = Engine::Create(o, RandomModel(SmallConfig(), 5));
  EXPECT_TRUE(cached.ok()) << cached.status();
  auto full = RecomputingEngine(o, 5);
  EXPECT_TRUE(full.ok());
  if (!cached.ok() || !full.ok()) return EngineStats();
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
    EXPECT_TRUE(a[0].ok()) << a[0].status();
    EXPECT_TRUE(b[0].ok());
    if (!a[0].ok() || !b[0].ok()) break;
    EXPECT_LE(test::MaxAbsDiff(a[0]->scores, b[0]->scores), test::kF32Abs) << "step " << step;
    EXPECT_LE(test::RelL2(a[0]->hidden, b[0]->hidden), test::kF32RelL2) << "step " << step;
    if (results != nullptr) results->push_back(*std::move(a[0]));
  }
  return (*cached)->Stats();
}

// The onload-rule tests' engines: pages of 4 tokens, a pool of 40, a host tier that keeps every
// copy, a recompute of 1 s a token, and a copy of `copy_seconds_per_page`.
EngineOptions RuleOptions(double copy_seconds_per_page) {
  EngineOptions o;
  o.page_size = 4;
  o.cache_pages = 40;
  o.host_cache_pages = 128;
  o.keep_hidden = true;
  o.recompute_seconds_per_token = 1;
  auto probe = Engine::Create(o, RandomModel(SmallConfig(), 7));
  EXPECT_TRUE(probe.ok()) << probe.status();
  if (probe.ok()) o.onload_bytes_per_second = (*probe)->Stats().kv_page_bytes / copy_seconds_per_page;
  return o;
}

// A user's next visit: `events` more events and two new candidates.
void Grow(std::mt19937& rng, RankRequest& r, int events) {
  for (int i = 0; i < events; ++i) {
    r.history_item_ids.push_back(rng() % 500);
    r.history_actions.push_back(rng() % 16);
  }
  r.candidate_item_ids = {static_cast<int64_t>(rng() % 500), static_cast<int64_t>(rng() % 500)};
}

// Users 1-4 of 32 tokens (8 pages each), then users 5-7 of 64 tokens, which push users 1-5 to
// the host tier of a RuleOptions engine. users: [10], ids set here.
void PushUsersToTheHost(Engine& e, std::mt19937& rng, std::vector<RankRequest>* users) {
  users->assign(10, RankRequest());
  for (int u = 1; u <= 7; ++u) {
    (*users)[u].user_id = u;
    Grow(rng, (*users)[u], u <= 4 ? 16 : 32);
    auto res = e.Rank({&(*users)[u], 1});
    ASSERT_TRUE(res[0].ok()) << res[0].status();
  }
  const EngineStats s = e.Stats();
  ASSERT_EQ(s.cache.evictions, 5u);
  ASSERT_EQ(s.cache.dropped_entries, 0u);
  ASSERT_EQ(s.cache.host_evictions, 0u);
}

uint64_t Lookups(const EngineStats& s, LookupResult r) {
  return s.cache.lookups[static_cast<int>(r)];
}

TEST(HostTierEngine, UsersRestoredFromTheHostScoreLikeAFullRecompute) {
  EngineOptions o;
  o.onload_policy = OnloadPolicy::kAlways;
  const EngineStats s = RunHostTierTraffic(o);
  EXPECT_GT(Lookups(s, LookupResult::kHostHit), 0u);
  EXPECT_EQ(Lookups(s, LookupResult::kHostRecompute), 0u);
  EXPECT_GT(s.cache.evictions, 0u);
  EXPECT_GT(s.cache.host_evictions, 0u);
  EXPECT_GT(s.kv_onload_bytes, 0u);
  EXPECT_EQ(s.kv_offload_bytes, s.cache.pages_offloaded * static_cast<uint64_t>(s.kv_page_bytes));
  EXPECT_EQ(s.cache.pages_pinned, 0);
  EXPECT_EQ(s.onload_waits, 0u);  // the CPU backend's copies are done before its forwards
}

// Everything but the host hits' outcome is the same under either choice: the pages a request
// needs, the evictions, the host copies (a recompute keeps its host copy).
void ExpectSameCacheHistory(const EngineStats& a, const EngineStats& b) {
  for (LookupResult r : {LookupResult::kHit, LookupResult::kPartial, LookupResult::kMiss,
                         LookupResult::kMismatch, LookupResult::kDisabled}) {
    EXPECT_EQ(Lookups(a, r), Lookups(b, r)) << LookupResultName(r);
  }
  EXPECT_EQ(Lookups(a, LookupResult::kHostHit) + Lookups(a, LookupResult::kHostRecompute),
            Lookups(b, LookupResult::kHostHit) + Lookups(b, LookupResult::kHostRecompute));
  EXPECT_EQ(a.cache.tokens_reused + a.cache.tokens_computed,
            b.cache.tokens_reused + b.cache.tokens_computed);
  EXPECT_EQ(a.cache.evictions, b.cache.evictions);
  EXPECT_EQ(a.cache.host_evictions, b.cache.host_evictions);
  EXPECT_EQ(a.cache.dropped_entries, b.cache.dropped_entries);
  EXPECT_EQ(a.cache.pages_offloaded, b.cache.pages_offloaded);
  EXPECT_EQ(a.cache.pages_pinned, 0);
  EXPECT_EQ(b.cache.pages_pinned, 0);
}

TEST(HostTierEngine, SlowCopiesRecomputeEveryHostHit) {
  EngineOptions always;
  always.onload_policy = OnloadPolicy::kAlways;
  std::vector<RankResult> ra, rs;
  const EngineStats a = RunHostTierTraffic(always, &ra);
  EngineOptions slow;
  slow.onload_policy = OnloadPolicy::kCost;
  slow.onload_bytes_per_second = 1;  // a page takes minutes; a token's recompute 1 us
  slow.recompute_seconds_per_token = 1e-6;
  const EngineStats s = RunHostTierTraffic(slow, &rs);
  ASSERT_GT(Lookups(a, LookupResult::kHostHit), 0u);
  EXPECT_EQ(Lookups(s, LookupResult::kHostHit), 0u);
  EXPECT_EQ(Lookups(s, LookupResult::kHostRecompute), Lookups(a, LookupResult::kHostHit));
  EXPECT_EQ(s.cache.pages_onloaded, 0u);
  EXPECT_EQ(s.kv_onload_bytes, 0u);
  EXPECT_EQ(s.cache.tokens_reused + a.cache.pages_onloaded * 4, a.cache.tokens_reused);
  EXPECT_EQ(s.onload_bytes_per_second, 1);
  EXPECT_EQ(s.recompute_seconds_per_token, 1e-6);
  ExpectSameCacheHistory(a, s);
  ASSERT_EQ(ra.size(), rs.size());
  for (size_t i = 0; i < ra.size(); ++i) {
    EXPECT_EQ(ra[i].reused_tokens + ra[i].computed_tokens,
              rs[i].reused_tokens + rs[i].computed_tokens);
    if (ra[i].cache_result == LookupResult::kHostHit) {
      EXPECT_EQ(rs[i].cache_result, LookupResult::kHostRecompute) << i;
      EXPECT_EQ(rs[i].reused_tokens, 0u) << i;
    } else {
      EXPECT_EQ(rs[i].cache_result, ra[i].cache_result) << i;
      EXPECT_EQ(rs[i].reused_tokens, ra[i].reused_tokens) << i;
    }
  }
}

TEST(HostTierEngine, FastCopiesOnloadEveryHostHit) {
  EngineOptions always;
  always.onload_policy = OnloadPolicy::kAlways;
  std::vector<RankResult> ra, rf;
  const EngineStats a = RunHostTierTraffic(always, &ra);
  EngineOptions fast;
  fast.onload_policy = OnloadPolicy::kCost;
  fast.onload_bytes_per_second = 1e15;
  fast.recompute_seconds_per_token = 1;
  const EngineStats f = RunHostTierTraffic(fast, &rf);
  EXPECT_EQ(Lookups(f, LookupResult::kHostRecompute), 0u);
  EXPECT_EQ(Lookups(f, LookupResult::kHostHit), Lookups(a, LookupResult::kHostHit));
  EXPECT_EQ(f.cache.pages_onloaded, a.cache.pages_onloaded);
  EXPECT_EQ(f.cache.tokens_reused, a.cache.tokens_reused);
  ExpectSameCacheHistory(a, f);
  ASSERT_EQ(ra.size(), rf.size());
  for (size_t i = 0; i < ra.size(); ++i) {
    EXPECT_EQ(rf[i].cache_result, ra[i].cache_result) << i;
    EXPECT_EQ(rf[i].reused_tokens, ra[i].reused_tokens) << i;
  }
}

TEST(HostTierEngine, AlwaysPolicyIgnoresTheRates) {
  EngineOptions always;
  always.onload_policy = OnloadPolicy::kAlways;
  std::vector<RankResult> ra, rs;
  const EngineStats a = RunHostTierTraffic(always, &ra);
  always.onload_bytes_per_second = 1;  // would refuse every onload under kCost
  always.recompute_seconds_per_token = 1e-9;
  const EngineStats s = RunHostTierTraffic(always, &rs);
  for (int r = 0; r < static_cast<int>(LookupResult::kNumResults); ++r) {
    EXPECT_EQ(a.cache.lookups[r], s.cache.lookups[r])
        << LookupResultName(static_cast<LookupResult>(r));
  }
  EXPECT_EQ(a.cache.pages_onloaded, s.cache.pages_onloaded);
  EXPECT_EQ(a.cache.tokens_reused, s.cache.tokens_reused);
  ASSERT_EQ(ra.size(), rs.size());
  for (size_t i = 0; i < ra.size(); ++i) {
    EXPECT_EQ(rs[i].scores, ra[i].scores) << i;  // bit for bit: the same work in the same order
    EXPECT_EQ(rs[i].cache_result, ra[i].cache_result) << i;
  }
}

TEST(HostTierEngine, MeasuredRatesMoveFromTheirStartValues) {
  EngineOptions o;  // kCost, both rates measured
  ASSERT_EQ(o.onload_policy, OnloadPolicy::kCost);
  const EngineStats s = RunHostTierTraffic(o);
  // The first host hit is onloaded whatever the CPU's speed (a 1 KiB page at the start value of
  // 50 GB/s against microseconds of forward per token), so the memcpy rate was measured.
  EXPECT_GT(Lookups(s, LookupResult::kHostHit), 0u);
  EXPECT_NE(s.onload_bytes_per_second, OnloadCostModel::kStartBytesPerSecond);
  EXPECT_NE(s.recompute_seconds_per_token, OnloadCostModel::kStartSecondsPerToken);
  EXPECT_GT(s.onload_bytes_per_second, 0);
  EXPECT_GT(s.recompute_seconds_per_token, 0);
  EXPECT_TRUE(std::isfinite(s.onload_bytes_per_second));
  EXPECT_TRUE(std::isfinite(s.recompute_seconds_per_token));
}

TEST(HostTierEngine, WaveOnloadsTheFirstHostHitsThenRecomputes) {
  // A user's 32 host tokens take 32 s to recompute and 12.8 s to copy (1.6 s a page). The copies
  // also hide behind half the wave's other compute (2 layers: all but the last layer's share): 8
  // candidate rows, plus 4 new tokens per onloaded user. So the first three copies finish in time
  // (12.8 s <= 32 + 4, 25.6 <= 32 + 6, 38.4 <= 32 + 8) and the fourth would not (51.2 > 32 + 10).
  const EngineOptions o = RuleOptions(1.6);
  auto e = Engine::Create(o, RandomModel(SmallConfig(), 7));
  ASSERT_TRUE(e.ok()) << e.status();
  auto full = RecomputingEngine(o, 7);
  ASSERT_TRUE(full.ok());
  std::mt19937 rng(3);
  std::vector<RankRequest> users;
  ASSERT_NO_FATAL_FAILURE(PushUsersToTheHost(**e, rng, &users));
  const EngineStats before = (*e)->Stats();
  std::vector<RankRequest> wave;
  for (int u = 1; u <= 4; ++u) {
    Grow(rng, users[u], 2);
    wave.push_back(users[u]);
  }
  auto got = (*e)->Rank(wave);
  auto want = (*full)->Rank(wave);
  const LookupResult expected[] = {LookupResult::kHostHit, LookupResult::kHostHit,
                                   LookupResult::kHostHit, LookupResult::kHostRecompute};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    ASSERT_TRUE(want[i].ok());
    EXPECT_EQ(got[i]->cache_result, expected[i]) << "user " << i + 1;
    EXPECT_EQ(got[i]->reused_tokens, expected[i] == LookupResult::kHostHit ? 32u : 0u);
    EXPECT_EQ(got[i]->reused_tokens + got[i]->computed_tokens, 36u);
    EXPECT_LE(test::MaxAbsDiff(got[i]->scores, want[i]->scores), test::kF32Abs);
    EXPECT_LE(test::RelL2(got[i]->hidden, want[i]->hidden), test::kF32RelL2);
  }
  const EngineStats s = (*e)->Stats();
  EXPECT_EQ(s.cache.pages_onloaded - before.cache.pages_onloaded, 24u);
  EXPECT_EQ(Lookups(s, LookupResult::kHostHit) - Lookups(before, LookupResult::kHostHit), 3u);
  EXPECT_EQ(Lookups(s, LookupResult::kHostRecompute), 1u);
  // The next wave starts with an idle link: the first host hit is onloaded again.
  for (int u = 5; u <= 7; ++u) {
    Grow(rng, users[u], 1);
    ASSERT_TRUE((*e)->Rank({&users[u], 1})[0].ok());
  }
  Grow(rng, users[3], 1);
  auto again = (*e)->Rank({&users[3], 1});
  ASSERT_TRUE(again[0].ok());
  EXPECT_EQ(again[0]->cache_result, LookupResult::kHostHit);
}

TEST(HostTierEngine, CopyHiddenBehindTheWaveIsOnloadedThoughSlowerThanItsRecompute) {
  // A user's 32 host tokens (8 pages) take 32 s to recompute and 40 s to copy: alone, recomputing
  // wins. Beside a new user of 64 tokens the copy hides behind half of that user's compute (2
  // layers) and wins: 40 <= 32 + (4 candidate rows + 64 tokens) / 2.
  EngineOptions o = RuleOptions(5);
  auto e = Engine::Create(o, RandomModel(SmallConfig(), 7));
  ASSERT_TRUE(e.ok()) << e.status();
  auto full = RecomputingEngine(o, 7);
  ASSERT_TRUE(full.ok());
  std::mt19937 rng(5);
  std::vector<RankRequest> users;
  ASSERT_NO_FATAL_FAILURE(PushUsersToTheHost(**e, rng, &users));
  auto check = [&](const std::vector<RankRequest>& wave,
                   const std::vector<absl::StatusOr<RankResult>>& got) {
    auto want = (*full)->Rank(wave);
    for (size_t i = 0; i < wave.size(); ++i) {
      ASSERT_TRUE(got[i].ok()) << got[i].status();
      ASSERT_TRUE(want[i].ok());
      EXPECT_LE(test::MaxAbsDiff(got[i]->scores, want[i]->scores), test::kF32Abs);
      EXPECT_LE(test::RelL2(got[i]->hidden, want[i]->hidden), test::kF32RelL2);
    }
  };
  // Alone: recomputed.
  Grow(rng, users[1], 2);
  std::vector<RankRequest> alone = {users[1]};
  auto got = (*e)->Rank(alone);
  check(alone, got);
  EXPECT_EQ(got[0]->cache_result, LookupResult::kHostRecompute);
  // Listed first beside a new user: admitted after it, and onloaded.
  Grow(rng, users[2], 2);
  users[9].user_id = 9;
  Grow(rng, users[9], 32);
  std::vector<RankRequest> wave = {users[2], users[9]};
  got = (*e)->Rank(wave);
  check(wave, got);
  EXPECT_EQ(got[0]->cache_result, LookupResult::kHostHit);
  EXPECT_EQ(got[0]->reused_tokens, 32u);
  EXPECT_EQ(got[1]->cache_result, LookupResult::kMiss);
  // A copy of 9 s a page (72 s) needs more compute to hide behind than that wave has.
  o = RuleOptions(9);
  auto slow = Engine::Create(o, RandomModel(SmallConfig(), 7));
  ASSERT_TRUE(slow.ok());
  for (int u = 1; u <= 7; ++u) ASSERT_TRUE((*slow)->Rank({&users[u], 1})[0].ok());
  Grow(rng, users[3], 2);
  users[8].user_id = 8;
  Grow(rng, users[8], 32);
  wave = {users[3], users[8]};
  got = (*slow)->Rank(wave);
  check(wave, got);
  EXPECT_EQ(got[0]->cache_result, LookupResult::kHostRecompute);  // 72 s > 32 + (4 + 64) / 2
}

// A user restored from the host is an ordinary cached entry afterwards: an edited history reuses
// only the pages before the edit (hash chain), whether the entry is back on the GPU or still on
// the host, and every answer equals a full recompute.
TEST(HostTierEngine, EditsAfterAnOnloadReuseOnlyThePagesBeforeTheEdit) {
  EngineOptions o = RuleOptions(/*copy_seconds_per_page=*/1e-9);
  o.onload_policy = OnloadPolicy::kAlways;
  auto e = Engine::Create(o, RandomModel(SmallConfig(), 7));
  ASSERT_TRUE(e.ok()) << e.status();
  auto full = RecomputingEngine(o, 7);
  ASSERT_TRUE(full.ok()) << full.status();
  std::mt19937 rng(21);
  std::vector<RankRequest> users;
  PushUsersToTheHost(**e, rng, &users);  // users 1-5 on the host only, 16 events (8 pages) each
  // Each step: the user, the event edited first (-1: none), the lookup and the tokens reused.
  struct Step {
    int user, edit_event;
    LookupResult want;
    uint32_t reused;
  };
  const Step steps[] = {
      {1, -1, LookupResult::kHostHit, 32},  // onloaded whole
      {1, 5, LookupResult::kPartial, 8},    // back on the GPU: event 5 is in page 2
      {1, 0, LookupResult::kMismatch, 0},   // the first page differs
      {2, 9, LookupResult::kHostHit, 16},   // still on the host: the 4 pages before event 9
  };
  for (const Step& st : steps) {
    RankRequest& r = users[st.user];
    if (st.edit_event >= 0) r.history_item_ids[st.edit_event] += 1;
    Grow(rng, r, 1);
    auto a = (*e)->Rank({&r, 1});
    auto b = (*full)->Rank({&r, 1});
    ASSERT_TRUE(a[0].ok()) << a[0].status();
    ASSERT_TRUE(b[0].ok()) << b[0].status();
    EXPECT_EQ(a[0]->cache_result, st.want) << "user " << st.user << " edit " << st.edit_event;
    EXPECT_EQ(a[0]->reused_tokens, st.reused) << "user " << st.user << " edit " << st.edit_event;
    EXPECT_LE(test::MaxAbsDiff(a[0]->scores, b[0]->scores), test::kF32Abs);
    EXPECT_LE(test::RelL2(a[0]->hidden, b[0]->hidden), test::kF32RelL2);
  }
}

TEST(HostTierEngine, CreateRejectsNegativeRates) {
  EngineOptions o;
  o.onload_bytes_per_second = -1;
  EXPECT_EQ(Engine::Create(o, RandomModel(SmallConfig(), 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.onload_bytes_per_second = 0;
  o.recompute_seconds_per_token = -1e-6;
  EXPECT_EQ(Engine::Create(o, RandomModel(SmallConfig(), 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Requests one at a time, each after a Prefetch() of a few "queued" users (as the scheduler does:
// random ones, often this one); every result is checked against the recomputing engine.
EngineStats RunPrefetchTraffic(EngineOptions o) {
  o.page_size = 4;
  o.cache_pages = 40;
  o.host_cache_pages = 80;
  auto cached = Engine::Create(o, RandomModel(SmallConfig(), 6));
  EXPECT_TRUE(cached.ok()) << cached.status();
  auto full = RecomputingEngine(o, 6);
  EXPECT_TRUE(full.ok());
  if (!cached.ok() || !full.ok()) return EngineStats();
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
    const RankRequest* running = &r;
    const std::vector<const RankRequest*> queued = {&users[rng() % 10], &users[rng() % 10], &r};
    (*cached)->Prefetch({&running, 1}, queued);
    auto a = (*cached)->Rank({&r, 1});
    auto b = (*full)->Rank({&r, 1});
    EXPECT_TRUE(a[0].ok()) << a[0].status();
    if (!a[0].ok() || !b[0].ok()) break;
    EXPECT_LE(test::MaxAbsDiff(a[0]->scores, b[0]->scores), test::kF32Abs) << "step " << step;
  }
  return (*cached)->Stats();
}

TEST(HostTierPrefetchEngine, PrefetchedUsersScoreLikeAFullRecompute) {
  EngineOptions o;
  o.onload_policy = OnloadPolicy::kAlways;
  const EngineStats s = RunPrefetchTraffic(o);
  EXPECT_GT(s.cache.pages_prefetched, 0u);
  EXPECT_GT(Lookups(s, LookupResult::kHostHit), 0u);
  EXPECT_EQ(s.cache.pages_pinned, 0);
}

TEST(HostTierPrefetchEngine, PrefetchCountsTheBatchItOverlapsInFull) {
  // A host user's 32 tokens (8 pages): 32 s to recompute, 40 s to copy. The copy runs beside the
  // whole batch about to run: a returning user's 2 candidates and 2 new tokens hide 4 s of it
  // (40 > 32 + 4: not started); a new user's 2 candidates and 64 tokens hide 66 s (started).
  const EngineOptions o = RuleOptions(5);
  auto e = Engine::Create(o, RandomModel(SmallConfig(), 7));
  ASSERT_TRUE(e.ok()) << e.status();
  std::mt19937 rng(9);
  std::vector<RankRequest> users;
  ASSERT_NO_FATAL_FAILURE(PushUsersToTheHost(**e, rng, &users));  // 8 pages free after it
  Grow(rng, users[2], 2);
  const RankRequest* queued = &users[2];
  Grow(rng, users[7], 1);
  const RankRequest* returning = &users[7];
  (*e)->Prefetch({&returning, 1}, {&queued, 1});
  EXPECT_EQ((*e)->Stats().cache.pages_prefetched, 0u);
  users[9].user_id = 9;
  Grow(rng, users[9], 32);
  const RankRequest* fresh = &users[9];
  (*e)->Prefetch({&fresh, 1}, {&queued, 1});
  EXPECT_EQ((*e)->Stats().cache.pages_prefetched, 8u);
  auto got = (*e)->Rank({&users[9], 1});
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  got = (*e)->Rank({&users[2], 1});
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->cache_result, LookupResult::kHostHit);
  EXPECT_EQ(got[0]->reused_tokens, 32u);
  auto full = RecomputingEngine(o, 7);
  ASSERT_TRUE(full.ok());
  auto want = (*full)->Rank({&users[2], 1});
  ASSERT_TRUE(want[0].ok());
  EXPECT_LE(test::MaxAbsDiff(got[0]->scores, want[0]->scores), test::kF32Abs);
}

// The queue can hold a later request of a user in the running batch (DESIGN §4: never two in
// one batch). Its history may match less of the entry (here an edit in the second page); a
// prefetch for it would cut the entry before the running request, which matches all of it, is
// admitted.
TEST(HostTierPrefetchEngine, QueuedRequestOfARunningUserLeavesItsEntryWhole) {
  EngineOptions o = RuleOptions(1e-3);
  o.onload_policy = OnloadPolicy::kAlways;
  auto e = Engine::Create(o, RandomModel(SmallConfig(), 7));
  ASSERT_TRUE(e.ok()) << e.status();
  std::mt19937 rng(13);
  std::vector<RankRequest> users;
  ASSERT_NO_FATAL_FAILURE(PushUsersToTheHost(**e, rng, &users));  // user 1: 8 pages on the host
  Grow(rng, users[1], 2);
  RankRequest edited = users[1];
  edited.history_item_ids[3] += 1;  // token 6: the second page differs
  const RankRequest* running = &users[1];
  const RankRequest* queued = &edited;
  (*e)->Prefetch({&running, 1}, {&queued, 1});
  EXPECT_EQ((*e)->Stats().cache.pages_prefetched, 0u);
  auto got = (*e)->Rank({&users[1], 1});
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->cache_result, LookupResult::kHostHit);
  EXPECT_EQ(got[0]->reused_tokens, 32u);
  auto full = RecomputingEngine(o, 7);
  ASSERT_TRUE(full.ok());
  auto want = (*full)->Rank({&users[1], 1});
  ASSERT_TRUE(want[0].ok());
  EXPECT_LE(test::MaxAbsDiff(got[0]->scores, want[0]->scores), test::kF32Abs);
  EXPECT_EQ((*e)->Stats().cache.pages_pinned, 0);
}

TEST(HostTierPrefetchEngine, FailedPrefetchIsRecomputedNotReused) {
  EngineOptions o;
  o.page_size = 4;
  o.cache_pages = 12;
  o.host_cache_pages = 200;
  o.onload_policy = OnloadPolicy::kAlways;
  auto full = RecomputingEngine(o, 3);
  ASSERT_TRUE(full.ok());
  auto faults = std::make_shared<testing::Faults>();
  o.wrap_backend = testing::WrapWithFaults(faults);
  auto e = Engine::Create(o, RandomModel(SmallConfig(), 3));
  ASSERT_TRUE(e.ok()) << e.status();
  std::mt19937 rng(5);
  std::vector<RankRequest> users(3);
  for (int u = 1; u <= 2; ++u) {
    users[u].user_id = u;
    Grow(rng, users[u], 20);
    ASSERT_TRUE((*e)->Rank({&users[u], 1})[0].ok());  // user 2 pushes user 1 to the host
  }
  Grow(rng, users[1], 2);
  const RankRequest* queued = &users[1];
  faults->fail_next_prefetch = true;
  (*e)->Prefetch({}, {&queued, 1});
  ASSERT_EQ(faults->prefetches.load(), 1);
  auto got = (*e)->Rank({&users[1], 1});
  auto want = (*full)->Rank({&users[1], 1});
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  ASSERT_TRUE(want[0].ok());
  EXPECT_EQ(got[0]->cache_result, LookupResult::kMiss);
  EXPECT_EQ(got[0]->reused_tokens, 0u);
  EXPECT_LE(test::MaxAbsDiff(got[0]->scores, want[0]->scores), test::kF32Abs);
  EXPECT_EQ((*e)->Stats().cache.pages_pinned, 0);
}

TEST(HostTierPrefetchEngine, CostPolicyPrefetchesOnlyWhatItWouldOnload) {
  EngineOptions o;
  o.onload_policy = OnloadPolicy::kCost;
  o.onload_bytes_per_second = 1;  // slow: nothing is prefetched, every host hit is recomputed
  o.recompute_seconds_per_token = 1e-6;
  const EngineStats slow = RunPrefetchTraffic(o);
  EXPECT_EQ(slow.cache.pages_prefetched, 0u);
  EXPECT_EQ(slow.cache.pages_onloaded, 0u);
  EXPECT_EQ(Lookups(slow, LookupResult::kHostHit), 0u);
  EXPECT_GT(Lookups(slow, LookupResult::kHostRecompute), 0u);
  EXPECT_EQ(slow.cache.pages_pinned, 0);
  o.onload_bytes_per_second = 1e15;  // fast: as with kAlways
  o.recompute_seconds_per_token = 1;
  const EngineStats fast = RunPrefetchTraffic(o);
  EngineOptions always;
  always.onload_policy = OnloadPolicy::kAlways;
  const EngineStats a = RunPrefetchTraffic(always);
  EXPECT_GT(fast.cache.pages_prefetched, 0u);
  EXPECT_EQ(fast.cache.pages_prefetched, a.cache.pages_prefetched);
  EXPECT_EQ(Lookups(fast, LookupResult::kHostHit), Lookups(a, LookupResult::kHostHit));
  EXPECT_EQ(Lookups(fast, LookupResult::kHostRecompute), 0u);
}

}  // namespace
}  // namespace hstu
