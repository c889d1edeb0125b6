// Append of the new history rows' K and V into their pages: a bit-exact 16-byte copy.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

// One block per jagged row; candidate rows return at once. Threads stride over the H * D / 8
// 16-byte chunks of K and of V.
__global__ void AppendKvKernel(AppendKvParams<bf16> p) {
  const int r = blockIdx.x;
  // The user owning row r: last b with row_offsets[b] <= r (binary search; B is small).
  int lo = 0, hi = p.kv.batch_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.row_offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  const int b = lo;
  const int i = r - p.row_offsets[b];
  if (i >= p.num_new[b]) return;
  const int t = p.kv.num_tokens[b] - p.num_new[b] + i;
  const int H = p.kv.num_heads, D = p.kv.head_dim;
  const int64_t hd = static_cast<int64_t>(H) * D;
  const bf16* row = p.uvqk + r * p.uvqk_row_stride;
  const int chunks_per_head = D / 8;
  for (int c = threadIdx.x; c < H * chunks_per_head; c += blockDim.x) {
    const int h = c / chunks_per_head, off = (c % chunks_per_head) * 8;
    bf16* k_dst = p.kv.K(b, t, h) + off;
    *reinterpret_cast<Bf16x8*>(k_dst) =
        *reinterpret_cast<const Bf16x8*>(row + kK * hd + h * D + off);
    *reinterpret_cast<Bf16x8*>(k_dst + p.kv.kv_stride) =
        *reinterpret_cast<const Bf16x8*>(row + kV * hd + h * D + off);
  }
}

}  // namespace

cudaError_t LaunchAppendKv(const AppendKvParams<bf16>& p, int32_t num_rows, cudaStream_t stream) {
  const auto& kv = p.kv;
  if (num_rows < 0 || kv.batch_size < 0 || kv.head_dim <= 0 || kv.head_dim % 8 != 0 ||
      kv.num_heads <= 0 || kv.page_size <= 0 || kv.base == nullptr || p.uvqk == nullptr ||
      p.uvqk_row_stride < 4LL * kv.num_heads * kv.head_dim || p.uvqk_row_stride % 8 != 0 ||
      kv.page_stride % 8 != 0 || kv.kv_stride % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0 || kv.batch_size == 0) return cudaSuccess;
  AppendKvKernel<<<num_rows, 128, 0, stream>>>(p);
  return cudaPeekAtLastError();
}

}  // namespace hstu::cuda
