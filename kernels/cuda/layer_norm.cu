// LayerNorm (fp32 statistics) of the residual stream into the bf16 GEMM input, and the output
// LayerNorm fused with the multiplication by u (NormMulU). Both are one read and one write per
// element.
//
// Widths up to kNormMaxCols run one warp per row with the row in registers (layer_norm.cuh): the
// statistics come from registers and warp shuffles, with no block barrier, and a block holds
// kNormWarps rows, so no thread idles at d = 1024 (the block-per-row kernel left half of its 256
// threads without work there). Wider rows take the block-per-row kernels below, which re-read the
// row from L1 for the second statistics pass.
#include "kernels/cuda/layer_norm.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

// NormMulU's optional row gather: output row r comes from row src_rows[r] of a and u, and row
// src_rows[r] of x (fp32, x_cols wide) is copied to row r of x_out on the way.
struct NormRowGather {
  const int32_t* src_rows = nullptr;  // nullptr: row r from row r
  const float* x = nullptr;           // nullptr: no copy
  float* x_out = nullptr;
  int64_t x_cols = 0;                 // multiple of 4

  // Threads t of `count` copy row src of x to row r of x_out, 16 bytes each, kBatch loads in
  // flight before their stores (one memory round trip per kBatch · count · 16 bytes: a warp copies
  // a 1024-column row in one, where a load-store loop took eight).
  __device__ __forceinline__ void CopyX(int64_t r, int64_t src, int t, int count) const {
    if (x == nullptr) return;
    constexpr int kBatch = 8;
    const float4* __restrict__ from = reinterpret_cast<const float4*>(x + src * x_cols);
    float4* __restrict__ to = reinterpret_cast<float4*>(x_out + r * x_cols);
    const int64_t n = x_cols / 4;
    for (int64_t c0 = t; c0 < n; c0 += static_cast<int64_t>(kBatch) * count) {
      float4 buf[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t c = c0 + static_cast<int64_t>(k) * count;
        if (c < n) buf[k] = __ldg(from + c);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t c = c0 + static_cast<int64_t>(k) * count;
        if (c < n) to[c] = buf[k];
      }
    }
  }
};

// ---- Warp per row (cols <= kNormMaxCols) --------------------------------------------------------

__device__ __forceinline__ Bf16x8 ZeroBf16x8() {
  Bf16x8 z;
#pragma unroll
  for (int k = 0; k < 4; ++k) z.h[k] = __float2bfloat162_rn(0.f);
  return z;
}

template <int kGroups>
__global__ void __launch_bounds__(kNormWarps * 32)
    LayerNormWarpKernel(const float* __restrict__ x, int64_t rows, int cols,
                        const float* __restrict__ w, const float* __restrict__ b, float eps,
                        bf16* __restrict__ out) {
  WaitForPredecessor();  // launched dependent on the kernel before it (LaunchDependent)
  AllowDependents();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  if (r >= rows) return;  // whole warps only: the shuffles below see all 32 lanes
  const float* xr = x + r * cols;
  float v[kGroups][8];
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int c = NormGroupCol(j, lane);
    if (c < cols) {
      Load8(xr + c, v[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[j][i] = 0.f;
    }
  }
  const NormAffine<kGroups> affine(w, b, cols, lane);
  const float2 st = WarpRowStats<kGroups>(v, cols, lane, eps);
  WarpRowNormStore<kGroups>(v, st, cols, lane, affine, out + r * cols);
}

// a is held packed (4 registers per group, not 8) and unpacked in each pass, so that u (and, up to
// 1024 columns, w and b) can be loaded up front with it: their latency then hides behind the
// statistics, and 4096 columns still fit in the register file (2 × 64 registers of data per lane).
template <int kGroups, bool kEarlyAffine>
__global__ void __launch_bounds__(kNormWarps * 32)
    NormMulUWarpKernel(const bf16* __restrict__ a, const bf16* __restrict__ u, int64_t u_stride,
                       int64_t rows, int hd, const float* __restrict__ w,
                       const float* __restrict__ b, float eps, bf16* __restrict__ y,
                       NormRowGather g) {
  WaitForPredecessor();  // launched dependent on the kernel before it (LaunchDependent)
  AllowDependents();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int64_t src = g.src_rows != nullptr ? g.src_rows[r] : r;
  const bf16* ar = a + src * hd;
  const bf16* ur = u + src * u_stride;
  Bf16x8 ap[kGroups], up[kGroups];
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int c = NormGroupCol(j, lane);
    if (c < hd) {
      ap[j] = *reinterpret_cast<const Bf16x8*>(ar + c);
      up[j] = *reinterpret_cast<const Bf16x8*>(ur + c);
    } else {
      ap[j] = ZeroBf16x8();
      up[j] = ap[j];
    }
  }
  g.CopyX(r, src, lane, 32);  // its loads overlap a's and u's
  const NormAffine<kGroups, kEarlyAffine> affine(w, b, hd, lane);
  // The same two passes as WarpRowStats, over the unpacked groups.
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    float v[8];
    Unpack8(ap[j], v);
#pragma unroll
    for (int i = 0; i < 8; ++i) s += v[i];
  }
  const float mean = WarpSum(s) / static_cast<float>(hd);
  float q = 0.f;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    if (NormGroupCol(j, lane) < hd) {
      float v[8];
      Unpack8(ap[j], v);
#pragma unroll
      for (int i = 0; i < 8; ++i) q += (v[i] - mean) * (v[i] - mean);
    }
  }
  const float rstd = rsqrtf(WarpSum(q) / static_cast<float>(hd) + eps);
  bf16* yr = y + r * hd;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int c = NormGroupCol(j, lane);
    if (c < hd) {
      float v[8], uv[8], wv[8], bv[8];
      Unpack8(ap[j], v);
      Unpack8(up[j], uv);
      affine.Get(j, c, wv, bv);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = ((v[i] - mean) * rstd * wv[i] + bv[i]) * uv[i];
      *reinterpret_cast<Bf16x8*>(yr + c) = Pack8(v);
    }
  }
}

// ---- Block per row (any cols % 8 == 0) ----------------------------------------------------------

constexpr int kThreads = 256;

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
  WaitForPredecessor();  // launched dependent on the kernel before it (LaunchDependent)
  AllowDependents();
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
                                                           bf16* __restrict__ y,
                                                           NormRowGather g) {
  WaitForPredecessor();  // launched dependent on the kernel before it (LaunchDependent)
  AllowDependents();
  __shared__ float scratch[32];
  const int64_t src = g.src_rows != nullptr ? g.src_rows[blockIdx.x] : blockIdx.x;
  g.CopyX(blockIdx.x, src, threadIdx.x, kThreads);
  const bf16* ar = a + src * hd;
  const bf16* ur = u + src * u_stride;
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

// From this many rows on, LayerNorm · u loads w and b after the statistics (NormAffine): 92
// registers instead of 133, 20 rows in flight an SM instead of 12 (round 35). The input LayerNorm
// measured slower that way (55 → 58.7 µs at 34 816 rows on an H200), so it keeps them early.
constexpr int64_t kNormLateAffineRows = 8192;

unsigned NormBlocks(int64_t rows) {
  return static_cast<unsigned>((rows + kNormWarps - 1) / kNormWarps);
}

}  // namespace

cudaError_t LaunchLayerNorm(const float* x, int64_t rows, int64_t cols, const float* w,
                            const float* b, float eps, bf16* out, cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || cols % 8 != 0 || x == nullptr || w == nullptr || b == nullptr ||
      out == nullptr || rows > 0x7fffffff || !Aligned16(x) || !Aligned16(w) || !Aligned16(b) ||
      !Aligned16(out)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const int groups = NormLaneGroups(cols);
  if (groups == 0) {
    return LaunchDependent(LayerNormKernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0,
                           stream, x, cols, w, b, eps, out);
  }
  const cudaError_t err = DispatchNormLaneGroups(groups, [&](auto g) {
    return LaunchDependent(LayerNormWarpKernel<decltype(g)::value>, dim3(NormBlocks(rows)),
                           dim3(kNormWarps * 32), 0, stream, x, rows, static_cast<int>(cols), w, b,
                           eps, out);
  });
  return err != cudaSuccess ? err : cudaPeekAtLastError();
}

namespace {

cudaError_t NormMulU(const bf16* a, const bf16* u, int64_t u_stride, int64_t rows, int64_t hd,
                     const float* w, const float* b, float eps, bf16* y, const NormRowGather& g,
                     cudaStream_t stream) {
  if (rows < 0 || hd <= 0 || hd % 8 != 0 || u_stride < hd || u_stride % 8 != 0 || a == nullptr ||
      u == nullptr || w == nullptr || b == nullptr || y == nullptr || rows > 0x7fffffff ||
      !Aligned16(a) || !Aligned16(u) || !Aligned16(w) || !Aligned16(b) || !Aligned16(y)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const int groups = NormLaneGroups(hd);
  if (groups == 0) {
    return LaunchDependent(NormMulUKernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0,
                           stream, a, u, u_stride, hd, w, b, eps, y, g);
  }
  // Many rows: w and b loaded after the statistics, so that more rows are in flight an SM.
  const bool early = rows < kNormLateAffineRows;
  const cudaError_t err = DispatchNormLaneGroups(groups, [&](auto lanes) {
    constexpr int kLanes = decltype(lanes)::value;
    auto* kernel = early ? NormMulUWarpKernel<kLanes, true> : NormMulUWarpKernel<kLanes, false>;
    return LaunchDependent(kernel, dim3(NormBlocks(rows)), dim3(kNormWarps * 32), 0, stream, a, u,
                           u_stride, rows, static_cast<int>(hd), w, b, eps, y, g);
  });
  return err != cudaSuccess ? err : cudaPeekAtLastError();
}

}  // namespace

cudaError_t LaunchNormMulU(const bf16* a, const bf16* u, int64_t u_stride, int64_t rows,
                           int64_t hd, const float* w, const float* b, float eps, bf16* y,
                           cudaStream_t stream) {
  return NormMulU(a, u, u_stride, rows, hd, w, b, eps, y, NormRowGather{}, stream);
}

cudaError_t LaunchNormMulUGather(const bf16* a, const bf16* u, int64_t u_stride,
                                 const int32_t* src_rows, int64_t rows, int64_t hd, const float* w,
                                 const float* b, float eps, bf16* y, const float* x,
                                 int64_t x_cols, float* x_out, cudaStream_t stream) {
  if (src_rows == nullptr || x == nullptr || x_out == nullptr || x_cols <= 0 || x_cols % 8 != 0 ||
      !Aligned16(x) || !Aligned16(x_out)) {
    return cudaErrorInvalidValue;
  }
  NormRowGather g;
  g.src_rows = src_rows;
  g.x = x;
  g.x_out = x_out;
  g.x_cols = x_cols;
  return NormMulU(a, u, u_stride, rows, hd, w, b, eps, y, g, stream);
}

}  // namespace hstu::cuda
