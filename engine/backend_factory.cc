#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#if defined(HSTU_WITH_CUDA)
#include "engine/cuda_backend.h"
#endif

namespace hstu {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& device,
                                                       const ModelWeights& weights,
                                                       int32_t page_size, int64_t num_pages,
                                                       const GraphOptions& graphs) {
  if (device == "cpu") return CreateCpuBackend(weights, page_size, num_pages);
  if (device == "cpu-bf16") {
    return CreateCpuBackend(weights, page_size, num_pages, CpuNumerics::kBf16);
  }
  int index = 0;
  const bool is_auto = device == "auto";
  if (!is_auto) {
    if (!absl::StartsWith(device, "cuda:") || !absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device '", device, "' is not one of cpu, cpu-bf16, cuda:N, auto"));
    }
  }
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
