// Element-wise passes of the MLP head (bias + activation, the gather + L2 normalisation of candidate
// rows) and dtype conversions. Bias + SiLU after the UVQK GEMM is in bias_silu_append_kv.cu.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

__global__ void BiasActivationKernel(float* __restrict__ x, int64_t count, int64_t cols,
                                     const float* __restrict__ bias, Activation act) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = x[i] + (bias != nullptr ? bias[i % cols] : 0.f);
    if (act == Activation::kRelu) v = fmaxf(v, 0.f);
    // Exact expf: scores are compared at 2e-3 and the head is tiny.
    if (act == Activation::kSigmoid) v = 1.f / (1.f + expf(-v));
    x[i] = v;
  }
}

__global__ void GatherL2NormalizeKernel(const float* __restrict__ x,
                                        const int32_t* __restrict__ rows, int64_t cols,
                                        float* __restrict__ raw, float* __restrict__ normed) {
  __shared__ float scratch[32];
  const float* xr = x + static_cast<int64_t>(rows != nullptr ? rows[blockIdx.x] : blockIdx.x) * cols;
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c] * xr[c];
  const float inv = 1.f / fmaxf(sqrtf(BlockSum(s, scratch)), 1e-6f);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = xr[c];
    if (raw != nullptr) raw[blockIdx.x * cols + c] = v;
    normed[blockIdx.x * cols + c] = v * inv;
  }
}

__global__ void F32ToBf16Kernel(const float* __restrict__ in, int64_t count, bf16* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

__global__ void Bf16ToF32Kernel(const bf16* __restrict__ in, int64_t count, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat162float(in[i]);
  }
}

// Enough blocks to fill any current GPU several times over; grid-stride loops do the rest.
unsigned GridFor(int64_t items, int threads) {
  const int64_t blocks = (items + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 8192 ? (blocks > 0 ? blocks : 1) : 8192);
}

}  // namespace

cudaError_t LaunchBiasActivation(float* x, int64_t rows, int64_t cols, const float* bias,
                                 Activation act, cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || x == nullptr) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  BiasActivationKernel<<<GridFor(rows * cols, 256), 256, 0, stream>>>(x, rows * cols, cols, bias,
                                                                      act);
  return cudaPeekAtLastError();
}

cudaError_t LaunchGatherL2Normalize(const float* x, const int32_t* rows, int64_t num_rows,
                                    int64_t cols, float* raw, float* normed, cudaStream_t stream) {
  if (num_rows < 0 || num_rows > 0x7fffffff || cols <= 0 || x == nullptr || normed == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  GatherL2NormalizeKernel<<<static_cast<unsigned>(num_rows), 256, 0, stream>>>(x, rows, cols, raw,
                                                                               normed);
  return cudaPeekAtLastError();
}

cudaError_t LaunchF32ToBf16(const float* in, int64_t count, bf16* out, cudaStream_t stream) {
  if (count < 0 || (count > 0 && (in == nullptr || out == nullptr))) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  F32ToBf16Kernel<<<GridFor(count, 256), 256, 0, stream>>>(in, count, out);
  return cudaPeekAtLastError();
}

cudaError_t LaunchBf16ToF32(const bf16* in, int64_t count, float* out, cudaStream_t stream) {
  if (count < 0 || (count > 0 && (in == nullptr || out == nullptr))) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  Bf16ToF32Kernel<<<GridFor(count, 256), 256, 0, stream>>>(in, count, out);
  return cudaPeekAtLastError();
}

}  // namespace hstu::cuda
