// A minimal Prometheus client: counter, gauge and histogram families with fixed label names,
// serialised in the text exposition format 0.0.4. Written here because prometheus-cpp is not
// packaged in Debian 12 (see docs/server.md); it covers exactly what server/metrics needs.
//
// Thread-safety: everything is thread-safe. Children are created once per label set and live as
// long as the registry, so callers may keep the references that WithLabels() returns.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hstu::server {

class Counter {
 public:
  void Increment(double v = 1) { value_.fetch_add(v, std::memory_order_relaxed); }
  // For totals kept elsewhere (the engine's stats), mirrored at scrape time; must not decrease.
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);  // ascending, +Inf implied
  void Observe(double v);
  struct Snapshot {
    std::vector<uint64_t> cumulative;  // [bounds + 1], the last is +Inf (== count)
    double sum = 0;
  };
  Snapshot Read() const;
  const std::vector<double>& upper_bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // [bounds + 1], not cumulative
  std::atomic<double> sum_{0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

template <typename T>
class Family {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::function<std::unique_ptr<T>()> make)
      : name_(std::move(name)),
        help_(std::move(help)),
        label_names_(std::move(label_names)),
        make_(std::move(make)) {}
  // `values` must have one entry per label name (aborts otherwise: a programming error).
  T& WithLabels(const std::vector<std::string>& values);
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Snapshot of the children (label values → child), for serialisation.
  std::vector<std::pair<std::vector<std::string>, const T*>> Children() const;

 private:
  const std::string name_, help_;
  const std::vector<std::string> label_names_;
  const std::function<std::unique_ptr<T>()> make_;
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> children_;
};

class Registry {
 public:
  Family<Counter>& AddCounter(const std::string& name, const std::string& help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help,
                          std::vector<std::string> label_names = {});
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<double> upper_bounds,
                                  std::vector<std::string> label_names = {});
  // Runs before each serialisation (mirrors stats kept elsewhere into the families).
  void AddCollectHook(std::function<void()> hook);
  // Text format 0.0.4, families in registration order.
  std::string Serialize() const;

 private:
  struct Entry {
    MetricType type;
    std::unique_ptr<Family<Counter>> counter;
    std::unique_ptr<Family<Gauge>> gauge;
    std::unique_ptr<Family<Histogram>> histogram;
  };
  mutable std::mutex mu_;
  std::vector<Entry> families_;
  std::vector<std::function<void()>> hooks_;
};

// Formats a sample value the way Prometheus parses it (integers exactly, "+Inf", "NaN").
std::string FormatPromValue(double v);
// Escapes a label value (backslash, double quote, newline).
std::string EscapeLabelValue(const std::string& v);

}  // namespace hstu::server
