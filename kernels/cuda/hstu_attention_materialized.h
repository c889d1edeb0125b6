// The materialised ("unfused") HSTU attention used as the baseline of the attention and layer
// benchmarks (DESIGN §11): S = Q·Kᵀ into a [T, T] buffer per (user, head) with cuBLAS, one
// element-wise SiLU + mask pass in place, then O = P·V with cuBLAS. Causal (all-history) mask only.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace hstu::cuda {

// s: [num_mats, T, T] bf16, row-major; row i of a matrix is query i, column j key j. In place:
// s = SiLU(alpha·s) / N where j <= i (causal), else 0. 16-byte accesses; T % 8 == 0.
cudaError_t LaunchSiluCausalMaskInPlace(__nv_bfloat16* s, int64_t num_mats, int64_t T, float alpha,
                                        float inv_norm, cudaStream_t stream);

// The whole baseline for B users of T tokens each (rows b*T .. b*T+T-1), H heads of dim D.
//   uvqk: [B*T, 4*H*D] (u | v | q | k); out: [B*T, H*D]; s: [B*H, T, T] bf16 workspace;
//   ptrs: device array of 6*B*H pointers (filled here by one host-to-device copy the first call
//   makes it; pass ptrs_ready = true afterwards). The handle's stream must be `stream`.
cublasStatus_t MaterializedHstuAttention(cublasHandle_t handle, const __nv_bfloat16* uvqk,
                                         __nv_bfloat16* out, __nv_bfloat16* s, const void** ptrs,
                                         bool ptrs_ready, int B, int T, int H, int D, float alpha,
                                         float inv_norm, cudaStream_t stream);

}  // namespace hstu::cuda
