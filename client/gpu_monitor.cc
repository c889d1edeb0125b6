#include "client/gpu_monitor.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>

#include "absl/strings/str_format.h"

namespace hstu::bench {
namespace {

// The few NVML entry points used here, as the NVML API reference declares them (nvml.h is not
// part of the toolkit installed here; the library is the driver's).
using NvmlReturn = int;  // nvmlReturn_t; 0 = NVML_SUCCESS
using NvmlDevice = struct NvmlDeviceOpaque*;
constexpr NvmlReturn kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;  // NVML_CLOCK_SM
// nvmlClocksEventReason* bits.
constexpr unsigned long long kSwPowerCap = 0x4;
constexpr unsigned long long kThermal = 0x20 | 0x40;  // software and hardware thermal slowdown

using InitFn = NvmlReturn (*)();
using HandleByPciFn = NvmlReturn (*)(const char*, NvmlDevice*);
using ClockFn = NvmlReturn (*)(NvmlDevice, int, unsigned*);
using PowerFn = NvmlReturn (*)(NvmlDevice, unsigned*);
using ReasonsFn = NvmlReturn (*)(NvmlDevice, unsigned long long*);
using EnergyFn = NvmlReturn (*)(NvmlDevice, unsigned long long*);

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

struct GpuMonitor::Nvml {
  void* lib = nullptr;
  NvmlDevice device = nullptr;
  InitFn shutdown = nullptr;
  ClockFn clock = nullptr;
  PowerFn power = nullptr;
  ReasonsFn reasons = nullptr;  // may be missing on old drivers
  EnergyFn energy = nullptr;    // may be missing too

  ~Nvml() {
    if (shutdown != nullptr) shutdown();
    if (lib != nullptr) dlclose(lib);
  }
};

std::unique_ptr<GpuMonitor> GpuMonitor::Start(int cuda_device, std::chrono::milliseconds period,
                                              std::string* why) {
  auto nvml = std::make_unique<Nvml>();
  nvml->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml->lib == nullptr) {
    *why = absl::StrFormat("NVML not loaded (%s)", dlerror());
    return nullptr;
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
  if (init == nullptr || by_pci == nullptr || nvml->clock == nullptr || nvml->power == nullptr) {
    *why = "NVML lacks nvmlInit_v2, nvmlDeviceGetHandleByPciBusId_v2, nvmlDeviceGetClockInfo or "
           "nvmlDeviceGetPowerUsage";
    return nullptr;
  }
  if (const NvmlReturn r = init(); r != kNvmlSuccess) {
    *why = absl::StrFormat("nvmlInit_v2 returned %d", r);
    return nullptr;
  }
  nvml->shutdown = reinterpret_cast<InitFn>(sym("nvmlShutdown"));
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device) != cudaSuccess) {
    *why = "cudaDeviceGetPCIBusId failed";
    return nullptr;
  }
  if (const NvmlReturn r = by_pci(bus_id, &nvml->device); r != kNvmlSuccess) {
    *why = absl::StrFormat("NVML has no device at PCI bus id %s (%d)", bus_id, r);
    return nullptr;
  }
  std::unique_ptr<GpuMonitor> m(new GpuMonitor());
  m->nvml_ = std::move(nvml);
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
    Sample s{Clock::now(), 0, 0, 0};
    unsigned mw = 0;
    const bool ok = nvml_->clock(nvml_->device, kNvmlClockSm, &s.sm_mhz) == kNvmlSuccess &&
                    nvml_->power(nvml_->device, &mw) == kNvmlSuccess;
    s.power_w = mw / 1000.0;
    if (nvml_->reasons != nullptr) nvml_->reasons(nvml_->device, &s.reasons);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      if (ok) samples_.push_back(s);
    }
    next += period;
    std::this_thread::sleep_until(next);
  }
}

GpuMonitor::Summary GpuMonitor::Between(Clock::time_point from, Clock::time_point to) const {
  std::vector<double> mhz, watts;
  int capped = 0, thermal = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Sample& s : samples_) {
      if (s.at < from || s.at > to) continue;
      mhz.push_back(s.sm_mhz);
      watts.push_back(s.power_w);
      capped += (s.reasons & kSwPowerCap) != 0;
      thermal += (s.reasons & kThermal) != 0;
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
  unsigned long long mj = 0;
  if (nvml_->energy == nullptr || nvml_->energy(nvml_->device, &mj) != kNvmlSuccess) {
    return std::nullopt;
  }
  return mj / 1000.0;
}

std::string DescribeClocks(const GpuMonitor::Summary& s) {
  if (s.samples == 0) return "no clock samples";
  std::string out = absl::StrFormat(
      "SM clock median %.0f MHz (min %.0f), power median %.0f W (max %.0f), power cap in %.0f %% "
      "of %d samples",
      s.sm_mhz_median, s.sm_mhz_min, s.power_w_median, s.power_w_max,
      100 * s.power_capped_share, s.samples);
  if (s.thermal_share > 0) out += absl::StrFormat(", thermal slowdown in %.0f %%", 100 * s.thermal_share);
  return out;
}

}  // namespace hstu::bench
