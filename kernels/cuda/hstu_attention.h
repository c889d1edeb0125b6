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
// graphs, whose replays resize the two kernels' grids to the plan. Its types and the planner are in
// hstu_attention_plan.h, host code that every build compiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/hstu_attention_plan.h"
#include "kernels/params.h"

namespace hstu::cuda {

// Most pages a layer's KV pool may hold: the warp-specialised kernel's tensor map addresses a page's
// K and V halves as 2·page + kv along a dimension of 2^24 (backends refuse larger pools).
inline constexpr int64_t kMaxKvPoolPages = int64_t{1} << 23;

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
