#include "client/gpu_monitor.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "client/bench_util.h"

namespace hstu::bench {

std::unique_ptr<GpuMonitor> GpuMonitor::Start(int cuda_device, std::chrono::milliseconds period,
                                              std::string* why) {
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device) != cudaSuccess) {
    *why = "cudaDeviceGetPCIBusId failed";
    return nullptr;
  }
  auto telemetry = GpuTelemetry::Open(bus_id);
  if (!telemetry.ok()) {
    *why = std::string(telemetry.status().message());
    return nullptr;
  }
  std::unique_ptr<GpuMonitor> m(new GpuMonitor(*std::move(telemetry)));
  m->thread_ = std::thread([raw = m.get(), period] { raw->Run(period); });
  return m;
}

GpuMonitor::~GpuMonitor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void GpuMonitor::Run(std::chrono::milliseconds period) {
  auto next = Clock::now();
  while (true) {
    const auto at = Clock::now();
    const absl::StatusOr<GpuReading> r = telemetry_->Read();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      if (r.ok()) {
        samples_.push_back({at, static_cast<float>(r->sm_clock_hz * 1e-6),
                            static_cast<float>(r->power_watts), r->clock_event_reasons});
      }
    }
    next += period;
    std::this_thread::sleep_until(next);
  }
}

GpuMonitor::Summary GpuMonitor::Between(Clock::time_point from, Clock::time_point to) const {
  std::vector<float> mhz, watts;
  int capped = 0, thermal = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Sample& s : samples_) {
      if (s.at < from || s.at > to) continue;
      mhz.push_back(s.sm_mhz);
      watts.push_back(s.power_w);
      capped += (s.reasons & kClockEventSwPowerCap) != 0;
      thermal += (s.reasons & kClockEventThermal) != 0;
    }
  }
  Summary out;
  out.samples = static_cast<int>(mhz.size());
  if (mhz.empty()) return out;
  out.sm_mhz_median = Median(mhz);
  out.sm_mhz_min = *std::min_element(mhz.begin(), mhz.end());
  out.power_w_median = Median(watts);
  out.power_w_max = *std::max_element(watts.begin(), watts.end());
  out.power_capped_share = static_cast<double>(capped) / out.samples;
  out.thermal_share = static_cast<double>(thermal) / out.samples;
  return out;
}

std::optional<double> GpuMonitor::EnergyJoules() const {
  const absl::StatusOr<GpuReading> r = telemetry_->Read();
  if (!r.ok() || r->energy_joules < 0) return std::nullopt;
  return r->energy_joules;
}

std::string DescribeClocks(const GpuMonitor::Summary& s) {
  if (s.samples == 0) return "no clock samples";
  std::string out = absl::StrFormat(
      "SM clock median %.0f MHz (min %.0f), power median %.0f W (max %.0f), power cap in %.0f %% "
      "of %d samples",
      s.sm_mhz_median, s.sm_mhz_min, s.power_w_median, s.power_w_max,
      100 * s.power_capped_share, s.samples);
  if (s.thermal_share > 0) {
    out += absl::StrFormat(", thermal slowdown in %.0f %%", 100 * s.thermal_share);
  }
  return out;
}

}  // namespace hstu::bench
