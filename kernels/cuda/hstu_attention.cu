// Launcher of the paged HSTU attention: argument checks and head-dim dispatch over an explicit list.
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/hstu_attention_kernel.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

template <int kD>
cudaError_t Launch(const AttentionParams<bf16>& p, const AttentionWorkItem* items, int32_t num_items,
                   float* partials, cudaStream_t stream) {
  constexpr int kSmem = AttnTraits<kD>::kSmemBytes;
  // Not a stream operation, so it is allowed while a stream is being captured.
  cudaError_t err = cudaFuncSetAttribute(HstuAttentionKernel<kD>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(num_items, p.kv.num_heads);
  HstuAttentionKernel<kD><<<grid, AttnTraits<kD>::kThreads, kSmem, stream>>>(p, items, partials);
  err = cudaPeekAtLastError();
  if (err != cudaSuccess || partials == nullptr) return err;
  const dim3 reduce_grid(num_items, p.kv.num_heads, kAttnBlockM / kReduceRows);
  HstuAttentionReduceKernel<kD><<<reduce_grid, 256, 0, stream>>>(items, partials, p.out,
                                                                 p.kv.num_heads);
  return cudaPeekAtLastError();
}

template <int kD>
cudaError_t CtasPerSm(int* n) {
  constexpr int kSmem = AttnTraits<kD>::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(HstuAttentionKernel<kD>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, HstuAttentionKernel<kD>,
                                                       AttnTraits<kD>::kThreads, kSmem);
}

}  // namespace

cudaError_t HstuAttentionCtasPerSm(int head_dim, int* ctas_per_sm) {
  // The kernel is wgmma (sm_90a) only: refuse other GPUs here, where the backend sets up.
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  if (major != 9 || minor != 0) return cudaErrorInvalidDeviceFunction;
  switch (head_dim) {
    case 64: return CtasPerSm<64>(ctas_per_sm);
    case 128: return CtasPerSm<128>(ctas_per_sm);
    case 256: return CtasPerSm<256>(ctas_per_sm);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchHstuAttention(const AttentionParams<bf16>& p, const AttentionWorkItem* items,
                                int32_t num_items, float* partials, int32_t* tile_counters,
                                cudaStream_t stream) {
  (void)tile_counters;  // kept for API stability; the split reduction is a second kernel now
  const auto& kv = p.kv;
  const int64_t hd = static_cast<int64_t>(kv.num_heads) * kv.head_dim;
  if (num_items < 0 || kv.num_heads <= 0 || kv.num_heads > 65535 || p.uvqk == nullptr ||
      p.out == nullptr || p.uvqk_row_stride < 4 * hd || p.uvqk_row_stride % 8 != 0 ||
      kv.page_size <= 0 || kv.page_stride % 8 != 0 || kv.kv_stride % 8 != 0 ||
      (num_items > 0 && items == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (!HeadDimSupported(kv.head_dim)) return cudaErrorInvalidValue;  // allowed: 64, 128, 256
  if (num_items == 0) return cudaSuccess;
  switch (kv.head_dim) {
    case 64: return Launch<64>(p, items, num_items, partials, stream);
    case 128: return Launch<128>(p, items, num_items, partials, stream);
    case 256: return Launch<256>(p, items, num_items, partials, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace hstu::cuda
