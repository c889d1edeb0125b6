// Fuzz target: a sequence of batches on the CPU engine with the KV cache, each request also scored
// by an engine without the cache (the oracle). The input picks the cache's shape (page size, a GPU
// pool small enough to evict, a host tier or none, the onload policy, a window, position encoding)
// and then the traffic: visits that extend, edit, shorten or replace a user's history, more
// candidates than one forward takes, batches holding one user twice, invalid requests, prefetches.
// Every request must get what the oracle got: the same scores (fp32 rounding apart) or the same
// error, except RESOURCE_EXHAUSTED when a user outgrows the cached engine's pool; no page may stay
// pinned after a batch; the tokens reused and computed must add up to the history the oracle
// computed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/model_file.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_input.h"

namespace hstu {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "engine_fuzz: %s\n", what.c_str());
  std::abort();
}

constexpr int kUsers = 5;
constexpr int kItems = 61;
constexpr int kActions = 4;
constexpr double kScoreAbs = 1e-5;  // tests/util/tolerance.h kF32Abs: rounding only

ModelConfig FuzzConfig(fuzz::FuzzInput& in) {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 2;
  c.hidden_dim = 16;
  c.num_heads = 2;
  c.head_dim = 8;
  c.max_history_tokens = 40;
  c.max_candidates = 6;
  c.attention_norm_len = c.max_history_tokens + c.max_candidates;
  static constexpr int kWindows[] = {0, 0, 5, 12};
  c.max_attn_len = kWindows[in.Below(4)];
  c.position_encoding = in.Bool();
  c.position_rows = c.position_encoding ? c.max_history_tokens : 0;
  c.item_rows = kItems;
  c.action_rows = kActions;
  c.num_tasks = 2;
  c.head_dims = {16, 8, 2};
  return c;
}

std::unique_ptr<Engine> MakeEngine(const EngineOptions& o, const ModelConfig& c) {
  auto e = Engine::Create(o, RandomModel(c, 7));
  if (!e.ok()) Fail("engine creation: " + e.status().ToString());
  return *std::move(e);
}

// The next visit of `user`: its history changed as the input says, new candidates.
RankRequest Visit(fuzz::FuzzInput& in, RankRequest* user) {
  switch (in.Below(8)) {
    case 0:  // an edit inside the history
      if (!user->history_item_ids.empty()) {
        user->history_item_ids[in.Below(user->history_item_ids.size())] = in.Below(kItems);
      }
      break;
    case 1:  // a shorter history
      user->history_item_ids.resize(in.Below(user->history_item_ids.size() + 1));
      user->history_actions.resize(user->history_item_ids.size());
      break;
    case 2:  // a new history
      user->history_item_ids.clear();
      user->history_actions.clear();
      [[fallthrough]];
    default: {  // new events (past the model's maximum too: truncation)
      const uint32_t add = in.Below(in.Bool() ? 4 : 30);
      for (uint32_t i = 0; i < add; ++i) {
        user->history_item_ids.push_back(in.Below(kItems));
        user->history_actions.push_back(static_cast<int32_t>(in.Below(kActions)));
      }
    }
  }
  RankRequest r = *user;
  // 0: invalid; past the model's max_candidates (6): scored in several candidate chunks.
  const uint32_t cands = in.Below(in.Bool() ? 7 : 15);
  for (uint32_t i = 0; i < cands; ++i) r.candidate_item_ids.push_back(in.Below(kItems));
  switch (in.Below(16)) {  // now and then an invalid request
    case 0: if (!r.history_actions.empty()) r.history_actions.back() = kActions; break;
    case 1: r.candidate_item_ids.push_back(-1); break;
    case 2: r.history_actions.push_back(0); break;  // lengths differ
    default: break;
  }
  return r;
}

void CheckSame(const absl::StatusOr<RankResult>& cached, const absl::StatusOr<RankResult>& full,
               const std::string& where) {
  if (!full.ok()) {
    if (cached.ok() || cached.status().code() != full.status().code()) {
      Fail(where + ": without the cache " + full.status().ToString() + ", with it " +
           (cached.ok() ? std::string("OK") : cached.status().ToString()));
    }
    return;
  }
  if (!cached.ok()) {
    if (cached.status().code() == absl::StatusCode::kResourceExhausted) return;  // pool too small
    Fail(where + ": with the cache " + cached.status().ToString());
  }
  if (cached->scores.size() != full->scores.size()) Fail(where + ": score counts differ");
  for (size_t i = 0; i < full->scores.size(); ++i) {
    const float a = cached->scores[i], b = full->scores[i];
    if (!(std::fabs(a - b) <= kScoreAbs) || !(a > 0.f && a < 1.f)) {
      Fail(where + ": score " + std::to_string(i) + " " + std::to_string(a) + " against " +
           std::to_string(b));
    }
  }
  if (cached->reused_tokens + cached->computed_tokens != full->computed_tokens) {
    Fail(where + ": reused + computed tokens differ from the history without the cache");
  }
}

// What the inputs run so far reached, for the corpus replay's check (HstuFuzzReplayCheck).
struct Reached {
  uint64_t lookups[static_cast<int>(LookupResult::kNumResults)] = {};
  uint64_t evictions = 0, host_evictions = 0, pages_onloaded = 0, pages_prefetched = 0;
  uint64_t rejected = 0, exhausted = 0;
};
Reached reached;

void Tally(const CacheStats& s) {
  for (int i = 0; i < static_cast<int>(LookupResult::kNumResults); ++i) {
    reached.lookups[i] += s.lookups[i];
  }
  reached.evictions += s.evictions;
  reached.host_evictions += s.host_evictions;
  reached.pages_onloaded += s.pages_onloaded;
  reached.pages_prefetched += s.pages_prefetched;
}

}  // namespace
}  // namespace hstu

// Called by the corpus replay (fuzz_replay_main.cc) after every input: the checked-in corpus must
// keep reaching each way the cache serves a request (host hits onloaded or recomputed counted
// together: the cost rule decides between them by measured rates), evictions from both tiers,
// onloads, prefetches, rejected requests and users too large for their pool. Nonzero if not.
extern "C" int HstuFuzzReplayCheck() {
  using hstu::LookupResult;
  const auto& r = hstu::reached;
  const auto n = [&](LookupResult l) { return r.lookups[static_cast<int>(l)]; };
  const std::pair<const char*, uint64_t> counts[] = {
      {"gpu hits", n(LookupResult::kHit)},
      {"host hits", n(LookupResult::kHostHit) + n(LookupResult::kHostRecompute)},
      {"partial hits", n(LookupResult::kPartial)},
      {"misses", n(LookupResult::kMiss)},
      {"hash mismatches", n(LookupResult::kMismatch)},
      {"GPU evictions", r.evictions},
      {"host evictions", r.host_evictions},
      {"pages onloaded", r.pages_onloaded},
      {"pages prefetched", r.pages_prefetched},
      {"invalid requests", r.rejected},
      {"users too large for the pool", r.exhausted},
  };
  int missing = 0;
  for (const auto& [what, count] : counts) {
    std::printf("engine fuzz corpus: %s %llu\n", what, static_cast<unsigned long long>(count));
    if (count == 0) {
      std::fprintf(stderr, "engine fuzz corpus: never reached: %s\n", what);
      ++missing;
    }
  }
  return missing;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hstu;
  static const bool quiet = [] {  // pools too small for a user are the point, not news
    spdlog::set_level(spdlog::level::err);
    return true;
  }();
  (void)quiet;
  fuzz::FuzzInput in(data, size);
  const ModelConfig config = FuzzConfig(in);
  EngineOptions cached_options;
  static constexpr int kPageSizes[] = {1, 3, 7, 16};
  cached_options.page_size = kPageSizes[in.Below(4)];
  // Pages of one user's full history (40 tokens): the pool holds from less than one user to all.
  const int64_t user_pages = (config.max_history_tokens + cached_options.page_size - 1) /
                             cached_options.page_size;
  cached_options.cache_pages = 1 + in.Below(static_cast<uint32_t>(user_pages * kUsers));
  cached_options.host_cache_pages =
      in.Bool() ? 0 : in.Below(static_cast<uint32_t>(user_pages * kUsers));
  cached_options.onload_policy = in.Bool() ? OnloadPolicy::kAlways : OnloadPolicy::kCost;
  EngineOptions full_options = cached_options;
  full_options.enable_cache = false;
  full_options.cache_pages = 2 * user_pages;  // one request at a time (the default is 1 GiB)
  full_options.host_cache_pages = 0;
  auto cached = MakeEngine(cached_options, config);
  auto full = MakeEngine(full_options, config);

  std::vector<RankRequest> users(kUsers);
  for (int u = 0; u < kUsers; ++u) users[u].user_id = 1000 + u;
  for (int step = 0; step < 24 && !in.empty(); ++step) {
    std::vector<RankRequest> batch(1 + in.Below(6));  // a user may appear twice
    for (RankRequest& r : batch) r = Visit(in, &users[in.Below(kUsers)]);
    if (in.Below(4) == 0) {  // prefetch the next batch's users behind this one
      std::vector<RankRequest> next(users);  // every user's next visit, as far as known
      for (RankRequest& r : next) r.candidate_item_ids = {1};
      std::vector<const RankRequest*> running, queued;
      for (const RankRequest& r : batch) running.push_back(&r);
      for (const RankRequest& r : next) queued.push_back(&r);
      cached->Prefetch(running, queued);
    }
    const auto a = cached->Rank(batch);
    std::vector<absl::StatusOr<RankResult>> b;
    for (const RankRequest& r : batch) b.push_back(std::move(full->Rank({&r, 1})[0]));
    if (a.size() != batch.size()) Fail("one result a request");
    for (size_t i = 0; i < batch.size(); ++i) {
      CheckSame(a[i], b[i], "step " + std::to_string(step) + " request " + std::to_string(i));
      if (!b[i].ok()) ++reached.rejected;
      if (!a[i].ok() && a[i].status().code() == absl::StatusCode::kResourceExhausted) {
        ++reached.exhausted;
      }
    }
    const CacheStats s = cached->Stats().cache;
    if (s.pages_pinned != 0) Fail("pages still pinned after a batch");
    if (s.pages_free < 0 || s.pages_free > s.pages_total) Fail("free GPU pages out of range");
    if (s.host_pages_free < 0 || s.host_pages_free > s.host_pages_total) {
      Fail("free host pages out of range");
    }
  }
  Tally(cached->Stats().cache);
  return 0;
}
