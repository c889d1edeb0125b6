#include "server/prom_family.h"

#include <cstdio>
#include <cstdlib>

namespace hstu::server {
namespace {

const std::string& CheckedHelp(const std::string& name, const std::string& help) {
  if (help.find_first_of("\\\n") != std::string::npos) {
    std::fprintf(stderr, "metric %s: help text with a backslash or a newline\n", name.c_str());
    std::abort();
  }
  return help;
}

template <typename T>
LabeledFamily<T> Register(prometheus::detail::Builder<T> builder, prometheus::Registry& registry,
                          const std::string& name, const std::string& help,
                          std::vector<std::string> label_names, std::vector<double> buckets) {
  return {builder.Name(name).Help(CheckedHelp(name, help)).Register(registry), name,
          std::move(label_names), std::move(buckets)};
}

}  // namespace

LabeledFamily<prometheus::Counter> RegisterCounter(prometheus::Registry& registry,
                                                   const std::string& name, const std::string& help,
                                                   std::vector<std::string> label_names) {
  return Register(prometheus::BuildCounter(), registry, name, help, std::move(label_names), {});
}

LabeledFamily<prometheus::Gauge> RegisterGauge(prometheus::Registry& registry,
                                               const std::string& name, const std::string& help,
                                               std::vector<std::string> label_names) {
  return Register(prometheus::BuildGauge(), registry, name, help, std::move(label_names), {});
}

LabeledFamily<prometheus::Histogram> RegisterHistogram(prometheus::Registry& registry,
                                                       const std::string& name,
                                                       const std::string& help,
                                                       std::vector<double> upper_bounds,
                                                       std::vector<std::string> label_names) {
  return Register(prometheus::BuildHistogram(), registry, name, help, std::move(label_names),
                  std::move(upper_bounds));
}

}  // namespace hstu::server
