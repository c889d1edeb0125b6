#include "engine/onload_policy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hstu {

const char* OnloadPolicyName(OnloadPolicy p) {
  switch (p) {
    case OnloadPolicy::kCost: return "cost";
    case OnloadPolicy::kAlways: return "always";
  }
  return "unknown";
}

absl::StatusOr<OnloadPolicy> ParseOnloadPolicy(absl::string_view name) {
  for (OnloadPolicy p : {OnloadPolicy::kCost, OnloadPolicy::kAlways}) {
    if (name == OnloadPolicyName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("onload policy '", name, "' is not one of: cost, always"));
}

OnloadCostModel::OnloadCostModel(double fixed_bytes_per_second, double fixed_seconds_per_token)
    : fixed_bytes_per_second_(fixed_bytes_per_second),
      fixed_seconds_per_token_(fixed_seconds_per_token) {}

double OnloadCostModel::bytes_per_second() const {
  if (fixed_bytes_per_second_ > 0) return fixed_bytes_per_second_;
  return copy_seconds_ > 0 ? copy_bytes_ / copy_seconds_ : kStartBytesPerSecond;
}

double OnloadCostModel::seconds_per_token() const {
  if (fixed_seconds_per_token_ > 0) return fixed_seconds_per_token_;
  if (!(compute_tokens_ > 0)) return kStartSecondsPerToken;
  const double ratio = compute_seconds_ / compute_tokens_;
  if (fit_n_ < 2) return ratio;
  const double mean_x = fit_x_ / fit_n_, mean_y = fit_y_ / fit_n_;
  const double var_x = fit_xx_ / fit_n_ - mean_x * mean_x;
  // Sizes within ±25 % of each other say little about the slope.
  if (!(var_x > 0.0625 * mean_x * mean_x)) return ratio;
  const double slope = (fit_xy_ / fit_n_ - mean_x * mean_y) / var_x;
  return std::clamp(slope, 0.1 * ratio, ratio);
}

double OnloadCostModel::queued_seconds(double now) const {
  return std::max(0.0, copies_done_at_ - now);
}

bool OnloadCostModel::ShouldOnload(int64_t bytes, int64_t tokens, double now,
                                   double overlap_seconds) const {
  const double copy_s = queued_seconds(now) + static_cast<double>(bytes) / bytes_per_second();
  const double recompute_s = static_cast<double>(tokens) * seconds_per_token();
  return copy_s <= recompute_s + std::max(0.0, overlap_seconds);
}

double OnloadCostModel::forward_fixed_seconds() const {
  if (fixed_seconds_per_token_ > 0 || !(fit_n_ > 0)) return 0;
  const double mean_x = fit_x_ / fit_n_, mean_y = fit_y_ / fit_n_;
  return std::max(0.0, mean_y - seconds_per_token() * mean_x);
}

double OnloadCostModel::ForwardSeconds(double rows) const {
  if (!(rows > 0)) return 0;
  return forward_fixed_seconds() + rows * seconds_per_token();
}

double OnloadCostModel::OverlapSeconds(double rows, int num_layers) const {
  if (num_layers <= 0) return 0;
  return ForwardSeconds(rows) * (num_layers - 1) / num_layers;
}

void OnloadCostModel::CopyIssued(int64_t bytes, double now) {
  const double copy_s = static_cast<double>(bytes) / bytes_per_second();
  copies_done_at_ = std::max(copies_done_at_, now) + copy_s;
}

void OnloadCostModel::CopiesIdle(double now) { copies_done_at_ = std::min(copies_done_at_, now); }

void OnloadCostModel::ObserveCopy(int64_t bytes, double seconds) {
  if (fixed_bytes_per_second_ > 0 || bytes <= 0 || !(seconds > 0)) return;
  copy_bytes_ = kKeep * copy_bytes_ + static_cast<double>(bytes);
  copy_seconds_ = kKeep * copy_seconds_ + seconds;
}

void OnloadCostModel::ObserveCompute(int64_t tokens, double seconds) {
  if (fixed_seconds_per_token_ > 0 || tokens <= 0 || !(seconds > 0)) return;
  compute_tokens_ = kKeep * compute_tokens_ + static_cast<double>(tokens);
  compute_seconds_ = kKeep * compute_seconds_ + seconds;
  const double x = static_cast<double>(tokens);
  fit_n_ = kKeep * fit_n_ + 1;
  fit_x_ = kKeep * fit_x_ + x;
  fit_y_ = kKeep * fit_y_ + seconds;
  fit_xx_ = kKeep * fit_xx_ + x * x;
  fit_xy_ = kKeep * fit_xy_ + x * seconds;
}

}  // namespace hstu
