// What the GPU's clock and power did while a benchmark ran (engine/gpu_telemetry.h, NVML).
//
// Under sustained load an H100 or H200 reaches its power limit and the driver lowers the SM clock
// (docs/benchmark_history.md, twenty-second session), so a time means little without the clock
// it ran at.
// GpuMonitor samples the SM clock, the power draw and the clock-event reasons on a thread, and
// reads the board's energy counter, so that a benchmark can report both beside each time: the
// clock over a span and the energy of a piece of work, which the power cap does not change.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/gpu_telemetry.h"

namespace hstu::bench {

class GpuMonitor {
 public:
  using Clock = std::chrono::steady_clock;

  struct Summary {
    int samples = 0;
    double sm_mhz_median = 0, sm_mhz_min = 0;
    double power_w_median = 0, power_w_max = 0;
    double power_capped_share = 0;  // samples whose reasons include the software power cap
    double thermal_share = 0;       // samples slowed by temperature (software or hardware)
  };

  // Starts sampling `cuda_device` (matched to NVML by its PCI bus id) every `period`; nullptr, with
  // the reason in *why, when NVML or the device cannot be used.
  static std::unique_ptr<GpuMonitor> Start(int cuda_device, std::chrono::milliseconds period,
                                           std::string* why);
  ~GpuMonitor();  // stops the sampler

  GpuMonitor(const GpuMonitor&) = delete;
  GpuMonitor& operator=(const GpuMonitor&) = delete;

  // The samples taken in [from, to].
  Summary Between(Clock::time_point from, Clock::time_point to) const;
  // The board's energy counter in joules (since the driver loaded), if the GPU has one.
  std::optional<double> EnergyJoules() const;

 private:
  struct Sample {
    Clock::time_point at;
    float sm_mhz;
    float power_w;
    uint64_t reasons;
  };
  explicit GpuMonitor(std::unique_ptr<GpuTelemetry> telemetry) : telemetry_(std::move(telemetry)) {}
  void Run(std::chrono::milliseconds period);

  const std::unique_ptr<GpuTelemetry> telemetry_;
  mutable std::mutex mu_;
  std::vector<Sample> samples_;  // guarded by mu_
  bool stop_ = false;            // guarded by mu_
  std::thread thread_;
};

// One line for a table caption: "SM clock median 1575 MHz (min 1305), power up to 676 W, power cap
// in 100 % of 80 samples", or why there are no samples.
std::string DescribeClocks(const GpuMonitor::Summary& s);

}  // namespace hstu::bench
