// LayerNorm (fp32 statistics) of the residual stream into the bf16 GEMM input, and the output
// LayerNorm fused with the multiplication by u (NormMulU). Both are one read and one write per
// element; the row is re-read from L1 for the second statistics pass instead of being held in
// registers, so any width that is a multiple of 8 works.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void Load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void Load8(const bf16* p, float (&v)[8]) {
  Unpack8(*reinterpret_cast<const Bf16x8*>(p), v);
}

// Mean and 1/sqrt(var + eps) of one row, two-pass (centred) in fp32.
template <typename T>
__device__ __forceinline__ float2 RowStats(const T* x, int64_t cols, float eps, float* scratch) {
  float s = 0.f;
  for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
    float v[8];
    Load8(x + c, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) s += v[i];
  }
  const float mean = BlockSum(s, scratch) / static_cast<float>(cols);
  float q = 0.f;
  for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
    float v[8];
    Load8(x + c, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) q += (v[i] - mean) * (v[i] - mean);
  }
  const float var = BlockSum(q, scratch) / static_cast<float>(cols);
  return make_float2(mean, rsqrtf(var + eps));
}

__global__ void __launch_bounds__(kThreads) LayerNormKernel(const float* __restrict__ x,
                                                            int64_t cols,
                                                            const float* __restrict__ w,
                                                            const float* __restrict__ b, float eps,
                                                            bf16* __restrict__ out) {
  __shared__ float scratch[32];
  const float* xr = x + blockIdx.x * cols;
  const float2 st = RowStats(xr, cols, eps, scratch);
  bf16* o = out + blockIdx.x * cols;
  for (int64_t c = threadIdx.x * 8; c < cols; c += kThreads * 8) {
    float v[8], wv[8], bv[8];
    Load8(xr + c, v);
    Load8(w + c, wv);
    Load8(b + c, bv);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = (v[i] - st.x) * st.y * wv[i] + bv[i];
    *reinterpret_cast<Bf16x8*>(o + c) = Pack8(v);
  }
}

__global__ void __launch_bounds__(kThreads) NormMulUKernel(const bf16* __restrict__ a,
                                                           const bf16* __restrict__ u,
                                                           int64_t u_stride, int64_t hd,
                                                           const float* __restrict__ w,
                                                           const float* __restrict__ b, float eps,
                                                           bf16* __restrict__ y) {
  __shared__ float scratch[32];
  const bf16* ar = a + blockIdx.x * hd;
  const bf16* ur = u + blockIdx.x * u_stride;
  const float2 st = RowStats(ar, hd, eps, scratch);
  bf16* o = y + blockIdx.x * hd;
  for (int64_t c = threadIdx.x * 8; c < hd; c += kThreads * 8) {
    float v[8], uv[8], wv[8], bv[8];
    Load8(ar + c, v);
    Load8(ur + c, uv);
    Load8(w + c, wv);
    Load8(b + c, bv);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ((v[i] - st.x) * st.y * wv[i] + bv[i]) * uv[i];
    *reinterpret_cast<Bf16x8*>(o + c) = Pack8(v);
  }
}

}  // namespace

cudaError_t LaunchLayerNorm(const float* x, int64_t rows, int64_t cols, const float* w,
                            const float* b, float eps, bf16* out, cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || cols % 8 != 0 || x == nullptr || w == nullptr || b == nullptr ||
      out == nullptr || rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  LayerNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, cols, w, b, eps, out);
  return cudaPeekAtLastError();
}

cudaError_t LaunchNormMulU(const bf16* a, const bf16* u, int64_t u_stride, int64_t rows,
                           int64_t hd, const float* w, const float* b, float eps, bf16* y,
                           cudaStream_t stream) {
  if (rows < 0 || hd <= 0 || hd % 8 != 0 || u_stride < hd || u_stride % 8 != 0 || a == nullptr ||
      u == nullptr || w == nullptr || b == nullptr || y == nullptr || rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  NormMulUKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(a, u, u_stride, hd, w, b,
                                                                        eps, y);
  return cudaPeekAtLastError();
}

}  // namespace hstu::cuda
