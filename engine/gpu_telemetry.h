// The GPU's clock, power, energy and throttling, read through NVML.
//
// Under sustained load an H100 or H200 reaches its power limit and the driver lowers the SM clock,
// so latency depends on it (docs/benchmark_history.md, twenty-second session). The server exports
// these readings to Prometheus; hstu_bench samples them beside its timings.
//
// NVML comes from the GPU machine's driver (libnvidia-ml.so.1) and is loaded with dlopen: nothing
// to link at build time, so CPU-only builds and machines without a driver just get an error from
// Open().
//
// Thread-safety: Read() may be called from any thread (NVML is thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace hstu {

// nvmlClocksEventReason bits, as NVML reports them.
inline constexpr uint64_t kClockEventSwPowerCap = 0x4;
inline constexpr uint64_t kClockEventThermal = 0x20 | 0x40;  // software and hardware slowdown

struct GpuReading {
  double sm_clock_hz = 0;
  double power_watts = 0;
  uint64_t clock_event_reasons = 0;  // 0 when the driver cannot say
  double energy_joules = -1;         // the board's counter since the driver loaded; -1: none
  // Time the clock was held below its target by the power limit and by temperature, cumulative
  // since the driver loaded (NVML violation counters); -1: not available.
  double power_throttled_seconds = -1;
  double thermal_throttled_seconds = -1;
};

class GpuTelemetry {
 public:
  // The GPU at `pci_bus_id` (as cudaDeviceGetPCIBusId writes it). Errors name what is missing:
  // the library, an entry point, or the device.
  static absl::StatusOr<std::unique_ptr<GpuTelemetry>> Open(const std::string& pci_bus_id);
  ~GpuTelemetry();

  GpuTelemetry(const GpuTelemetry&) = delete;
  GpuTelemetry& operator=(const GpuTelemetry&) = delete;

  absl::StatusOr<GpuReading> Read() const;

 private:
  struct Nvml;
  explicit GpuTelemetry(std::unique_ptr<Nvml> nvml);
  std::unique_ptr<Nvml> nvml_;
};

}  // namespace hstu
