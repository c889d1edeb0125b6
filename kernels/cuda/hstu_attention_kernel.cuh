// The paged HSTU attention kernel (see hstu_attention.h for the work decomposition and
// docs/cuda_kernels.md for the design). One CTA = 4 warps = one (work item, head): 64 query rows
// against one chunk of history keys read straight from the pages, in blocks of 64 keys.
//
// Per key block: S = Q·Kᵀ (mma.sync m16n8k16, bf16 → fp32), P = SiLU(alpha·S)/N with the mask,
// rounded to bf16 in registers (the accumulator fragment of S is the A fragment of P·V), then
// O += P·V. Q, K and V tiles live in shared memory with a 16-byte-chunk XOR swizzle so ldmatrix
// is conflict-free. K of the next block is loaded (cp.async) while P·V of this one runs, and V
// while S runs (the FlashAttention-2 schedule).
#pragma once

#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hstu_attention.h"

namespace hstu::cuda {

template <int kD>
struct AttnTraits {
  static constexpr int kM = kAttnBlockM;
  static constexpr int kN = kAttnBlockN;
  static constexpr int kStages = 2;       // K/V of block j+1 load while block j computes
  static constexpr int kThreads = 128;
  static constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static constexpr int kNT = kN / 8;      // n-tiles of S per warp
  static constexpr int kK2 = kN / 16;     // k-steps of P·V
  static constexpr int kSSets = kD >= 256 ? 2 : 4;  // independent accumulator sets of S (registers)
  static_assert(kChunks >= 8, "the swizzle needs at least 8 chunks per row");
  static_assert(kM == 2 * kN, "the diagonal (self) block spans the two K/V stages");
  static constexpr int kSmemBytes = (kM + 2 * kStages * kN) * kD * 2 + kStages * kN * 8;
};

// Element offset of 16-byte chunk `c` of row `r` in a swizzled [rows, kD] bf16 tile.
template <int kD>
__device__ __forceinline__ int Swz(int r, int c) {
  return r * kD + ((c ^ (r & 7)) << 3);
}

template <int kD>
__global__ void __launch_bounds__(128, 2)
    HstuAttentionKernel(const AttentionParams<bf16> p, const AttentionWorkItem* __restrict__ items,
                        float* __restrict__ partials, int32_t* __restrict__ counters) {
  using Tr = AttnTraits<kD>;
  constexpr int kM = Tr::kM, kN = Tr::kN, kChunks = Tr::kChunks;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* s_q = reinterpret_cast<bf16*>(smem_raw);
  bf16* s_k0 = s_q + kM * kD;                    // [kStages][kN, kD]
  bf16* s_v0 = s_k0 + Tr::kStages * kN * kD;     // [kStages][kN, kD]
  int64_t* s_off = reinterpret_cast<int64_t*>(s_v0 + Tr::kStages * kN * kD);  // [kStages][kN]

  const AttentionWorkItem it = items[blockIdx.x];
  const int h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t hd = static_cast<int64_t>(p.kv.num_heads) * kD;
  const int b = it.user;
  const int hist = p.kv.num_tokens[b];
  const int num_new = p.num_new[b];
  const int first_new = hist - num_new;
  const int W = p.max_attn_len;
  const bf16* uvqk = p.uvqk;

  // Mask bounds of this thread's two rows (warp*16 + g and + 8): allowed keys lo..hi (inclusive).
  int lo[2], hi[2];
  bool is_cand[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
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
    CpAsync16(s_q + Swz<kD>(r, c), src, valid);
  }
  CpAsyncCommit();

  float o[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  const float alpha = p.alpha, inv_norm = p.inv_norm;

  // S = Q·Kᵀ over the whole head dim, for this warp's 16 rows × kN keys of stage s_k. The head dim
  // is split over kSets independent accumulator sets (summed at the end): with one set every mma
  // waits for the previous one on the same tile, and S is latency-bound.
  auto compute_s = [&](float (&s)[Tr::kNT][4], const bf16* s_k) {
    constexpr int kSets = Tr::kSSets;
    float acc[kSets][Tr::kNT][4];
#pragma unroll
    for (int q = 0; q < kSets; ++q)
#pragma unroll
      for (int i = 0; i < Tr::kNT; ++i) acc[q][i][0] = acc[q][i][1] = acc[q][i][2] = acc[q][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[4];
      LdMatrixX4(a, s_q + Swz<kD>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
      for (int n2 = 0; n2 < Tr::kNT / 2; ++n2) {
        uint32_t bk[4];
        LdMatrixX4(bk, s_k + Swz<kD>(n2 * 16 + (lane & 7) + ((lane >> 4) << 3),
                                     kk * 2 + ((lane >> 3) & 1)));
        MmaBf16(acc[kk % kSets][2 * n2], a, bk[0], bk[1]);
        MmaBf16(acc[kk % kSets][2 * n2 + 1], a, bk[2], bk[3]);
      }
    }
#pragma unroll
    for (int i = 0; i < Tr::kNT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = acc[0][i][e];
#pragma unroll
        for (int q = 1; q < kSets; ++q) v += acc[q][i][e];
        s[i][e] = v;
      }
    }
  };
  // O += P·V with P as A fragments: pa[k2] covers keys 16*k2 .. 16*k2+15 of stage s_v.
  auto accumulate_pv = [&](const uint32_t (&pa)[Tr::kK2][4], const bf16* s_v) {
#pragma unroll
    for (int k2 = 0; k2 < Tr::kK2; ++k2) {
#pragma unroll
      for (int d2 = 0; d2 < kD / 16; ++d2) {
        uint32_t bv[4];
        LdMatrixX4Trans(bv, s_v + Swz<kD>(k2 * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                          d2 * 2 + (lane >> 4)));
        MmaBf16(o[2 * d2], pa[k2], bv[0], bv[1]);
        MmaBf16(o[2 * d2 + 1], pa[k2], bv[2], bv[3]);
      }
    }
  };
  // P = SiLU(alpha S) / N where allowed(row i, key column j) holds, packed to bf16 A fragments.
  auto make_p = [&](const float (&s)[Tr::kNT][4], uint32_t (&pa)[Tr::kK2][4], auto allowed) {
    float pv[Tr::kNT][4];
#pragma unroll
    for (int n = 0; n < Tr::kNT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * t4 + (e & 1);
        const float v = Silu(alpha * s[n][e]) * inv_norm;
        pv[n][e] = allowed(e >> 1, col) ? v : 0.f;
      }
    }
#pragma unroll
    for (int k2 = 0; k2 < Tr::kK2; ++k2) {
      pa[k2][0] = PackBf16x2(pv[2 * k2][0], pv[2 * k2][1]);
      pa[k2][1] = PackBf16x2(pv[2 * k2][2], pv[2 * k2][3]);
      pa[k2][2] = PackBf16x2(pv[2 * k2 + 1][0], pv[2 * k2 + 1][1]);
      pa[k2][3] = PackBf16x2(pv[2 * k2 + 1][2], pv[2 * k2 + 1][3]);
    }
  };

  // ---- The candidates' own keys (diagonal), split 0 of a tile that has candidates ----
  // The tile's 64 own K/V rows fill both stages (rows 0..31 in stage 0, 32..63 in stage 1).
  if (it.split == 0 && it.q_local + it.num_q > num_new) {
    for (int idx = tid; idx < kM * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = r < it.num_q;
      const bf16* row =
          uvqk + static_cast<int64_t>(it.q_row + (valid ? r : 0)) * p.uvqk_row_stride + h * kD + c * 8;
      CpAsync16(s_k0 + Swz<kD>(r, c), row + kK * hd, valid);  // r ≥ kN lands in stage 1
      CpAsync16(s_v0 + Swz<kD>(r, c), row + kV * hd, valid);
    }
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      float s[Tr::kNT][4];
      compute_s(s, s_k0 + half * kN * kD);
      uint32_t pa[Tr::kK2][4];
      make_p(s, pa, [&](int i, int col) {
        return is_cand[i] && col + half * kN == warp * 16 + g + 8 * i;
      });
      accumulate_pv(pa, s_v0 + half * kN * kD);
    }
    __syncthreads();  // the stages are reused by the paged blocks
  }

  // ---- History keys from the pages ----
  const int kv_begin = it.kv_begin, kv_end = it.kv_end;
  const int num_blocks = (kv_end - kv_begin + kN - 1) / kN;
  const int32_t* pages = p.kv.page_ids + p.kv.indptr[b];
  const int page_size = p.kv.page_size;
  const int64_t head_off = static_cast<int64_t>(h) * kD;
  const int64_t slot_stride = hd;  // elements between slots of a page
  // Offsets of the K rows of a block; the page id is loaded early and stored late (after the block's
  // math) so that its latency hides behind the tensor-core work.
  auto page_of = [&](int t) -> int32_t { return t < kv_end ? __ldg(pages + t / page_size) : -1; };
  auto offset_of = [&](int t, int32_t page) -> int64_t {
    return page < 0 ? int64_t{-1}
                    : page * p.kv.page_stride + (t % page_size) * slot_stride + head_off;
  };
  auto load_kv = [&](int stage) {
    const int64_t* offs = s_off + stage * kN;
    bf16* s_k = s_k0 + stage * kN * kD;
    bf16* s_v = s_v0 + stage * kN * kD;
#pragma unroll 2
    for (int idx = tid; idx < kN * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int64_t off = offs[r];
      const bf16* src = p.kv.base + (off >= 0 ? off + c * 8 : 0);
      CpAsync16(s_k + Swz<kD>(r, c), src, off >= 0);
      CpAsync16(s_v + Swz<kD>(r, c), src + (off >= 0 ? p.kv.kv_stride : 0), off >= 0);
    }
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
    __syncthreads();  // KV(j) (and Q) landed; every warp is done with the other stage and s_off
    if (j + 1 < num_blocks) load_kv(stage ^ 1);
    // Page of this thread's key row of block j + 2 (its slot in s_off is free after the barrier).
    const int t2 = kstart + 2 * kN + tid;
    const int32_t page2 = (j + 2 < num_blocks && tid < kN) ? page_of(t2) : -1;

    float s[Tr::kNT][4];
    compute_s(s, s_k0 + stage * kN * kD);
    const int klast = kstart + kN - 1;
    const bool full = klast < kv_end && klast <= hi[0] && klast <= hi[1] && kstart >= lo[0] &&
                      kstart >= lo[1];
    uint32_t pa[Tr::kK2][4];
    if (__all_sync(0xffffffffu, full)) {
      make_p(s, pa, [](int, int) { return true; });
    } else {
      make_p(s, pa, [&](int i, int col) {
        const int key = kstart + col;
        return key < kv_end && key <= hi[i] && key >= lo[i];
      });
    }
    accumulate_pv(pa, s_v0 + stage * kN * kD);
    if (j + 2 < num_blocks && tid < kN) s_off[stage * kN + tid] = offset_of(t2, page2);
  }

  bf16* out = p.out + h * kD;
  if (it.num_splits == 1) {
    // Stage the bf16 tile in s_q (free once every warp is past its last S) for 16-byte stores.
    CpAsyncWait<0>();
    __syncthreads();
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = warp * 16 + g + 8 * i;
        *reinterpret_cast<uint32_t*>(s_q + Swz<kD>(r, n) + 2 * t4) =
            PackBf16x2(o[n][2 * i], o[n][2 * i + 1]);
      }
    }
    __syncthreads();
    for (int idx = tid; idx < it.num_q * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      *reinterpret_cast<Bf16x8*>(out + static_cast<int64_t>(it.q_row + r) * hd + c * 8) =
          *reinterpret_cast<const Bf16x8*>(s_q + Swz<kD>(r, c));
    }
    return;
  }

  // Split tile: write this chunk's fp32 partial; the last chunk to finish sums them in order.
  const int num_heads = p.kv.num_heads;
  float* part = partials + (static_cast<int64_t>(it.partial_base + it.split) * num_heads + h) * kM * kD;
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp * 16 + g + 8 * i;
      if (r < it.num_q) {
        *reinterpret_cast<float2*>(part + r * kD + n * 8 + 2 * t4) =
            make_float2(o[n][2 * i], o[n][2 * i + 1]);
      }
    }
  }
  __threadfence();
  __syncthreads();
  __shared__ int s_last;
  if (tid == 0) {
    const int done = atomicAdd(counters + it.tile * num_heads + h, 1);
    s_last = done == it.num_splits - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const float* first = partials + (static_cast<int64_t>(it.partial_base) * num_heads + h) * kM * kD;
  const int64_t split_stride = static_cast<int64_t>(num_heads) * kM * kD;
  // Every thread owns kIters float4 of the tile and issues all of a split's loads before adding,
  // so the reduction costs about one L2 round trip per split (a loop of dependent loads would cost
  // one per element and split).
  constexpr int kIters = kM * kD / 4 / Tr::kThreads;
  float4 acc[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < it.num_splits; ++s) {
    const float4* src = reinterpret_cast<const float4*>(first + s * split_stride);
    float4 v[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int idx = tid + i * Tr::kThreads;
      v[i] = idx / (kD / 4) < it.num_q ? __ldcg(src + idx) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      acc[i].x += v[i].x; acc[i].y += v[i].y; acc[i].z += v[i].z; acc[i].w += v[i].w;
    }
  }
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = tid + i * Tr::kThreads;
    const int r = idx / (kD / 4), c = (idx % (kD / 4)) * 4;
    if (r < it.num_q) {
      uint2 packed;
      packed.x = PackBf16x2(acc[i].x, acc[i].y);
      packed.y = PackBf16x2(acc[i].z, acc[i].w);
      *reinterpret_cast<uint2*>(out + static_cast<int64_t>(it.q_row + r) * hd + c) = packed;
    }
  }
  if (tid == 0) counters[it.tile * num_heads + h] = 0;
}

}  // namespace hstu::cuda
