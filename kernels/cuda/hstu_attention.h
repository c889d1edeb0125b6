// Paged HSTU attention on tensor cores (DESIGN §2.2): plan on the host, run on the device.
//
// Work decomposition. Each user's rows (new history, then candidates) are cut into query tiles of
// kAttnBlockM rows; each tile's key range (history tokens in the pages, bounded by the causal mask
// and the window) is cut into chunks of whole kAttnBlockN-key blocks so that the grid fills the GPU
// even for one user ("split-K"). A CTA computes one (work item, head): its Q tile against its key
// chunk. Since HSTU attention has no softmax, partial results of a split tile simply add: each chunk
// writes an fp32 partial, and a second kernel sums a tile's partials in split order —
// deterministic — adds the candidates' own keys (the diagonal, from the uvqk rows) and writes the
// bf16 output; an unsplit tile's CTA adds its diagonal and writes the output itself. A cluster
// plan (a decode step of a few users, one wave of clusters) makes each tile and head a thread
// block cluster instead: its CTAs sum their chunks in distributed shared memory, with no partials
// in global memory and no second kernel (docs/kernel_rounds.md, round 14).
//
// The plan is plain data (no device pointers), so it can be built into static buffers for CUDA
// graphs, whose replays resize the two kernels' grids to the plan.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/params.h"

namespace hstu::cuda {

inline constexpr int kAttnBlockM = 128;  // query rows per tile (2 warpgroups × 64)
inline constexpr int kAttnBlockN = 64;   // keys per pipeline stage (2 stages)
inline constexpr int kMaxAttnCluster = 8;  // portable thread block cluster size
// Most pages a layer's KV pool may hold: the warp-specialised kernel's tensor map addresses a page's
// K and V halves as 2·page + kv along a dimension of 2^24 (backends refuse larger pools).
inline constexpr int64_t kMaxKvPoolPages = int64_t{1} << 23;
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

// Which kernel LaunchHstuAttention runs for p's pool and shape, and when it is not the
// warp-specialised TMA kernel, why (encodes the pool's tensor map as a launch would). Only p.kv's
// base, page size, heads, head dim and strides and p.max_attn_len are read.
std::string HstuAttentionKernelName(const AttentionParams<__nv_bfloat16>& p);

// Diagnostic timeline of the warp-specialised kernel (D = 256), only in builds configured with
// -DHSTU_ATTN_TRACE=ON: per CTA (block x < kAttnTraceCtas) kAttnTraceFields words — %globaltimer
// in ns at entry, after the wait for the previous kernel, when Q has landed, when the first K tile
// has landed, at the end of the key loop and after the epilogue, then (blocks << 32 | SM id), then
// (cluster plans) when the cluster's first sync in the epilogue returned.
inline constexpr int kAttnTraceCtas = 16384, kAttnTraceFields = 8;
enum AttnTraceField {
  kTraceEntry = 0, kTraceReady, kTraceQ, kTraceFirstKv, kTraceLoopEnd, kTraceEnd, kTraceSmAndBlocks,
  kTraceClusterSynced
};
// Copies the timeline out (kAttnTraceCtas * kAttnTraceFields words) and zeroes it.
// cudaErrorNotSupported in builds without the trace.
cudaError_t ReadHstuAttentionTrace(std::vector<uint64_t>* out);

// Whether a backend should read new K/V from the rows (AttentionParams::new_kv_from_rows) where
// the warp-specialised kernel runs (HSTU_ATTN_FRESH_ROWS=0 turns it off, for A/B timing).
bool HstuAttentionKvFromRowsEnabled();

// CTAs of the attention kernel one SM runs at once for this head dim (occupancy API).
cudaError_t HstuAttentionCtasPerSm(int head_dim, int* ctas_per_sm);

// Runs the plan: the attention kernel, one CTA per work item and head, then — when partials is
// given — the split reduction, one block per split tile, head and kReduceRows rows (at least one
// tile's worth of blocks, so that a captured graph keeps the node; its blocks find no split tile
// and exit). p: AttentionParams (history K/V of every user already appended to the pages); items:
// device copy of plan.items [num_items]; num_split_tiles: plan.num_split_tiles; partials:
// [plan.num_partials, H, kAttnBlockM, D] fp32 scratch, nullptr only when num_split_tiles == 0.
// Head dim must be 64, 128 or 256 (cudaErrorInvalidValue otherwise; see kSupportedHeadDimsText in
// ops.h).
//
// cluster > 0 runs a cluster plan (PlanHstuAttention with a cluster size): items are tile-major,
// `cluster` chunks a tile, and each tile and head is one thread block cluster whose CTAs sum
// their results through distributed shared memory — no partials, no reduction kernel
// (num_split_tiles must be 0; partials may still be given, the reduction's blocks then exit).
// Warp-specialised kernel only (D = 256; cudaErrorInvalidValue otherwise).
//
// p.new_kv_from_rows: the new history K/V of the users NewKvFromRows picks (fresh users and those
// whose cached prefix is whole 64-key blocks) are read from their uvqk rows and stored to their
// pages by the kernel (AttentionParams); the warp-specialised kernel only, with p.uvqk_rows >=
// p.num_rows and packed rows — cudaErrorInvalidValue otherwise, since those users' K/V are in no
// page yet. Inside a stream capture the rows' tensor map must already exist (an eager launch on
// the same buffer built it). With p.store_new_kv false the kernel stores nothing (pages nobody
// reads again: the cache is off).
cudaError_t LaunchHstuAttention(const AttentionParams<__nv_bfloat16>& p,
                                const AttentionWorkItem* items, int32_t num_items,
                                int32_t num_split_tiles, float* partials, cudaStream_t stream,
                                int32_t cluster = 0);

// Clusters of `cluster` CTAs of the warp-specialised attention kernel the GPU runs at once
// (cudaOccupancyMaxActiveClusters; 0 when none fit). cudaErrorInvalidDeviceFunction on a GPU
// that is not compute capability 9.x.
cudaError_t HstuAttentionMaxClusters(int32_t cluster, int* max_clusters);

// Blocks along x of the split reduction for a plan with num_split_tiles split tiles (a CUDA graph
// resizes the captured node to this on each replay; the attention kernel's is num_items * H).
inline int32_t HstuAttentionReduceGridX(int32_t num_split_tiles, int32_t num_heads) {
  return (num_split_tiles > 0 ? num_split_tiles : 1) * num_heads;
}

}  // namespace hstu::cuda
