// The UVQK projection with its bias and SiLU in the GEMM's epilogue: c[m, n] = SiLU(a[m, k] · b[k, n]
// + bias[n]) in one kernel (CUTLASS 3 on sm_90a: TMA loads, wgmma with fp32 accumulation, bias +
// SiLU on the fp32 accumulators, bf16 out through a TMA store). It saves the separate bias + SiLU
// pass over the uvqk rows (a read and a write of 2·m·n bytes) and rounds once instead of twice.
// cuBLASLt has no SiLU epilogue, hence CUTLASS.
//
// Built only when the CUTLASS headers were found (HSTU_HAVE_CUTLASS) and sm_90a is among the
// architectures; GemmBiasSiluAvailable() says whether this build and the current device can run
// it. GemmTuner::BiasSiluRoute times the two whole routes per row class — this kernel + the K/V
// append alone, or cuBLAS + the fused bias + SiLU + append pass — and keeps the faster
// (docs/cuda_kernels.md, "Fused UVQK GEMM").
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace hstu::cuda {

// Tile configurations of the fused kernel (all persistent, 2 consumer warpgroups):
//   0: 128 × 256 × 64 tiles, cooperative (both warpgroups on one tile), cluster 2 × 1;
//   1: 128 × 128 × 64 tiles, ping-pong (each warpgroup its own tile; one's epilogue overlaps the
//      other's main loop), cluster 2 × 1.
inline constexpr int kGemmBiasSiluConfigs = 2;

// True when this build has the fused kernel and the current device is compute capability 9.0.
bool GemmBiasSiluAvailable();

// c[m, n] = SiLU(a[m, k] · b[k, n] + bias[n]), all row-major; a, b, c bf16, bias fp32; SiLU as
// x / (1 + e^−x) in fp32 (the same formula as the bias + SiLU pass). Needs n % 8 == 0,
// k % 8 == 0, 16-byte aligned pointers, m, n, k < 2^31. Does not synchronise; capturable (the
// launch parameters, with their TMA descriptors, are built on the host and cached per call shape).
// cudaErrorInvalidValue for bad arguments, cudaErrorNotSupported when unavailable.
cudaError_t LaunchGemmBiasSilu(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* bias,
                               __nv_bfloat16* c, int64_t m, int64_t n, int64_t k, int config,
                               cudaStream_t stream);

}  // namespace hstu::cuda
