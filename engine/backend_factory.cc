#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#if defined(HSTU_WITH_CUDA)
#include "engine/cuda_backend.h"
#endif

namespace hstu {

absl::Status CheckDeviceName(const std::string& device) {
  int index = 0;
  if (device == "cpu" || device == "cpu-bf16" || device == "auto" ||
      (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), &index) &&
       index >= 0)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device '", device, "' is not one of cpu, cpu-bf16, cuda:N, auto"));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& device,
                                                       const ModelWeights& weights,
                                                       int32_t page_size, int64_t num_pages,
                                                       const GraphOptions& graphs) {
  if (device == "cpu") return CreateCpuBackend(weights, page_size, num_pages);
  if (device == "cpu-bf16") {
    return CreateCpuBackend(weights, page_size, num_pages, CpuNumerics::kBf16);
  }
  if (absl::Status name = CheckDeviceName(device); !name.ok()) return name;
  const bool is_auto = device == "auto";
  int index = 0;
  if (!is_auto) (void)absl::SimpleAtoi(device.substr(5), &index);
#if defined(HSTU_WITH_CUDA)
  auto cuda = CreateCudaBackend(weights, page_size, num_pages, index, graphs);
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
