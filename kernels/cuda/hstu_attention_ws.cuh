// Warp-specialised paged HSTU attention for D = 256 (sm_90a): a producer warp moves each 64-key
// K or V tile from the pages into a ring of shared-memory slots with TMA (copy engine, no warps
// spent on the gather); two consumer warpgroups run the same S / SiLU / P·V as HstuAttentionKernel
// and hand each slot back as soon as their wgmma has read it. See docs/kernel_rounds.md, round 6.
//
// Same work items, grid (items × H), plan, partials and reduction as HstuAttentionKernel — and
// cluster plans, which only this kernel runs (ClusterReduceEpilogue, round 14); it only
// runs when a block never straddles a TMA box: chunk starts are multiples of 64 keys (with a
// window too: the plan starts a tile's keys at the block holding its first one and the mask
// drops the keys before a row's window), page size a multiple of 8, the pool packed
// [pages, 2, page_size, H, D] (the launcher checks).
#pragma once

#include <cuda.h>  // CUtensorMap (a plain 64-byte-aligned struct; no driver library is linked)

#include "kernels/cuda/hstu_attention_kernel.cuh"

namespace hstu::cuda {

// ---- mbarrier and TMA helpers ----
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts its phase "1" as
// completed, so a producer's first wait on an empty slot passes at once).
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity)
      : "memory");
}
// One box of the K/V tensor map (see KvTensorMap in hstu_attention.cu): dims, fastest first,
// {64 columns, H*D/64 slabs, page_size rows, 2*num_pages K|V halves}; box {64, 1, box_rows, 1}.
// `map` points at a __grid_constant__ kernel parameter (the kernel takes its maps by value).
__device__ __forceinline__ void TmaLoad4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                          int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// The reverse, shared memory to global (new K/V from the rows to their pages), in the CTA's bulk
// group; the smem tile must not be rewritten before BulkWaitRead, nor the CTA exit before
// BulkWaitAll.
__device__ __forceinline__ void TmaStore4d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                           int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void BulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void SetMaxNRegDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void SetMaxNRegInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- Thread block clusters (the cluster reduction) ----
__device__ __forceinline__ void ClusterSync() {  // all non-exited threads of the cluster
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// 4 floats of CTA `rank`'s shared memory at this CTA's shared address `addr`.
__device__ __forceinline__ float4 LdClusterF4(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// ---- Optional per-CTA timeline (diagnostic builds: -DHSTU_ATTN_TRACE=ON) ----
// Consumer thread 0 of each CTA stamps %globaltimer (ns) at fixed points; ReadHstuAttentionTrace
// copies the stamps out (hstu_bench attention_trace). Compiled out otherwise.
#if defined(HSTU_ATTN_TRACE)
__device__ unsigned long long g_attn_trace[kAttnTraceCtas * kAttnTraceFields];
__device__ __forceinline__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define HSTU_ATTN_TRACE_AT(field, value)                                         \
  do {                                                                           \
    const unsigned cta_ = blockIdx.y * gridDim.x + blockIdx.x;                   \
    if (threadIdx.x == 128 && cta_ < kAttnTraceCtas) {                           \
      g_attn_trace[cta_ * kAttnTraceFields + (field)] = (value);                 \
    }                                                                            \
  } while (0)
#else
#define HSTU_ATTN_TRACE_AT(field, value) \
  do {                                   \
  } while (0)
#endif

// The cluster plan's epilogue, run by the 256 consumer threads of each CTA of a cluster (the
// tile's chunks, rank = split): each CTA puts its fp32 O in its own shared memory (the Q tile and
// the ring are free once both consumer warpgroups have left the loop), the cluster syncs, and CTA
// r sums rows [r·R, r·R + R) of all the cluster's O (R = 128 / cluster) in rank order — the split
// order, deterministic — through distributed shared memory, adds the candidates' own keys (the
// diagonal, as HstuAttentionReduceKernel does) and writes bf16. A second sync keeps every CTA's
// shared memory alive until the others have read it.
template <int kD = 256>
__device__ __forceinline__ void ClusterReduceEpilogue(const AttentionParams<bf16>& p,
                                                      const AttentionWorkItem& it, int h,
                                                      int cluster, int row0, int t4,
                                                      const float (&o)[kD / 2],
                                                      unsigned char* smem) {
  constexpr int kStride = kD + 4;  // floats per row of O in shared memory (bank spread)
  static_assert(kAttnBlockM * kStride * 4 + kAttnBlockM * 4 <= kAttnBlockM * kD * 2 + 5 * kAttnBlockN * kD * 2,
                "O of a tile and the diagonal weights fit in the Q tile and the ring");
  float* s_o = reinterpret_cast<float*>(smem);
  float* s_pd = s_o + kAttnBlockM * kStride;
  const int ctid = threadIdx.x - 128, lane = threadIdx.x & 31, cwarp = ctid >> 5;
  const int64_t hd = static_cast<int64_t>(p.kv.num_heads) * kD;
  const int num_new = p.num_new[it.user];
  const uint32_t rank = ClusterCtaRank();
  const int rows = kAttnBlockM / cluster;  // rows this CTA reduces: 16 for clusters of 8
  const int row_begin = static_cast<int>(rank) * rows;

  NamedBarrierSync(3, 256);  // both consumer warpgroups are past their last wgmma
#pragma unroll
  for (int jn = 0; jn < kD / 8; ++jn) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      *reinterpret_cast<float2*>(s_o + (row0 + 8 * i) * kStride + jn * 8 + 2 * t4) =
          make_float2(o[4 * jn + 2 * i], o[4 * jn + 2 * i + 1]);
    }
  }
  // The diagonal's weights of this CTA's rows (warp w: rows row_begin + w + 8j), before the sync.
  const bf16* rows_base = p.uvqk + static_cast<int64_t>(it.q_row) * p.uvqk_row_stride + h * kD;
  for (int r = row_begin + cwarp; r < row_begin + rows; r += 8) {
    const bool cand = r < it.num_q && it.q_local + r >= num_new;  // warp-uniform
    float pd = 0.f;
    if (cand) {
      Bf16x8 q{}, k{};
      if (lane < kD / 8) {
        const bf16* row = rows_base + static_cast<int64_t>(r) * p.uvqk_row_stride;
        q = Ldg8(row + kQ * hd + 8 * lane);
        k = Ldg8(row + kK * hd + 8 * lane);
      }
      pd = Silu(p.alpha * WarpSum(Dot8(q, k, 0.f))) * p.inv_norm;
    }
    if (lane == 0) s_pd[r - row_begin] = pd;
  }
  ClusterSync();
  HSTU_ATTN_TRACE_AT(kTraceClusterSynced, GlobalTimerNs());

  const uint32_t o_addr = SmemAddr(s_o);
  bf16* out = p.out + h * kD;
  constexpr int kVec = kD / 4;  // float4 per row
  for (int idx = ctid; idx < rows * kVec; idx += 256) {
    const int r = row_begin + idx / kVec, c = (idx % kVec) * 4;
    const uint32_t at = o_addr + static_cast<uint32_t>((r * kStride + c) * 4);
    // Every load of the step is issued before the first sum, so that their latencies overlap:
    // a candidate row's v for the diagonal, then the cluster's O, summed in rank order after.
    const bool cand = r < it.num_q && it.q_local + r >= num_new;
    uint2 vv = make_uint2(0u, 0u);
    if (cand) {
      vv = __ldg(reinterpret_cast<const uint2*>(
          rows_base + static_cast<int64_t>(r) * p.uvqk_row_stride + kV * hd + c));
    }
    float4 part[kMaxAttnCluster];
#pragma unroll
    for (int s = 0; s < kMaxAttnCluster; ++s) {
      if (s < cluster) part[s] = LdClusterF4(at, static_cast<uint32_t>(s));
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kMaxAttnCluster; ++s) {
      if (s < cluster) {
        acc.x += part[s].x; acc.y += part[s].y; acc.z += part[s].z; acc.w += part[s].w;
      }
    }
    if (r < it.num_q) {
      if (cand) {
        const float pd = s_pd[r - row_begin];
        const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vv.x));
        const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vv.y));
        acc.x = fmaf(pd, v01.x, acc.x);
        acc.y = fmaf(pd, v01.y, acc.y);
        acc.z = fmaf(pd, v23.x, acc.z);
        acc.w = fmaf(pd, v23.y, acc.w);
      }
      uint2 packed;
      packed.x = PackBf16x2(acc.x, acc.y);
      packed.y = PackBf16x2(acc.z, acc.w);
      *reinterpret_cast<uint2*>(out + static_cast<int64_t>(it.q_row + r) * hd + c) = packed;
    }
  }
  ClusterSync();  // the other CTAs have read this one's O
}

struct AttnWsTraits {
  static constexpr int kD = 256;
  static constexpr int kM = kAttnBlockM, kN = kAttnBlockN;
  static constexpr int kThreads = 384;           // producer warpgroup + 2 consumer warpgroups
  static constexpr int kSlabs = kD / 64;
  static constexpr int kChunks = kD / 8;
  static constexpr int kQBytes = kM * kD * 2;    // 64 KB
  static constexpr int kSlotBytes = kN * kD * 2; // one K or V tile: 32 KB
  static constexpr int kSlots = 5;               // the producer runs up to 2.5 key blocks ahead
  static constexpr int kConsumerWarps = 8;       // arrivals that free a slot
  static constexpr int kSmemBytes = 1024 + kQBytes + kSlots * kSlotBytes + 2 * kSlots * 8;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// Grid (items × H), or with cluster > 0 (a cluster plan, PlanHstuAttention) grid (cluster,
// tiles × H) in clusters of (cluster, 1, 1): the chunks of one tile and head are one cluster, and
// after the key loop they sum their O through distributed shared memory (ClusterReduceEpilogue)
// instead of writing partials for the reduction kernel. 384 threads. Each consumer warpgroup runs
// S, SiLU, P·V of a block in order; the two warpgroups overlap each other. (A FlashAttention-3
// ping-pong of the two, with S(j) and P(j-1)·V(j-1) issued in one turn, measured 30 % slower:
// docs/kernel_rounds.md, round 6.) kv_map: the pool's tensor map, by value; box_rows: rows of one
// TMA box (64, 32, 16 or 8, dividing the page size).
//
// New K/V from the rows (p.new_kv_from_rows; users NewKvFromRows picks, rounds 19 and 27): the
// producer loads their new keys' K/V blocks from the uvqk rows through rows_map (box {64 columns,
// 1 slab, 64 rows, 1}: rows [T, 4·H·D/64 slabs of 128 bytes]), in the same swizzled layout, and
// the append has skipped them. A key block of the tile's own rows (new key i = row i) is loaded
// by this tile only among all tiles whose causal range covers it, and it is one of the CTA's
// last two blocks, still in the ring after the loop: the consumers store it from there to the
// pages with TMA (the pool map's boxes), which costs the CTA no loads and no kernel.
__global__ void __launch_bounds__(384, 1)
    HstuAttentionWsKernel(const AttentionParams<bf16> p, const AttentionWorkItem* __restrict__ items,
                          float* __restrict__ partials, const __grid_constant__ CUtensorMap kv_map,
                          const __grid_constant__ CUtensorMap rows_map, int box_rows, int cluster) {
#ifdef HSTU_WGMMA_ENABLED
  HSTU_ATTN_TRACE_AT(kTraceEntry, GlobalTimerNs());
  // Launched dependent on the kernel before it (LaunchDependent). Until WaitForPredecessor this
  // CTA reads only the step's metadata (work items, page table, token counts), which a copy wrote
  // before the step's first kernel, so before any kernel of the chain could start: the page ids
  // are in registers when the previous kernel ends. K/V pages (the new rows' appended by the
  // previous kernel) and the uvqk rows are read after the wait, by each role.
  AllowDependents();

  using Tr = AttnWsTraits;
  constexpr int kD = Tr::kD, kM = Tr::kM, kN = Tr::kN, kChunks = Tr::kChunks, kSlots = Tr::kSlots;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  unsigned char* smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  unsigned char* s_q = smem;                    // [kSlabs][kM][64]
  unsigned char* s_ring = s_q + Tr::kQBytes;    // [kSlots][kSlabs][kN][64]
  const uint32_t q_addr = SmemAddr(s_q), ring_addr = SmemAddr(s_ring);
  const uint32_t bar_addr = ring_addr + kSlots * Tr::kSlotBytes;
  auto full_bar = [&](int slot) { return bar_addr + 8 * slot; };
  auto empty_bar = [&](int slot) { return bar_addr + 8 * (kSlots + slot); };

  // Block x = item * H + head: the heads of an item launch together, in the plan's order. In a
  // cluster plan block y = tile * H + head and block x = the chunk (= the CTA's rank).
  const int H = p.kv.num_heads;
  const int item = cluster > 0 ? static_cast<int>(blockIdx.y) / H * cluster + blockIdx.x
                               : static_cast<int>(blockIdx.x) / H;
  const AttentionWorkItem it = items[item];
  const int h = static_cast<int>(cluster > 0 ? blockIdx.y : blockIdx.x) % H;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = it.user;
  const int kv_begin = it.kv_begin, kv_end = it.kv_end;
  const int num_blocks = (kv_end - kv_begin + kN - 1) / kN;
  const int num_items = 2 * num_blocks;  // ring items: K(j) = 2j, V(j) = 2j + 1
  // A user NewKvFromRows picks has its new keys in its rows (key first_rows_key + i = row
  // row_offsets[b] + i; the cached keys before them, whole blocks, in the pages). The CTA's blocks
  // from first_owned on are its tile's own rows, which it stores to the pages (at most 2 blocks:
  // kv_begin, first_rows_key and q_local are multiples of 64 keys) unless the pages are not kept.
  static_assert(kN == kKvFromRowsAlign, "a key block must not mix keys of the pages and the rows");
  const bool rows_user = NewKvFromRows(p.new_kv_from_rows, p.returning_kv_from_rows,
                                       p.kv.num_tokens[b], p.num_new[b]);
  const int first_rows_key = rows_user ? p.kv.num_tokens[b] - p.num_new[b] : INT_MAX;
  const int first_owned = rows_user && p.store_new_kv
                              ? max(0, (first_rows_key + it.q_local - kv_begin + kN - 1) / kN)
                              : num_blocks;

  if (tid == 0) {
    for (int s = 0; s < kSlots; ++s) {
      MbarInit(full_bar(s), 1);
      MbarInit(empty_bar(s), Tr::kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {
    // ---- Producer warpgroup: warp 0 issues every TMA box; the other three warps leave. ----
    SetMaxNRegDec<24>();
    if (warp != 0) return;
    // The maps are kernel parameters (no generic-proxy write to order against): only fetch them
    // into the TMA unit's descriptor cache ahead of the first box.
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(&kv_map) : "memory");
    if (rows_user) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&rows_map) : "memory");
    const int32_t* pages = p.kv.page_ids + p.kv.indptr[b];
    const int page_size = p.kv.page_size;
    const int G = kN / box_rows;               // box groups per 64-key tile: 1, 2, 4, 8
    const int boxes = G * Tr::kSlabs;          // per K or V tile: 4 .. 32
    const int gi = lane % G, slab = lane / G;  // this lane's box
    const bool box_lane = lane < boxes;
    auto page_of_group = [&](int blk) -> int32_t {
      const int t = kv_begin + blk * kN + gi * box_rows;
      return (box_lane && blk < num_blocks && t < kv_end) ? __ldg(pages + t / page_size) : -1;
    };
    int32_t page = kv_begin >= first_rows_key ? -1 : page_of_group(0);
    const int row_base = p.row_offsets[b];
    const int part_slab = static_cast<int>(p.kv.num_heads) * Tr::kSlabs;  // slabs of u, v, q or k
    WaitForPredecessor();
    for (int i = 0; i < num_items; ++i) {
      const int blk = i >> 1, kv = i & 1, slot = i % kSlots;
      const int kstart = kv_begin + blk * kN;
      const int groups = min(G, (kv_end - kstart + box_rows - 1) / box_rows);
      MbarWait(empty_bar(slot), ((i / kSlots) & 1) ^ 1);
      if (kstart >= first_rows_key) {  // one 64-row box a slab; rows past the user's keys are
                                       // masked as in a page
        if (lane == 0) MbarArriveExpectTx(full_bar(slot), static_cast<uint32_t>(Tr::kSlotBytes));
        __syncwarp();
        if (lane < Tr::kSlabs) {
          const uint32_t dst = ring_addr + slot * Tr::kSlotBytes + lane * (kN * 128);
          TmaLoad4d(dst, &rows_map, full_bar(slot), 0,
                    (kv == 1 ? kV : kK) * part_slab + h * Tr::kSlabs + lane,
                    row_base + kstart - first_rows_key, 0);
        }
        continue;
      }
      if (lane == 0) {
        MbarArriveExpectTx(full_bar(slot), static_cast<uint32_t>(groups * box_rows * 128 * Tr::kSlabs));
      }
      __syncwarp();
      if (box_lane && gi < groups) {
        const int row_in_page = (kstart + gi * box_rows) % page_size;
        const uint32_t dst = ring_addr + slot * Tr::kSlotBytes + slab * (kN * 128) + gi * box_rows * 128;
        TmaLoad4d(dst, &kv_map, full_bar(slot), 0, h * Tr::kSlabs + slab, row_in_page, 2 * page + kv);
      }
      if (kv == 1) page = page_of_group(blk + 1);  // the next block's pages, while this one flies
    }
    return;
  }

  // ---- Consumer warpgroups 1 and 2: query rows 64*cw .. 64*cw + 63 of the tile. ----
  SetMaxNRegInc<240>();
  const int cw = (warp >> 2) - 1;                // 0 or 1
  const int cwarp = warp - 4;                    // 0 .. 7
  const int ctid = tid - 128;                    // 0 .. 255
  const int wg_tid = ctid & 127;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t hd = static_cast<int64_t>(p.kv.num_heads) * kD;
  const int hist = p.kv.num_tokens[b];
  const int num_new = p.num_new[b];
  const int first_new = hist - num_new;
  const bf16* uvqk = p.uvqk;

  // Mask bounds of this thread's two rows (row0 and row0 + 8): allowed keys lo..hi (inclusive;
  // lo from the window, whose chunks start at the block holding the tile's first key).
  const int row0 = cwarp * 16 + g;
  int lo[2], hi[2];
  bool is_cand[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row0 + 8 * i;
    const int local = it.q_local + r;
    is_cand[i] = r < it.num_q && local >= num_new;
    const int qid = local >= num_new ? hist : first_new + local;
    hi[i] = r < it.num_q ? (local >= num_new ? hist - 1 : qid) : -1;
    lo[i] = p.max_attn_len > 0 ? qid - p.max_attn_len : INT_MIN;
  }
  WaitForPredecessor();
  HSTU_ATTN_TRACE_AT(kTraceReady, GlobalTimerNs());

  // This warpgroup's 64 Q rows.
  for (int idx = wg_tid; idx < 64 * kChunks; idx += 128) {
    const int r = 64 * cw + idx / kChunks, c = idx % kChunks;
    const bool valid = r < it.num_q;
    const bf16* src = uvqk + static_cast<int64_t>(it.q_row + (valid ? r : 0)) * p.uvqk_row_stride +
                      kQ * hd + h * kD + c * 8;
    CpAsync16(s_q + TileOffset<kM>(r, c), src, valid);
  }
  CpAsyncCommit();

  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
  const float half_alpha = 0.5f * p.alpha;

  CpAsyncWait<0>();
  FenceProxyAsync();
  NamedBarrierSync(1 + cw, 128);  // every warp's Q rows landed
  HSTU_ATTN_TRACE_AT(kTraceQ, GlobalTimerNs());

  const uint32_t q_wg_addr = q_addr + cw * 64 * 128;
  // The first kQRegSteps k-steps (16 columns each) of this warp's 16 Q rows live in registers, in
  // the wgmma register-A layout (ldmatrix once), so those S wgmmas read only K from shared memory.
  // Measured 2 % faster at batch 8 than all of Q in shared memory; 12 steps gave the same, 16
  // (all of Q) spills (docs/kernel_rounds.md, round 6).
  constexpr int kQRegSteps = 8;
  uint32_t qa[kQRegSteps][4];
#pragma unroll
  for (int kk = 0; kk < kQRegSteps; ++kk) {
    const int r = 64 * cw + 16 * (cwarp & 3) + (lane & 15);
    LdMatrixX4(qa[kk], s_q + TileOffset<kM>(r, 2 * kk + (lane >> 4)));
  }
  auto slot_of = [](int item) { return item % kSlots; };
  auto parity_of = [](int item) { return static_cast<uint32_t>((item / kSlots) & 1); };
  auto tile_of = [&](int item) { return ring_addr + slot_of(item) * Tr::kSlotBytes; };
  auto release = [&](int item) {  // this warp's wgmma has read the slot: one arrival per warp
    __syncwarp();
    if (lane == 0) MbarArrive(empty_bar(slot_of(item)));
  };
  auto issue_s = [&](float (&s)[kN / 2], int j) {  // S = Q·K(j)ᵀ, committed as one group
    const uint32_t k_tile = tile_of(2 * j);
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) s[e] = 0.f;
    FenceRegs(s);
    WgmmaFence();
    auto desc_k = [&](int kk) {  // K-major: 16 columns = 32 bytes of a 128-byte slab row
      return MakeSmemDesc(k_tile + (kk >> 2) * (kN * 128) + (kk & 3) * 32, 16, 1024);
    };
#pragma unroll
    for (int kk = 0; kk < kQRegSteps; ++kk) WgmmaRS_m64n64k16_KMajorB(s, qa[kk], desc_k(kk));
#pragma unroll
    for (int kk = kQRegSteps; kk < kD / 16; ++kk) {
      WgmmaSS_m64n64k16(
          s, MakeSmemDesc(q_wg_addr + (kk >> 2) * (kM * 128) + (kk & 3) * 32, 16, 1024), desc_k(kk), 1);
    }
    WgmmaCommit();
  };
  auto issue_pv = [&](const uint32_t (&pa)[kN / 16][4], int j) {  // O += P(j)·V(j), one group
    const uint32_t v_tile = tile_of(2 * j + 1);
    WgmmaFence();
#pragma unroll
    for (int k2 = 0; k2 < kN / 16; ++k2) {
      WgmmaRS<kD>(o, pa[k2], MakeSmemDesc(v_tile + k2 * 16 * 128, kN * 128, 1024));
    }
    WgmmaCommit();
  };
  // P = SiLU(alpha·S), masked (keys past the chunk end or after the row's last key), as bf16 in
  // the register-A layout of the P·V wgmma. The 1/N is applied to O once after the loop (P·V is
  // linear), which saves a multiply per element of S.
  auto silu_pack = [&](const float (&s)[kN / 2], int j, uint32_t (&pa)[kN / 16][4]) {
    const int kstart = kv_begin + j * kN;
    const int klast = kstart + kN - 1;
    const bool full = klast < kv_end && klast <= hi[0] && klast <= hi[1] && kstart >= lo[0] &&
                      kstart >= lo[1];
    float pv[kN / 2];
    if (__all_sync(0xffffffffu, full)) {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) pv[e] = SiluHalf(s[e], half_alpha);
    } else {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) {
        const int i = (e >> 1) & 1;
        const int key = kstart + (e >> 2) * 8 + 2 * t4 + (e & 1);
        const bool ok = key < kv_end && key <= hi[i] && key >= lo[i];
        pv[e] = ok ? SiluHalf(s[e], half_alpha) : 0.f;
      }
    }
#pragma unroll
    for (int k2 = 0; k2 < kN / 16; ++k2) {
      pa[k2][0] = PackBf16x2(pv[8 * k2 + 0], pv[8 * k2 + 1]);
      pa[k2][1] = PackBf16x2(pv[8 * k2 + 2], pv[8 * k2 + 3]);
      pa[k2][2] = PackBf16x2(pv[8 * k2 + 4], pv[8 * k2 + 5]);
      pa[k2][3] = PackBf16x2(pv[8 * k2 + 6], pv[8 * k2 + 7]);
    }
  };
  // Waits for V(j); in a block that runs past the chunk end, zeroes the rows there before this
  // warpgroup's wgmma reads them: they hold stale page rows or nothing copied, P is 0 there, but V
  // must be finite (0 · NaN is NaN). The other warpgroup writes the same zeros.
  auto wait_v = [&](int j) {
    MbarWait(full_bar(slot_of(2 * j + 1)), parity_of(2 * j + 1));
    const int kstart = kv_begin + j * kN;
    if (kstart + kN > kv_end) {
      const int r0 = kv_end - kstart;
      unsigned char* vt = s_ring + slot_of(2 * j + 1) * Tr::kSlotBytes;
      for (int idx = wg_tid; idx < (kN - r0) * kChunks; idx += 128) {
        const int r = r0 + idx / kChunks, c = idx % kChunks;
        *reinterpret_cast<uint4*>(vt + TileOffset<kN>(r, c)) = make_uint4(0, 0, 0, 0);
      }
      FenceProxyAsync();
      NamedBarrierSync(1 + cw, 128);
    }
  };

#if defined(HSTU_ATTN_TRACE)
  if (num_blocks > 0) {
    MbarWait(full_bar(slot_of(0)), parity_of(0));
    HSTU_ATTN_TRACE_AT(kTraceFirstKv, GlobalTimerNs());
  }
#endif
  for (int j = 0; j < num_blocks; ++j) {
    MbarWait(full_bar(slot_of(2 * j)), parity_of(2 * j));
    float s[kN / 2];
    issue_s(s, j);
    WgmmaWait<0>();
    FenceRegs(s);
    release(2 * j);  // K(j) read: the producer may refill it
    uint32_t pa[kN / 16][4];
    silu_pack(s, j, pa);
    wait_v(j);
    issue_pv(pa, j);
    WgmmaWait<0>();
    FenceRegs(o);
    release(2 * j + 1);
  }

  HSTU_ATTN_TRACE_AT(kTraceLoopEnd, GlobalTimerNs());
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) o[e] *= p.inv_norm;  // O = (Σ SiLU(alpha·S)·V) / N
#if defined(HSTU_ATTN_TRACE)
  {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    HSTU_ATTN_TRACE_AT(kTraceSmAndBlocks, (static_cast<unsigned long long>(num_blocks) << 32) | smid);
  }
#endif

  // The tile's own new blocks, still in the ring (no load follows the last), to its pages: warp 0
  // of the consumers issues the boxes of the producer's page layout once both warpgroups are past
  // their last wgmma and the tail rows of the last V are zeroed (wait_v fenced them).
  const bool stores = first_owned < num_blocks;  // CTA-uniform
  if (stores) {
    NamedBarrierSync(3, 256);
    if (cwarp == 0) {
      const int32_t* pages = p.kv.page_ids + p.kv.indptr[b];
      const int page_size = p.kv.page_size;
      const int G = kN / box_rows;
      const int gi = lane % G, slab = lane / G;
      if (lane < G * Tr::kSlabs) {
        for (int i = 2 * first_owned; i < num_items; ++i) {
          const int blk = i >> 1, kv = i & 1;
          const int t = kv_begin + blk * kN + gi * box_rows;
          if (t < kv_end) {
            const int32_t page = __ldg(pages + t / page_size);
            TmaStore4d(&kv_map, tile_of(i) + slab * (kN * 128) + gi * box_rows * 128, 0,
                       h * Tr::kSlabs + slab, t % page_size, 2 * page + kv);
          }
        }
      }
      BulkCommit();
      if (cluster > 0) BulkWaitRead();  // the cluster epilogue reuses the ring (after a barrier)
    }
  }
  auto drain_stores = [&] {  // the pages are written before the grid completes
    if (stores && cwarp == 0) BulkWaitAll();
  };

  if (cluster > 0) {
    ClusterReduceEpilogue(p, it, h, cluster, row0, t4, o, smem);
    HSTU_ATTN_TRACE_AT(kTraceEnd, GlobalTimerNs());
    drain_stores();
    return;
  }

  // ---- The candidates' own keys (diagonal) of an unsplit tile (the reduction adds a split
  // tile's: here it would lengthen the tile's longest chunk) ----
  if (it.num_splits == 1 && it.q_local + it.num_q > num_new) {
    AddCandidateDiagonal<kD>(p, it, h, row0, t4, is_cand, o);
  }

  bf16* out = p.out + h * kD;
  if (it.num_splits == 1) {
    // Stage this warpgroup's bf16 rows in its half of s_q (only it reads those rows) for 16-byte
    // stores.
#pragma unroll
    for (int jn = 0; jn < kD / 8; ++jn) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * i;
        *reinterpret_cast<uint32_t*>(s_q + TileOffset<kM>(r, jn) + 4 * t4) =
            PackBf16x2(o[4 * jn + 2 * i], o[4 * jn + 2 * i + 1]);
      }
    }
    NamedBarrierSync(1 + cw, 128);
    const int rows = min(64, it.num_q - 64 * cw);
    for (int idx = wg_tid; idx < rows * kChunks; idx += 128) {
      const int r = 64 * cw + idx / kChunks, c = idx % kChunks;
      *reinterpret_cast<Bf16x8*>(out + static_cast<int64_t>(it.q_row + r) * hd + c * 8) =
          *reinterpret_cast<const Bf16x8*>(s_q + TileOffset<kM>(r, c));
    }
    HSTU_ATTN_TRACE_AT(kTraceEnd, GlobalTimerNs());
    drain_stores();
    return;
  }

  StorePartial<kD>(it, h, p.kv.num_heads, row0, t4, o, partials);
  HSTU_ATTN_TRACE_AT(kTraceEnd, GlobalTimerNs());
  drain_stores();
#else
  __trap();
#endif
}

}  // namespace hstu::cuda
