#include "client/latency_histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace hstu::loadgen {

LatencyHistogram::LatencyHistogram() : buckets_((kPowers + 1) << kSubBits, 0) {}

int LatencyHistogram::Index(uint64_t us) {
  // Values below 64 µs are exact; above, each power of two [2^k, 2^(k+1)) has 64 linear buckets.
  if (us < (1u << kSubBits)) return static_cast<int>(us);
  const int k = 63 - std::countl_zero(us);  // 2^k <= us
  const int shift = k - kSubBits;
  const int power = std::min(k - kSubBits + 1, kPowers);
  const int sub = static_cast<int>((us >> shift) & ((1u << kSubBits) - 1));
  return power >= kPowers ? ((kPowers + 1) << kSubBits) - 1 : (power << kSubBits) + sub;
}

double LatencyHistogram::UpperEdgeSeconds(int idx) {
  const int power = idx >> kSubBits;
  const int sub = idx & ((1 << kSubBits) - 1);
  double us;
  if (power == 0) {
    us = sub + 1;
  } else {
    const int shift = power - 1;
    us = static_cast<double>((static_cast<uint64_t>((1 << kSubBits) + sub) + 1) << shift);
  }
  return us * 1e-6;
}

void LatencyHistogram::Record(double seconds) {
  const double us = std::max(0.0, seconds * 1e6);
  ++buckets_[Index(static_cast<uint64_t>(us))];
  ++count_;
  sum_ += seconds;
  max_ = std::max(max_, seconds);
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  for (size_t i = 0; i < buckets_.size(); ++i) buckets_[i] += other.buckets_[i];
  count_ += other.count_;
  sum_ += other.sum_;
  max_ = std::max(max_, other.max_);
}

void LatencyHistogram::Clear() {
  std::fill(buckets_.begin(), buckets_.end(), 0);
  count_ = 0;
  sum_ = 0;
  max_ = 0;
}

double LatencyHistogram::Quantile(double q) const {
  if (count_ == 0) return 0;
  const int64_t rank = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(q * count_)));
  int64_t acc = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    acc += buckets_[i];
    if (acc >= rank) return std::min(UpperEdgeSeconds(static_cast<int>(i)), max_);
  }
  return max_;
}

}  // namespace hstu::loadgen
