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
// columns to the K and V blocks of its page slot, which for one token are H·D contiguous elements
// — except those of a user NewKvFromRows picks (p.new_kv_from_rows), whose rows are written back
// whole.
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
      // The rows of a user NewKvFromRows picks keep their v and k (the attention reads them there
      // and stores them to the pages: AppendKvParams::new_kv_from_rows).
      if (i < num_new &&
          !NewKvFromRows(p.new_kv_from_rows, p.returning_kv_from_rows, num_tokens, num_new)) {
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

// The append alone, for uvqk rows that already hold their post-SiLU values (the fused UVQK GEMM):
// warp w takes segment w % segs of the v block (first segs) or the k block of row w / (2·segs) and,
// when the row is a new history row of its user (not one of a user NewKvFromRows picks),
// copies it to the row's page slot (K block, or V at kv_stride). Without new_kv_from_rows, as in
// the fused pass, the loads are issued before the owner lookup, whose dependent loads then hide
// behind them (a candidate row's loads, L2 hits, are simply dropped).
__global__ void __launch_bounds__(kWarps * 32)
    AppendKvFromRowsKernel(int64_t rows, int64_t segs, AppendKvParams<bf16> p) {
  WaitForPredecessor();  // launched dependent on the kernel before it (LaunchDependent)
  AllowDependents();
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t r = warp / (2 * segs);
  if (r >= rows) return;
  const int64_t rem = warp - r * 2 * segs;
  const bool is_v = rem < segs;
  const int64_t seg = is_v ? rem : rem - segs;
  const int64_t hd = p.kv.num_heads * static_cast<int64_t>(p.kv.head_dim);
  const bf16* src = p.uvqk + r * p.uvqk_row_stride + (is_v ? kV : kK) * hd;
  Bf16x8 in[kLaneGroups];
  auto load = [&] {
#pragma unroll
    for (int k = 0; k < kLaneGroups; ++k) {
      const int64_t c = seg * kSegCols + k * 256 + lane * 8;
      if (c < hd) in[k] = *reinterpret_cast<const Bf16x8*>(src + c);
    }
  };
  // With new_kv_from_rows most rows have nothing to append (the decode steps' users all go through
  // the rows): the owner first, so that their loads are never issued.
  if (!p.new_kv_from_rows) load();
  const int ri = static_cast<int>(r);
  const int b = RowOwner(p.row_offsets, p.kv.batch_size, ri, lane);
  const int first = p.row_offsets[b], num_new = p.num_new[b];
  const int num_tokens = p.kv.num_tokens[b], page_idx = p.kv.indptr[b];
  const int i = ri - first;
  if (i >= num_new ||
      NewKvFromRows(p.new_kv_from_rows, p.returning_kv_from_rows, num_tokens, num_new)) {
    return;
  }
  if (p.new_kv_from_rows) load();
  const int t = num_tokens - num_new + i;
  bf16* dst = p.kv.base + p.kv.SlotOffset(p.kv.page_ids[page_idx + t / p.kv.page_size], t, 0) +
              (is_v ? p.kv.kv_stride : 0);
#pragma unroll
  for (int k = 0; k < kLaneGroups; ++k) {
    const int64_t c = seg * kSegCols + k * 256 + lane * 8;
    if (c < hd) *reinterpret_cast<Bf16x8*>(dst + c) = in[k];
  }
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

cudaError_t LaunchAppendKvFromRows(int64_t rows, const AppendKvParams<bf16>& p,
                                   cudaStream_t stream) {
  const auto& kv = p.kv;
  const int64_t hd = static_cast<int64_t>(kv.num_heads) * kv.head_dim;
  if (rows < 0 || rows > 0x7fffffff || p.uvqk == nullptr || kv.batch_size < 0 ||
      kv.head_dim <= 0 || kv.head_dim % 8 != 0 || kv.num_heads <= 0 || kv.page_size <= 0 ||
      kv.base == nullptr || p.uvqk_row_stride != 4 * hd || kv.page_stride % 8 != 0 ||
      kv.kv_stride % 8 != 0 || !Aligned16(p.uvqk) || !Aligned16(kv.base) ||
      (kv.batch_size > 0 && (p.row_offsets == nullptr || p.num_new == nullptr ||
                             kv.indptr == nullptr || kv.page_ids == nullptr ||
                             kv.num_tokens == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || kv.batch_size == 0) return cudaSuccess;
  const int64_t segs = (hd + kSegCols - 1) / kSegCols;
  const int64_t blocks = (rows * 2 * segs + kWarps - 1) / kWarps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return LaunchDependent(AppendKvFromRowsKernel, dim3(static_cast<unsigned>(blocks)),
                         dim3(kWarps * 32), 0, stream, rows, segs, p);
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
