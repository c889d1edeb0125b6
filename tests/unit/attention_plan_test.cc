// The paged attention's work plan (kernels/cuda/hstu_attention_plan.h), on the CPU: every tile's
// keys are covered exactly once by its chunks, the split bookkeeping is consistent, the items come
// longest first with the split tiles' first chunks leading, and the chunk length beats a uniform
// split of the decode-step shape; cluster plans are tile-major, `cluster` chunks a tile, and are
// made only where the clusters run in one wave and fill the GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/cuda/hstu_attention_plan.h"

namespace hstu::cuda {
namespace {

struct Batch {
  std::vector<int32_t> row_offsets{0}, num_new, num_tokens;
  void Add(int32_t rows, int32_t new_tokens, int32_t hist) {
    row_offsets.push_back(row_offsets.back() + rows);
    num_new.push_back(new_tokens);
    num_tokens.push_back(hist);
  }
  int32_t size() const { return static_cast<int32_t>(num_new.size()); }
};

// 1..max_users users, each with < max_new new history tokens, a cache of < 5000 tokens (none for
// a quarter of them) and 1..max_cand candidates.
Batch RandomBatch(std::mt19937& rng, int32_t max_users, int32_t max_new, int32_t max_cand) {
  Batch b;
  const int32_t users = 1 + static_cast<int32_t>(rng() % max_users);
  for (int32_t u = 0; u < users; ++u) {
    const int32_t new_tokens = static_cast<int32_t>(rng() % max_new);
    const int32_t cached = rng() % 4 == 0 ? 0 : static_cast<int32_t>(rng() % 5000);
    const int32_t cands = 1 + static_cast<int32_t>(rng() % max_cand);
    b.Add(new_tokens + cands, new_tokens, cached + new_tokens);
  }
  return b;
}

// Makespan of the launch (block x = item * H + head, handed to the first free SM) when a CTA
// costs its key blocks plus kAttnCtaOverheadBlocks.
double Makespan(const AttentionPlan& plan, int heads, int slots) {
  std::vector<double> sm(slots, 0.0);
  for (const AttentionWorkItem& it : plan.items) {
    for (int h = 0; h < heads; ++h) {
      *std::min_element(sm.begin(), sm.end()) +=
          (it.kv_end - it.kv_begin + kAttnBlockN - 1) / kAttnBlockN + kAttnCtaOverheadBlocks;
    }
  }
  return *std::max_element(sm.begin(), sm.end());
}

// The same items in longest-first order (the order before round 38), ties kept in plan order.
AttentionPlan LongestFirst(AttentionPlan plan) {
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const auto& x, const auto& y) {
    return x.kv_end - x.kv_begin > y.kv_end - y.kv_begin;
  });
  return plan;
}

// candidates_only: the plan covers each user's candidate rows only (rows num_new..).
void CheckPlan(const Batch& b, int32_t window, const AttentionPlan& plan, const std::string& what,
               bool candidates_only = false) {
  // Tiles as the kernel sees them: 128 query rows of one user.
  std::map<std::pair<int32_t, int32_t>, std::vector<AttentionWorkItem>> by_tile;
  for (const AttentionWorkItem& it : plan.items) by_tile[{it.user, it.q_local}].push_back(it);
  std::set<int32_t> partial_slots, split_tiles;
  int32_t tiles = 0;
  for (int32_t u = 0; u < b.size(); ++u) {
    const int32_t rows = b.row_offsets[u + 1] - b.row_offsets[u];
    for (int32_t q0 = candidates_only ? b.num_new[u] : 0; q0 < rows; q0 += kAttnBlockM, ++tiles) {
      auto found = by_tile.find({u, q0});
      ASSERT_NE(found, by_tile.end()) << what << ": no item for user " << u << " rows " << q0;
      std::vector<AttentionWorkItem> chunks = found->second;
      std::sort(chunks.begin(), chunks.end(),
                [](const auto& x, const auto& y) { return x.split < y.split; });
      const int32_t last = q0 + std::min(kAttnBlockM, rows - q0) - 1;
      const int32_t hist = b.num_tokens[u], first_new = hist - b.num_new[u];
      const int32_t kv_end = last >= b.num_new[u] ? hist : first_new + last + 1;
      const int32_t min_qid = q0 < b.num_new[u] ? first_new + q0 : hist;
      // With a window, from the 64-key block holding the tile's first key.
      const int32_t kv_begin = std::min(
          kv_end, window > 0 ? std::max(0, min_qid - window) / kAttnBlockN * kAttnBlockN : 0);
      int32_t next = kv_begin;
      const int32_t n = static_cast<int32_t>(chunks.size());
      for (int32_t s = 0; s < n; ++s) {
        const AttentionWorkItem& it = chunks[s];
        EXPECT_EQ(it.split, s) << what;
        EXPECT_EQ(it.num_splits, n) << what;
        EXPECT_EQ(it.q_row, b.row_offsets[u] + q0) << what;
        EXPECT_EQ(it.num_q, std::min(kAttnBlockM, rows - q0)) << what;
        EXPECT_EQ(it.kv_begin, next) << what << ": chunks of a tile must be contiguous";
        EXPECT_LE(it.kv_begin, it.kv_end) << what;
        next = it.kv_end;
        if (n > 1) {
          EXPECT_TRUE(partial_slots.insert(it.partial_base + s).second) << what << ": partial reused";
          EXPECT_LT(it.partial_base + s, plan.num_partials) << what;
          EXPECT_EQ(it.tile, chunks[0].tile) << what;
        } else {
          EXPECT_EQ(it.tile, -1) << what;
        }
      }
      EXPECT_EQ(next, kv_end) << what << ": keys of user " << u << " rows " << q0 << " not covered";
      if (n > 1) split_tiles.insert(chunks[0].tile);
    }
  }
  EXPECT_EQ(static_cast<int32_t>(by_tile.size()), tiles) << what << ": items for tiles that do not exist";
  EXPECT_EQ(static_cast<int32_t>(split_tiles.size()), plan.num_split_tiles) << what;
  // The split reduction's grid covers the first num_split_tiles items: split tile t's first chunk.
  for (int32_t t = 0; t < plan.num_split_tiles && t < static_cast<int32_t>(plan.items.size()); ++t) {
    EXPECT_EQ(plan.items[t].tile, t) << what << ": item " << t;
    EXPECT_EQ(plan.items[t].split, 0) << what << ": item " << t;
    EXPECT_GT(plan.items[t].num_splits, 1) << what << ": item " << t;
  }
  auto length = [](const AttentionWorkItem& it) { return it.kv_end - it.kv_begin; };
  if (plan.num_split_tiles > 0 || b.size() < 2) {
    for (size_t i = 1; i < plan.items.size(); ++i) {
      EXPECT_GE(length(plan.items[i - 1]), length(plan.items[i]))
          << what << ": items must come longest first";
    }
    return;
  }
  // Without split tiles, several users: user by user (users with the longest items first, each
  // user's longest first), either every item or those of at least half the longest length, the
  // rest then following longest first; or longest first where that ends the launch sooner (the
  // random test below checks by how much).
  auto user_major = [&](size_t from, size_t to) {
    std::set<int32_t> done;
    for (size_t i = from; i < to; ++i) {
      const AttentionWorkItem& it = plan.items[i];
      if (i == from || it.user != plan.items[i - 1].user) {
        if (!done.insert(it.user).second) return false;  // a user's items split up
        if (i > from && length(it) > length(plan.items[from])) return false;
      } else if (length(plan.items[i - 1]) < length(it)) {
        return false;
      }
    }
    return true;
  };
  auto longest_first = [&](size_t from) {
    for (size_t i = from + 1; i < plan.items.size(); ++i) {
      if (length(plan.items[i - 1]) < length(plan.items[i])) return false;
    }
    return true;
  };
  int32_t longest = 0;
  for (const AttentionWorkItem& it : plan.items) longest = std::max(longest, length(it));
  size_t head = 0;
  while (head < plan.items.size() && length(plan.items[head]) >= (longest + 1) / 2) ++head;
  bool tail_short = true;
  for (size_t i = head; i < plan.items.size(); ++i) tail_short &= length(plan.items[i]) < (longest + 1) / 2;
  EXPECT_TRUE(user_major(0, plan.items.size()) ||
              (tail_short && user_major(0, head) && longest_first(head)) || longest_first(0))
      << what << ": items neither user by user (with or without a longest-first tail) nor "
                 "longest first";
}

TEST(AttentionPlanTest, RandomBatchesCoverEveryKeyOnceWithConsistentSplits) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const Batch b = RandomBatch(rng, 17, 700, 300);
    const int32_t window = rng() % 3 == 0 ? 1 + static_cast<int32_t>(rng() % 1500) : 0;
    const int32_t heads = 1 << (rng() % 4);
    const int32_t slots = rng() % 2 ? 132 : 1 + static_cast<int32_t>(rng() % 300);
    const int32_t max_split = 1 + static_cast<int32_t>(rng() % 64);
    const AttentionPlan plan = PlanHstuAttention(b.row_offsets.data(), b.num_new.data(),
                                                 b.num_tokens.data(), b.size(), window, heads,
                                                 slots, max_split);
    const std::string what = "trial " + std::to_string(trial);
    CheckPlan(b, window, plan, what);
    for (const AttentionWorkItem& it : plan.items) ASSERT_LE(it.num_splits, max_split) << what;
    if (plan.num_split_tiles == 0 && b.size() > 1) {
      // User by user (round 38) only where the launch ends at most 2 % later than longest first.
      EXPECT_LE(Makespan(plan, heads, slots), 1.02 * Makespan(LongestFirst(plan), heads, slots))
          << what;
    }
    if (HasFailure()) return;
  }
}

// The no-cache block's attention (8 users of 4096 new history tokens and 256 candidates, 4 heads):
// no split tiles, the items user by user so that one or two users' keys are read at a time, and
// the launch's makespan no longer than the longest-first order's.
TEST(AttentionPlanTest, NoCacheBatchGoesUserByUser) {
  Batch b;
  for (int u = 0; u < 8; ++u) b.Add(4096 + 256, 4096, 4096);
  const AttentionPlan plan = PlanHstuAttention(b.row_offsets.data(), b.num_new.data(),
                                               b.num_tokens.data(), b.size(), 0, 4, 132);
  CheckPlan(b, 0, plan, "no cache, 8 users");
  ASSERT_EQ(plan.num_split_tiles, 0);
  // All alike: every item user by user, in batch order (the longest-first tail is not needed).
  int32_t last_user = 0;
  for (const AttentionWorkItem& it : plan.items) {
    EXPECT_GE(it.user, last_user);
    last_user = it.user;
  }
  EXPECT_EQ(last_user, 7);
  EXPECT_LE(Makespan(plan, 4, 132), Makespan(LongestFirst(plan), 4, 132));
}

TEST(AttentionPlanTest, ListScheduleMakespanMatchesTheFirstFreeMachineRule) {
  // Against the rule itself, one CTA at a time to the machine that is free first.
  std::mt19937 rng(3);
  std::vector<int32_t> scratch;
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<int32_t> costs(1 + rng() % 400);
    const int32_t top = 1 + static_cast<int32_t>(rng() % 70);
    for (int32_t& c : costs) c = static_cast<int32_t>(rng() % (top + 1));
    // Descending (the chunk-length model) in most trials; in launch order of any kind (round 38's
    // orders) in every fourth.
    if (trial % 4 != 3) std::sort(costs.begin(), costs.end(), std::greater<>());
    const int32_t copies = 1 + static_cast<int32_t>(rng() % 8);
    const int32_t machines = 1 + static_cast<int32_t>(rng() % 300);
    std::vector<int64_t> free_at(machines, 0);
    for (int32_t c : costs) {
      for (int32_t k = 0; k < copies; ++k) *std::min_element(free_at.begin(), free_at.end()) += c;
    }
    const int64_t want = *std::max_element(free_at.begin(), free_at.end());
    ASSERT_EQ(ListScheduleMakespan(costs, copies, machines, trial % 2 ? &scratch : nullptr), want)
        << "trial " << trial << ": " << costs.size() << " costs up to " << top << ", " << copies
        << " copies, " << machines << " machines";
  }
  EXPECT_EQ(ListScheduleMakespan({}, 4, 132), 0);
  EXPECT_EQ(ListScheduleMakespan({5}, 3, 1), 15);
  EXPECT_EQ(ListScheduleMakespan({7, 3, 3}, 1, 2), 7);
  EXPECT_EQ(ListScheduleMakespan({3, 3, 7}, 1, 2), 10);
}

TEST(AttentionPlanTest, DecodeStepOfEightUsersBeatsUniformSplits) {
  // The decode-step benchmark: 8 users of 3968 cached + 128 new history tokens + 256 candidates,
  // 4 heads, 132 SMs, a CTA costing its blocks + 4. The best uniform split (16 blocks a chunk,
  // tiles in batch order) ends at 60 cost units; longest first with one long (50) and one short
  // (14) chunk per tile ends at 54: 96 SMs run a long chunk, 36 run three short ones.
  Batch b;
  for (int u = 0; u < 8; ++u) b.Add(384, 128, 4096);
  const AttentionPlan plan =
      PlanHstuAttention(b.row_offsets.data(), b.num_new.data(), b.num_tokens.data(), 8, 0, 4, 132);
  CheckPlan(b, 0, plan, "decode b8");
  EXPECT_LE(Makespan(plan, 4, 132), 54.0);
  // One user: every SM busy in one wave.
  Batch one;
  one.Add(384, 128, 4096);
  const AttentionPlan p1 =
      PlanHstuAttention(one.row_offsets.data(), one.num_new.data(), one.num_tokens.data(), 1, 0, 4, 132);
  CheckPlan(one, 0, p1, "decode b1");
  EXPECT_LE(Makespan(p1, 4, 132), 10.0);
}

// A cluster plan: items[t * cluster + s] is chunk s of tile t (tiles in user, then row order),
// every chunk whole 64-key blocks but the last non-empty one, the tile's keys covered once, no
// partials and no split tiles (tile = -1, so the split reduction skips every item).
void CheckClusterPlan(const Batch& b, const AttentionPlan& plan, int32_t cluster,
                      const std::string& what, int32_t window = 0) {
  ASSERT_EQ(plan.cluster, cluster) << what;
  EXPECT_EQ(plan.num_split_tiles, 0) << what;
  EXPECT_EQ(plan.num_partials, 0) << what;
  size_t t = 0;
  for (int32_t u = 0; u < b.size(); ++u) {
    const int32_t rows = b.row_offsets[u + 1] - b.row_offsets[u];
    for (int32_t q0 = 0; q0 < rows; q0 += kAttnBlockM, ++t) {
      const int32_t last = q0 + std::min(kAttnBlockM, rows - q0) - 1;
      const int32_t hist = b.num_tokens[u], first_new = hist - b.num_new[u];
      const int32_t kv_end = last >= b.num_new[u] ? hist : first_new + last + 1;
      // With a window, from the 64-key block holding the tile's first key.
      const int32_t min_qid = q0 < b.num_new[u] ? first_new + q0 : hist;
      int32_t next = std::min(
          kv_end, window > 0 ? std::max(0, min_qid - window) / kAttnBlockN * kAttnBlockN : 0);
      for (int32_t s = 0; s < cluster; ++s) {
        ASSERT_LT(t * cluster + s, plan.items.size()) << what;
        const AttentionWorkItem& it = plan.items[t * cluster + s];
        EXPECT_EQ(it.user, u) << what;
        EXPECT_EQ(it.q_local, q0) << what;
        EXPECT_EQ(it.q_row, b.row_offsets[u] + q0) << what;
        EXPECT_EQ(it.split, s) << what;
        EXPECT_EQ(it.num_splits, cluster) << what;
        EXPECT_EQ(it.tile, -1) << what;
        EXPECT_EQ(it.kv_begin, next) << what << ": chunks of a tile must be contiguous";
        EXPECT_LE(it.kv_begin, it.kv_end) << what;
        if (it.kv_end < kv_end) {
          EXPECT_EQ((it.kv_end - it.kv_begin) % kAttnBlockN, 0) << what;
        }
        next = it.kv_end;
      }
      EXPECT_EQ(next, kv_end) << what << ": keys of user " << u << " rows " << q0;
    }
  }
  EXPECT_EQ(plan.items.size(), t * cluster) << what;
}

TEST(AttentionPlanTest, ClusterPlanForAOneWaveDecodeStep) {
  // One user of the decode-step shape: 3 tiles × 4 heads = 12 clusters of 8 (96 CTAs, ≥ 2/3 of
  // 132), within the 16 the GPU holds at once.
  Batch one;
  one.Add(384, 128, 4096);
  const AttentionPlan p1 = PlanHstuAttention(one.row_offsets.data(), one.num_new.data(),
                                             one.num_tokens.data(), 1, 0, 4, 132, 64, 8, 16);
  CheckClusterPlan(one, p1, 8, "decode b1");
  EXPECT_EQ(p1.chunk_blocks, 8);  // 64 blocks (4096 keys) in 8 chunks
  // A short history (the graph capture's warm-up batch: 1 key) still makes a cluster plan, with
  // empty chunks, so a bucket's capture and its replays agree on the kind of plan.
  Batch warm;
  warm.Add(384, 1, 1);
  CheckClusterPlan(warm,
                   PlanHstuAttention(warm.row_offsets.data(), warm.num_new.data(),
                                     warm.num_tokens.data(), 1, 0, 4, 132, 64, 8, 16),
                   8, "warm-up");
  // With a window: the tiles' keys from the block holding their first one, in 8 chunks.
  CheckClusterPlan(one,
                   PlanHstuAttention(one.row_offsets.data(), one.num_new.data(),
                                     one.num_tokens.data(), 1, 600, 4, 132, 64, 8, 16),
                   8, "decode b1, window 600", 600);
  // Not a cluster plan: too many clusters for one wave (8 users), too few CTAs to fill the GPU
  // (1 tile: 4 × 8 = 32 CTAs), or no cluster size.
  Batch eight;
  for (int u = 0; u < 8; ++u) eight.Add(384, 128, 4096);
  EXPECT_EQ(PlanHstuAttention(eight.row_offsets.data(), eight.num_new.data(),
                              eight.num_tokens.data(), 8, 0, 4, 132, 64, 8, 16)
                .cluster,
            0);
  CheckPlan(eight, 0,
            PlanHstuAttention(eight.row_offsets.data(), eight.num_new.data(),
                              eight.num_tokens.data(), 8, 0, 4, 132, 64, 8, 16),
            "b8 with clusters available");
  Batch small;
  small.Add(100, 0, 4096);
  EXPECT_EQ(PlanHstuAttention(small.row_offsets.data(), small.num_new.data(),
                              small.num_tokens.data(), 1, 0, 4, 132, 64, 8, 16)
                .cluster,
            0);
  EXPECT_EQ(PlanHstuAttention(one.row_offsets.data(), one.num_new.data(), one.num_tokens.data(), 1,
                              0, 4, 132)
                .cluster,
            0);
}

TEST(AttentionPlanTest, RandomClusterPlansCoverEveryKeyOnce) {
  std::mt19937 rng(11);
  int made = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const Batch b = RandomBatch(rng, 3, 300, 200);
    const int32_t cluster = 2 << (rng() % 3);  // 2, 4, 8
    const int32_t heads = 1 << (rng() % 3);
    const int32_t slots = 8 + static_cast<int32_t>(rng() % 132);
    const int32_t max_clusters = 1 + static_cast<int32_t>(rng() % 40);
    const AttentionPlan plan = PlanHstuAttention(b.row_offsets.data(), b.num_new.data(),
                                                 b.num_tokens.data(), b.size(), 0, heads, slots,
                                                 64, cluster, max_clusters);
    int64_t tiles = 0;
    for (int32_t u = 0; u < b.size(); ++u) {
      tiles += (b.row_offsets[u + 1] - b.row_offsets[u] + kAttnBlockM - 1) / kAttnBlockM;
    }
    const bool expect = tiles * heads <= max_clusters && 3 * tiles * heads * cluster >= 2LL * slots;
    const std::string what = "trial " + std::to_string(trial);
    ASSERT_EQ(plan.cluster > 0, expect) << what;
    if (expect) {
      CheckClusterPlan(b, plan, cluster, what);
      ++made;
    } else {
      CheckPlan(b, 0, plan, what);
    }
    if (HasFailure()) return;
  }
  EXPECT_GT(made, 20);  // the trials reach both kinds of plan
}

// The last layer's plan (candidates_only): tiles over each user's candidate rows only, each seeing
// the user's whole history (within the window).
TEST(AttentionPlanTest, CandidateRowsOnlyCoverTheCandidatesAgainstTheWholeHistory) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 300; ++trial) {
    Batch b = RandomBatch(rng, 17, 700, 300);
    if (trial % 5 == 0) b.Add(40, 40, 900);  // a user without candidates: no tile
    const int32_t window = rng() % 3 == 0 ? 1 + static_cast<int32_t>(rng() % 1500) : 0;
    const int32_t heads = 1 << (rng() % 4);
    const int32_t slots = rng() % 2 ? 132 : 1 + static_cast<int32_t>(rng() % 300);
    const AttentionPlan plan =
        PlanHstuAttention(b.row_offsets.data(), b.num_new.data(), b.num_tokens.data(), b.size(),
                          window, heads, slots, 64, 0, 0, /*candidates_only=*/true);
    const std::string what = "trial " + std::to_string(trial);
    CheckPlan(b, window, plan, what, /*candidates_only=*/true);
    for (const AttentionWorkItem& it : plan.items) {
      ASSERT_GE(it.q_local, b.num_new[it.user]) << what << ": a tile of history rows";
    }
    if (HasFailure()) return;
  }
  // No candidates at all: an empty plan.
  Batch none;
  none.Add(50, 50, 3000);
  EXPECT_TRUE(PlanHstuAttention(none.row_offsets.data(), none.num_new.data(),
                                none.num_tokens.data(), 1, 0, 4, 132, 64, 0, 0, true)
                  .items.empty());
}

}  // namespace
}  // namespace hstu::cuda
