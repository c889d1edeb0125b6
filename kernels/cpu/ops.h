// fp32 reference ops: the oracle every CUDA op is checked against. Row-major; shapes in comments.
// All functions are thread-compatible (no shared state) and never allocate on the caller's behalf
// except where noted.
#pragma once

#include <cstdint>

#include "kernels/params.h"

namespace hstu::cpu {

// out[r] = table[id] (+ position encoding: out[r] = out[r] * sqrt(d) + P[min(pos, P_rows - 1)]).
// Preconditions (checked by the caller's validation): ids in range for their table.
void EmbeddingGather(const EmbeddingParams<float>& p);

// out = LayerNorm(x) * w + b over the last dim.  x, out: [rows, cols]; w, b: [cols]. out may be x.
void LayerNorm(const float* x, int64_t rows, int64_t cols, const float* w, const float* b, float eps,
               float* out);

// c[m, n] = beta * c + a[m, k] · b[k, n] (+ bias[n] when bias != nullptr). BLAS sgemm.
void Gemm(const float* a, const float* b, const float* bias, int64_t m, int64_t n, int64_t k,
          float beta, float* c);

// x = SiLU(x) element-wise over `count` elements.
void SiluInPlace(float* x, int64_t count);

// Writes K, V of each user's new history rows into the pages (see AppendKvParams).
void AppendKv(const AppendKvParams<float>& p);

// HSTU attention (see AttentionParams): out[i] = sum_j SiLU(alpha <q_i, k_j>) / N * v_j over the
// allowed pairs. Parallel over heads and rows is not attempted: this is the readable oracle.
// With `round_p_to_bf16` each weight SiLU(alpha s) / N is rounded to bf16 before it multiplies v_j,
// as the GPU's P·V MMA takes it (DESIGN §2.4).
void HstuAttention(const AttentionParams<float>& p, bool round_p_to_bf16 = false);

// y[r] = LayerNorm(a[r]; w, b) * u[r] over H*D columns.
//   a: [rows, hd] (row stride hd); u: column block of uvqk rows, row stride `u_stride`; y: [rows, hd].
void NormMulU(const float* a, const float* u, int64_t u_stride, int64_t rows, int64_t hd,
              const float* w, const float* b, float eps, float* y);

// x[r] /= max(|x[r]|_2, 1e-6) for each row of x: [rows, cols].
void L2NormalizeRows(float* x, int64_t rows, int64_t cols);

// The GPU's roundings, for the CPU backend's emulation of them (CpuNumerics::kBf16):
// to bf16 (8 significant bits) and to TF32 (11), both to nearest with ties to even; NaN stays NaN,
// values beyond the format's largest finite become infinities.
float RoundToBf16(float x);
float RoundToTf32(float x);
void RoundToBf16InPlace(float* x, int64_t count);
void RoundToTf32InPlace(float* x, int64_t count);

// x = max(x, 0) / ScoreFromLogit(x) (the sigmoid inside (0, 1)) element-wise.
void ReluInPlace(float* x, int64_t count);
void SigmoidInPlace(float* x, int64_t count);

}  // namespace hstu::cpu
