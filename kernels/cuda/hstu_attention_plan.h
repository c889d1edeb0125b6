// The paged HSTU attention's work plan (kernels/cuda/hstu_attention.h has the kernels and the
// decomposition): which query tile and key chunk each CTA takes, in which order, and whether the
// chunks of a tile sum in a cluster. Plain host code with no CUDA dependency, built in every
// configuration so that its tests also run under the sanitizers (whose builds have CUDA off).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace hstu::cuda {

inline constexpr int kAttnBlockM = 128;  // query rows per tile (2 warpgroups × 64)
inline constexpr int kAttnBlockN = 64;   // keys per pipeline stage (2 stages)
inline constexpr int kMaxAttnCluster = 8;  // portable thread block cluster size
// A CTA's fixed work outside its key loop, in 64-key blocks, as the planner counts it
// (PlanHstuAttention; docs/kernel_rounds.md, round 26).
inline constexpr int32_t kAttnCtaOverheadBlocks = 4;

struct AttentionWorkItem {
  int32_t user = 0;
  int32_t q_row = 0;         // first jagged row of the tile
  int32_t num_q = 0;         // rows in the tile, 1..kAttnBlockM
  int32_t q_local = 0;       // index of the tile's first row among the user's rows
  int32_t kv_begin = 0;      // history keys [kv_begin, kv_end) of this chunk
  int32_t kv_end = 0;
  int32_t split = 0;         // chunk index within the tile
  int32_t num_splits = 1;
  int32_t tile = -1;         // index of the split tile, -1 when num_splits == 1
  int32_t partial_base = 0;  // first partial slot of the split tile; slot = partial_base + split
};

struct AttentionPlan {
  // Longest first; items[t] for t < num_split_tiles is the first chunk (split 0) of split tile t.
  std::vector<AttentionWorkItem> items;
  int32_t num_split_tiles = 0;  // tiles cut into several chunks (each reduced by the 2nd kernel)
  int32_t num_partials = 0;     // partial slots: num_partials * H * kAttnBlockM * D floats
  int32_t chunk_blocks = 0;     // chosen chunk length in key blocks (for reports)
  // > 0: a cluster plan (LaunchHstuAttention's `cluster`): items are tile-major, `cluster` chunks
  // a tile (empty ones included), items[t * cluster + s] = chunk s of tile t; no split tiles.
  int32_t cluster = 0;
};

// Builds the work list from the host copy of the batch plan.
//   row_offsets: [B + 1]; num_new, num_tokens: [B] (num_tokens after the append).
//   candidates_only: tiles cover only each user's candidate rows (rows num_new.. of the user): the
//   last layer's plan, whose history rows feed no later layer (DESIGN §2.3 reads the candidate
//   rows only). Their output rows are left unwritten.
//   concurrent_ctas: CTAs the GPU runs at once (SMs × CTAs per SM, see HstuAttentionCtasPerSm).
//   max_split: upper bound on chunks per tile (bounds the workspace); >= 1.
//   cluster, max_clusters: with cluster > 0 (2, 4 or 8; the warp-specialised kernel)
//   the plan is a cluster plan when the tiles × heads fit in max_clusters clusters at once
//   (HstuAttentionMaxClusters) and tiles × heads × cluster CTAs fill at least two thirds of
//   concurrent_ctas: each tile's keys in `cluster` chunks, summed in distributed shared memory
//   instead of through partials and the reduction kernel (a one-wave decode step of a few users).
AttentionPlan PlanHstuAttention(const int32_t* row_offsets, const int32_t* num_new,
                                const int32_t* num_tokens, int32_t batch_size,
                                int32_t max_attn_len, int32_t num_heads, int32_t concurrent_ctas,
                                int32_t max_split = 64, int32_t cluster = 0,
                                int32_t max_clusters = 0, bool candidates_only = false);

// Whether PlanHstuAttention orders a plan without split tiles user by user (round 38 in
// docs/kernel_rounds.md); HSTU_ATTN_USER_ORDER=0 turns it off, for A/B timing. Read once.
bool HstuAttentionUserOrderEnabled();

// The list schedule PlanHstuAttention times its chunk lengths with: costs (descending, >= 0; each
// CTA's key blocks plus its fixed work) each taken `copies` times (the heads) in order, by the
// first of `machines` (SM slots, all free at 0) to free up. Returns when the last one finishes.
// A run of equal costs goes to the machines free at one time all at once: O(runs · levels +
// makespan) with integer costs, where a heap of the machines' finish times took O(log machines)
// a CTA; the result is the same. scratch: reused storage, may be nullptr.
int64_t ListScheduleMakespan(const std::vector<int32_t>& costs, int32_t copies, int32_t machines,
                             std::vector<int32_t>* scratch = nullptr);
// The same over runs: (cost, how many CTAs of it) in launch order, counts > 0 (the copies
// already counted in); two runs of one cost schedule as one.
int64_t ListScheduleMakespan(const std::vector<std::pair<int32_t, int64_t>>& runs,
                             int32_t machines, std::vector<int32_t>* scratch = nullptr);

}  // namespace hstu::cuda
