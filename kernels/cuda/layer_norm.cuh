// Warp-per-row LayerNorm pieces shared by the LayerNorm kernels (layer_norm.cu) and the embedding
// gather fused with the first layer's LayerNorm (embedding.cu).
//
// A warp owns one row and holds it in registers: lane l holds the 8-column groups l, l + 32, l + 64,
// … (kGroups of them), so every step of the warp covers 256 consecutive columns with 16-byte (bf16)
// or 2 × 16-byte (fp32) accesses per lane. Columns at or past `cols` are held as zeros and never
// stored, so any width with cols % 8 == 0 up to kNormMaxCols runs here; wider rows take the
// block-per-row kernels of layer_norm.cu.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace hstu::cuda {

inline constexpr int kNormWarps = 4;  // rows per block of the warp-per-row kernels
inline constexpr int kNormMaxCols = 16 * 256;

// Columns per lane group count the kernels are instantiated for; a width runs on the first count
// that covers it (masked columns cost predicates, not bytes). 0: wider than kNormMaxCols.
inline int NormLaneGroups(int64_t cols) {
  const int64_t need = (cols + 255) / 256;
  for (int g : {1, 2, 3, 4, 6, 8, 12, 16}) {
    if (g >= need) return g;
  }
  return 0;
}

// Calls fn(std::integral_constant<int, G>{}) for the instantiated G == groups.
template <typename Fn>
cudaError_t DispatchNormLaneGroups(int groups, Fn&& fn) {
  switch (groups) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    case 12: return fn(std::integral_constant<int, 12>{});
    case 16: return fn(std::integral_constant<int, 16>{});
    default: return cudaErrorInvalidValue;
  }
}

// First column of this lane's group j.
__device__ __forceinline__ int NormGroupCol(int j, int lane) { return (j * 32 + lane) * 8; }

// Mean and 1/sqrt(var + eps) of the warp's row, two-pass (centred) in fp32 from registers.
// Masked groups hold zeros; they add nothing to the sum and are skipped in the centred pass.
template <int kGroups>
__device__ __forceinline__ float2 WarpRowStats(const float (&v)[kGroups][8], int cols, int lane,
                                               float eps) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s += v[j][i];
  }
  const float mean = WarpSum(s) / static_cast<float>(cols);
  float q = 0.f;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    if (NormGroupCol(j, lane) < cols) {
#pragma unroll
      for (int i = 0; i < 8; ++i) q += (v[j][i] - mean) * (v[j][i] - mean);
    }
  }
  const float var = WarpSum(q) / static_cast<float>(cols);
  return make_float2(mean, rsqrtf(var + eps));
}

// This lane's groups of the LayerNorm's w and b. Up to 1024 columns they are loaded when the
// object is made, i.e. next to the row itself, so that their latency hides behind the statistics
// instead of following them (on an H200 at batch 1 of the decode step: 0.7–1.0 µs of a 7 µs
// LayerNorm, and no loss at batch 8); wider rows load them group by group after the statistics,
// which keeps 4096 columns inside the register file.
// kAllowEarly false keeps them late at any width (64 registers a lane fewer: more rows in flight
// where there are many rows, LaunchNormMulU).
template <int kGroups, bool kAllowEarly = true>
struct NormAffine {
  static constexpr bool kEarly = kAllowEarly && kGroups <= 4;
  static constexpr int kHeld = kEarly ? kGroups : 1;
  const float* w;
  const float* b;
  float wv[kHeld][8], bv[kHeld][8];

  __device__ __forceinline__ NormAffine(const float* w_, const float* b_, int cols, int lane)
      : w(w_), b(b_) {
    if constexpr (kEarly) {
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {
        const int c = NormGroupCol(j, lane);
        if (c < cols) {
          Load8(w + c, wv[j]);
          Load8(b + c, bv[j]);
        }
      }
    }
  }
  // w and b of group j (first column c).
  __device__ __forceinline__ void Get(int j, int c, float (&w8)[8], float (&b8)[8]) const {
    if constexpr (kEarly) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        w8[i] = wv[j][i];
        b8[i] = bv[j][i];
      }
    } else {
      Load8(w + c, w8);
      Load8(b + c, b8);
    }
  }
};

// out[c] = (v[c] - mean) * rstd * w[c] + b[c] as bf16 for this lane's valid groups.
template <int kGroups>
__device__ __forceinline__ void WarpRowNormStore(const float (&v)[kGroups][8], float2 stats,
                                                 int cols, int lane,
                                                 const NormAffine<kGroups>& affine, bf16* out) {
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int c = NormGroupCol(j, lane);
    if (c < cols) {
      float wv[8], bv[8], o[8];
      affine.Get(j, c, wv, bv);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = (v[j][i] - stats.x) * stats.y * wv[i] + bv[i];
      *reinterpret_cast<Bf16x8*>(out + c) = Pack8(o);
    }
  }
}

}  // namespace hstu::cuda
