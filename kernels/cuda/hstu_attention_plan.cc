#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda/hstu_attention.h"

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

// The query tiles of a batch: kAttnBlockM rows of one user, with their key range.
std::vector<Tile> MakeTiles(const int32_t* row_offsets, const int32_t* num_new,
                            const int32_t* num_tokens, int32_t batch_size, int32_t max_attn_len) {
  std::vector<Tile> tiles;
  for (int32_t b = 0; b < batch_size; ++b) {
    const int32_t rows = row_offsets[b + 1] - row_offsets[b];
    const int32_t hist = num_tokens[b];
    const int32_t first_new = hist - num_new[b];
    for (int32_t q0 = 0; q0 < rows; q0 += kAttnBlockM) {
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
      t.kv_begin = max_attn_len > 0 ? std::max(0, min_qid - max_attn_len) : 0;
      t.kv_begin = std::min(t.kv_begin, t.kv_end);
      tiles.push_back(t);
    }
  }
  return tiles;
}

// ---- Lean plans ----
// Cost units as in the split plan's model: a key block is 1, a CTA's fixed work (Q, first K/V,
// epilogue) 2. A later item of the same CTA costs less (its K/V are prefetched while the previous
// item's epilogue runs; its Q is not), and a chunk of a split tile adds its partial's round trip.
constexpr double kCtaOverhead = 2.0;
constexpr double kItemOverhead = 1.0;
// A partial (128 rows × 256 fp32 = 128 KB) written or read by one CTA (~1.2 µs at an SM's share of
// L2 bandwidth), and the split reduction kernel of a split plan: its launch, and its reads of all
// partials spread over the GPU (measured on an H200: 7.1 µs for 132 partials, 13.4 for 192).
constexpr double kPartialCost = 0.75;
constexpr double kReduceLaunch = 2.0;
constexpr double kReducePerPartial = 0.03;
constexpr int32_t kMinLeanPiece = 4;  // key blocks: a lane boundary closer to a group edge snaps

struct LeanResult {
  AttentionPlan plan;
  double span = 1e300;  // estimated, in cost units
};

// A lean plan: every user's tiles of one head form a group whose length is the longest tile's
// key blocks; the groups, in (user, head) order, are cut into `lanes` ranges of about equal
// length. Lane j is W CTAs (W = the most tiles a user has): CTA j·W + k runs tile k of each group
// piece in the lane's range, so the lane's CTAs read the same keys at the same time. A lane runs
// its partial group pieces first (their partials are summed while whole groups still run).
LeanResult PlanLean(const std::vector<Tile>& tiles, int32_t num_heads, int32_t slots) {
  LeanResult r;
  // Tiles of each user (consecutive in `tiles`).
  std::vector<std::pair<size_t, size_t>> users;  // [first, end) tile of each user with rows
  for (size_t i = 0; i < tiles.size(); ++i) {
    if (i == 0 || tiles[i].user != tiles[i - 1].user) users.push_back({i, i});
    users.back().second = i + 1;
  }
  int32_t W = 0;
  for (const auto& [first, end] : users) W = std::max(W, static_cast<int32_t>(end - first));
  if (W == 0 || W > kMaxLeanTiles) return r;
  const int32_t lanes = slots / W;
  if (lanes < 2) return r;
  std::vector<int32_t> blocks(tiles.size());
  for (size_t i = 0; i < tiles.size(); ++i) {
    if (tiles[i].kv_begin != 0) return r;  // a window (the kernel needs block-aligned chunks)
    blocks[i] = CeilDiv(tiles[i].kv_end, kAttnBlockN);
  }
  struct Group {
    size_t user;
    int32_t head;
    int64_t start, len;  // in key blocks of the concatenated groups
  };
  std::vector<Group> groups;
  int64_t total = 0;
  for (size_t u = 0; u < users.size(); ++u) {
    int32_t len = 1;  // a group without keys still takes a unit (its tiles write the diagonal)
    for (size_t t = users[u].first; t < users[u].second; ++t) len = std::max(len, blocks[t]);
    for (int32_t h = 0; h < num_heads; ++h) {
      groups.push_back({u, h, total, len});
      total += len;
    }
  }
  // Lane boundaries, snapped to a group edge when a piece would be shorter than kMinLeanPiece.
  std::vector<int64_t> bound(lanes + 1);
  size_t g = 0;
  for (int32_t j = 0; j <= lanes; ++j) {
    int64_t b = total * j / lanes;
    while (g + 1 < groups.size() && groups[g].start + groups[g].len <= b) ++g;
    const int64_t gs = groups[g].start, ge = gs + groups[g].len;
    if (b > gs && b < ge) {
      if (b - gs < kMinLeanPiece) b = gs;
      else if (ge - b < kMinLeanPiece) b = ge;
    }
    bound[j] = j == 0 ? 0 : std::max(b, bound[j - 1]);
  }
  bound[lanes] = total;

  // The pieces: per CTA (lane-major) a list of (tile, head, first block, end block).
  struct Piece {
    int32_t tile, head, b0, b1;
  };
  std::vector<std::vector<Piece>> cta_pieces(static_cast<size_t>(lanes) * W);
  for (int32_t j = 0; j < lanes; ++j) {
    const int64_t s = bound[j], e = bound[j + 1];
    if (s >= e) continue;
    std::vector<std::pair<size_t, std::pair<int32_t, int32_t>>> segs, whole;  // group, [a, b)
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const Group& gr = groups[gi];
      const int64_t a = std::max(s, gr.start), b = std::min(e, gr.start + gr.len);
      if (a >= b) continue;
      const std::pair<int32_t, int32_t> ab{static_cast<int32_t>(a - gr.start),
                                           static_cast<int32_t>(b - gr.start)};
      (ab.first == 0 && ab.second == gr.len ? whole : segs).push_back({gi, ab});
    }
    segs.insert(segs.end(), whole.begin(), whole.end());  // partial pieces first
    for (const auto& [gi, ab] : segs) {
      const Group& gr = groups[gi];
      const auto [first, end] = users[gr.user];
      for (size_t t = first; t < end; ++t) {
        const int32_t b0 = std::min(ab.first, blocks[t]), b1 = std::min(ab.second, blocks[t]);
        // A tile without keys gets one empty piece, in the lane holding its group's start.
        if (b0 < b1 || (blocks[t] == 0 && ab.first == 0)) {
          cta_pieces[static_cast<size_t>(j) * W + (t - first)].push_back(
              {static_cast<int32_t>(t), gr.head, b0, b1});
        }
      }
    }
  }

  // Splits per tile-head (pieces in key order), partial slots and counters.
  std::map<std::pair<int32_t, int32_t>, std::vector<std::pair<int32_t, size_t>>> by_tile_head;
  for (size_t c = 0; c < cta_pieces.size(); ++c) {
    for (const Piece& pc : cta_pieces[c]) by_tile_head[{pc.tile, pc.head}].push_back({pc.b0, c});
  }
  struct Split {
    int32_t split, num_splits, counter, partial_base;
  };
  std::map<std::tuple<int32_t, int32_t, int32_t>, Split> splits;  // (tile, head, b0)
  AttentionPlan& plan = r.plan;
  int32_t slots_used = 0;
  for (auto& [key, list] : by_tile_head) {
    std::sort(list.begin(), list.end());
    const int32_t n = static_cast<int32_t>(list.size());
    const int32_t counter = n > 1 ? plan.num_counters++ : -1;
    const int32_t base = slots_used;
    if (n > 1) slots_used += n;
    for (int32_t sidx = 0; sidx < n; ++sidx) {
      splits[{key.first, key.second, list[sidx].first}] = {sidx, n, counter, base};
    }
  }

  // Items: CTA c's first item at index c (CTAs with work only), later ones after, linked by next.
  std::vector<size_t> busy;
  for (size_t c = 0; c < cta_pieces.size(); ++c) {
    if (!cta_pieces[c].empty()) busy.push_back(c);
  }
  plan.items.resize(busy.size());
  double span = 0;
  for (size_t k = 0; k < busy.size(); ++k) {
    int32_t prev = -1;
    double cost = kCtaOverhead - kItemOverhead;
    for (const Piece& pc : cta_pieces[busy[k]]) {
      const Tile& t = tiles[pc.tile];
      const Split& sp = splits.at({pc.tile, pc.head, pc.b0});
      AttentionWorkItem it;
      it.user = t.user;
      it.q_row = t.q_row;
      it.num_q = t.num_q;
      it.q_local = t.q_local;
      it.kv_begin = std::min(t.kv_end, pc.b0 * kAttnBlockN);
      it.kv_end = std::min(t.kv_end, pc.b1 * kAttnBlockN);
      it.split = sp.split;
      it.num_splits = sp.num_splits;
      it.tile = sp.counter;
      it.partial_base = sp.partial_base;
      it.head = pc.head;
      const int32_t idx = prev < 0 ? static_cast<int32_t>(k) : static_cast<int32_t>(plan.items.size());
      if (prev < 0) {
        plan.items[k] = it;
      } else {
        plan.items.push_back(it);
        plan.items[prev].next = idx;
      }
      prev = idx;
      // Two chunks: the first writes its partial, the second reads it. More: each writes its
      // partial, and the last (any of them) reads them all.
      const double partials = sp.num_splits == 1   ? 0.0
                              : sp.num_splits == 2 ? 1.0
                                                   : 1.0 + sp.num_splits;
      cost += (pc.b1 - pc.b0) + kItemOverhead + partials * kPartialCost;
    }
    span = std::max(span, cost);
  }
  plan.lean_ctas = static_cast<int32_t>(busy.size());
  plan.num_partials = (slots_used + num_heads - 1) / num_heads;
  plan.chunk_blocks = static_cast<int32_t>((total + lanes - 1) / lanes);
  r.span = span;
  return r;
}

}  // namespace

AttentionPlan PlanHstuAttentionLean(const int32_t* row_offsets, const int32_t* num_new,
                                    const int32_t* num_tokens, int32_t batch_size,
                                    int32_t num_heads, int32_t concurrent_ctas) {
  return PlanLean(MakeTiles(row_offsets, num_new, num_tokens, batch_size, 0), num_heads,
                  std::max(1, concurrent_ctas))
      .plan;
}

AttentionPlan PlanHstuAttention(const int32_t* row_offsets, const int32_t* num_new,
                                const int32_t* num_tokens, int32_t batch_size,
                                int32_t max_attn_len, int32_t num_heads, int32_t concurrent_ctas,
                                int32_t max_split, int32_t cluster, int32_t max_clusters,
                                bool lean) {
  const std::vector<Tile> tiles = MakeTiles(row_offsets, num_new, num_tokens, batch_size, max_attn_len);

  // A cluster plan: one wave of clusters, a tile's keys in `cluster` chunks of whole blocks
  // (trailing chunks may be empty), summed on chip.
  const int64_t tile_heads = static_cast<int64_t>(tiles.size()) * num_heads;
  if (cluster > 1 && max_attn_len <= 0 && !tiles.empty() && tile_heads <= max_clusters &&
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
  // costs its blocks plus two blocks' worth of fixed work (Q load, epilogue, reduction). Every
  // chunk gets a lower bound on its makespan (its longest CTA, or the total spread evenly); the
  // few with the lowest bounds are scheduled exactly and the shortest schedule wins (ties: the
  // longer chunk, fewer partials). The kernels launch the H heads of an item next to each other
  // (block x = item * H + head).
  std::vector<int32_t> blocks(tiles.size());
  int32_t max_blocks = 1;
  for (size_t i = 0; i < tiles.size(); ++i) {
    blocks[i] = CeilDiv(tiles[i].kv_end - tiles[i].kv_begin, kAttnBlockN);
    max_blocks = std::max(max_blocks, blocks[i]);
  }
  const int32_t slots = std::max(1, concurrent_ctas);
  struct Candidate {
    int32_t chunk;
    double bound;  // lower bound on the makespan
    double waves;  // the waves estimate: waves of CTAs times the longest
  };
  std::vector<Candidate> candidates;
  for (int32_t chunk = 1; chunk <= max_blocks; ++chunk) {
    int64_t ctas = 0, work = 0;
    int32_t longest = 0;
    bool too_many = false;
    for (int32_t b : blocks) {
      const int32_t splits = std::max(1, CeilDiv(b, chunk));
      too_many |= splits > max_split;
      ctas += splits;
      work += b;
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
  std::vector<int32_t> costs;
  std::vector<double> finish;
  int32_t best_chunk = tried.front().chunk;
  double best_span = 1e300;
  for (const Candidate& candidate : tried) {
    const int32_t chunk = candidate.chunk;
    const double bound = candidate.bound;
    costs.clear();
    for (int32_t b : blocks) {
      for (int32_t k = 0; k < std::max(1, CeilDiv(b, chunk)); ++k) {
        costs.push_back(std::min(chunk, b - k * chunk));
      }
    }
    std::sort(costs.begin(), costs.end(), std::greater<>());
    double span = 0;
    const int64_t launched = static_cast<int64_t>(costs.size()) * num_heads;
    if (launched <= slots) {
      span = costs.front() + kCtaOverhead;  // one wave
    } else if (launched > 16LL * slots) {
      // Many waves: the list schedule ends about half a CTA past the even spread.
      span = bound + 0.5 * (std::min(chunk, max_blocks) + kCtaOverhead);
    } else {
      // Min-heap of the SMs' finish times.
      finish.assign(static_cast<size_t>(slots), 0.0);
      for (int32_t cost : costs) {
        for (int32_t h = 0; h < num_heads; ++h) {
          std::pop_heap(finish.begin(), finish.end(), std::greater<>());
          finish.back() += cost + kCtaOverhead;
          std::push_heap(finish.begin(), finish.end(), std::greater<>());
        }
      }
      span = *std::max_element(finish.begin(), finish.end());
    }
    if (span < best_span - 1e-9 || (span < best_span + 1e-9 && chunk > best_chunk)) {
      best_span = span;
      best_chunk = chunk;
    }
  }

  // A lean plan where it should end sooner (by more than a block: the model is coarse), counting
  // the split plan's reduction kernel.
  if (lean && max_attn_len <= 0) {
    int64_t partials = 0;
    for (int32_t b : blocks) {
      const int32_t splits = CeilDiv(b, best_chunk);
      if (splits > 1) partials += splits;
    }
    const double reduce =
        partials > 0 ? kReduceLaunch + kReducePerPartial * static_cast<double>(partials * num_heads)
                     : 0.0;
    LeanResult lr = PlanLean(tiles, num_heads, slots);
    if (lr.span + 1.0 < best_span + reduce) return std::move(lr.plan);
  }

  AttentionPlan plan;
  plan.chunk_blocks = best_chunk;
  const int32_t chunk_keys = best_chunk * kAttnBlockN;
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
  auto leads = [](const AttentionWorkItem& a) { return a.num_splits > 1 && a.split == 0; };
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [&](const AttentionWorkItem& a, const AttentionWorkItem& b) {
                     const int32_t la = a.kv_end - a.kv_begin, lb = b.kv_end - b.kv_begin;
                     return la != lb ? la > lb : leads(a) && !leads(b);
                   });
  return plan;
}

}  // namespace hstu::cuda
