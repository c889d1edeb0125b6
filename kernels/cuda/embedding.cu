// Embedding gather (+ absolute position encoding) into the fp32 residual stream.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

// One block per row; each thread moves 8 columns per step (16-byte loads of the bf16 tables).
__global__ void EmbeddingGatherKernel(EmbeddingParams<bf16> p, float* __restrict__ out,
                                      float scale) {
  const int64_t r = blockIdx.x;
  const int64_t d = p.hidden_dim;
  const int64_t id = p.token_ids[r];
  const bf16* src = p.token_types[r] == kItemToken ? p.item_table + (id % p.item_rows) * d
                                                   : p.action_table + id * d;
  const bf16* pe = nullptr;
  if (p.position_table != nullptr) {
    const int64_t pos = min(static_cast<int64_t>(p.positions[r]), p.position_rows - 1);
    pe = p.position_table + pos * d;
  }
  float* dst = out + r * d;
  for (int64_t c = threadIdx.x * 8; c < d; c += blockDim.x * 8) {
    float v[8];
    Unpack8(*reinterpret_cast<const Bf16x8*>(src + c), v);
    if (pe != nullptr) {
      float e[8];
      Unpack8(*reinterpret_cast<const Bf16x8*>(pe + c), e);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = v[i] * scale + e[i];
    }
    reinterpret_cast<float4*>(dst + c)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst + c)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

}  // namespace

cudaError_t LaunchEmbeddingGather(const EmbeddingParams<bf16>& p, float* out, cudaStream_t stream) {
  if (p.num_rows < 0 || p.hidden_dim <= 0 || p.hidden_dim % 8 != 0 || out == nullptr ||
      p.out != nullptr || p.item_table == nullptr || p.action_table == nullptr ||
      p.item_rows <= 0 || (p.position_table != nullptr && p.position_rows <= 0)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_rows == 0) return cudaSuccess;
  const int threads = p.hidden_dim >= 1024 ? 128 : 64;
  EmbeddingGatherKernel<<<p.num_rows, threads, 0, stream>>>(
      p, out, std::sqrt(static_cast<float>(p.hidden_dim)));
  return cudaPeekAtLastError();
}

}  // namespace hstu::cuda
