// Tolerances of every comparison in the tests, per dtype, in one place (STYLE habit 9).
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace hstu::test {

// fp32 vs fp32 computed in another order (BLAS blocking, paged vs contiguous): rounding only.
constexpr double kF32RelL2 = 1e-5;
constexpr double kF32Abs = 1e-5;
// fp32 CPU engine vs an independent float64 reference (scores).
constexpr double kReferenceScoreAbs = 1e-4;
// bf16 GPU vs fp32 CPU (DESIGN §2.4).
constexpr double kBf16RelL2 = 1e-2;
constexpr double kBf16ScoreAbs = 2e-3;
// The base model's scores (8 layers, d 1024) against the fp32 CPU engine: the bf16 format's own
// limit there is 6.4e-3 to 6.9e-3 (docs/kernel_rounds.md, round 31), so the bound leaves room.
constexpr double kBf16BaseScoreAbs = 1e-2;
// Backend parity on small random models WITHOUT position encoding: there the final hidden rows are
// made of layer outputs only, every bf16 activation rounding shows (measured hidden rel L2 2.4e-3 to
// 3.7e-3), and the random MLP head turns that into score differences of 2.2e-3 to 2.7e-3 (H200,
// 2026-11-21). kBf16ScoreAbs (2e-3) is kept for the engine-level check of DESIGN §2.4.
constexpr double kBf16ScoreAbsNoPositionEncoding = 4e-3;
// One rounding of an fp32 result to bf16 (8 significant bits: ≤ 2^-9 relative per element).
constexpr double kBf16RoundRelL2 = 4e-3;
// The same per element, bf16 GPU vs fp32 CPU of one element-wise op: half a bf16 unit from the
// rounding plus a few fp32 units from fast intrinsics (__expf) stays under one bf16 unit, 2^-7.
constexpr double kBf16RoundRelElement = 1.0 / 128;

// ‖a − b‖ / ‖b‖; NaN when any element is not finite so that a comparison never passes on NaN.
inline double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return NAN;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return NAN;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// max |a − b| / |b| over elements with b != 0 (a must then be exactly 0); NaN on any non-finite.
inline double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return NAN;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return NAN;
    if (b[i] == 0.f) {
      if (a[i] != 0.f) return INFINITY;
      continue;
    }
    m = std::max(m, std::abs(double(a[i]) - b[i]) / std::abs(double(b[i])));
  }
  return m;
}

inline double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return NAN;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return NAN;
    m = std::max(m, std::abs(double(a[i]) - b[i]));
  }
  return m;
}

}  // namespace hstu::test
