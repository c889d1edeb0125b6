// Embedding gather (+ absolute position encoding) into the fp32 residual stream, optionally fused
// with the first layer's input LayerNorm: the row is normalised from the registers it was gathered
// into, so the LayerNorm's read of x (4·T·d bytes) and one launch per forward disappear.
#include <cmath>

#include "kernels/cuda/layer_norm.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

// Row r's embedding row, and its position-encoding row (nullptr when the model has none).
__device__ __forceinline__ const bf16* EmbeddingSource(const EmbeddingParams<bf16>& p, int64_t r,
                                                       const bf16** pe) {
  const int64_t d = p.hidden_dim;
  const int64_t id = p.token_ids[r];
  *pe = nullptr;
  if (p.position_table != nullptr) {
    const int64_t pos = min(static_cast<int64_t>(p.positions[r]), p.position_rows - 1);
    *pe = p.position_table + pos * d;
  }
  return p.token_types[r] == kItemToken ? p.item_table + (id % p.item_rows) * d
                                        : p.action_table + id * d;
}

// v = src * scale + pe (an explicit fma, so that both kernels below round alike), or src.
__device__ __forceinline__ void EmbeddingValues(const bf16* src, const bf16* pe, int64_t c,
                                                float scale, float (&v)[8]) {
  Load8(src + c, v);
  if (pe != nullptr) {
    float e[8];
    Load8(pe + c, e);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmaf_rn(v[i], scale, e[i]);
  }
}

// One block per row, any d % 8 == 0: each thread moves 8 columns per step (16-byte table loads).
__global__ void EmbeddingGatherKernel(EmbeddingParams<bf16> p, float* __restrict__ out,
                                      float scale) {
  const int64_t r = blockIdx.x;
  const int64_t d = p.hidden_dim;
  const bf16* pe = nullptr;
  const bf16* src = EmbeddingSource(p, r, &pe);
  float* dst = out + r * d;
  for (int64_t c = threadIdx.x * 8; c < d; c += blockDim.x * 8) {
    float v[8];
    EmbeddingValues(src, pe, c, scale, v);
    Store8(dst + c, v);
  }
}

// One warp per row (d <= kNormMaxCols), the row kept in registers for the LayerNorm (layer_norm.cuh).
template <int kGroups>
__global__ void __launch_bounds__(kNormWarps * 32)
    EmbeddingLayerNormKernel(EmbeddingParams<bf16> p, float scale, const float* __restrict__ w,
                             const float* __restrict__ b, float eps, float* __restrict__ x,
                             bf16* __restrict__ n) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  if (r >= p.num_rows) return;  // whole warps only
  const int d = p.hidden_dim;
  const NormAffine<kGroups> affine(w, b, d, lane);  // issued first: the row waits on its ids
  const bf16* pe = nullptr;
  const bf16* src = EmbeddingSource(p, r, &pe);
  float v[kGroups][8];
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int c = NormGroupCol(j, lane);
    if (c < d) {
      EmbeddingValues(src, pe, c, scale, v[j]);
      Store8(x + r * d + c, v[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[j][i] = 0.f;
    }
  }
  const float2 st = WarpRowStats<kGroups>(v, d, lane, eps);
  WarpRowNormStore<kGroups>(v, st, d, lane, affine, n + r * d);
}

}  // namespace

cudaError_t LaunchEmbeddingGather(const EmbeddingParams<bf16>& p, float* out, const float* norm_w,
                                  const float* norm_b, float eps, bf16* norm_out,
                                  cudaStream_t stream) {
  if (p.num_rows < 0 || p.hidden_dim <= 0 || p.hidden_dim % 8 != 0 || out == nullptr ||
      p.out != nullptr || p.item_table == nullptr || p.action_table == nullptr ||
      p.item_rows <= 0 || p.action_rows <= 0 ||
      (p.num_rows > 0 && (p.token_ids == nullptr || p.token_types == nullptr)) ||
      (p.position_table != nullptr && (p.position_rows <= 0 || p.positions == nullptr)) ||
      !Aligned16(out) || !Aligned16(p.item_table) || !Aligned16(p.action_table) ||
      (p.position_table != nullptr && !Aligned16(p.position_table)) ||
      (norm_out != nullptr && (norm_w == nullptr || norm_b == nullptr || !Aligned16(norm_out) ||
                               !Aligned16(norm_w) || !Aligned16(norm_b)))) {
    return cudaErrorInvalidValue;
  }
  if (p.num_rows == 0) return cudaSuccess;
  const float scale = std::sqrt(static_cast<float>(p.hidden_dim));
  const int groups = norm_out != nullptr ? NormLaneGroups(p.hidden_dim) : 0;
  if (groups == 0) {
    // Gather only, or a row too wide for registers: gather, then the LayerNorm's own fallback.
    const int threads = p.hidden_dim >= 1024 ? 128 : 64;
    EmbeddingGatherKernel<<<p.num_rows, threads, 0, stream>>>(p, out, scale);
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess || norm_out == nullptr) return err;
    return LaunchLayerNorm(out, p.num_rows, p.hidden_dim, norm_w, norm_b, eps, norm_out, stream);
  }
  const unsigned blocks = static_cast<unsigned>((p.num_rows + kNormWarps - 1) / kNormWarps);
  const cudaError_t err = DispatchNormLaneGroups(groups, [&](auto g) {
    EmbeddingLayerNormKernel<decltype(g)::value><<<blocks, kNormWarps * 32, 0, stream>>>(
        p, scale, norm_w, norm_b, eps, out, norm_out);
    return cudaSuccess;
  });
  return err != cudaSuccess ? err : cudaPeekAtLastError();
}

}  // namespace hstu::cuda
