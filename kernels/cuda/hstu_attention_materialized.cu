#include "kernels/cuda/hstu_attention_materialized.h"

#include <vector>

#include "kernels/cuda/common.cuh"

namespace hstu::cuda {
namespace {

__global__ void SiluCausalMaskKernel(bf16* __restrict__ s, int64_t num_vec, int64_t T, float alpha,
                                     float inv_norm) {
  const int64_t vec_per_row = T / 8;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vec;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = v / vec_per_row;
    const int64_t i = row % T;                // query
    const int64_t j0 = (v % vec_per_row) * 8;  // first key of the vector
    Bf16x8* p = reinterpret_cast<Bf16x8*>(s) + v;
    float f[8];
    if (j0 > i) {
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = 0.f;
    } else {
      Unpack8(*p, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = j0 + e <= i ? Silu(alpha * f[e]) * inv_norm : 0.f;
    }
    *p = Pack8(f);
  }
}

}  // namespace

cudaError_t LaunchSiluCausalMaskInPlace(bf16* s, int64_t num_mats, int64_t T, float alpha,
                                        float inv_norm, cudaStream_t stream) {
  if (s == nullptr || T <= 0 || T % 8 != 0 || num_mats <= 0) return cudaErrorInvalidValue;
  const int64_t num_vec = num_mats * T * T / 8;
  const int64_t blocks = std::min<int64_t>((num_vec + 255) / 256, 132 * 32);
  SiluCausalMaskKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(s, num_vec, T, alpha,
                                                                         inv_norm);
  return cudaPeekAtLastError();
}

cublasStatus_t MaterializedHstuAttention(cublasHandle_t handle, const bf16* uvqk, bf16* out,
                                         bf16* s, const void** ptrs, bool ptrs_ready, int B, int T,
                                         int H, int D, float alpha, float inv_norm,
                                         cudaStream_t stream) {
  const int64_t hd = static_cast<int64_t>(H) * D, ld_uvqk = 4 * hd;
  const int n = B * H;
  // ptrs: [K | Q | S | V | S | O] pointer arrays of n entries each (GEMM 1: A=K, B=Q, C=S;
  // GEMM 2: A=V, B=S(=P), C=O).
  if (!ptrs_ready) {
    std::vector<const void*> h(6 * static_cast<size_t>(n));
    for (int b = 0; b < B; ++b) {
      for (int hh = 0; hh < H; ++hh) {
        const int i = b * H + hh;
        const bf16* row = uvqk + static_cast<int64_t>(b) * T * ld_uvqk + hh * D;
        bf16* mat = s + static_cast<int64_t>(i) * T * T;
        h[0 * n + i] = row + 3 * hd;  // k
        h[1 * n + i] = row + 2 * hd;  // q
        h[2 * n + i] = mat;
        h[3 * n + i] = row + 1 * hd;  // v
        h[4 * n + i] = mat;
        h[5 * n + i] = out + static_cast<int64_t>(b) * T * hd + hh * D;
      }
    }
    if (cudaMemcpyAsync(ptrs, h.data(), h.size() * sizeof(void*), cudaMemcpyHostToDevice, stream) !=
            cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
  }
  const float one = 1.f, zero = 0.f;
  // Row-major S[T,T] = Q·Kᵀ is column-major Sᵀ = K·Qᵀ: A = K (col-major D×T, transposed), B = Q.
  cublasStatus_t st = cublasGemmBatchedEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, T, T, D, &one, ptrs + 0 * n, CUDA_R_16BF, ld_uvqk,
      ptrs + 1 * n, CUDA_R_16BF, ld_uvqk, &zero, const_cast<void**>(ptrs + 2 * n), CUDA_R_16BF, T,
      n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (LaunchSiluCausalMaskInPlace(s, n, T, alpha, inv_norm, stream) != cudaSuccess) {
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  // Row-major O[T,D] = P·V is column-major Oᵀ = Vᵀ·Pᵀ: A = V (col-major D×T), B = P (col-major Pᵀ).
  return cublasGemmBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, D, T, T, &one, ptrs + 3 * n,
                             CUDA_R_16BF, ld_uvqk, ptrs + 4 * n, CUDA_R_16BF, T, &zero,
                             const_cast<void**>(ptrs + 5 * n), CUDA_R_16BF, hd, n,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

}  // namespace hstu::cuda
