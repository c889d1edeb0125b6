#include "kernels/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace hstu::cpu {
namespace {

inline float Silu(float x) { return x / (1.f + std::exp(-x)); }

// Rounds x to its top 32 - dropped_bits bits, to nearest with ties to even.
float RoundMantissa(float x, int dropped_bits) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;  // NaN stays NaN
  const uint32_t half = (1u << (dropped_bits - 1)) - 1u;
  u += half + ((u >> dropped_bits) & 1u);  // a carry into the exponent is the right result
  u &= ~((1u << dropped_bits) - 1u);
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

}  // namespace

void EmbeddingGather(const EmbeddingParams<float>& p) {
  const int64_t d = p.hidden_dim;
  const float scale = std::sqrt(static_cast<float>(d));
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const float* src = p.token_types[r] == kItemToken
                           ? p.item_table + (p.token_ids[r] % p.item_rows) * d
                           : p.action_table + p.token_ids[r] * d;
    float* dst = p.out + r * d;
    if (p.position_table == nullptr) {
      std::memcpy(dst, src, sizeof(float) * d);
      continue;
    }
    const int64_t pos = std::min<int64_t>(p.positions[r], p.position_rows - 1);
    const float* pe = p.position_table + pos * d;
    for (int64_t c = 0; c < d; ++c) dst[c] = src[c] * scale + pe[c];
  }
}

void LayerNorm(const float* x, int64_t rows, int64_t cols, const float* w, const float* b, float eps,
               float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    double mean = 0.0;
    for (int64_t c = 0; c < cols; ++c) mean += xr[c];
    mean /= static_cast<double>(cols);
    double var = 0.0;
    for (int64_t c = 0; c < cols; ++c) var += (xr[c] - mean) * (xr[c] - mean);
    var /= static_cast<double>(cols);
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    const float m = static_cast<float>(mean);
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = (xr[c] - m) * inv * w[c] + b[c];
  }
}

void Gemm(const float* a, const float* b, const float* bias, int64_t m, int64_t n, int64_t k,
          float beta, float* c) {
  if (m == 0) return;
  if (bias != nullptr) {
    // Fold the bias into C so one sgemm with beta = 1 adds it.
    for (int64_t r = 0; r < m; ++r) {
      float* cr = c + r * n;
      if (beta == 0.f) {
        std::memcpy(cr, bias, sizeof(float) * n);
      } else {
        for (int64_t j = 0; j < n; ++j) cr[j] = beta * cr[j] + bias[j];
      }
    }
    beta = 1.f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.f, a, static_cast<int>(k), b, static_cast<int>(n), beta, c,
              static_cast<int>(n));
}

void SiluInPlace(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = Silu(x[i]);
}

void AppendKv(const AppendKvParams<float>& p) {
  const int H = p.kv.num_heads, D = p.kv.head_dim;
  const int64_t hd = static_cast<int64_t>(H) * D;
  for (int b = 0; b < p.kv.batch_size; ++b) {
    const int first_pos = p.kv.num_tokens[b] - p.num_new[b];
    for (int i = 0; i < p.num_new[b]; ++i) {
      const float* row = p.uvqk + (p.row_offsets[b] + i) * p.uvqk_row_stride;
      for (int h = 0; h < H; ++h) {
        std::memcpy(p.kv.K(b, first_pos + i, h), row + kK * hd + h * D, sizeof(float) * D);
        std::memcpy(p.kv.V(b, first_pos + i, h), row + kV * hd + h * D, sizeof(float) * D);
      }
    }
  }
}

void HstuAttention(const AttentionParams<float>& p, bool round_p_to_bf16) {
  const int H = p.kv.num_heads, D = p.kv.head_dim;
  const int64_t hd = static_cast<int64_t>(H) * D;
  const int64_t W = p.max_attn_len;
  std::vector<float> acc(D);
  for (int b = 0; b < p.kv.batch_size; ++b) {
    const int64_t hist_len = p.kv.num_tokens[b];
    const int64_t first_new = hist_len - p.num_new[b];
    for (int64_t r = p.row_offsets[b]; r < p.row_offsets[b + 1]; ++r) {
      const int64_t i = r - p.row_offsets[b];
      const bool is_candidate = i >= p.num_new[b];
      // Query id: a history token's position, or the history length for a candidate.
      const int64_t qid = is_candidate ? hist_len : first_new + i;
      const int64_t last_key = is_candidate ? hist_len - 1 : qid;  // inclusive, history keys
      const int64_t first_key = W > 0 ? std::max<int64_t>(0, qid - W) : 0;
      const float* row = p.uvqk + r * p.uvqk_row_stride;
      for (int h = 0; h < H; ++h) {
        const float* q = row + kQ * hd + h * D;
        std::fill(acc.begin(), acc.end(), 0.f);
        auto accumulate = [&](const float* k, const float* v) {
          float s = 0.f;
          for (int c = 0; c < D; ++c) s += q[c] * k[c];
          float w = Silu(p.alpha * s) * p.inv_norm;
          if (round_p_to_bf16) w = RoundToBf16(w);
          for (int c = 0; c < D; ++c) acc[c] += w * v[c];
        };
        for (int64_t j = first_key; j <= last_key; ++j) {
          accumulate(p.kv.K(b, static_cast<int>(j), h), p.kv.V(b, static_cast<int>(j), h));
        }
        if (is_candidate) accumulate(row + kK * hd + h * D, row + kV * hd + h * D);
        std::memcpy(p.out + r * hd + h * D, acc.data(), sizeof(float) * D);
      }
    }
  }
}

void NormMulU(const float* a, const float* u, int64_t u_stride, int64_t rows, int64_t hd,
              const float* w, const float* b, float eps, float* y) {
  LayerNorm(a, rows, hd, w, b, eps, y);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < hd; ++c) y[r * hd + c] *= u[r * u_stride + c];
  }
}

void L2NormalizeRows(float* x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * cols;
    double ss = 0.0;
    for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(xr[c]) * xr[c];
    const float inv = 1.f / std::max(static_cast<float>(std::sqrt(ss)), 1e-6f);
    for (int64_t c = 0; c < cols; ++c) xr[c] *= inv;
  }
}

float RoundToBf16(float x) { return RoundMantissa(x, 16); }
float RoundToTf32(float x) { return RoundMantissa(x, 13); }

void RoundToBf16InPlace(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = RoundToBf16(x[i]);
}

void RoundToTf32InPlace(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = RoundToTf32(x[i]);
}

void ReluInPlace(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = std::max(x[i], 0.f);
}

void SigmoidInPlace(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = ScoreFromLogit(x[i]);
}

}  // namespace hstu::cpu
