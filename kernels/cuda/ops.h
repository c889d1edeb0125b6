// Launchers of the CUDA kernels (bf16 activations and KV, fp32 residual stream and statistics).
//
// Every launcher validates its arguments (cudaErrorInvalidValue for a bad one, with nothing
// launched), enqueues work on `stream` without synchronising, and returns the launch status
// (cudaPeekAtLastError, so it is safe inside a stream capture). Shapes are row-major.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/params.h"

namespace hstu::cuda {

using bf16 = __nv_bfloat16;

// Head dims the attention kernel is instantiated for; anything else is rejected with
// cudaErrorInvalidValue (see HeadDimSupported / kSupportedHeadDimsText).
inline constexpr int kSupportedHeadDims[] = {64, 128, 256};
inline constexpr const char* kSupportedHeadDimsText = "64, 128, 256";
inline bool HeadDimSupported(int d) { return d == 64 || d == 128 || d == 256; }

// x[r] = E[id] (* sqrt(d) + P[min(pos, P_rows - 1)] with position encoding), as fp32 into the
// residual stream `out` [num_rows, d]; p.out must be nullptr. With norm_out != nullptr the first
// layer's input LayerNorm is fused: norm_out[r] = LayerNorm(out[r]) * norm_w + norm_b, bf16
// [num_rows, d] (norm_w, norm_b: [d] fp32), bit for bit what LaunchLayerNorm(out, …) would write,
// without reading `out` back. Requires d % 8 == 0 and 16-byte aligned tables and outputs. Ids are
// assumed valid (the engine validates).
cudaError_t LaunchEmbeddingGather(const EmbeddingParams<bf16>& p, float* out, const float* norm_w,
                                  const float* norm_b, float eps, bf16* norm_out,
                                  cudaStream_t stream);

// out = LayerNorm(x) * w + b (fp32 two-pass statistics), rounded to bf16.
//   x: [rows, cols] fp32; w, b: [cols] fp32; out: [rows, cols] bf16. cols % 8 == 0; 16-byte
//   aligned pointers. One warp per row up to 4096 columns, one block per row beyond.
cudaError_t LaunchLayerNorm(const float* x, int64_t rows, int64_t cols, const float* w,
                            const float* b, float eps, bf16* out, cudaStream_t stream);

// uvqk = SiLU(uvqk + bias) in place (bf16 in, fp32 bias and SiLU, bf16 out), and the post-SiLU K
// and V of each user's new history rows written into their pages (AppendKvParams; the same slots
// as cpu::AppendKv) instead of back to those rows: a new history row's v and k columns keep the
// GEMM output, every other column of every row gets SiLU. One pass over the rows.
//   uvqk: [rows, cols] bf16, cols = 4·H·D (u | v | q | k), row stride cols; bias: [cols] fp32.
//   p.uvqk must be uvqk and p.uvqk_row_stride cols. Rows at or past row_offsets[B] (padding) get
//   bias + SiLU only. 16-byte aligned uvqk, bias and pool.
cudaError_t LaunchBiasSiluAppendKv(bf16* uvqk, int64_t rows, int64_t cols, const float* bias,
                                   const AppendKvParams<bf16>& p, cudaStream_t stream);

// The append of LaunchBiasSiluAppendKv alone, for uvqk rows that already hold their post-SiLU
// values (written by LaunchGemmBiasSilu): each new history row's v and k columns are copied into
// its page slot; the rows are not modified. Same arguments and checks as LaunchBiasSiluAppendKv
// (p.uvqk: [rows, 4·H·D], p.uvqk_row_stride = 4·H·D).
cudaError_t LaunchAppendKvFromRows(int64_t rows, const AppendKvParams<bf16>& p,
                                   cudaStream_t stream);

// x = SiLU(x + bias) in place, for rows that have no pages (the materialised attention baseline).
// x: [rows, cols] bf16 (row stride cols, cols % 8 == 0); bias: [cols] fp32. Same kernel and
// rounding as LaunchBiasSiluAppendKv.
cudaError_t LaunchBiasSilu(bf16* x, int64_t rows, int64_t cols, const float* bias,
                           cudaStream_t stream);

// y[r] = LayerNorm(a[r]; w, b) * u[r] over hd columns (fp32 statistics).
//   a: [rows, hd] bf16; u: [rows, u_stride] bf16 (the u block of uvqk rows); y: [rows, hd] bf16.
//   hd % 8 == 0, u_stride % 8 == 0; 16-byte aligned pointers. Warp per row up to hd = 4096.
cudaError_t LaunchNormMulU(const bf16* a, const bf16* u, int64_t u_stride, int64_t rows,
                           int64_t hd, const float* w, const float* b, float eps, bf16* y,
                           cudaStream_t stream);

// The same for gathered rows: y[r] = LayerNorm(a[src_rows[r]]; w, b) * u[src_rows[r]], and
// x_out[r] = x[src_rows[r]] (fp32, x_cols wide, x_cols % 8 == 0), for r < rows. The last layer's
// candidate rows, compacted for its output projection (the rows feed nothing else).
cudaError_t LaunchNormMulUGather(const bf16* a, const bf16* u, int64_t u_stride,
                                 const int32_t* src_rows, int64_t rows, int64_t hd, const float* w,
                                 const float* b, float eps, bf16* y, const float* x,
                                 int64_t x_cols, float* x_out, cudaStream_t stream);

// For each i < num_rows: raw[i] = x[rows[i]] (when raw != nullptr) and
// normed[i] = x[rows[i]] / max(|x[rows[i]]|_2, 1e-6).  x: [*, cols] fp32; raw, normed: [num_rows, cols].
// rows == nullptr: row i of x itself.
cudaError_t LaunchGatherL2Normalize(const float* x, const int32_t* rows, int64_t num_rows,
                                    int64_t cols, float* raw, float* normed, cudaStream_t stream);

enum class Activation : int32_t { kNone = 0, kRelu = 1, kSigmoid = 2 };
// x = act(x + bias) in place. x: [rows, cols] fp32; bias: [cols] fp32 or nullptr.
cudaError_t LaunchBiasActivation(float* x, int64_t rows, int64_t cols, const float* bias,
                                 Activation act, cudaStream_t stream);

// The head's narrow last layer in one kernel, fused with the bias and ReLU of the layer before it
// and with the L2 normalisation of the head's input: for each row r,
//   s = 1 / max(|norm_rows[r]|_2, 1e-6) (norm_cols floats), or 1 when norm_rows is nullptr;
//   with in_bias: h = max(s · in[r] + in_bias, 0), out[r][o] = act(Σ_i h[i] · w[i][o] + bias[o]);
//   without:      out[r][o] = act(s · Σ_i in[r][i] · w[i][o] + bias[o]);
// in fp32 (a warp a row). (x/|x|)·W = (x·W)/|x|, so a head of one or two layers needs no
// normalisation pass; and a GEMM of 4 output columns is a split-K kernel, its reduction and a bias
// pass, where this is one launch.
// w: [in_cols, out_cols] row-major; bias: [out_cols] or nullptr; out: [rows, out_cols].
// HeadOutputFits says which shapes it takes (the weights are staged in shared memory).
inline constexpr int64_t kHeadOutMaxCols = 16;
inline constexpr int64_t kHeadOutMaxSharedFloats = 12288;  // 48 KB
bool HeadOutputFits(int64_t in_cols, int64_t out_cols);
cudaError_t LaunchHeadOutput(const float* in, int64_t rows, int64_t in_cols, const float* in_bias,
                             const float* norm_rows, int64_t norm_cols, const float* w,
                             const float* bias, int64_t out_cols, Activation act, float* out,
                             cudaStream_t stream);

// dst[0, bytes) = src[0, bytes) by the SMs' loads and stores, for the step's small transfers
// between device memory and pinned host memory (cudaMallocHost: device-accessible under unified
// addressing). A cudaMemcpyAsync of the same direction queues behind every copy the copy engines
// already hold, on any stream: a few KB of step metadata or scores waited up to the whole KV onload
// or write-behind offload in flight (2.4 ms behind 128 MiB, measured on an H200). Both pointers
// 16-byte aligned; the ranges must not overlap.
cudaError_t LaunchSmCopy(void* dst, const void* src, size_t bytes, cudaStream_t stream);

// out[i] = bf16(in[i]) and back; used for weights at load time and by tests.
cudaError_t LaunchF32ToBf16(const float* in, int64_t count, bf16* out, cudaStream_t stream);
cudaError_t LaunchBf16ToF32(const bf16* in, int64_t count, float* out, cudaStream_t stream);

}  // namespace hstu::cuda
