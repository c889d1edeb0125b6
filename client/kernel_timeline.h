// Every kernel the device ran between Start() and Stop(), as CUPTI records them (concurrent-kernel
// activity: hardware start and end timestamps, kernels not serialised, graph nodes included).
// hstu_bench timeline uses it to show where a decode step's time goes between and around kernels
// (programmatic-launch overlap, launch gaps), which a per-kernel profiler that serialises the
// kernels (ncu) cannot show.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hstu::bench {

struct KernelSpan {
  std::string name;  // demangled, without its arguments
  uint64_t start_ns = 0, end_ns = 0;
  int grid = 0;  // blocks (x · y · z)
};

class KernelTimeline {
 public:
  // Enables the activity records; one timeline records at a time in a process.
  KernelTimeline();
  ~KernelTimeline();
  KernelTimeline(const KernelTimeline&) = delete;
  KernelTimeline& operator=(const KernelTimeline&) = delete;

  // Drops what was recorded so far (after a cudaDeviceSynchronize by the caller).
  void Clear();
  // The kernels completed since the last Clear(), ordered by start (the caller synchronises the
  // device first).
  std::vector<KernelSpan> Take();
};

// A kernel's name shortened for a table: the function's name without namespaces, template
// arguments or parameters; cuBLAS's and CUTLASS's long names cut to 48 characters.
std::string ShortKernelName(const std::string& demangled);

}  // namespace hstu::bench
