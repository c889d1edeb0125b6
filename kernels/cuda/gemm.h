// Row-major GEMMs through cuBLAS (bf16 operands, fp32 accumulation). cuBLAS is column-major, so a
// row-major C[m,n] = A[m,k]·B[k,n] is computed as the column-major Cᵀ = Bᵀ·Aᵀ with no copies.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace hstu::cuda {

// c[m, n] = a[m, k] · b[k, n] + beta * c.  a, b bf16; c bf16 (c_is_f32 = false) or fp32.
// beta = 1 with an fp32 c adds the product to the residual stream in place.
cublasStatus_t GemmBf16(cublasHandle_t handle, const __nv_bfloat16* a, const __nv_bfloat16* b,
                        void* c, bool c_is_f32, int64_t m, int64_t n, int64_t k, float beta);

// fp32 c[m, n] = a[m, k] · b[k, n] + beta * c (the MLP head). tf32: the tensor cores, with a and
// b rounded to TF32 (10-bit mantissa) and fp32 accumulation; else plain fp32 (CUDA cores).
cublasStatus_t GemmF32(cublasHandle_t handle, const float* a, const float* b, float* c, int64_t m,
                       int64_t n, int64_t k, float beta, bool tf32 = false);

}  // namespace hstu::cuda
