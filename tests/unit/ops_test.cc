// Each CPU op against a naive formula written differently (explicit loops, dense masks).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

std::vector<float> Random(size_t n, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

double SiluD(double x) { return x / (1.0 + std::exp(-x)); }

TEST(CpuOps, LayerNormMatchesFormula) {
  std::mt19937 rng(1);
  const int rows = 5, cols = 37;
  auto x = Random(rows * cols, rng, -3, 5), w = Random(cols, rng), b = Random(cols, rng);
  std::vector<float> out(rows * cols, NAN);
  cpu::LayerNorm(x.data(), rows, cols, w.data(), b.data(), 1e-5f, out.data());
  std::vector<float> ref(rows * cols);
  for (int r = 0; r < rows; ++r) {
    double s = 0, s2 = 0;
    for (int c = 0; c < cols; ++c) s += x[r * cols + c], s2 += double(x[r * cols + c]) * x[r * cols + c];
    const double mean = s / cols, var = s2 / cols - mean * mean;
    for (int c = 0; c < cols; ++c) ref[r * cols + c] = float((x[r * cols + c] - mean) / std::sqrt(var + 1e-5) * w[c] + b[c]);
  }
  EXPECT_LT(test::RelL2(out, ref), test::kF32RelL2);
}

TEST(CpuOps, SigmoidKeepsScoresInsideZeroOne) {
  std::vector<float> x = {0.f, 1.f, -2.5f, 16.f, 17.f, 40.f, -90.f, -104.f, -1e30f, INFINITY,
                          -INFINITY, NAN};
  const std::vector<float> logits = x;
  cpu::SigmoidInPlace(x.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i + 1 < x.size(); ++i) {
    const float plain = 1.f / (1.f + std::exp(-logits[i]));
    EXPECT_GT(x[i], 0.f) << logits[i];
    EXPECT_LT(x[i], 1.f) << logits[i];
    // Unchanged wherever the plain sigmoid is already inside (0, 1) and a normal float.
    if (plain >= kMinScore && plain <= kMaxScore) {
      EXPECT_EQ(x[i], plain) << logits[i];
    }
  }
  EXPECT_EQ(x[4], kMaxScore);   // 1/(1+e^-17) rounds to 1 in fp32
  EXPECT_EQ(x[9], kMaxScore);   // +inf
  EXPECT_EQ(x[8], kMinScore);   // rounds to 0
  EXPECT_EQ(x[10], kMinScore);  // -inf
  EXPECT_LT(x[3], kMaxScore);   // 1/(1+e^-16) is still below 1
  EXPECT_TRUE(std::isnan(x.back()));  // the engine refuses it; no clamp hides it
  EXPECT_EQ(kMaxScore, std::nextafter(1.f, 0.f));
  EXPECT_EQ(kMinScore, std::numeric_limits<float>::min());
}

// The GPU's roundings that CpuNumerics::kBf16 emulates: nearest, ties to even, on the bits.
TEST(CpuOps, RoundToBf16AndTf32) {
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  };
  EXPECT_EQ(cpu::RoundToBf16(1.f), 1.f);
  EXPECT_EQ(cpu::RoundToBf16(-2.5f), -2.5f);
  // bf16 keeps 8 significant bits: 1 + 2^-7 is exact, 1 + 2^-8 is a tie (to the even 1), 1 + 3·2^-8
  // a tie to the even 1 + 2^-6, and anything past half a step rounds up.
  EXPECT_EQ(cpu::RoundToBf16(1.f + 0x1p-7f), 1.f + 0x1p-7f);
  EXPECT_EQ(cpu::RoundToBf16(1.f + 0x1p-8f), 1.f);
  EXPECT_EQ(cpu::RoundToBf16(1.f + 3 * 0x1p-8f), 1.f + 0x1p-6f);
  EXPECT_EQ(cpu::RoundToBf16(1.f + 0x1p-8f + 0x1p-20f), 1.f + 0x1p-7f);
  EXPECT_EQ(cpu::RoundToBf16(-(1.f + 0x1p-8f + 0x1p-20f)), -(1.f + 0x1p-7f));
  EXPECT_EQ(cpu::RoundToBf16(0x1.fep-1f), 0x1.fep-1f);    // 0.99609375, exact
  EXPECT_EQ(cpu::RoundToBf16(0x1.ffp-1f), 1.f);           // the carry moves into the exponent
  EXPECT_EQ(cpu::RoundToBf16(3.4e38f), INFINITY);         // past bf16's largest finite
  EXPECT_EQ(cpu::RoundToBf16(-INFINITY), -INFINITY);
  EXPECT_TRUE(std::isnan(cpu::RoundToBf16(NAN)));
  EXPECT_TRUE(std::isnan(cpu::RoundToBf16(bits(0x7f800001u))));  // a NaN whose payload would round away
  EXPECT_EQ(cpu::RoundToBf16(0x1p-133f), 0x1p-133f);            // subnormals keep their top bits
  // TF32 keeps 11 significant bits.
  EXPECT_EQ(cpu::RoundToTf32(1.f + 0x1p-10f), 1.f + 0x1p-10f);
  EXPECT_EQ(cpu::RoundToTf32(1.f + 0x1p-11f), 1.f);
  EXPECT_EQ(cpu::RoundToTf32(1.f + 3 * 0x1p-11f), 1.f + 0x1p-9f);
  EXPECT_EQ(cpu::RoundToTf32(1.f + 0x1p-11f + 0x1p-20f), 1.f + 0x1p-10f);

  std::vector<float> v = {1.f + 0x1p-8f + 0x1p-20f, 0.1f, -7.3f};
  cpu::RoundToBf16InPlace(v.data(), static_cast<int64_t>(v.size()));
  for (float x : v) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    EXPECT_EQ(u & 0xffffu, 0u) << x;
  }
  EXPECT_EQ(v[0], 1.f + 0x1p-7f);
}

TEST(CpuOps, GemmWithBiasAndAccumulate) {
  std::mt19937 rng(2);
  const int m = 7, n = 13, k = 11;
  auto a = Random(m * k, rng), b = Random(k * n, rng), bias = Random(n, rng), c0 = Random(m * n, rng);
  std::vector<float> c = c0;
  cpu::Gemm(a.data(), b.data(), bias.data(), m, n, k, 1.f, c.data());
  std::vector<float> ref(m * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = c0[i * n + j] + bias[j];
      for (int p = 0; p < k; ++p) s += double(a[i * k + p]) * b[p * n + j];
      ref[i * n + j] = float(s);
    }
  EXPECT_LT(test::RelL2(c, ref), test::kF32RelL2);
  std::vector<float> c2(m * n, NAN);
  cpu::Gemm(a.data(), b.data(), nullptr, m, n, k, 0.f, c2.data());  // beta 0 ignores NaN in C
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) ref[i * n + j] -= c0[i * n + j] + bias[j];
  EXPECT_LT(test::RelL2(c2, ref), test::kF32RelL2);
}

TEST(CpuOps, EmbeddingGatherWithPositions) {
  std::mt19937 rng(3);
  const int d = 6, items = 10, actions = 4, prow = 5;
  auto it = Random(items * d, rng), ac = Random(actions * d, rng), pe = Random(prow * d, rng);
  std::vector<int64_t> ids = {3, 2, 27, 1, 9};
  std::vector<int32_t> types = {kItemToken, kActionToken, kItemToken, kActionToken, kItemToken};
  std::vector<int32_t> pos = {0, 1, 2, 3, 40};
  std::vector<float> out(ids.size() * d, NAN);
  EmbeddingParams<float> p{it.data(), ac.data(), pe.data(), items, actions, prow, d, 5,
                           ids.data(), types.data(), pos.data(), out.data()};
  cpu::EmbeddingGather(p);
  for (int r = 0; r < 5; ++r) {
    const float* src = types[r] == kItemToken ? &it[(ids[r] % items) * d] : &ac[ids[r] * d];
    const int prow_idx = std::min(pos[r], prow - 1);
    for (int c = 0; c < d; ++c) {
      EXPECT_NEAR(out[r * d + c], src[c] * std::sqrt(float(d)) + pe[prow_idx * d + c], 1e-5);
    }
  }
}

// A paged batch built from contiguous per-user K/V, with pages scattered in the pool.
struct PagedFixture {
  int H, D, page_size, B;
  std::vector<int> cached, num_new, num_cand;
  std::vector<std::vector<float>> hist_k, hist_v;  // per user [hist_len, H, D] (cached + new)
  std::vector<float> uvqk;                         // [rows, 4HD]
  std::vector<int32_t> row_offsets, indptr, page_ids, num_tokens;
  std::vector<float> pool;
  int64_t page_elems() const { return 2LL * page_size * H * D; }

  PagedFixture(int H_, int D_, int ps, std::vector<int> c, std::vector<int> n, std::vector<int> k,
               std::mt19937& rng)
      : H(H_), D(D_), page_size(ps), B(int(c.size())), cached(c), num_new(n), num_cand(k) {
    const int hd = H * D;
    row_offsets = {0};
    indptr = {0};
    int total_pages = 0;
    for (int b = 0; b < B; ++b) {
      const int len = cached[b] + num_new[b];
      total_pages += (len + ps - 1) / ps;
      num_tokens.push_back(len);
      row_offsets.push_back(row_offsets.back() + num_new[b] + num_cand[b]);
    }
    std::vector<int32_t> perm(total_pages + 3);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    pool = Random(perm.size() * page_elems(), rng);  // garbage where nothing is written
    uvqk = Random(size_t(row_offsets.back()) * 4 * hd, rng);
    int next = 0;
    for (int b = 0; b < B; ++b) {
      const int len = num_tokens[b];
      for (int p = 0; p < (len + ps - 1) / ps; ++p) page_ids.push_back(perm[next++]);
      indptr.push_back(int32_t(page_ids.size()));
      hist_k.push_back(Random(size_t(len) * hd, rng));
      hist_v.push_back(Random(size_t(len) * hd, rng));
      // The new rows' K/V are in uvqk; mirror them into the contiguous copy.
      for (int i = 0; i < num_new[b]; ++i) {
        const float* row = &uvqk[size_t(row_offsets[b] + i) * 4 * hd];
        std::copy(row + kK * hd, row + kK * hd + hd, &hist_k[b][size_t(cached[b] + i) * hd]);
        std::copy(row + kV * hd, row + kV * hd + hd, &hist_v[b][size_t(cached[b] + i) * hd]);
      }
    }
  }
  PagedKvView<float> View() {
    return MakePagedKvView(pool.data(), page_size, H, D, B, indptr.data(), page_ids.data(),
                           num_tokens.data());
  }
  // Writes the cached (pre-existing) tokens into the pages directly.
  void WriteCached() {
    auto v = View();
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < cached[b]; ++t)
        for (int h = 0; h < H; ++h)
          for (int c = 0; c < D; ++c) {
            v.K(b, t, h)[c] = hist_k[b][(size_t(t) * H + h) * D + c];
            v.V(b, t, h)[c] = hist_v[b][(size_t(t) * H + h) * D + c];
          }
  }
};

TEST(CpuOps, AppendKvWritesEveryNewTokenIntoItsPage) {
  std::mt19937 rng(4);
  for (int ps : {1, 3, 7, 17}) {
    PagedFixture f(2, 8, ps, {0, 5, 33}, {4, 0, 9}, {1, 2, 3}, rng);
    AppendKvParams<float> p{f.uvqk.data(), 4 * 16, f.row_offsets.data(), f.num_new.data(), f.View()};
    cpu::AppendKv(p);
    auto v = f.View();
    for (int b = 0; b < f.B; ++b)
      for (int t = f.cached[b]; t < f.num_tokens[b]; ++t)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < 8; ++c) {
            ASSERT_EQ(v.K(b, t, h)[c], f.hist_k[b][(size_t(t) * 2 + h) * 8 + c]) << "ps " << ps;
            ASSERT_EQ(v.V(b, t, h)[c], f.hist_v[b][(size_t(t) * 2 + h) * 8 + c]) << "ps " << ps;
          }
  }
}

// Naive HSTU attention: dense allowed(i, j) over a contiguous key list that includes candidates.
// With round_p, each weight is rounded to bf16 before it multiplies v (the GPU's P).
std::vector<float> NaiveAttention(const PagedFixture& f, float alpha, float inv_n, int W,
                                  bool round_p = false) {
  const int H = f.H, D = f.D, hd = H * D;
  std::vector<float> out(size_t(f.row_offsets.back()) * hd, 0.f);
  for (int b = 0; b < f.B; ++b) {
    const int L = f.num_tokens[b];
    const int nq = f.num_new[b] + f.num_cand[b];
    // Keys of this user: every history token, then every candidate row of this pass.
    auto key_id = [&](int j) { return j < L ? j : L; };
    auto allowed = [&](int qi, int kj) {
      const bool q_cand = qi >= f.num_new[b];
      const int q_id = q_cand ? L : f.cached[b] + qi;
      const bool k_cand = kj >= L;
      if (k_cand) return q_cand && (kj - L) == (qi - f.num_new[b]);  // only itself
      if (!q_cand && kj > q_id) return false;
      return W == 0 || q_id - key_id(kj) <= W;
    };
    for (int qi = 0; qi < nq; ++qi) {
      const float* qrow = &f.uvqk[size_t(f.row_offsets[b] + qi) * 4 * hd];
      for (int h = 0; h < H; ++h) {
        for (int kj = 0; kj < L + f.num_cand[b]; ++kj) {
          if (!allowed(qi, kj)) continue;
          const float *k, *v;
          if (kj < L) {
            k = &f.hist_k[b][(size_t(kj) * H + h) * D];
            v = &f.hist_v[b][(size_t(kj) * H + h) * D];
          } else {
            const float* crow = &f.uvqk[size_t(f.row_offsets[b] + f.num_new[b] + kj - L) * 4 * hd];
            k = crow + kK * hd + h * D;
            v = crow + kV * hd + h * D;
          }
          double s = 0;
          for (int c = 0; c < D; ++c) s += double(qrow[kQ * hd + h * D + c]) * k[c];
          double p = SiluD(alpha * s) * inv_n;
          if (round_p) p = cpu::RoundToBf16(static_cast<float>(p));
          for (int c = 0; c < D; ++c) out[size_t(f.row_offsets[b] + qi) * hd + h * D + c] += float(p * v[c]);
        }
      }
    }
  }
  return out;
}

TEST(CpuOps, HstuAttentionMatchesDenseMaskFormula) {
  std::mt19937 rng(5);
  for (int ps : {1, 3, 7, 17, 32}) {
    for (int W : {0, 5}) {
      PagedFixture f(2, 16, ps, {0, 10, 40, 3}, {6, 0, 7, 0}, {3, 2, 1, 0}, rng);
      f.WriteCached();
      AppendKvParams<float> ap{f.uvqk.data(), 4 * 32, f.row_offsets.data(), f.num_new.data(), f.View()};
      cpu::AppendKv(ap);
      std::vector<float> out(size_t(f.row_offsets.back()) * 32, NAN);
      AttentionParams<float> p;
      p.uvqk = f.uvqk.data();
      p.uvqk_row_stride = 4 * 32;
      p.out = out.data();
      p.num_rows = f.row_offsets.back();
      p.row_offsets = f.row_offsets.data();
      p.num_new = f.num_new.data();
      p.kv = f.View();
      p.alpha = 0.25f;
      p.inv_norm = 1.f / 100.f;
      p.max_attn_len = W;
      cpu::HstuAttention(p);
      auto ref = NaiveAttention(f, 0.25f, 1.f / 100.f, W);
      EXPECT_LT(test::RelL2(out, ref), test::kF32RelL2) << "page size " << ps << " window " << W;

      // P rounded to bf16: close to the formula with P rounded, a bf16 step from the one without.
      std::vector<float> out_bf16(out.size(), NAN);
      p.out = out_bf16.data();
      cpu::HstuAttention(p, /*round_p_to_bf16=*/true);
      const auto ref_bf16 = NaiveAttention(f, 0.25f, 1.f / 100.f, W, /*round_p=*/true);
      const double off = test::RelL2(out_bf16, ref);
      EXPECT_GT(off, 10 * test::kF32RelL2) << "page size " << ps << " window " << W;
      EXPECT_LT(off, test::kBf16RoundRelL2) << "page size " << ps << " window " << W;
      EXPECT_LT(test::RelL2(out_bf16, ref_bf16), 0.1 * off) << "page size " << ps << " window " << W;
    }
  }
}

TEST(CpuOps, NormMulUAndL2Normalize) {
  std::mt19937 rng(6);
  const int rows = 3, hd = 10, stride = 40;
  auto a = Random(rows * hd, rng), u = Random(rows * stride, rng), w = Random(hd, rng), b = Random(hd, rng);
  std::vector<float> y(rows * hd, NAN), ln(rows * hd);
  cpu::NormMulU(a.data(), u.data(), stride, rows, hd, w.data(), b.data(), 1e-5f, y.data());
  cpu::LayerNorm(a.data(), rows, hd, w.data(), b.data(), 1e-5f, ln.data());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < hd; ++c) EXPECT_NEAR(y[r * hd + c], ln[r * hd + c] * u[r * stride + c], 1e-6);
  const std::vector<float> before = y;
  cpu::L2NormalizeRows(y.data(), rows, hd);
  for (int r = 0; r < rows; ++r) {
    double n = 0;
    for (int c = 0; c < hd; ++c) n += double(before[r * hd + c]) * before[r * hd + c];
    ASSERT_GT(n, 1e-3);  // far from the floor below
    // Each element is its row's value over the row's norm (so the row keeps its direction).
    for (int c = 0; c < hd; ++c) {
      EXPECT_NEAR(y[r * hd + c], before[r * hd + c] / std::sqrt(n), 1e-6) << r << "," << c;
    }
  }
  std::vector<float> z(4, 0.f);
  cpu::L2NormalizeRows(z.data(), 1, 4);  // the 1e-6 floor keeps zeros finite
  for (float v : z) EXPECT_EQ(v, 0.f);
}

}  // namespace
}  // namespace hstu
