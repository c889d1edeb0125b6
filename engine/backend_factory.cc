#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#if defined(HSTU_WITH_CUDA)
#include "engine/cuda_backend.h"
#endif

namespace hstu {

namespace {

// The GPU a device name asks for: N for "cuda:N", 0 for "auto" (when a GPU is present), -1 for
// the CPU backends; INVALID_ARGUMENT for a name that is none of these.
absl::StatusOr<int> GpuIndex(const std::string& device) {
  if (device == "cpu" || device == "cpu-bf16") return -1;
  if (device == "auto") return 0;
  int index = 0;
  if (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), &index) && index >= 0) {
    return index;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device '", device, "' is not one of cpu, cpu-bf16, cuda:N, auto"));
}

}  // namespace

absl::Status CheckDeviceName(const std::string& device) { return GpuIndex(device).status(); }

absl::Status CudaRunsModel(const ModelConfig& config) {
#if defined(HSTU_WITH_CUDA)
  return CudaBackendRunsModel(config);
#else
  (void)config;
  return absl::UnavailableError("this build has no CUDA backend (HSTU_ENABLE_CUDA=OFF)");
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& device,
                                                       const ModelWeights& weights,
                                                       int32_t page_size, int64_t num_pages,
                                                       const GraphOptions& graphs) {
  if (device == "cpu") return CreateCpuBackend(weights, page_size, num_pages);
  if (device == "cpu-bf16") {
    return CreateCpuBackend(weights, page_size, num_pages, CpuNumerics::kBf16);
  }
  const absl::StatusOr<int> index = GpuIndex(device);
  if (!index.ok()) return index.status();
  const bool is_auto = device == "auto";
#if defined(HSTU_WITH_CUDA)
  auto cuda = CreateCudaBackend(weights, page_size, num_pages, *index, graphs);
  // auto: the CPU only where no GPU can be used (UNAVAILABLE); any other failure is reported.
  if (cuda.ok() || !is_auto || cuda.status().code() != absl::StatusCode::kUnavailable) return cuda;
#else
  (void)graphs;  // CPU-only build: no backend with graphs
  if (!is_auto) {
    return absl::UnavailableError(
        absl::StrCat("device '", device, "' needs a build with HSTU_ENABLE_CUDA=ON"));
  }
#endif
  return CreateCpuBackend(weights, page_size, num_pages);
}

}  // namespace hstu
