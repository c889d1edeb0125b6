// The server's use of prometheus-cpp (core only; the HTTP side is server/http_exposer.h): a
// family registered with its label names fixed, so that a series is named by its label values in
// order, and counters that mirror totals kept elsewhere (the engine's stats) at scrape time.
//
// Thread-safety: as prometheus-cpp's families and metrics, which are thread-safe.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace hstu::server {

// Not copyable or movable (it holds a mutex): built in place from RegisterCounter & co.
template <typename T>
class LabeledFamily {
 public:
  LabeledFamily(prometheus::Family<T>& family, std::string name,
                std::vector<std::string> label_names, std::vector<double> buckets)
      : family_(family),
        name_(std::move(name)),
        label_names_(std::move(label_names)),
        buckets_(std::move(buckets)) {}

  // The series with these label values, created at the first call. `values` has one entry per
  // label name (aborts otherwise: a programming error). Later calls find it here: prometheus-cpp's
  // Family::Add builds a metric (for a histogram, its buckets) on every call, then drops it when
  // the series exists.
  T& WithLabels(const std::vector<std::string>& values) const {
    if (values.size() != label_names_.size()) {
      std::fprintf(stderr, "metric %s: %zu label values for %zu labels\n", name_.c_str(),
                   values.size(), label_names_.size());
      std::abort();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = series_.find(values); it != series_.end()) return *it->second;
    prometheus::Labels labels;
    for (size_t i = 0; i < values.size(); ++i) labels.emplace(label_names_[i], values[i]);
    T* series = nullptr;
    if constexpr (std::is_same_v<T, prometheus::Histogram>) {
      series = &family_.Add(labels, buckets_);
    } else {
      series = &family_.Add(labels);
    }
    series_.emplace(values, series);
    return *series;
  }

 private:
  prometheus::Family<T>& family_;
  const std::string name_;
  const std::vector<std::string> label_names_;
  const std::vector<double> buckets_;  // histograms only: ascending upper bounds, +Inf implied
  mutable std::mutex mu_;
  mutable std::map<std::vector<std::string>, T*> series_;  // owned by family_
};

// Registers a family in `registry` (prometheus-cpp keeps it for the registry's life).
// prometheus-cpp 1.0.1 writes the help text unescaped: one with a backslash or a newline aborts
// here (a programming error) rather than break the page.
LabeledFamily<prometheus::Counter> RegisterCounter(prometheus::Registry& registry,
                                                   const std::string& name, const std::string& help,
                                                   std::vector<std::string> label_names = {});
LabeledFamily<prometheus::Gauge> RegisterGauge(prometheus::Registry& registry,
                                               const std::string& name, const std::string& help,
                                               std::vector<std::string> label_names = {});
// `upper_bounds` ascending; +Inf is implied.
LabeledFamily<prometheus::Histogram> RegisterHistogram(prometheus::Registry& registry,
                                                       const std::string& name,
                                                       const std::string& help,
                                                       std::vector<double> upper_bounds,
                                                       std::vector<std::string> label_names = {});

// Moves a counter that mirrors a running total kept elsewhere up to `total`. A counter never
// decreases: a smaller total leaves it as it is. Calls for one counter must not run concurrently
// (ServerMetrics mirrors under its scrape lock).
inline void MirrorTotal(prometheus::Counter& counter, double total) {
  const double step = total - counter.Value();
  if (step > 0) counter.Increment(step);
}

}  // namespace hstu::server
