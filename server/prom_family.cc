#include "server/prom_family.h"

namespace hstu::server {

LabeledFamily<prometheus::Counter> RegisterCounter(prometheus::Registry& registry,
                                                   const std::string& name, const std::string& help,
                                                   std::vector<std::string> label_names) {
  return {prometheus::BuildCounter().Name(name).Help(help).Register(registry), name,
          std::move(label_names), {}};
}

LabeledFamily<prometheus::Gauge> RegisterGauge(prometheus::Registry& registry,
                                               const std::string& name, const std::string& help,
                                               std::vector<std::string> label_names) {
  return {prometheus::BuildGauge().Name(name).Help(help).Register(registry), name,
          std::move(label_names), {}};
}

LabeledFamily<prometheus::Histogram> RegisterHistogram(prometheus::Registry& registry,
                                                       const std::string& name,
                                                       const std::string& help,
                                                       std::vector<double> upper_bounds,
                                                       std::vector<std::string> label_names) {
  return {prometheus::BuildHistogram().Name(name).Help(help).Register(registry), name,
          std::move(label_names), std::move(upper_bounds)};
}

}  // namespace hstu::server
