#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda/hstu_attention_plan.h"

namespace hstu::cuda {
namespace {

struct Tile {
  int32_t user, q_row, num_q, q_local, kv_begin, kv_end;
  bool has_candidates;
};

int32_t CeilDiv(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

// Chunk s of `splits` of tile t, chunk_keys keys each (the last ones may be shorter or empty).
AttentionWorkItem ChunkOf(const Tile& t, int32_t s, int32_t splits, int32_t chunk_keys,
                          int32_t tile_idx, int32_t partial_base) {
  AttentionWorkItem it;
  it.user = t.user;
  it.q_row = t.q_row;
  it.num_q = t.num_q;
  it.q_local = t.q_local;
  it.kv_begin = std::min(t.kv_end, t.kv_begin + s * chunk_keys);
  it.kv_end = std::min(t.kv_end, t.kv_begin + (s + 1) * chunk_keys);
  it.split = s;
  it.num_splits = splits;
  it.tile = tile_idx;
  it.partial_base = partial_base;
  return it;
}

// Round 38: user-by-user orders are taken unless longest first ends this much sooner.
constexpr double kUserOrderSlack = 1.02;

// When the last CTA of a launch of `items` in this order ends (block x = item · heads + head, each
// CTA taken by the first free of `slots`), a CTA costing its key blocks plus its fixed work.
int64_t LaunchMakespan(const std::vector<AttentionWorkItem>& items, int32_t heads, int32_t slots,
                       std::vector<std::pair<int32_t, int64_t>>* runs,
                       std::vector<int32_t>* scratch) {
  runs->clear();
  for (const AttentionWorkItem& it : items) {
    const int32_t cost = CeilDiv(it.kv_end - it.kv_begin, kAttnBlockN) +
                         static_cast<int32_t>(kAttnCtaOverheadBlocks);
    if (runs->empty() || runs->back().first != cost) runs->push_back({cost, 0});
    runs->back().second += heads;
  }
  return ListScheduleMakespan(*runs, slots, scratch);
}

}  // namespace

bool HstuAttentionUserOrderEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("HSTU_ATTN_USER_ORDER");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

int64_t ListScheduleMakespan(const std::vector<std::pair<int32_t, int64_t>>& runs,
                             int32_t machines, std::vector<int32_t>* scratch) {
  if (runs.empty()) return 0;
  machines = std::max(machines, 1);
  // The least finish time never decreases (a machine taken at the minimum t finishes later), and
  // it is at most the work assigned so far over the machines, so a count of machines per finish
  // time up to total / machines + the longest cost holds the schedule, whatever the runs' order:
  // the minimum is found by a pointer that only moves forward. The CTAs of a run take the
  // machines free at the least finish time together (which of those machines takes which CTA
  // does not change the finish times).
  int64_t total = 0, longest = 0;
  for (const auto& [cost, count] : runs) {
    total += cost * count;
    longest = std::max<int64_t>(longest, cost);
  }
  const int64_t cap = total / machines + longest + 2;
  std::vector<int32_t> local;
  std::vector<int32_t>& free_at = scratch != nullptr ? *scratch : local;
  free_at.assign(static_cast<size_t>(cap), 0);
  free_at[0] = machines;
  int64_t least = 0, last = 0;
  for (const auto& [cost, count] : runs) {
    for (int64_t left = count; left > 0;) {
      while (free_at[least] == 0) ++least;
      const int32_t take = static_cast<int32_t>(std::min<int64_t>(free_at[least], left));
      free_at[least] -= take;
      free_at[least + cost] += take;
      left -= take;
      last = std::max(last, least + cost);
    }
  }
  return last;
}

int64_t ListScheduleMakespan(const std::vector<int32_t>& costs, int32_t copies, int32_t machines,
                             std::vector<int32_t>* scratch) {
  if (copies <= 0) return 0;
  std::vector<std::pair<int32_t, int64_t>> runs;
  for (int32_t c : costs) {
    if (runs.empty() || runs.back().first != c) runs.push_back({c, 0});
    runs.back().second += copies;
  }
  return ListScheduleMakespan(runs, machines, scratch);
}

AttentionPlan PlanHstuAttention(const int32_t* row_offsets, const int32_t* num_new,
                                const int32_t* num_tokens, int32_t batch_size,
                                int32_t max_attn_len, int32_t num_heads, int32_t concurrent_ctas,
                                int32_t max_split, int32_t cluster, int32_t max_clusters,
                                bool candidates_only) {
  std::vector<Tile> tiles;
  tiles.reserve(static_cast<size_t>(row_offsets[batch_size] - row_offsets[0]) / kAttnBlockM +
                static_cast<size_t>(batch_size) * 2);
  for (int32_t b = 0; b < batch_size; ++b) {
    const int32_t rows = row_offsets[b + 1] - row_offsets[b];
    const int32_t hist = num_tokens[b];
    const int32_t first_new = hist - num_new[b];
    for (int32_t q0 = candidates_only ? num_new[b] : 0; q0 < rows; q0 += kAttnBlockM) {
      Tile t;
      t.user = b;
      t.q_row = row_offsets[b] + q0;
      t.num_q = std::min(kAttnBlockM, rows - q0);
      t.q_local = q0;
      const int32_t last = q0 + t.num_q - 1;
      t.has_candidates = last >= num_new[b];
      // Keys up to the largest query id of the tile (candidates see the whole history).
      t.kv_end = t.has_candidates ? hist : first_new + last + 1;
      const int32_t min_qid = q0 < num_new[b] ? first_new + q0 : hist;
      // With a window, from the 64-key block holding the first key any query reads: the chunks are
      // whole blocks from there (the warp-specialised kernel's boxes and the rows' blocks are
      // block-aligned); keys before the window are masked.
      t.kv_begin = max_attn_len > 0
                       ? std::max(0, min_qid - max_attn_len) / kAttnBlockN * kAttnBlockN
                       : 0;
      t.kv_begin = std::min(t.kv_begin, t.kv_end);
      tiles.push_back(t);
    }
  }

  if (tiles.empty()) return AttentionPlan{};  // no query rows (the last layer without candidates)

  // A cluster plan: one wave of clusters, a tile's keys in `cluster` chunks of whole blocks
  // (trailing chunks may be empty), summed on chip.
  const int64_t tile_heads = static_cast<int64_t>(tiles.size()) * num_heads;
  if (cluster > 1 && !tiles.empty() && tile_heads <= max_clusters &&
      3 * tile_heads * cluster >= 2LL * concurrent_ctas) {
    AttentionPlan plan;
    plan.cluster = cluster;
    for (const Tile& t : tiles) {
      const int32_t chunk_keys =
          std::max(1, CeilDiv(CeilDiv(t.kv_end - t.kv_begin, kAttnBlockN), cluster)) * kAttnBlockN;
      plan.chunk_blocks = std::max(plan.chunk_blocks, chunk_keys / kAttnBlockN);
      for (int32_t s = 0; s < cluster; ++s) {
        // tile -1: no partials, the split reduction skips it.
        plan.items.push_back(ChunkOf(t, s, cluster, chunk_keys, -1, 0));
      }
    }
    return plan;
  }

  // Chunk length (in key blocks): the GPU hands CTAs to SMs in launch order, so with the items
  // emitted longest first (below) the launch is a longest-processing-time list schedule. A CTA
  // costs its blocks plus kCtaOverhead blocks' worth of fixed work (Q load, epilogue). Every
  // chunk gets a lower bound on its makespan (its longest CTA, or the total spread evenly); the
  // few with the lowest bounds are scheduled exactly and the shortest schedule wins (ties: the
  // longer chunk, fewer partials). The kernels launch the H heads of an item next to each other
  // (block x = item * H + head).
  // The tiles' lengths in key blocks, as (length, tiles of that length): a batch's tiles share a
  // few lengths (users at one history length, a user's candidate tiles), and the loops below run
  // over each candidate chunk length.
  std::vector<std::pair<int32_t, int32_t>> lengths;
  int32_t max_blocks = 1;
  {
    std::vector<int32_t> blocks(tiles.size());
    for (size_t i = 0; i < tiles.size(); ++i) {
      blocks[i] = CeilDiv(tiles[i].kv_end - tiles[i].kv_begin, kAttnBlockN);
      max_blocks = std::max(max_blocks, blocks[i]);
    }
    std::sort(blocks.begin(), blocks.end(), std::greater<>());
    for (int32_t b : blocks) {
      if (lengths.empty() || lengths.back().first != b) lengths.push_back({b, 0});
      ++lengths.back().second;
    }
  }
  const int32_t slots = std::max(1, concurrent_ctas);
  // A CTA's work outside its key loop: the Q tile and the first K/V tile (~3 µs) and the
  // epilogue (~4 µs), against ~1.6 µs a block (round 12's timeline, H100/H200). Counted as two
  // blocks, the batch-8 decode step got 49 + 15-block chunks and the SMs that ran three short
  // chunks back to back finished last (110 µs); as four, 50 + 14 and 106 µs (round 26, H100).
  constexpr double kCtaOverhead = kAttnCtaOverheadBlocks;
  struct Candidate {
    int32_t chunk;
    double bound;  // lower bound on the makespan
    double waves;  // the waves estimate: waves of CTAs times the longest
  };
  std::vector<Candidate> candidates;
  candidates.reserve(static_cast<size_t>(max_blocks));
  for (int32_t chunk = 1; chunk <= max_blocks; ++chunk) {
    int64_t ctas = 0, work = 0;
    int32_t longest = 0;
    bool too_many = false;
    for (const auto& [b, n] : lengths) {
      const int32_t splits = std::max(1, (b + chunk - 1) / chunk);
      too_many |= splits > max_split;
      ctas += static_cast<int64_t>(splits) * n;
      work += static_cast<int64_t>(b) * n;
      longest = std::max(longest, std::min(b, chunk));
    }
    if (too_many) continue;
    const double total = static_cast<double>(work + kCtaOverhead * ctas) * num_heads;
    const double waves = static_cast<double>((ctas * num_heads + slots - 1) / slots);
    candidates.push_back({chunk, std::max(longest + kCtaOverhead, total / slots),
                          waves * (longest + kCtaOverhead)});
  }
  if (candidates.empty()) candidates.push_back({max_blocks, 0.0, 0.0});
  // Scheduled exactly: the four lowest bounds, the first chunks whose longest CTA reaches the even
  // spread (where the few long CTAs leave room for the short ones beside them), and the best of
  // the waves estimate.
  std::vector<Candidate> tried;
  auto add = [&](const Candidate& c) {
    if (std::none_of(tried.begin(), tried.end(), [&](const Candidate& t) { return t.chunk == c.chunk; })) {
      tried.push_back(c);
    }
  };
  std::vector<Candidate> by_bound = candidates;
  const size_t lowest = std::min<size_t>(4, by_bound.size());
  std::partial_sort(by_bound.begin(), by_bound.begin() + static_cast<std::ptrdiff_t>(lowest),
                    by_bound.end(), [](const Candidate& x, const Candidate& y) {
                      return x.bound < y.bound || (x.bound == y.bound && x.chunk > y.chunk);
                    });
  for (size_t i = 0; i < lowest; ++i) add(by_bound[i]);
  for (size_t i = 0, found = 0; i < candidates.size() && found < 4; ++i) {
    const Candidate& c = candidates[i];  // ascending chunk
    if (found > 0 || c.bound <= std::min(c.chunk, max_blocks) + kCtaOverhead + 1e-9) {
      add(c);
      ++found;
    }
  }
  add(*std::min_element(candidates.begin(), candidates.end(), [](const Candidate& x, const Candidate& y) {
        return x.waves < y.waves || (x.waves == y.waves && x.chunk > y.chunk);
      }));
  // A chunk length's CTAs as runs of equal cost (ListScheduleMakespan's form): a tile of b blocks
  // makes b / chunk whole chunks and one of b % chunk.
  std::vector<std::pair<int32_t, int64_t>> runs;
  std::vector<int32_t> counts;  // ListScheduleMakespan's scratch
  int32_t best_chunk = tried.front().chunk;
  double best_span = 1e300;
  for (const Candidate& candidate : tried) {
    const int32_t chunk = candidate.chunk;
    const double bound = candidate.bound;
    runs.clear();
    for (const auto& [b, n] : lengths) {
      const int32_t whole = b / chunk, rest = b % chunk;
      if (whole > 0) runs.push_back({chunk, static_cast<int64_t>(whole) * n});
      if (rest > 0 || b == 0) runs.push_back({rest, n});  // an empty tile is one CTA too
    }
    std::sort(runs.begin(), runs.end(), std::greater<>());
    int64_t launched = 0;
    for (auto& [cost, count] : runs) {
      cost += static_cast<int32_t>(kCtaOverhead);
      count *= num_heads;
      launched += count;
    }
    double span = 0;
    if (launched <= slots) {
      span = runs.front().first;  // one wave
    } else if (launched > 16LL * slots) {
      // Many waves: the list schedule ends about half a CTA past the even spread.
      span = bound + 0.5 * (std::min(chunk, max_blocks) + kCtaOverhead);
    } else {
      span = static_cast<double>(ListScheduleMakespan(runs, slots, &counts));
    }
    if (span < best_span - 1e-9 || (span < best_span + 1e-9 && chunk > best_chunk)) {
      best_span = span;
      best_chunk = chunk;
    }
  }

  AttentionPlan plan;
  plan.chunk_blocks = best_chunk;
  const int32_t chunk_keys = best_chunk * kAttnBlockN;
  size_t num_items = 0;
  for (const Tile& t : tiles) num_items += std::max(1, CeilDiv(t.kv_end - t.kv_begin, chunk_keys));
  plan.items.reserve(num_items);
  for (const Tile& t : tiles) {
    const int32_t splits = std::max(1, CeilDiv(t.kv_end - t.kv_begin, chunk_keys));
    const int32_t tile_idx = splits > 1 ? plan.num_split_tiles++ : -1;
    const int32_t base = plan.num_partials;
    if (splits > 1) plan.num_partials += splits;
    for (int32_t s = 0; s < splits; ++s) {
      plan.items.push_back(ChunkOf(t, s, splits, chunk_keys, tile_idx, base));
    }
  }
  // Longest first; among equal lengths the split tiles' first chunks lead (a split tile's first
  // chunk is a whole chunk, as long as any item, so items[t] is split 0 of split tile t: the split
  // reduction's grid covers exactly those), then the order above (a tile's chunks, then the next
  // tile of the same user, which reads the same keys).
  //
  // Without split tiles and with several users (the no-cache shapes), the items go user by user
  // instead (round 38): longest first, a user's query tiles start at different times and read the
  // same keys from 0 up, so every user's K/V had to stay in L2 for the whole kernel (142 MB at
  // batch 8; 810 MB of DRAM reads a layer for 213 MB of q, k, v). User by user, one or two users'
  // keys are in flight. For users of unequal lengths that can lengthen the launch's tail, so the
  // plan also considers keeping the items shorter than half the longest at the end, longest
  // first, and takes whichever of the two the list schedule finishes first (ties: all user by
  // user), unless longest first would finish more than kUserOrderSlack earlier.
  const bool by_user =
      plan.num_split_tiles == 0 && batch_size > 1 && HstuAttentionUserOrderEnabled();
  std::vector<int32_t> user_rank(static_cast<size_t>(batch_size), 0);
  if (by_user) {
    // Users with the longest items first (then in batch order).
    std::vector<std::pair<int32_t, int32_t>> users(static_cast<size_t>(batch_size), {0, 0});
    for (int32_t b = 0; b < batch_size; ++b) users[b].second = b;
    for (const AttentionWorkItem& it : plan.items) {
      users[it.user].first = std::min(users[it.user].first, -(it.kv_end - it.kv_begin));
    }
    std::sort(users.begin(), users.end());
    for (int32_t r = 0; r < batch_size; ++r) user_rank[users[r].second] = r;
  }
  // The items in order; tail_below: items shorter than this many keys go last, longest first.
  // Sorted as (key, index) pairs: the order of a stable sort without its buffer.
  auto ordered = [&](int32_t tail_below) {
    using Key = std::tuple<int32_t, int32_t, int64_t, int32_t>;  // (late, user, -length, index)
    std::vector<Key> order(plan.items.size());
    for (size_t i = 0; i < plan.items.size(); ++i) {
      const AttentionWorkItem& it = plan.items[i];
      const int32_t length = it.kv_end - it.kv_begin;
      const bool leads = it.num_splits > 1 && it.split == 0;
      const bool grouped = by_user && length >= tail_below;
      order[i] = {by_user && !grouped ? 1 : 0, grouped ? user_rank[it.user] : 0,
                  -(2 * static_cast<int64_t>(length) + (leads ? 1 : 0)), static_cast<int32_t>(i)};
    }
    std::sort(order.begin(), order.end());
    std::vector<AttentionWorkItem> sorted(order.size());
    for (size_t i = 0; i < order.size(); ++i) sorted[i] = plan.items[std::get<3>(order[i])];
    return sorted;
  };
  std::vector<AttentionWorkItem> sorted = ordered(0);
  if (by_user) {
    int32_t longest = 0;
    for (const AttentionWorkItem& it : plan.items) {
      longest = std::max(longest, it.kv_end - it.kv_begin);
    }
    std::vector<std::pair<int32_t, int64_t>> scratch_runs;
    std::vector<int32_t> scratch_counts;
    auto span_of = [&](const std::vector<AttentionWorkItem>& items) {
      return static_cast<double>(
          LaunchMakespan(items, num_heads, slots, &scratch_runs, &scratch_counts));
    };
    double span = span_of(sorted);
    std::vector<AttentionWorkItem> with_tail = ordered((longest + 1) / 2);
    if (const double s = span_of(with_tail); s < span) {
      sorted = std::move(with_tail);
      span = s;
    }
    // Longest first after all when the launch would end more than 2 % later user by user (few
    // CTAs a slot, where one long item placed late shows).
    std::vector<AttentionWorkItem> lpt = ordered(longest + 1);
    if (span > kUserOrderSlack * span_of(lpt)) sorted = std::move(lpt);
  }
  plan.items = std::move(sorted);
  return plan;
}

}  // namespace hstu::cuda
