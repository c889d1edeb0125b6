// The paged HSTU attention kernel for Hopper (sm_90a; see hstu_attention.h for the work
// decomposition and docs/cuda_kernels.md for the design). One CTA = 2 warpgroups = one (work item,
// head): 128 query rows (64 per warpgroup) against one chunk of history keys read straight from the
// pages, in blocks of 64 keys.
//
// Per key block: S = Q·Kᵀ with wgmma (Q and K from shared memory), P = SiLU(alpha·S)/N with the mask
// in registers, rounded to bf16 (the accumulator layout of S is the register A layout of the next
// wgmma), then O += P·V with wgmma (P from registers, V from shared memory, transposed). K/V of block
// j+1 are gathered from the pages with cp.async (16-byte row pieces, any page size; warp w copies
// rows 8w..8w+7) while block j computes. Both warpgroups share the K/V tiles (one barrier per block). A candidate's own key (the diagonal) is added in fp32 at the end, from the uvqk rows.
#pragma once

#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/hstu_attention_wgmma.cuh"

namespace hstu::cuda {

template <int kD>
struct AttnTraits {
  static constexpr int kM = kAttnBlockM;   // 128 query rows: 64 per warpgroup
  static constexpr int kN = kAttnBlockN;   // 64 keys per block
  static constexpr int kStages = 2;        // K/V of block j+1 load while block j computes
  static constexpr int kThreads = 256;     // 2 warpgroups
  static constexpr int kChunks = kD / 8;   // 16-byte chunks per row
  static constexpr int kSlabs = kD / 64;   // 128-byte (64-element) column slabs of a tile
  static constexpr int kMinBlocks = kD >= 256 ? 1 : 2;
  static constexpr int kQBytes = kM * kD * 2;
  static constexpr int kKvBytes = kN * kD * 2;  // one K or V stage
  static constexpr int kOffBytes = 3 * kN * 8;  // row offsets of up to 3 key blocks
  // 1 KB of slack to align the tiles to the 1024-byte swizzle atoms.
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kKvBytes + kOffBytes;
  static_assert(kD % 64 == 0, "head dim must be a multiple of 64 (128-byte swizzle slabs)");
  static_assert(kM == 128 && kN == 64, "the warpgroup tiling assumes 128 x 64 blocks");
};

// Byte offset of 16-byte chunk `c` (0 .. kD/8-1) of row `r` in a [kRows, kD] bf16 tile stored as
// kD/64 slabs of [kRows, 64] with the 128-byte swizzle (chunk ^ row % 8) that wgmma expects.
template <int kRows>
__device__ __forceinline__ uint32_t TileOffset(int r, int c) {
  return (c >> 3) * (kRows * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// SiLU(x) for x = alpha·s, as u + u·tanh u with u = x/2 (the warp-specialised kernel applies 1/N to
// O after its loop instead).
__device__ __forceinline__ float SiluHalf(float s, float half_alpha) {
  const float u = s * half_alpha;
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  return fmaf(u, t, u);
}

// P = SiLU(x) / N for x = alpha·s, as u·(1 + tanh u) / N with u = x/2: one MUFU op (tanh.approx,
// relative error ~2^-11, below the bf16 rounding of P that follows).
__device__ __forceinline__ float SiluScaled(float s, float half_alpha, float inv_norm) {
  const float u = s * half_alpha;
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  const float c = u * inv_norm;
  return fmaf(c, t, c);
}

// ---- Shared by both attention kernels ----
// A thread holds two query rows of its warpgroup's wgmma accumulator, row0 and row0 + 8 of the
// tile, and in each 8-column group jn the columns 8·jn + 2·t4 + {0, 1}: o[4·jn + 2·i + {0, 1}].

// The candidates' own keys (the diagonal) of an unsplit tile with candidates, added at the end of
// its CTA (HstuAttentionReduceKernel adds a split tile's): p_ii = SiLU(alpha q_i·k_i)/N,
// o_i += p_ii v_i, in fp32 from the uvqk row. The loads of a row are issued together: q and k as
// the row's 16-byte chunks t4, t4 + 4, ... (the 4 threads of a quad cover the row; two shuffles
// reduce the dot product), v at this thread's own accumulator columns.
template <int kD>
__device__ __forceinline__ void AddCandidateDiagonal(const AttentionParams<bf16>& p,
                                                     const AttentionWorkItem& it, int h, int row0,
                                                     int t4, const bool (&is_cand)[2],
                                                     float (&o)[kD / 2]) {
  constexpr int kGroups = kD / 8;     // 8-column groups (16-byte chunks) of a row
  constexpr int kOwn = kGroups / 4;   // chunks of q and k this thread reduces
  const int64_t hd = static_cast<int64_t>(p.kv.num_heads) * kD;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = min(row0 + 8 * i, it.num_q - 1);
    const bf16* row = p.uvqk + static_cast<int64_t>(it.q_row + r) * p.uvqk_row_stride + h * kD;
    Bf16x8 q[kOwn], k[kOwn];
    uint32_t v[kGroups];
#pragma unroll
    for (int c = 0; c < kOwn; ++c) {
      q[c] = Ldg8(row + kQ * hd + 8 * (4 * c + t4));
      k[c] = Ldg8(row + kK * hd + 8 * (4 * c + t4));
    }
#pragma unroll
    for (int jn = 0; jn < kGroups; ++jn) {
      v[jn] = __ldg(reinterpret_cast<const unsigned int*>(row + kV * hd + 8 * jn + 2 * t4));
    }
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < kOwn; ++c) dot = Dot8(q[c], k[c], dot);
    dot += __shfl_xor_sync(0xffffffffu, dot, 1);
    dot += __shfl_xor_sync(0xffffffffu, dot, 2);
    const float pd = is_cand[i] ? Silu(p.alpha * dot) * p.inv_norm : 0.f;
#pragma unroll
    for (int jn = 0; jn < kGroups; ++jn) {
      const float2 vf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[jn]));
      o[4 * jn + 2 * i] = fmaf(pd, vf.x, o[4 * jn + 2 * i]);
      o[4 * jn + 2 * i + 1] = fmaf(pd, vf.y, o[4 * jn + 2 * i + 1]);
    }
  }
}

// A split tile's fp32 partial of this chunk (HstuAttentionReduceKernel sums them): rows past the
// tile's end are not written.
template <int kD>
__device__ __forceinline__ void StorePartial(const AttentionWorkItem& it, int h, int num_heads,
                                             int row0, int t4, const float (&o)[kD / 2],
                                             float* __restrict__ partials) {
  float* part = partials + (static_cast<int64_t>(it.partial_base + it.split) * num_heads + h) *
                               kAttnBlockM * kD;
#pragma unroll
  for (int jn = 0; jn < kD / 8; ++jn) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row0 + 8 * i;
      if (r < it.num_q) {
        __stcg(reinterpret_cast<float2*>(part + r * kD + jn * 8 + 2 * t4),
               make_float2(o[4 * jn + 2 * i], o[4 * jn + 2 * i + 1]));
      }
    }
  }
}

template <int kD>
__global__ void __launch_bounds__(256, AttnTraits<kD>::kMinBlocks)
    HstuAttentionKernel(const AttentionParams<bf16> p, const AttentionWorkItem* __restrict__ items,
                        float* __restrict__ partials) {
#ifdef HSTU_WGMMA_ENABLED
  WaitForPredecessor();  // launched dependent on the kernel before it (LaunchDependent)
  AllowDependents();

  using Tr = AttnTraits<kD>;
  constexpr int kM = Tr::kM, kN = Tr::kN, kChunks = Tr::kChunks;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  unsigned char* smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  unsigned char* s_q = smem;                                   // [kSlabs][kM][64]
  unsigned char* s_k0 = s_q + Tr::kQBytes;                     // [kStages][kSlabs][kN][64]
  unsigned char* s_v0 = s_k0 + Tr::kStages * Tr::kKvBytes;     // [kStages][kSlabs][kN][64]
  int64_t* s_off = reinterpret_cast<int64_t*>(s_v0 + Tr::kStages * Tr::kKvBytes);  // [kStages][kN]
  const uint32_t q_addr = SmemAddr(s_q), k_addr = SmemAddr(s_k0), v_addr = SmemAddr(s_v0);

  // Block x = item * H + head: the heads of an item launch together, in the plan's order.
  const AttentionWorkItem it = items[blockIdx.x / p.kv.num_heads];
  const int h = blockIdx.x % p.kv.num_heads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2;  // warpgroup: query rows 64*wg .. 64*wg+63
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t hd = static_cast<int64_t>(p.kv.num_heads) * kD;
  const int b = it.user;
  const int hist = p.kv.num_tokens[b];
  const int num_new = p.num_new[b];
  const int first_new = hist - num_new;
  const int W = p.max_attn_len;
  const bf16* uvqk = p.uvqk;

  // Mask bounds of this thread's two rows (row0 and row0 + 8): allowed keys lo..hi (inclusive).
  const int row0 = warp * 16 + g;  // = 64*wg + 16*(warp%4) + g
  int lo[2], hi[2];
  bool is_cand[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row0 + 8 * i;
    const int local = it.q_local + r;
    is_cand[i] = r < it.num_q && local >= num_new;
    const int qid = local >= num_new ? hist : first_new + local;
    hi[i] = r < it.num_q ? (local >= num_new ? hist - 1 : qid) : -1;
    lo[i] = W > 0 ? qid - W : INT_MIN;
  }

  // ---- Q tile ----
  for (int idx = tid; idx < kM * kChunks; idx += Tr::kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < it.num_q;
    const bf16* src = uvqk + static_cast<int64_t>(it.q_row + (valid ? r : 0)) * p.uvqk_row_stride +
                      kQ * hd + h * kD + c * 8;
    CpAsync16(s_q + TileOffset<kM>(r, c), src, valid);
  }
  CpAsyncCommit();

  float o[kD / 2];  // this warpgroup's O[64, kD] in the wgmma accumulator layout
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;

  const float half_alpha = 0.5f * p.alpha, inv_norm = p.inv_norm;

  // ---- History keys from the pages ----
  const int kv_begin = it.kv_begin, kv_end = it.kv_end;
  const int num_blocks = (kv_end - kv_begin + kN - 1) / kN;
  const int32_t* pages = p.kv.page_ids + p.kv.indptr[b];
  const int page_size = p.kv.page_size;
  const int64_t head_off = static_cast<int64_t>(h) * kD;
  // Offsets of the K rows of a block; the page id is loaded early and stored late (after the block's
  // math) so that its latency hides behind the tensor-core work.
  auto page_of = [&](int t) -> int32_t { return t < kv_end ? __ldg(pages + t / page_size) : -1; };
  auto offset_of = [&](int t, int32_t page) -> int64_t {
    return page < 0 ? int64_t{-1} : page * p.kv.page_stride + (t % page_size) * hd + head_off;
  };
  // Gather of one 64-key block into the swizzled tile: warp w copies rows 8w .. 8w+7, lane = one
  // 16-byte chunk (D = 256: one row per instruction; D = 128/64: 2/4 rows). The 8 row offsets of a
  // thread are read from s_off before its first copy, and the per-lane source base is fixed, so each
  // copy costs a 64-bit add, a compare and the cp.async.
  constexpr int kRowsPerInstr = 32 / kChunks;         // 1, 2, 4
  constexpr int kInstr = 8 / kRowsPerInstr;           // copies per warp per tile: 8, 4, 2
  const int g_c = lane % kChunks;
  const int g_r0 = warp * 8 + lane / kChunks;          // first row of this thread; + kRowsPerInstr*i
  const bf16* const g_src = p.kv.base + g_c * 8;
  auto gather_kv = [&](const int64_t* offs, unsigned char* k_tile, unsigned char* v_tile) {
    int64_t off[kInstr];
#pragma unroll
    for (int i = 0; i < kInstr; ++i) off[i] = offs[g_r0 + kRowsPerInstr * i];
#pragma unroll
    for (int i = 0; i < kInstr; ++i) {
      const int r = g_r0 + kRowsPerInstr * i;
      const int64_t o = off[i];
      const uint32_t dst = TileOffset<kN>(r, g_c);
      CpAsync16(k_tile + dst, g_src + (o >= 0 ? o : 0), o >= 0);
      CpAsync16(v_tile + dst, g_src + (o >= 0 ? o + p.kv.kv_stride : 0), o >= 0);
    }
  };

  // Masked P = SiLU(alpha·S)/N of the key block starting at kstart, packed to bf16 in the register-A
  // layout of the P·V wgmma.
  auto silu_pack = [&](const float (&s)[kN / 2], int kstart, uint32_t (&pa)[kN / 16][4]) {
    const int klast = kstart + kN - 1;
    const bool full = klast < kv_end && klast <= hi[0] && klast <= hi[1] && kstart >= lo[0] &&
                      kstart >= lo[1];
    float pv[kN / 2];
    if (__all_sync(0xffffffffu, full)) {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) pv[e] = SiluScaled(s[e], half_alpha, inv_norm);
    } else {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) {
        const int i = (e >> 1) & 1;
        const int key = kstart + (e >> 2) * 8 + 2 * t4 + (e & 1);
        const bool ok = key < kv_end && key <= hi[i] && key >= lo[i];
        pv[e] = ok ? SiluScaled(s[e], half_alpha, inv_norm) : 0.f;
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

  // Descriptors. Q and K are K-major (rows of the head dim): one wgmma covers 16 columns = 32 bytes
  // of a 128-byte slab row, 8-row groups 1024 bytes apart. V is read transposed (MN-major): the
  // 64-column slabs are kN*128 bytes apart (leading offset), 8-key groups 1024 bytes apart.
  const uint32_t q_wg_addr = q_addr + wg * 64 * 128;
  auto issue_s = [&](float (&s)[kN / 2], uint32_t ks_addr) {
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) s[e] = 0.f;
    FenceRegs(s);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t col = (kk & 3) * 32;  // byte offset of columns 16*kk.. inside the slab row
      WgmmaSS_m64n64k16(s, MakeSmemDesc(q_wg_addr + (kk >> 2) * (kM * 128) + col, 16, 1024),
                        MakeSmemDesc(ks_addr + (kk >> 2) * (kN * 128) + col, 16, 1024), 1);
    }
    WgmmaCommit();
  };
  auto issue_pv = [&](const uint32_t (&pa)[kN / 16][4], uint32_t vs_addr) {
    WgmmaFence();
#pragma unroll
    for (int k2 = 0; k2 < kN / 16; ++k2) {
      WgmmaRS<kD>(o, pa[k2], MakeSmemDesc(vs_addr + k2 * 16 * 128, kN * 128, 1024));
    }
    WgmmaCommit();
  };

  auto load_kv = [&](int stage) {
    gather_kv(s_off + stage * kN, s_k0 + stage * Tr::kKvBytes, s_v0 + stage * Tr::kKvBytes);
    CpAsyncCommit();
  };
  if (num_blocks > 0) {
    if (tid < kN) s_off[tid] = offset_of(kv_begin + tid, page_of(kv_begin + tid));
    if (num_blocks > 1 && tid < kN) {
      s_off[kN + tid] = offset_of(kv_begin + kN + tid, page_of(kv_begin + kN + tid));
    }
    __syncthreads();
    load_kv(0);
  }
  for (int j = 0; j < num_blocks; ++j) {
    const int kstart = kv_begin + j * kN;
    const int stage = j & 1;
    CpAsyncWait<0>();
    FenceProxyAsync();
    __syncthreads();  // KV(j) (and Q) landed; every warp is done with the other stage and s_off
    if (j + 1 < num_blocks) load_kv(stage ^ 1);
    // Page of this thread's key row of block j + 2 (its slot in s_off is free after the barrier).
    const int t2 = kstart + 2 * kN + tid;
    const int32_t page2 = (j + 2 < num_blocks && tid < kN) ? page_of(t2) : -1;
    float s[kN / 2];
    issue_s(s, k_addr + stage * Tr::kKvBytes);
    WgmmaWait<0>();
    FenceRegs(s);
    uint32_t pa[kN / 16][4];
    silu_pack(s, kstart, pa);
    issue_pv(pa, v_addr + stage * Tr::kKvBytes);
    WgmmaWait<0>();
    FenceRegs(o);
    if (j + 2 < num_blocks && tid < kN) s_off[stage * kN + tid] = offset_of(t2, page2);
  }

  // ---- The candidates' own keys (diagonal) of an unsplit tile (the reduction adds a split
  // tile's: here it would lengthen the tile's longest chunk) ----
  if (it.num_splits == 1 && it.q_local + it.num_q > num_new) {
    AddCandidateDiagonal<kD>(p, it, h, row0, t4, is_cand, o);
  }

  bf16* out = p.out + h * kD;
  if (it.num_splits == 1) {
    // Stage the bf16 tile in s_q (free once every warp is past its last S) for 16-byte stores.
    CpAsyncWait<0>();
    __syncthreads();
#pragma unroll
    for (int jn = 0; jn < kD / 8; ++jn) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * i;
        *reinterpret_cast<uint32_t*>(s_q + TileOffset<kM>(r, jn) + 4 * t4) =
            PackBf16x2(o[4 * jn + 2 * i], o[4 * jn + 2 * i + 1]);
      }
    }
    __syncthreads();
    for (int idx = tid; idx < it.num_q * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      *reinterpret_cast<Bf16x8*>(out + static_cast<int64_t>(it.q_row + r) * hd + c * 8) =
          *reinterpret_cast<const Bf16x8*>(s_q + TileOffset<kM>(r, c));
    }
    return;
  }

  // Split tile: write this chunk's fp32 partial; HstuAttentionReduceKernel sums them.
  StorePartial<kD>(it, h, p.kv.num_heads, row0, t4, o, partials);
#else
  __trap();  // built for an architecture without wgmma; the launcher refuses non-sm_90 devices
#endif
}

// Sums the fp32 partials of every split tile in split order (deterministic), adds the candidates'
// own keys (the diagonal: p_ii = SiLU(alpha q_i·k_i)/N times v_i, from the uvqk rows; the attention
// kernels leave it out of a split tile, where it would sit on the longest chunk's critical path) and
// writes bf16. Grid: (HstuAttentionReduceGridX, 1, kAttnBlockM / kReduceRows); items[t] is split 0
// of split tile t (PlanHstuAttention orders them first), block x = t * H + head. Every load of a
// block is issued before the first is used.
inline constexpr int kReduceRows = 8;

template <int kD>
__global__ void __launch_bounds__(256)
    HstuAttentionReduceKernel(const AttentionWorkItem* __restrict__ items,
                              const float* __restrict__ partials, const AttentionParams<bf16> p) {
  // Launched dependent on the attention kernel (LaunchDependent): the metadata (work item, token
  // counts; written by a copy before the step's first kernel) is read before the wait, the
  // partials and uvqk rows after it.
  AllowDependents();
  const int num_heads = p.kv.num_heads;
  const AttentionWorkItem it = items[blockIdx.x / num_heads];
  // A graph's block for a plan without split tiles (unsplit items and cluster plans: tile < 0).
  // It returns before WaitForPredecessor; the next kernel's wait still covers the attention
  // (common.cuh, tests/gpu/pdl_test.cu).
  if (it.tile < 0 || it.split != 0) return;
  const int h = blockIdx.x % num_heads;
  const int row_begin = blockIdx.z * kReduceRows;
  if (row_begin >= it.num_q) return;
  constexpr int kVec = kReduceRows * kD / 4;     // float4 per block
  constexpr int kPer = (kVec + 255) / 256;       // float4 per thread
  static_assert(kD / 8 <= 32 && kReduceRows == 8, "a warp per row, a lane per 16-byte chunk");
  const int64_t hd = static_cast<int64_t>(num_heads) * kD;
  const int num_new = p.num_new[it.user];
  const bool has_cand = it.q_local + it.num_q > num_new;  // block-uniform
  const bf16* rows = p.uvqk + static_cast<int64_t>(it.q_row) * p.uvqk_row_stride + h * kD;
  WaitForPredecessor();

  // The diagonal's q and k: warp w takes row row_begin + w, lane l its 16-byte chunk l.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool dcand = has_cand && row_begin + warp < it.num_q &&
                     it.q_local + row_begin + warp >= num_new;  // warp-uniform
  Bf16x8 dq{}, dk{};  // zeros: lanes past the row add nothing
  if (dcand && lane < kD / 8) {
    const bf16* row = rows + static_cast<int64_t>(row_begin + warp) * p.uvqk_row_stride;
    dq = Ldg8(row + kQ * hd + 8 * lane);
    dk = Ldg8(row + kK * hd + 8 * lane);
  }
  // This thread's 4 columns of v of each of its candidate rows.
  bool valid[kPer];
  uint2 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = threadIdx.x + i * 256;
    const int r = row_begin + idx / (kD / 4);
    valid[i] = idx < kVec && r < it.num_q;
    v[i] = make_uint2(0u, 0u);
    if (has_cand && valid[i] && it.q_local + r >= num_new) {
      v[i] = __ldg(reinterpret_cast<const uint2*>(rows + static_cast<int64_t>(r) * p.uvqk_row_stride +
                                                  kV * hd + (idx % (kD / 4)) * 4));
    }
  }
  // The partials, 8 splits' loads in flight.
  const int64_t split_stride = static_cast<int64_t>(num_heads) * kAttnBlockM * kD;
  const float* first = partials + (static_cast<int64_t>(it.partial_base) * num_heads + h) *
                                      kAttnBlockM * kD + row_begin * kD;
  float4 acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int s = 0; s < it.num_splits; ++s) {
    const float4* src = reinterpret_cast<const float4*>(first + s * split_stride);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (valid[i]) {
        const float4 pv = __ldcg(src + threadIdx.x + i * 256);
        acc[i].x += pv.x; acc[i].y += pv.y; acc[i].z += pv.z; acc[i].w += pv.w;
      }
    }
  }

  // The diagonal's weights p_ii of the block's candidate rows.
  __shared__ float s_pd[kReduceRows];
  if (has_cand) {
    const float dot = WarpSum(Dot8(dq, dk, 0.f));
    if (lane == 0) s_pd[warp] = dcand ? Silu(p.alpha * dot) * p.inv_norm : 0.f;
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (!valid[i]) continue;
    const int idx = threadIdx.x + i * 256;
    const int r = row_begin + idx / (kD / 4), c = (idx % (kD / 4)) * 4;
    if (has_cand && it.q_local + r >= num_new) {
      const float pd = s_pd[r - row_begin];
      const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[i].x));
      const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[i].y));
      acc[i].x = fmaf(pd, v01.x, acc[i].x);
      acc[i].y = fmaf(pd, v01.y, acc[i].y);
      acc[i].z = fmaf(pd, v23.x, acc[i].z);
      acc[i].w = fmaf(pd, v23.y, acc[i].w);
    }
    uint2 packed;
    packed.x = PackBf16x2(acc[i].x, acc[i].y);
    packed.y = PackBf16x2(acc[i].z, acc[i].w);
    *reinterpret_cast<uint2*>(p.out + static_cast<int64_t>(it.q_row + r) * hd + h * kD + c) = packed;
  }
}

}  // namespace hstu::cuda
