#include "engine/gpu_telemetry.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace hstu {
namespace {

// The NVML entry points used here, as the NVML API reference declares them (nvml.h is not part of
// the toolkit installed here; the library is the driver's).
using NvmlReturn = int;  // nvmlReturn_t; 0 = NVML_SUCCESS
using NvmlDevice = struct NvmlDeviceOpaque*;
struct NvmlViolationTime {  // nvmlViolationTime_t
  unsigned long long reference_time;
  unsigned long long violation_time;  // ns
};
constexpr NvmlReturn kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;        // NVML_CLOCK_SM
constexpr int kNvmlPerfPolicyPower = 0;    // NVML_PERF_POLICY_POWER
constexpr int kNvmlPerfPolicyThermal = 1;  // NVML_PERF_POLICY_THERMAL

using InitFn = NvmlReturn (*)();
using HandleByPciFn = NvmlReturn (*)(const char*, NvmlDevice*);
using ClockFn = NvmlReturn (*)(NvmlDevice, int, unsigned*);
using PowerFn = NvmlReturn (*)(NvmlDevice, unsigned*);
using ReasonsFn = NvmlReturn (*)(NvmlDevice, unsigned long long*);
using EnergyFn = NvmlReturn (*)(NvmlDevice, unsigned long long*);
using ViolationFn = NvmlReturn (*)(NvmlDevice, int, NvmlViolationTime*);

}  // namespace

struct GpuTelemetry::Nvml {
  void* lib = nullptr;
  NvmlDevice device = nullptr;
  InitFn shutdown = nullptr;  // set once nvmlInit_v2 succeeded
  ClockFn clock = nullptr;
  PowerFn power = nullptr;
  ReasonsFn reasons = nullptr;      // optional, as the rest below
  EnergyFn energy = nullptr;
  ViolationFn violation = nullptr;

  ~Nvml() {
    if (shutdown != nullptr) shutdown();
    if (lib != nullptr) dlclose(lib);
  }
};

GpuTelemetry::GpuTelemetry(std::unique_ptr<Nvml> nvml) : nvml_(std::move(nvml)) {}
GpuTelemetry::~GpuTelemetry() = default;

absl::StatusOr<std::unique_ptr<GpuTelemetry>> GpuTelemetry::Open(const std::string& pci_bus_id) {
  auto nvml = std::make_unique<Nvml>();
  nvml->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml->lib == nullptr) {
    return absl::UnavailableError(absl::StrCat("NVML (libnvidia-ml.so.1) not loaded: ", dlerror()));
  }
  auto sym = [&](const char* name) { return dlsym(nvml->lib, name); };
  auto init = reinterpret_cast<InitFn>(sym("nvmlInit_v2"));
  auto by_pci = reinterpret_cast<HandleByPciFn>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
  nvml->clock = reinterpret_cast<ClockFn>(sym("nvmlDeviceGetClockInfo"));
  nvml->power = reinterpret_cast<PowerFn>(sym("nvmlDeviceGetPowerUsage"));
  nvml->reasons = reinterpret_cast<ReasonsFn>(sym("nvmlDeviceGetCurrentClocksEventReasons"));
  if (nvml->reasons == nullptr) {
    nvml->reasons = reinterpret_cast<ReasonsFn>(sym("nvmlDeviceGetCurrentClocksThrottleReasons"));
  }
  nvml->energy = reinterpret_cast<EnergyFn>(sym("nvmlDeviceGetTotalEnergyConsumption"));
  nvml->violation = reinterpret_cast<ViolationFn>(sym("nvmlDeviceGetViolationStatus"));
  if (init == nullptr || by_pci == nullptr || nvml->clock == nullptr || nvml->power == nullptr) {
    return absl::UnavailableError(
        "NVML lacks nvmlInit_v2, nvmlDeviceGetHandleByPciBusId_v2, nvmlDeviceGetClockInfo or "
        "nvmlDeviceGetPowerUsage");
  }
  if (const NvmlReturn r = init(); r != kNvmlSuccess) {
    return absl::UnavailableError(absl::StrCat("nvmlInit_v2 returned ", r));
  }
  nvml->shutdown = reinterpret_cast<InitFn>(sym("nvmlShutdown"));
  if (const NvmlReturn r = by_pci(pci_bus_id.c_str(), &nvml->device); r != kNvmlSuccess) {
    return absl::NotFoundError(
        absl::StrCat("NVML has no GPU at PCI bus id '", pci_bus_id, "' (error ", r, ")"));
  }
  return std::unique_ptr<GpuTelemetry>(new GpuTelemetry(std::move(nvml)));
}

absl::StatusOr<GpuReading> GpuTelemetry::Read() const {
  GpuReading r;
  unsigned mhz = 0, milliwatts = 0;
  if (const NvmlReturn e = nvml_->clock(nvml_->device, kNvmlClockSm, &mhz); e != kNvmlSuccess) {
    return absl::InternalError(absl::StrCat("nvmlDeviceGetClockInfo returned ", e));
  }
  if (const NvmlReturn e = nvml_->power(nvml_->device, &milliwatts); e != kNvmlSuccess) {
    return absl::InternalError(absl::StrCat("nvmlDeviceGetPowerUsage returned ", e));
  }
  r.sm_clock_hz = mhz * 1e6;
  r.power_watts = milliwatts / 1000.0;
  unsigned long long v = 0;
  if (nvml_->reasons != nullptr && nvml_->reasons(nvml_->device, &v) == kNvmlSuccess) {
    r.clock_event_reasons = v;
  }
  if (nvml_->energy != nullptr && nvml_->energy(nvml_->device, &v) == kNvmlSuccess) {
    r.energy_joules = v / 1000.0;  // mJ
  }
  NvmlViolationTime t{};
  if (nvml_->violation != nullptr) {
    if (nvml_->violation(nvml_->device, kNvmlPerfPolicyPower, &t) == kNvmlSuccess) {
      r.power_throttled_seconds = t.violation_time * 1e-9;
    }
    if (nvml_->violation(nvml_->device, kNvmlPerfPolicyThermal, &t) == kNvmlSuccess) {
      r.thermal_throttled_seconds = t.violation_time * 1e-9;
    }
  }
  return r;
}

}  // namespace hstu
