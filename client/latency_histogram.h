// Latency histogram with bounded relative error (log-linear buckets, HdrHistogram style): values
// from 1 µs to 2^36 µs (~19 h), 64 sub-buckets per power of two (< 1.6% error). Mergeable.
//
// Thread-safety: none; callers lock or keep one per thread and Merge().
#pragma once

#include <cstdint>
#include <vector>

namespace hstu::loadgen {

class LatencyHistogram {
 public:
  LatencyHistogram();
  void Record(double seconds);
  void Merge(const LatencyHistogram& other);
  void Clear();
  int64_t count() const { return count_; }
  double mean_seconds() const { return count_ ? sum_ / static_cast<double>(count_) : 0; }
  double max_seconds() const { return max_; }
  // q in [0, 1]; the upper edge of the bucket holding the q-quantile (0 when empty).
  double Quantile(double q) const;

 private:
  static constexpr int kSubBits = 6;  // 64 sub-buckets per power of two
  static constexpr int kPowers = 31;  // buckets up to 2^36 µs (~19 h); above, the last one
  static int Index(uint64_t us);
  static double UpperEdgeSeconds(int idx);

  std::vector<int64_t> buckets_;
  int64_t count_ = 0;
  double sum_ = 0;
  double max_ = 0;
};

}  // namespace hstu::loadgen
