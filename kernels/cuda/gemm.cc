#include "kernels/cuda/gemm.h"

#include <climits>

namespace hstu::cuda {

cublasStatus_t GemmBf16(cublasHandle_t handle, const __nv_bfloat16* a, const __nv_bfloat16* b,
                        void* c, bool c_is_f32, int64_t m, int64_t n, int64_t k, float beta) {
  if (m < 0 || n <= 0 || k <= 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0) return CUBLAS_STATUS_SUCCESS;
  const float alpha = 1.f;
  return cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                      static_cast<int>(k), &alpha, b, CUDA_R_16BF, static_cast<int>(n), a,
                      CUDA_R_16BF, static_cast<int>(k), &beta, c,
                      c_is_f32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(n),
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t GemmF32(cublasHandle_t handle, const float* a, const float* b, float* c, int64_t m,
                       int64_t n, int64_t k, float beta, bool tf32) {
  if (m < 0 || n <= 0 || k <= 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0) return CUBLAS_STATUS_SUCCESS;
  const float alpha = 1.f;
  return cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                      static_cast<int>(k), &alpha, b, CUDA_R_32F, static_cast<int>(n), a,
                      CUDA_R_32F, static_cast<int>(k), &beta, c, CUDA_R_32F, static_cast<int>(n),
                      tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

}  // namespace hstu::cuda
