// The engine on the CPU: incremental forward with the cache == full forward without it, edits,
// truncation, candidate chunking, eviction pressure, validation.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "engine/engine.h"
#include "engine/gpu_telemetry.h"
#include "engine/model_file.h"
#include "gtest/gtest.h"
#include "kernels/params.h"
#include "tests/util/faulty_backend.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

ModelConfig TestConfig(bool position_encoding, int window, int max_history = 64, int max_cand = 16) {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 3;
  c.hidden_dim = 24;
  c.num_heads = 2;
  c.head_dim = 8;
  c.max_history_tokens = max_history;
  c.max_candidates = max_cand;
  c.attention_norm_len = max_history + max_cand;
  c.max_attn_len = window;
  c.position_encoding = position_encoding;
  c.position_rows = position_encoding ? max_history : 0;
  c.item_rows = 97;
  c.action_rows = 5;
  c.num_tasks = 2;
  c.head_dims = {24, 12, 2};
  return c;
}

std::unique_ptr<Engine> MakeEngine(const ModelConfig& c, bool cache, int page_size,
                                   int64_t pages = 0, int64_t seed = 3) {
  EngineOptions o;
  o.enable_cache = cache;
  o.page_size = page_size;
  o.cache_pages = pages;
  o.keep_hidden = true;
  auto e = Engine::Create(o, RandomModel(c, seed));
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

RankResult RankOne(Engine& e, const RankRequest& r) {
  auto res = e.Rank({&r, 1});
  EXPECT_TRUE(res[0].ok()) << res[0].status();
  return *std::move(res[0]);
}

struct Traffic {
  std::mt19937 rng;
  std::vector<RankRequest> users;
  explicit Traffic(int n, uint64_t seed) : rng(seed), users(n) {
    for (int u = 0; u < n; ++u) users[u].user_id = 100 + u;
  }
  // The next visit of user u: a few new events, sometimes an edit or a shortened history.
  RankRequest Visit(int u, bool allow_edits) {
    RankRequest& r = users[u];
    const int op = rng() % 10;
    if (allow_edits && op == 0 && !r.history_item_ids.empty()) {
      r.history_item_ids[rng() % r.history_item_ids.size()] = rng() % 1000;
    } else if (allow_edits && op == 1 && r.history_item_ids.size() > 3) {
      r.history_item_ids.resize(r.history_item_ids.size() - 3);
      r.history_actions.resize(r.history_item_ids.size());
    } else {
      const int add = rng() % 6;
      for (int i = 0; i < add; ++i) {
        r.history_item_ids.push_back(rng() % 1000);
        r.history_actions.push_back(rng() % 5);
      }
    }
    r.candidate_item_ids.clear();
    const int nc = 1 + rng() % 5;
    for (int i = 0; i < nc; ++i) r.candidate_item_ids.push_back(rng() % 1000);
    return r;
  }
};

void ExpectSame(const RankResult& a, const RankResult& b, const std::string& what) {
  ASSERT_EQ(a.scores.size(), b.scores.size()) << what;
  EXPECT_LE(test::MaxAbsDiff(a.scores, b.scores), test::kF32Abs) << what;
  EXPECT_LE(test::RelL2(a.hidden, b.hidden), test::kF32RelL2) << what;
}

class CachedEqualsFull : public ::testing::TestWithParam<std::tuple<int, bool, int>> {};

TEST_P(CachedEqualsFull, ScoresAndHiddenStatesMatch) {
  const auto [page_size, pos_enc, window] = GetParam();
  const ModelConfig c = TestConfig(pos_enc, window);
  auto cached = MakeEngine(c, true, page_size);
  auto full = MakeEngine(c, false, page_size);
  Traffic t(4, page_size * 31 + window);
  uint64_t reused = 0;
  for (int step = 0; step < 40; ++step) {
    const RankRequest r = t.Visit(step % 4, /*allow_edits=*/true);
    const RankResult a = RankOne(*cached, r), b = RankOne(*full, r);
    EXPECT_EQ(b.reused_tokens, 0u);
    EXPECT_EQ(a.reused_tokens + a.computed_tokens, b.computed_tokens);
    reused += a.reused_tokens;
    ExpectSame(a, b, "step " + std::to_string(step));
    for (float s : a.scores) ASSERT_TRUE(s > 0.f && s < 1.f);
  }
  EXPECT_GT(reused, 0u);
}

INSTANTIATE_TEST_SUITE_P(PageSizesEncodingsWindows, CachedEqualsFull,
                         ::testing::Combine(::testing::Values(1, 3, 7, 17, 32), ::testing::Bool(),
                                            ::testing::Values(0, 6)));

TEST(Engine, ReturningUserReusesExactlyTheUnchangedPrefix) {
  const ModelConfig c = TestConfig(true, 0);
  auto e = MakeEngine(c, true, 4);
  RankRequest r{7, {1, 2, 3, 4, 5}, {0, 1, 2, 3, 4}, {9, 8}};
  EXPECT_EQ(RankOne(*e, r).computed_tokens, 10u);
  r.history_item_ids.push_back(6);
  r.history_actions.push_back(0);
  RankResult grown = RankOne(*e, r);
  EXPECT_EQ(grown.reused_tokens, 10u);
  EXPECT_EQ(grown.computed_tokens, 2u);
  r.history_item_ids[3] = 77;  // token 6 edited: pages 0 (tokens 0-3) still match
  RankResult edited = RankOne(*e, r);
  EXPECT_EQ(edited.reused_tokens, 4u);
  EXPECT_EQ(edited.computed_tokens, 8u);
  auto fresh = MakeEngine(c, false, 4);
  ExpectSame(edited, RankOne(*fresh, r), "edited history");
}

TEST(Engine, AModelThatOverflowsFailsTheRequestAndCachesNothing) {
  // Before: the NaN scores went out (hstu_rank wrote null, the server NaN) and the user's NaN K/V
  // stayed in the cache for the next visit.
  const ModelConfig c = TestConfig(false, 0);
  ModelWeights w = RandomModel(c, 3);
  for (size_t i = 0; i < w.layers[0].output_w.size(); ++i) {
    w.layers[0].output_w[i] = i % 2 == 0 ? 3e38f : -3e38f;  // finite, but y · W_o is not
  }
  EngineOptions o;
  o.page_size = 4;
  auto e = Engine::Create(o, std::move(w));
  ASSERT_TRUE(e.ok()) << e.status();
  const RankRequest r{7, {1, 2, 3, 4, 5}, {0, 1, 2, 3, 4}, {9, 8}};
  auto res = (*e)->Rank({&r, 1});
  ASSERT_FALSE(res[0].ok());
  EXPECT_EQ(res[0].status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(std::string(res[0].status().message()).find("non-finite scores"), std::string::npos)
      << res[0].status();
  const CacheStats stats = (*e)->Stats().cache;
  EXPECT_EQ(stats.entries, 0);
  EXPECT_EQ(stats.pages_free, stats.pages_total);
}

TEST(Engine, SaturatedLogitsStillGiveScoresInsideZeroOne) {
  // Before: a logit past ~16.6 gave a score of exactly 1 and one below ~-88.7 exactly 0, outside
  // the (0, 1) the wire contract promises (log(1 - p) of a calibration became -inf).
  const ModelConfig c = TestConfig(false, 0);
  ModelWeights w = RandomModel(c, 3);
  HeadLayerWeights& last = w.head.back();
  ASSERT_GE(last.out, 2);
  last.b[0] += 200.f;
  last.b[1] -= 200.f;
  const int tasks = last.out;  // `last` goes with the weights into the engine
  EngineOptions o;
  o.page_size = 4;
  auto e = Engine::Create(o, std::move(w));
  ASSERT_TRUE(e.ok()) << e.status();
  const RankRequest r{7, {1, 2, 3, 4, 5}, {0, 1, 2, 3, 4}, {9, 8, 3}};
  const RankResult res = RankOne(**e, r);
  for (size_t c = 0; c < r.candidate_item_ids.size(); ++c) {
    EXPECT_EQ(res.scores[c * tasks + 0], kMaxScore) << "candidate " << c;
    EXPECT_EQ(res.scores[c * tasks + 1], kMinScore) << "candidate " << c;
  }
  for (float s : res.scores) {
    EXPECT_GT(s, 0.f);
    EXPECT_LT(s, 1.f);
  }
}

TEST(Engine, CudaRunsModelNamesTheShapesTheKernelsDoNotRun) {
  // No GPU is needed: the shapes alone decide.
  ModelConfig base = *PresetConfig("base");
  ModelConfig tiny = *PresetConfig("tiny");
  ModelConfig odd_width = base;
  odd_width.hidden_dim = 1020;
#if defined(HSTU_WITH_CUDA)
  EXPECT_TRUE(CudaRunsModel(base).ok()) << CudaRunsModel(base);
  const absl::Status t = CudaRunsModel(tiny);
  EXPECT_EQ(t.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(t.message()).find("head dims 64, 128, 256, not 32"), std::string::npos) << t;
  const absl::Status w = CudaRunsModel(odd_width);
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(w.message()).find("hidden_dim % 8"), std::string::npos) << w;
#else
  EXPECT_EQ(CudaRunsModel(base).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CudaRunsModel(tiny).code(), absl::StatusCode::kUnavailable);
#endif
}

TEST(Engine, TwoRequestsOfOneUserInABatchRunInOrder) {
  const ModelConfig c = TestConfig(false, 0);
  auto e = MakeEngine(c, true, 4);
  RankRequest a{5, {1, 2, 3}, {0, 1, 2}, {4}};
  RankRequest b = a;
  b.history_item_ids.push_back(9);
  b.history_actions.push_back(1);
  RankRequest other{6, {3}, {1}, {4, 5}};
  std::vector<RankRequest> batch = {a, other, b};
  auto res = e->Rank(batch);
  ASSERT_TRUE(res[0].ok() && res[1].ok() && res[2].ok());
  EXPECT_EQ(res[2]->reused_tokens, 6u);
  EXPECT_EQ(res[2]->computed_tokens, 2u);
  auto full = MakeEngine(c, false, 4);
  ExpectSame(*res[2], RankOne(*full, b), "second request of the user");
  ExpectSame(*res[1], RankOne(*full, other), "other user in the batch");
}

TEST(Engine, CandidateChunksGiveIdenticalScores) {
  const ModelConfig c = TestConfig(true, 0, 64, /*max_cand=*/4);
  auto e = MakeEngine(c, true, 3);
  RankRequest r{1, {5, 6, 7, 8}, {1, 2, 3, 4}, {}};
  for (int i = 0; i < 11; ++i) r.candidate_item_ids.push_back(10 * i + 1);
  const RankResult all = RankOne(*e, r);
  ASSERT_EQ(all.scores.size(), 11u * 2);
  auto single = MakeEngine(c, false, 3);
  for (int i = 0; i < 11; ++i) {
    RankRequest one = r;
    one.candidate_item_ids = {r.candidate_item_ids[i]};
    const RankResult s = RankOne(*single, one);
    for (int t = 0; t < 2; ++t) EXPECT_NEAR(all.scores[i * 2 + t], s.scores[t], test::kF32Abs) << i;
  }
}

TEST(Engine, TruncationKeepsTheLatestTokensInStrides) {
  // M = 16 history tokens, stride 4 tokens (2 events).
  const ModelConfig c = TestConfig(true, 0, 16, 8);
  ASSERT_EQ(c.truncation_stride(), 4);
  auto e = MakeEngine(c, true, 4);
  auto full = MakeEngine(c, false, 4);
  RankRequest r{3, {}, {}, {1, 2}};
  for (int i = 0; i < 8; ++i) {
    r.history_item_ids.push_back(i + 1);
    r.history_actions.push_back(i % 5);
  }
  RankOne(*e, r);  // 16 tokens: exactly M, nothing dropped
  r.history_item_ids.push_back(9);
  r.history_actions.push_back(0);
  // 18 tokens > 16: start = ceil(2/4)*4 = 4, keeps events 2.. (7 events, 14 tokens).
  const RankResult moved = RankOne(*e, r);
  EXPECT_EQ(moved.reused_tokens + moved.computed_tokens, 14u);
  EXPECT_EQ(moved.reused_tokens, 0u);  // the start moved: nothing cached is valid
  RankRequest explicit_tail{4, {}, {}, r.candidate_item_ids};
  explicit_tail.history_item_ids.assign(r.history_item_ids.begin() + 2, r.history_item_ids.end());
  explicit_tail.history_actions.assign(r.history_actions.begin() + 2, r.history_actions.end());
  ExpectSame(moved, RankOne(*full, explicit_tail), "truncated == explicit tail");
  // One more event within the same stride: start stays 4, the cache is reused.
  r.history_item_ids.push_back(10);
  r.history_actions.push_back(1);
  const RankResult next = RankOne(*e, r);
  EXPECT_EQ(next.reused_tokens, 14u);
  EXPECT_EQ(next.computed_tokens, 2u);
  ExpectSame(next, RankOne(*full, r), "within the stride");
}

TEST(Engine, EvictionUnderATinyPoolKeepsScoresCorrect) {
  const ModelConfig c = TestConfig(false, 0);
  auto e = MakeEngine(c, true, 4, /*pages=*/20);  // ~2 users of 40 tokens
  auto full = MakeEngine(c, false, 4);
  Traffic t(6, 77);
  for (int step = 0; step < 60; ++step) {
    const RankRequest r = t.Visit(step % 6, false);
    ExpectSame(RankOne(*e, r), RankOne(*full, r), "step " + std::to_string(step));
  }
  const EngineStats s = e->Stats();
  EXPECT_GT(s.cache.evictions, 0u);
  EXPECT_EQ(s.cache.pages_pinned, 0);
  EXPECT_LE(s.cache.pages_total - s.cache.pages_free, 20);
}

TEST(Engine, UserLargerThanThePoolFailsAloneWithResourceExhausted) {
  const ModelConfig c = TestConfig(false, 0);
  auto e = MakeEngine(c, true, 4, /*pages=*/3);
  RankRequest big{1, std::vector<int64_t>(20, 1), std::vector<int32_t>(20, 1), {1}};
  RankRequest small{2, {1}, {1}, {1}};
  auto res = e->Rank(std::vector<RankRequest>{big, small});
  EXPECT_EQ(res[0].status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(res[1].ok());
}

TEST(Engine, AKvPoolTooLargeForMemoryIsAnErrorNotAnAbort) {
  EngineOptions o;
  o.page_size = 4096;
  o.cache_pages = std::numeric_limits<int32_t>::max();  // petabytes
  auto e = Engine::Create(o, RandomModel(TestConfig(false, 0), 3));
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted) << e.status();
  // Past what 32-bit page ids address: refused by name before any allocation.
  o.cache_pages = int64_t{1} << 50;
  e = Engine::Create(o, RandomModel(TestConfig(false, 0), 3));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
  EXPECT_NE(e.status().message().find("cache_pages must be in [0, 2147483647]"), std::string::npos)
      << e.status();
  // The host tier too. Before: std::bad_alloc (or bad_array_new_length) out of Engine::Create.
  o.cache_pages = 64;
  o.host_cache_pages = std::numeric_limits<int32_t>::max();
  e = Engine::Create(o, RandomModel(TestConfig(false, 0), 3));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted) << e.status();
  EXPECT_NE(e.status().message().find("host KV tier"), std::string::npos) << e.status();
  o.host_cache_pages = int64_t{1} << 40;
  e = Engine::Create(o, RandomModel(TestConfig(false, 0), 3));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
  o.host_cache_pages = 0;
  o.offload_backlog_mib = int64_t{1} << 44;  // its bytes overflowed
  e = Engine::Create(o, RandomModel(TestConfig(false, 0), 3));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
}

TEST(Engine, UsersThatDoNotFitBesideEachOtherRunOneAfterAnother) {
  // A pool of 12 pages of 4 tokens holds one of these users (40 tokens, 10 pages) at a time.
  // Batched together, the second and third used to fail RESOURCE_EXHAUSTED while the first held
  // the pool; now they run once it committed, with and without the cache, and score as alone.
  const ModelConfig c = TestConfig(false, 0);
  for (const bool cache : {true, false}) {
    auto e = MakeEngine(c, cache, 4, /*pages=*/12);
    auto full = MakeEngine(c, false, 4);
    std::vector<RankRequest> batch;
    for (uint64_t u = 1; u <= 3; ++u) {
      RankRequest r{u, {}, {}, {static_cast<int64_t>(u), 7}};
      for (int i = 0; i < 20; ++i) {
        r.history_item_ids.push_back(static_cast<int64_t>(u * 100 + i));
        r.history_actions.push_back(i % 3);
      }
      batch.push_back(r);
    }
    batch.push_back(batch[0]);  // user 1 again: a second wave, after the deferred users
    batch.back().candidate_item_ids = {9};
    auto res = e->Rank(batch);
    ASSERT_EQ(res.size(), 4u);
    for (size_t i = 0; i < res.size(); ++i) {
      ASSERT_TRUE(res[i].ok()) << "cache " << cache << " request " << i << ": " << res[i].status();
      ExpectSame(*res[i], RankOne(*full, batch[i]), "request " + std::to_string(i));
    }
    // User 1 was evicted for users 2 and 3 (no host tier): its second request is a miss.
    EXPECT_EQ(res[3]->cache_result, cache ? LookupResult::kMiss : LookupResult::kDisabled);
    EXPECT_EQ(e->Stats().cache.pages_pinned, 0);
  }
}

// A one-off backend failure fails its batch alone (INTERNAL) and the engine keeps serving. A lost
// device (DeviceStatus not OK after a failure) fails that batch too; from then on every request is
// answered UNAVAILABLE without reaching the backend, and prefetches stop.
TEST(Engine, ALostDeviceIsNotUsedAgain) {
  const ModelConfig c = TestConfig(false, 0);
  auto faults = std::make_shared<testing::Faults>();
  EngineOptions o;
  o.page_size = 4;
  o.cache_pages = 12;  // one user of 40 tokens at a time: the others go to the host tier
  o.host_cache_pages = 200;
  o.onload_policy = OnloadPolicy::kAlways;
  o.wrap_backend = testing::WrapWithFaults(faults);
  auto made = Engine::Create(o, RandomModel(c, 3));
  ASSERT_TRUE(made.ok()) << made.status();
  Engine& e = **made;
  ASSERT_TRUE(e.has_host_tier());
  auto visit = [](uint64_t user, int events) {
    RankRequest r{user, {}, {}, {7, 8, 9}};
    for (int i = 0; i < events; ++i) {
      r.history_item_ids.push_back(static_cast<int64_t>(user * 31 + i) % 97);
      r.history_actions.push_back(i % 5);
    }
    return r;
  };
  RankOne(e, visit(1, 20));
  RankOne(e, visit(2, 20));  // user 1 moves to the host

  faults->fail_next_forward = true;
  const RankRequest once = visit(2, 20);
  auto res = e.Rank({&once, 1});
  EXPECT_EQ(res[0].status().code(), absl::StatusCode::kInternal) << res[0].status();
  EXPECT_TRUE(e.health().ok());
  RankOne(e, visit(2, 20));  // serving again
  EXPECT_FALSE(e.Stats().device_lost);

  // The control for the prefetch check below: a queued visit of user 1 is onloaded early (user 2,
  // whose pages all have host copies, goes to the host to make room).
  const RankRequest again1 = visit(1, 20);
  const RankRequest* queued[] = {&again1};
  e.Prefetch({}, queued);
  ASSERT_EQ(faults->prefetches, 1);
  RankOne(e, again1);
  RankOne(e, visit(2, 20));  // user 1 to the host again

  faults->device_lost = true;
  const RankRequest lost = visit(3, 5);
  res = e.Rank({&lost, 1});
  EXPECT_EQ(res[0].status().code(), absl::StatusCode::kInternal) << res[0].status();
  EXPECT_EQ(e.health().code(), absl::StatusCode::kUnavailable) << e.health();
  EXPECT_TRUE(e.Stats().device_lost);

  const int forwards = faults->forwards;
  std::vector<RankRequest> batch = {visit(2, 20), visit(4, 3)};
  batch[1].candidate_item_ids.clear();  // invalid too: the device's state is the answer
  res = e.Rank(batch);
  for (const auto& r : res) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    EXPECT_NE(r.status().message().find("the device is lost"), std::string::npos) << r.status();
  }
  const RankRequest later1 = visit(1, 20);
  const RankRequest* queued_after[] = {&later1};
  e.Prefetch({}, queued_after);
  EXPECT_EQ(faults->forwards, forwards);
  EXPECT_EQ(faults->prefetches, 1);
}

// Before: after the first wave's forward lost the device, every later wave (and round) of the
// batch still ran on it and answered INTERNAL.
TEST(Engine, ABatchStopsUsingADeviceItLost) {
  const ModelConfig c = TestConfig(false, 0);
  auto faults = std::make_shared<testing::Faults>();
  EngineOptions o;
  o.page_size = 4;
  o.cache_pages = 64;
  o.wrap_backend = testing::WrapWithFaults(faults);
  auto made = Engine::Create(o, RandomModel(c, 3));
  ASSERT_TRUE(made.ok()) << made.status();
  Engine& e = **made;
  RankRequest r{5, {1, 2, 3}, {0, 1, 2}, {7, 8}};
  const std::vector<RankRequest> batch = {r, r, r};  // three waves of one user
  faults->device_lost = true;
  const auto res = e.Rank(batch);
  EXPECT_EQ(faults->forwards, 1);
  EXPECT_EQ(res[0].status().code(), absl::StatusCode::kInternal) << res[0].status();
  for (int i : {1, 2}) {
    EXPECT_EQ(res[i].status().code(), absl::StatusCode::kUnavailable) << res[i].status();
    EXPECT_NE(res[i].status().message().find("engine unavailable"), std::string::npos);
  }
}

// An automatic host tier the machine cannot pin costs the tier, not the start-up; an explicit
// size that cannot be pinned is an error.
TEST(Engine, AnAutomaticHostTierThatCannotBePinnedIsDisabled) {
  const ModelConfig c = TestConfig(false, 0);
  auto faults = std::make_shared<testing::Faults>();
  faults->device_memory_bytes = int64_t{80} << 30;  // as a GPU backend reports
  faults->fail_host_pool = true;
  EngineOptions o;
  o.page_size = 4;
  o.cache_pages = 64;
  o.host_cache_pages = -1;
  o.wrap_backend = testing::WrapWithFaults(faults);
  auto automatic = Engine::Create(o, RandomModel(c, 3));
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_FALSE((*automatic)->has_host_tier());
  RankOne(**automatic, RankRequest{5, {1, 2, 3}, {0, 1, 2}, {7, 8}});
  o.host_cache_pages = 100;
  auto explicit_size = Engine::Create(o, RandomModel(c, 3));
  EXPECT_EQ(explicit_size.status().code(), absl::StatusCode::kResourceExhausted)
      << explicit_size.status();
  // The control: the same automatic size, pinned, makes a tier.
  faults->fail_host_pool = false;
  o.host_cache_pages = -1;
  auto pinned = Engine::Create(o, RandomModel(c, 3));
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_TRUE((*pinned)->has_host_tier());
}

// The automatic host tier is sized from what a container may use, not the machine's RAM.
TEST(UsableMemoryBytes, TakesTheCgroupLimitWhenLower) {
  const std::string root = ::testing::TempDir() + "/cgroup_" + std::to_string(getpid());
  std::filesystem::create_directories(root + "/memory");
  const int64_t machine = UsableMemoryBytes(root);  // no limit files yet
  ASSERT_GT(machine, 0);
  std::ofstream(root + "/memory.max") << "max\n";  // cgroup v2, no limit
  EXPECT_EQ(UsableMemoryBytes(root), machine);
  std::ofstream(root + "/memory.max") << (int64_t{1} << 30) << "\n";
  EXPECT_EQ(UsableMemoryBytes(root), std::min<int64_t>(machine, int64_t{1} << 30));
  std::filesystem::remove(root + "/memory.max");
  std::ofstream(root + "/memory/memory.limit_in_bytes") << "9223372036854771712\n";  // v1, none
  EXPECT_EQ(UsableMemoryBytes(root), machine);
  std::ofstream(root + "/memory/memory.limit_in_bytes") << (int64_t{512} << 20) << "\n";
  EXPECT_EQ(UsableMemoryBytes(root), std::min<int64_t>(machine, int64_t{512} << 20));
  std::filesystem::remove_all(root);
}

TEST(Engine, ValidationNamesTheField) {
  const ModelConfig c = TestConfig(false, 0);
  auto e = MakeEngine(c, true, 4);
  auto msg = [&](const RankRequest& r) {
    auto res = e->Rank({&r, 1});
    EXPECT_EQ(res[0].status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(res[0].status().message());
  };
  EXPECT_NE(msg({1, {1, 2}, {1}, {3}}).find("history_actions has 1 entries"), std::string::npos);
  EXPECT_NE(msg({1, {1, -2}, {1, 1}, {3}}).find("history_item_ids[1] = -2"), std::string::npos);
  EXPECT_NE(msg({1, {1}, {5}, {3}}).find("history_actions[0] = 5 is out of range [0, 5)"), std::string::npos);
  EXPECT_NE(msg({1, {1}, {1}, {}}).find("candidate_item_ids is empty"), std::string::npos);
  EXPECT_NE(msg({1, {1}, {1}, {3, -1}}).find("candidate_item_ids[1] = -1"), std::string::npos);
  RankRequest many{1, {}, {}, std::vector<int64_t>(1025, 1)};
  EXPECT_NE(msg(many).find("more than the limit of 1024"), std::string::npos);
  // Bad entries deep in long lists (the checks scan whole vectors first), at both ends of the
  // ranges; the first bad one is named.
  RankRequest deep{1, std::vector<int64_t>(1000, 7), std::vector<int32_t>(1000, 4),
                   std::vector<int64_t>(300, 9)};
  EXPECT_TRUE(e->Validate(deep).ok());
  RankRequest r = deep;
  r.history_actions[777] = -1;
  r.history_actions[900] = 5;
  EXPECT_NE(msg(r).find("history_actions[777] = -1 is out of range"), std::string::npos);
  r = deep;
  r.history_actions[999] = std::numeric_limits<int32_t>::min();
  EXPECT_NE(msg(r).find("history_actions[999] = -2147483648"), std::string::npos);
  r = deep;
  r.history_item_ids[640] = std::numeric_limits<int64_t>::min();
  r.history_actions[10] = 5;  // an earlier bad action is named first
  EXPECT_NE(msg(r).find("history_actions[10] = 5"), std::string::npos);
  r.history_actions[10] = 0;
  EXPECT_NE(msg(r).find("history_item_ids[640] = -9223372036854775808 is negative"),
            std::string::npos);
  r = deep;
  r.candidate_item_ids[299] = -3;
  EXPECT_NE(msg(r).find("candidate_item_ids[299] = -3 is negative"), std::string::npos);
  // The limits: a tighter one binds, 0 is none (before, a history limit of 0 refused every
  // non-empty history).
  RequestLimits tight;
  tight.max_history_events = 999;
  EXPECT_NE(ValidateRankRequest(deep, c, tight).message().find(
                "history_item_ids has 1000 events, more than the limit of 999"),
            std::string::npos);
  RequestLimits none;
  none.max_history_events = 0;
  none.max_candidates = 0;
  EXPECT_TRUE(ValidateRankRequest(deep, c, none).ok()) << ValidateRankRequest(deep, c, none);
}

TEST(Engine, RejectsANonPositiveOffloadBacklog) {
  EngineOptions o;
  o.offload_backlog_mib = 0;
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("offload_backlog_mib"), std::string::npos) << e.status();
}

TEST(Engine, DeviceNamesAndTheBf16Emulation) {
  EngineOptions o;
  o.device = "cpu-bf16";
  o.keep_hidden = true;
  auto bf16 = Engine::Create(o);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ((*bf16)->device_name(), "cpu-bf16");
  o.device = "cpu";
  auto fp32 = Engine::Create(o);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_EQ((*fp32)->device_name(), "cpu");

  // The same request: the emulation rounds (hidden states a few bf16 steps off), yet scores stay
  // near the fp32 ones. tests/reference checks where it rounds against an independent emulation.
  RankRequest r{1, {}, {}, {}};
  for (int i = 0; i < 40; ++i) {
    r.history_item_ids.push_back(i * 11);
    r.history_actions.push_back(i % 16);
  }
  for (int i = 0; i < 16; ++i) r.candidate_item_ids.push_back(i * 5);
  const RankResult a = RankOne(**fp32, r), b = RankOne(**bf16, r);
  ASSERT_EQ(a.hidden.size(), b.hidden.size());
  const double off = test::RelL2(b.hidden, a.hidden);
  EXPECT_GT(off, 1e-4);
  EXPECT_LT(off, test::kBf16RelL2);
  EXPECT_LT(test::MaxAbsDiff(b.scores, a.scores), 1e-2);

  o.device = "cpu-fp8";
  auto bad = Engine::Create(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'cpu-fp8' is not one of cpu, cpu-bf16, cuda:N, auto"),
            std::string::npos)
      << bad.status();
}

TEST(GpuTelemetry, OpenNamesWhatIsMissing) {
  // No GPU at this bus id on any machine (and no NVML at all on a CPU-only one): an error that says
  // which, never a crash.
  auto t = GpuTelemetry::Open("ffff:ff:1f.7");
  ASSERT_FALSE(t.ok());
  const std::string msg(t.status().message());
  EXPECT_TRUE(msg.find("NVML") != std::string::npos) << msg;
  EXPECT_TRUE(t.status().code() == absl::StatusCode::kUnavailable ||
              (t.status().code() == absl::StatusCode::kNotFound &&
               msg.find("ffff:ff:1f.7") != std::string::npos))
      << t.status();
  // The engine on the CPU has no GPU to name.
  auto e = Engine::Create(EngineOptions{});
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->device_pci_bus_id(), "");
}

TEST(Engine, RandomTinyModelGivesUsefulScores) {
  auto e = Engine::Create(EngineOptions{});
  ASSERT_TRUE(e.ok());
  RankRequest r{1, {}, {}, {}};
  for (int i = 0; i < 100; ++i) {
    r.history_item_ids.push_back(i * 7);
    r.history_actions.push_back(i % 16);
  }
  for (int i = 0; i < 64; ++i) r.candidate_item_ids.push_back(i * 13);
  const RankResult res = RankOne(**e, r);
  float lo = 1, hi = 0;
  for (float s : res.scores) {
    ASSERT_TRUE(std::isfinite(s));
    lo = std::min(lo, s);
    hi = std::max(hi, s);
  }
  EXPECT_GT(hi - lo, 0.1f) << "scores do not vanish or saturate";
}

}  // namespace
}  // namespace hstu
