// Bias + SiLU of the UVQK GEMM output, in place, fused with the append of the new history rows' K
// and V into their pages: one pass over the uvqk rows instead of two kernels, the append no longer
// reading back what bias + SiLU has just written. The attention reads history K/V from the pages
// and a candidate's own K/V from its row, so a new history row's v and k are written to its page
// slot and not back to the row (whose v and k columns then keep the GEMM output); u, q and every
// column of the other rows are written back in place, bit for bit what LaunchBiasSilu writes.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

// A warp takes a segment of 512 columns of one row (2 groups of 8 a lane). On an H200 this beat
// 1024 and 256 columns (4 and 1 groups a lane) at batch 1 and 8 of the decode step by 0.3–0.9 µs:
// more warps hide the SiLU's MUFU work and the page lookup better than more bytes per warp.
constexpr int kWarps = 4;       // warps per block
constexpr int kLaneGroups = 2;  // 8-column groups per lane of one segment
constexpr int kSegCols = kLaneGroups * 32 * 8;

// The user owning row r: the last b < B with row_offsets[b] <= r, i.e. (row_offsets being
// non-decreasing from 0) the number of b in [1, B) with row_offsets[b] <= r. Counted 32 users a
// step with a ballot, so up to 33 users cost one load instead of log2(B) dependent ones.
// Warp-uniform r; call from all lanes.
__device__ __forceinline__ int RowOwner(const int32_t* __restrict__ row_offsets, int num_users,
                                        int r, int lane) {
  int b = 0;
  for (int base = 1; base < num_users; base += 32) {
    const int l = base + lane;
    const unsigned below = __ballot_sync(0xffffffffu, l < num_users && row_offsets[l] <= r);
    b += __popc(below);
    if (below != 0xffffffffu) break;
  }
  return b;
}

// Warp w of the grid takes segment w % segs_per_row of row w / segs_per_row; lane l holds columns
// seg·kSegCols + 256k + 8l (k < kLaneGroups), so each of the warp's steps moves 512 contiguous
// bytes.
// All of a lane's loads are issued before the page lookup, whose few dependent (cached) loads of
// the batch metadata then hide behind them. x: [rows, cols] bf16, row stride cols; bias: [cols].
// kAppend: cols = 4·H·D (u | v | q | k); a row that is a new history row of its user (the same
// search as the attention's: last user b with row_offsets[b] <= r) also writes its v and k
// columns to the K and V blocks of its page slot, which for one token are H·D contiguous elements.
// Rows at or past row_offsets[B] (padding) belong to no user's new rows and are never appended.
template <bool kAppend>
__global__ void __launch_bounds__(kWarps * 32)
    BiasSiluAppendKvKernel(bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t segs_per_row,
                           const float* __restrict__ bias, AppendKvParams<bf16> p) {
  WaitForPredecessor();  // launched dependent on the kernel before it (LaunchDependent)
  AllowDependents();
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t r = warp / segs_per_row;
  if (r >= rows) return;
  const int64_t seg_begin = (warp - r * segs_per_row) * kSegCols;
  const int64_t col0 = seg_begin + lane * 8;
  bf16* row = x + r * cols;
  Bf16x8 in[kLaneGroups];
#pragma unroll
  for (int k = 0; k < kLaneGroups; ++k) {
    const int64_t c = col0 + k * 256;
    if (c < cols) in[k] = *reinterpret_cast<const Bf16x8*>(row + c);
  }

  const int64_t hd = cols / 4;
  bf16* k_dst = nullptr;  // K of row r's page slot when r is a new history row; V is kv_stride on
  if constexpr (kAppend) {
    const int64_t seg_end = seg_begin + kSegCols;
    const bool has_kv = (seg_begin < (kV + 1) * hd && seg_end > kV * hd) || seg_end > kK * hd;
    if (has_kv && p.kv.batch_size > 0) {
      const int ri = static_cast<int>(r);
      const int b = RowOwner(p.row_offsets, p.kv.batch_size, ri, lane);
      // Independent loads, issued together; then the page id.
      const int first = p.row_offsets[b], num_new = p.num_new[b];
      const int num_tokens = p.kv.num_tokens[b], page_idx = p.kv.indptr[b];
      const int i = ri - first;
      if (i < num_new) {
        const int t = num_tokens - num_new + i;
        k_dst = p.kv.base + p.kv.SlotOffset(p.kv.page_ids[page_idx + t / p.kv.page_size], t, 0);
      }
    }
  }

#pragma unroll
  for (int k = 0; k < kLaneGroups; ++k) {
    const int64_t c = col0 + k * 256;
    if (c < cols) {
      float v[8], bv[8];
      Unpack8(in[k], v);
      Load8(bias + c, bv);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = Silu(v[i] + bv[i]);
      const Bf16x8 out = Pack8(v);
      // An appended row's v and k go to its page slot only: nothing reads them from the row (the
      // attention takes history K/V from the pages), so writing them back would only cost bytes.
      if (kAppend && k_dst != nullptr && c >= kK * hd) {
        *reinterpret_cast<Bf16x8*>(k_dst + (c - kK * hd)) = out;
      } else if (kAppend && k_dst != nullptr && c >= kV * hd && c < (kV + 1) * hd) {
        *reinterpret_cast<Bf16x8*>(k_dst + p.kv.kv_stride + (c - kV * hd)) = out;
      } else {
        *reinterpret_cast<Bf16x8*>(row + c) = out;
      }
    }
  }
}

// slot[r] = element offset (from the pool base) of row r's K slot when r is a new history row of
// its user, else −1: one thread per row, the owner found by binary search over row_offsets.
__global__ void RowSlotsKernel(int64_t rows, AppendKvParams<bf16> p, int64_t* __restrict__ slot) {
  WaitForPredecessor();
  AllowDependents();
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  // The last b in [0, B) with row_offsets[b] <= r.
  int lo = 0, hi = p.kv.batch_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.row_offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  const int i = static_cast<int>(r) - p.row_offsets[lo];
  int64_t out = -1;
  if (i >= 0 && i < p.num_new[lo]) {
    const int t = p.kv.num_tokens[lo] - p.num_new[lo] + i;
    out = p.kv.SlotOffset(p.kv.page_ids[p.kv.indptr[lo] + t / p.kv.page_size], t, 0);
  }
  slot[r] = out;
}

// Grid of the row pass; 0 when it would not fit a launch.
unsigned RowPassBlocks(int64_t rows, int64_t cols, int64_t* segs_per_row) {
  *segs_per_row = (cols + kSegCols - 1) / kSegCols;
  const int64_t blocks = (rows * *segs_per_row + kWarps - 1) / kWarps;
  return blocks > 0x7fffffff ? 0u : static_cast<unsigned>(blocks);
}

}  // namespace

cudaError_t LaunchBiasSiluAppendKv(bf16* uvqk, int64_t rows, int64_t cols, const float* bias,
                                   const AppendKvParams<bf16>& p, cudaStream_t stream) {
  const auto& kv = p.kv;
  const bool have_users = kv.batch_size > 0;
  if (rows < 0 || rows > 0x7fffffff || uvqk == nullptr || bias == nullptr || p.uvqk != uvqk ||
      kv.batch_size < 0 || kv.head_dim <= 0 || kv.head_dim % 8 != 0 || kv.num_heads <= 0 ||
      kv.page_size <= 0 || kv.base == nullptr || cols != 4LL * kv.num_heads * kv.head_dim ||
      p.uvqk_row_stride != cols || kv.page_stride % 8 != 0 || kv.kv_stride % 8 != 0 ||
      !Aligned16(uvqk) || !Aligned16(bias) || !Aligned16(kv.base) ||
      (have_users && (p.row_offsets == nullptr || p.num_new == nullptr || kv.indptr == nullptr ||
                      kv.page_ids == nullptr || kv.num_tokens == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  int64_t segs_per_row = 0;
  const unsigned blocks = RowPassBlocks(rows, cols, &segs_per_row);
  if (blocks == 0) return cudaErrorInvalidValue;
  return LaunchDependent(BiasSiluAppendKvKernel<true>, dim3(blocks), dim3(kWarps * 32), 0, stream,
                         uvqk, rows, cols, segs_per_row, bias, p);
}

cudaError_t LaunchRowSlots(int64_t rows, const AppendKvParams<bf16>& p, int64_t* row_slot,
                           cudaStream_t stream) {
  const auto& kv = p.kv;
  if (rows < 0 || rows > 0x7fffffff || row_slot == nullptr || kv.batch_size < 0 ||
      kv.page_size <= 0 ||
      (kv.batch_size > 0 && (p.row_offsets == nullptr || p.num_new == nullptr ||
                             kv.indptr == nullptr || kv.page_ids == nullptr ||
                             kv.num_tokens == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (kv.batch_size == 0) return cudaMemsetAsync(row_slot, 0xFF, rows * sizeof(int64_t), stream);
  constexpr int kThreads = 256;
  return LaunchDependent(RowSlotsKernel, dim3(static_cast<unsigned>((rows + kThreads - 1) / kThreads)),
                         dim3(kThreads), 0, stream, rows, p, row_slot);
}

cudaError_t LaunchBiasSilu(bf16* x, int64_t rows, int64_t cols, const float* bias,
                           cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || cols % 8 != 0 || x == nullptr || bias == nullptr ||
      !Aligned16(x) || !Aligned16(bias)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  int64_t segs_per_row = 0;
  const unsigned blocks = RowPassBlocks(rows, cols, &segs_per_row);
  if (blocks == 0) return cudaErrorInvalidValue;
  BiasSiluAppendKvKernel<false><<<blocks, kWarps * 32, 0, stream>>>(x, rows, cols, segs_per_row,
                                                                   bias, AppendKvParams<bf16>{});
  return cudaPeekAtLastError();
}

}  // namespace hstu::cuda
