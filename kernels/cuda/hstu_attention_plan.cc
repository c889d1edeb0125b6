#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/hstu_attention.h"

namespace hstu::cuda {
namespace {

struct Tile {
  int32_t user, q_row, num_q, q_local, kv_begin, kv_end;
  bool has_candidates;
};

int32_t CeilDiv(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

}  // namespace

AttentionPlan PlanHstuAttention(const int32_t* row_offsets, const int32_t* num_new,
                                const int32_t* num_tokens, int32_t batch_size,
                                int32_t max_attn_len, int32_t num_heads, int32_t concurrent_ctas,
                                int32_t max_split) {
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

  // Chunk length (in key blocks) that minimises the estimated makespan: waves of CTAs times the
  // blocks each runs, plus two blocks' worth of fixed cost per CTA (Q load, epilogue, reduction).
  int32_t max_blocks = 1;
  for (const Tile& t : tiles) max_blocks = std::max(max_blocks, CeilDiv(t.kv_end - t.kv_begin, kAttnBlockN));
  const int64_t slots = std::max(1, concurrent_ctas);
  int32_t best_chunk = max_blocks;
  double best_cost = 1e300;
  for (int32_t chunk = 1; chunk <= max_blocks; ++chunk) {
    int64_t ctas = 0;
    bool too_many = false;
    for (const Tile& t : tiles) {
      const int32_t splits = std::max(1, CeilDiv(CeilDiv(t.kv_end - t.kv_begin, kAttnBlockN), chunk));
      too_many |= splits > max_split;
      ctas += splits;
    }
    if (too_many) continue;
    ctas *= num_heads;
    const double waves = static_cast<double>((ctas + slots - 1) / slots);
    const double cost = waves * (chunk + 2.0);
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best_chunk = chunk;
    }
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
      it.partial_base = base;
      plan.items.push_back(it);
    }
  }
  return plan;
}

}  // namespace hstu::cuda
