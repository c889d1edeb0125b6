// The MLP head's passes (bias + activation, the gather + L2 normalisation of candidate rows, the
// fused narrow last layer), dtype conversions and the step's small host transfers (LaunchSmCopy).
// Bias + SiLU after the UVQK GEMM is in bias_silu_append_kv.cu.
#include <algorithm>
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
    if (act == Activation::kSigmoid) v = ScoreFromLogit(v);
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

// Columns base + 32·k + lane (k < kN) of a row of `cols` floats into v, 0 past its end: every
// load issued before any is used.
template <int kN>
__device__ __forceinline__ void LoadLaneColumns(const float* __restrict__ row, int cols, int base,
                                                int lane, float (&v)[kN]) {
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const int i = base + 32 * k + lane;
    v[k] = i < cols ? row[i] : 0.f;
  }
}

// A warp a row: s = 1 / max(|norm_rows[r]|, 1e-6) (1 without norm_rows); with in_bias,
// h = max(s · in[r] + in_bias, 0) and out[r][o] = act(h · w[:, o] + bias[o]); without,
// out[r][o] = act(s · (in[r] · w[:, o]) + bias[o]). The weights sit transposed in shared memory
// ([out_cols][in_cols]: consecutive lanes, consecutive banks), the previous layer's bias after
// them.
__global__ void HeadOutputKernel(const float* __restrict__ in, int64_t rows, int in_cols,
                                 const float* __restrict__ in_bias,
                                 const float* __restrict__ norm_rows, int norm_cols,
                                 const float* __restrict__ w, const float* __restrict__ bias,
                                 int out_cols, Activation act, float* __restrict__ out) {
  extern __shared__ float s_head[];
  float* s_w = s_head;                           // [out_cols][in_cols]
  float* s_in_bias = s_head + out_cols * in_cols;  // [in_cols] when in_bias
  constexpr int kPerThread = 8;  // weight loads in flight a thread
  const int n = in_cols * out_cols;
  for (int base = threadIdx.x; base < n; base += kPerThread * blockDim.x) {
    float v[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int i = base + k * blockDim.x;
      v[k] = i < n ? w[i] : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int i = base + k * blockDim.x;
      if (i < n) s_w[(i % out_cols) * in_cols + i / out_cols] = v[k];
    }
  }
  if (in_bias != nullptr) {
    for (int i = threadIdx.x; i < in_cols; i += blockDim.x) s_in_bias[i] = in_bias[i];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); r < rows;
       r += static_cast<int64_t>(gridDim.x) * warps) {
    float scale = 1.f;
    if (norm_rows != nullptr) {
      constexpr int kNormPerLane = 32;  // a 1024-wide row in one round trip
      const float* xr = norm_rows + r * norm_cols;
      float ss = 0.f;
      for (int base = 0; base < norm_cols; base += 32 * kNormPerLane) {
        float v[kNormPerLane];
        LoadLaneColumns(xr, norm_cols, base, lane, v);
#pragma unroll
        for (int k = 0; k < kNormPerLane; ++k) ss = fmaf(v[k], v[k], ss);
      }
      scale = 1.f / fmaxf(sqrtf(WarpSum(ss)), 1e-6f);  // as GatherL2NormalizeKernel
    }
    const float* x = in + r * in_cols;
    float acc[kHeadOutMaxCols];
#pragma unroll
    for (int o = 0; o < kHeadOutMaxCols; ++o) acc[o] = 0.f;
    // kPerLane columns a lane per pass, their loads issued before any is used: a 512-wide row is
    // one round trip, not sixteen.
    constexpr int kPerLane = 16;
    for (int base = 0; base < in_cols; base += 32 * kPerLane) {
      float h[kPerLane];
      LoadLaneColumns(x, in_cols, base, lane, h);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int i = base + 32 * k + lane;
        if (i >= in_cols) break;
        const float v = in_bias != nullptr ? fmaxf(fmaf(h[k], scale, s_in_bias[i]), 0.f) : h[k];
#pragma unroll
        for (int o = 0; o < kHeadOutMaxCols; ++o) {
          if (o < out_cols) acc[o] = fmaf(v, s_w[o * in_cols + i], acc[o]);
        }
      }
    }
    float mine = 0.f;
#pragma unroll
    for (int o = 0; o < kHeadOutMaxCols; ++o) {
      if (o < out_cols) {
        const float v = WarpSum(acc[o]);
        if (lane == o) mine = v;
      }
    }
    if (lane < out_cols) {
      float v = (in_bias != nullptr ? mine : mine * scale) + (bias != nullptr ? bias[lane] : 0.f);
      if (act == Activation::kRelu) v = fmaxf(v, 0.f);
      if (act == Activation::kSigmoid) v = ScoreFromLogit(v);  // as BiasActivationKernel
      out[r * out_cols + lane] = v;
    }
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

// 16-byte words, then the last bytes.
__global__ void SmCopyKernel(uint4* __restrict__ dst, const uint4* __restrict__ src, int64_t words,
                             unsigned char* __restrict__ dst_tail,
                             const unsigned char* __restrict__ src_tail, int tail) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += stride) {
    dst[i] = src[i];
  }
  if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < tail) {
    dst_tail[threadIdx.x] = src_tail[threadIdx.x];
  }
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

bool HeadOutputFits(int64_t in_cols, int64_t out_cols) {
  return in_cols > 0 && out_cols > 0 && out_cols <= kHeadOutMaxCols &&
         in_cols * (out_cols + 1) <= kHeadOutMaxSharedFloats;
}

cudaError_t LaunchHeadOutput(const float* in, int64_t rows, int64_t in_cols, const float* in_bias,
                             const float* norm_rows, int64_t norm_cols, const float* w,
                             const float* bias, int64_t out_cols, Activation act, float* out,
                             cudaStream_t stream) {
  if (rows < 0 || !HeadOutputFits(in_cols, out_cols) || in == nullptr || w == nullptr ||
      out == nullptr || (norm_rows != nullptr && (norm_cols <= 0 || norm_cols > 0x7fffffff))) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256, kWarps = kThreads / 32;
  const int64_t blocks = std::min<int64_t>((rows + kWarps - 1) / kWarps, 1024);
  const size_t smem = static_cast<size_t>(in_cols * out_cols + (in_bias != nullptr ? in_cols : 0)) *
                      sizeof(float);
  HeadOutputKernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
      in, rows, static_cast<int>(in_cols), in_bias, norm_rows, static_cast<int>(norm_cols), w,
      bias, static_cast<int>(out_cols), act, out);
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

cudaError_t LaunchSmCopy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr || reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  if (d < s + bytes && s < d + bytes) return cudaErrorInvalidValue;
  const int64_t words = static_cast<int64_t>(bytes / 16);
  const int tail = static_cast<int>(bytes % 16);
  const int blocks =
      static_cast<int>(std::min<int64_t>(std::max<int64_t>(1, (words + 255) / 256), 1024));
  SmCopyKernel<<<blocks, 256, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src),
                                           words, d + 16 * words, s + 16 * words, tail);
  return cudaPeekAtLastError();
}

}  // namespace hstu::cuda
