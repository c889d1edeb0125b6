// Onload or recompute (docs/architecture.md, host tier): a user whose KV lives only on the host
// tier can get it back over PCIe or have those tokens recomputed on the GPU. On an H200 with the
// base model the copy (32 KiB per token at ~54 GB/s, ~0.6 us per token) is slower than the
// recompute (~0.36-0.46 us per token), so onloading every host hit made the server slower than no
// cache at all. The cost rule onloads when the copy, queued behind the copies already issued,
// finishes no later than the recompute would plus the compute it overlaps: a forward waits for
// each layer's pages right before that layer, so a copy hides behind the rest of its wave's
// compute (all but the last layer's share of it) and costs the wave nothing there.
//
// OnloadCostModel holds the two rates and the copy backlog. Times are seconds on one monotonic
// clock, passed in by the caller so that tests can fix them. Not thread-safe: the engine's thread
// owns it.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hstu {

enum class OnloadPolicy : int {
  kCost,    // onload a host hit only when the copy beats recomputing it (the default)
  kAlways,  // onload every host hit
};
const char* OnloadPolicyName(OnloadPolicy p);  // "cost" | "always"
// INVALID_ARGUMENT naming the allowed values otherwise.
absl::StatusOr<OnloadPolicy> ParseOnloadPolicy(absl::string_view name);

class OnloadCostModel {
 public:
  // Start values until the first measurement: about the H200's pinned host → GPU rate, and about
  // the base model's no-cache forward per row (history tokens + candidates) at batch 1.
  static constexpr double kStartBytesPerSecond = 50e9;
  static constexpr double kStartSecondsPerToken = 0.5e-6;

  // A rate > 0 is fixed (observations of it are ignored); 0 means measured, from the start value.
  OnloadCostModel(double fixed_bytes_per_second, double fixed_seconds_per_token);

  // Would `bytes` of host → GPU copies issued at `now`, behind every copy still queued, finish no
  // later than recomputing `tokens` tokens would, plus `overlap_seconds` of compute that runs
  // while the copy does whichever way the user goes (OverlapSeconds)? Ties go to the copy: it
  // spends PCIe, not GPU time.
  bool ShouldOnload(int64_t bytes, int64_t tokens, double now, double overlap_seconds = 0) const;
  // The compute a wave's copies overlap when the wave computes `rows` other rows through
  // `num_layers` layers: the forward's time for them (its fixed part and the rows at the marginal
  // rate), of which only the last layer's share must follow the last copy.
  double OverlapSeconds(double rows, int num_layers) const;
  // A forward's time for `rows` rows: its fixed part and the rows at the marginal rate.
  double ForwardSeconds(double rows) const;
  // `bytes` of host → GPU copies were issued at `now` (onloads and prefetches share the link).
  void CopyIssued(int64_t bytes, double now);
  // Every host → GPU copy issued so far has completed (by `now`).
  void CopiesIdle(double now);
  // One completed host → GPU transfer as timed by the backend (copy-engine time, not waits).
  void ObserveCopy(int64_t bytes, double seconds);
  // One forward pass of `tokens` rows that waited for no copy.
  void ObserveCompute(int64_t tokens, double seconds);

  // The recompute rate is the marginal cost of one more row: a forward has a fixed part (launches,
  // weights, the head) that the wave pays anyway, so when the recent forwards' sizes vary enough it
  // is the slope of a least-squares line through (rows, seconds); otherwise, and never above it,
  // seconds per row of the recent forwards. (At concurrency 1 on an H200, forwards of 384 and
  // ~3800 rows took ~0.9 and ~2.0 ms: 0.77 µs per row on average, 0.32 µs per extra row.)

  double bytes_per_second() const;
  double seconds_per_token() const;
  // A forward's fixed part (launches, weight reads, the head): the intercept of the line whose
  // slope is seconds_per_token(); 0 with a fixed rate or without forwards of different sizes.
  double forward_fixed_seconds() const;
  // Estimated time until the copies issued so far are done (0 when idle).
  double queued_seconds(double now) const;

 private:
  // Each new sample keeps this share of the older ones' weight: a rate follows the last ~10
  // samples, each weighted by its size (bytes, rows), so a tiny copy or pass cannot swing it.
  static constexpr double kKeep = 0.9;

  double fixed_bytes_per_second_;
  double fixed_seconds_per_token_;
  double copy_bytes_ = 0, copy_seconds_ = 0;        // decayed sums of copy samples
  double compute_tokens_ = 0, compute_seconds_ = 0;  // decayed sums of forward samples
  // Decayed least-squares sums over forward samples, each of weight 1: n, Σx, Σy, Σx², Σxy.
  double fit_n_ = 0, fit_x_ = 0, fit_y_ = 0, fit_xx_ = 0, fit_xy_ = 0;
  double copies_done_at_ = 0;                        // estimated end of the copy backlog
};

}  // namespace hstu
