#include "server/prom_registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace hstu::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)),
      counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end())) {
    std::fprintf(stderr, "histogram bounds must be ascending\n");
    std::abort();
  }
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
  // Prometheus buckets are "less or equal": the first bound >= v.
  const size_t idx = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  counts_[idx].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = acc;
  }
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

template <typename T>
T& Family<T>::WithLabels(const std::vector<std::string>& values) {
  if (values.size() != label_names_.size()) {
    std::fprintf(stderr, "metric %s: %zu label values for %zu labels\n", name_.c_str(),
                 values.size(), label_names_.size());
    std::abort();
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto& child = children_[values];
  if (!child) child = make_();
  return *child;
}

template <typename T>
std::vector<std::pair<std::vector<std::string>, const T*>> Family<T>::Children() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::vector<std::string>, const T*>> out;
  for (const auto& [labels, child] : children_) out.emplace_back(labels, child.get());
  return out;
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Family<Counter>& Registry::AddCounter(const std::string& name, const std::string& help,
                                      std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry e{MetricType::kCounter, nullptr, nullptr, nullptr};
  e.counter = std::make_unique<Family<Counter>>(name, help, std::move(label_names),
                                                [] { return std::make_unique<Counter>(); });
  families_.push_back(std::move(e));
  return *families_.back().counter;
}

Family<Gauge>& Registry::AddGauge(const std::string& name, const std::string& help,
                                  std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry e{MetricType::kGauge, nullptr, nullptr, nullptr};
  e.gauge = std::make_unique<Family<Gauge>>(name, help, std::move(label_names),
                                            [] { return std::make_unique<Gauge>(); });
  families_.push_back(std::move(e));
  return *families_.back().gauge;
}

Family<Histogram>& Registry::AddHistogram(const std::string& name, const std::string& help,
                                          std::vector<double> upper_bounds,
                                          std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry e{MetricType::kHistogram, nullptr, nullptr, nullptr};
  e.histogram = std::make_unique<Family<Histogram>>(
      name, help, std::move(label_names),
      [upper_bounds] { return std::make_unique<Histogram>(upper_bounds); });
  families_.push_back(std::move(e));
  return *families_.back().histogram;
}

void Registry::AddCollectHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.push_back(std::move(hook));
}

std::string FormatPromValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  // The shortest of %.15g / %.17g that reads back exactly ("0.0003", not "0.00029999999999999997").
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.15g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

namespace {

// `{a="x",b="y"}` (with an optional extra label such as le), or "" without labels.
std::string LabelSet(const std::vector<std::string>& names, const std::vector<std::string>& values,
                     const std::string& extra_name = "", const std::string& extra_value = "") {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : ",", names[i], "=\"", EscapeLabelValue(values[i]),
                    "\"");
  }
  if (!extra_name.empty()) {
    absl::StrAppend(&out, out.empty() ? "" : ",", extra_name, "=\"", extra_value, "\"");
  }
  return out.empty() ? out : absl::StrCat("{", out, "}");
}

// HELP text escapes only backslash and newline.
std::string EscapeHelp(const std::string& h) {
  std::string out;
  for (char c : h) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

template <typename F>
void Header(const F& f, const char* type, std::string* out) {
  absl::StrAppend(out, "# HELP ", f.name(), " ", EscapeHelp(f.help()), "\n# TYPE ", f.name(), " ",
                  type, "\n");
}

}  // namespace

std::string Registry::Serialize() const {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hooks = hooks_;
  }
  for (const auto& h : hooks) h();
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const Entry& e : families_) {
    switch (e.type) {
      case MetricType::kCounter: {
        Header(*e.counter, "counter", &out);
        for (const auto& [labels, c] : e.counter->Children()) {
          absl::StrAppend(&out, e.counter->name(), LabelSet(e.counter->label_names(), labels), " ",
                          FormatPromValue(c->Value()), "\n");
        }
        break;
      }
      case MetricType::kGauge: {
        Header(*e.gauge, "gauge", &out);
        for (const auto& [labels, g] : e.gauge->Children()) {
          absl::StrAppend(&out, e.gauge->name(), LabelSet(e.gauge->label_names(), labels), " ",
                          FormatPromValue(g->Value()), "\n");
        }
        break;
      }
      case MetricType::kHistogram: {
        const Family<Histogram>& f = *e.histogram;
        Header(f, "histogram", &out);
        for (const auto& [labels, h] : f.Children()) {
          const Histogram::Snapshot s = h->Read();
          const auto& bounds = h->upper_bounds();
          for (size_t i = 0; i <= bounds.size(); ++i) {
            const std::string le = i < bounds.size() ? FormatPromValue(bounds[i]) : "+Inf";
            absl::StrAppend(&out, f.name(), "_bucket", LabelSet(f.label_names(), labels, "le", le),
                            " ", s.cumulative[i], "\n");
          }
          absl::StrAppend(&out, f.name(), "_sum", LabelSet(f.label_names(), labels), " ",
                          FormatPromValue(s.sum), "\n");
          absl::StrAppend(&out, f.name(), "_count", LabelSet(f.label_names(), labels), " ",
                          s.cumulative.back(), "\n");
        }
        break;
      }
    }
  }
  return out;
}

}  // namespace hstu::server
