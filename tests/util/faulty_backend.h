// A Backend that forwards to a real one (EngineOptions::wrap_backend) and fails on command: a
// one-off forward failure, or a lost device (every forward fails, DeviceStatus UNAVAILABLE), as a
// sticky CUDA error leaves a GPU. Tests of the engine's and the server's behaviour after a fault.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"

namespace hstu::testing {

struct Faults {
  std::atomic<bool> fail_next_forward{false};  // one INTERNAL forward; the device stays usable
  std::atomic<bool> device_lost{false};        // from now on, as after a sticky CUDA error
  std::atomic<bool> fail_next_prefetch{false}; // one failed PrefetchPages (nothing copied)
  std::atomic<int> forwards{0};                // Forward calls that reached the backend
  std::atomic<int> prefetches{0};              // PrefetchPages calls that reached it
  // Set before the engine is created: the backend says it has this much device memory (as a GPU
  // does; the engine then sizes an automatic host tier), and pinning the host pool fails.
  int64_t device_memory_bytes = -1;  // < 0: the inner backend's
  bool fail_host_pool = false;
  // Set before the engine is created: the backend's name, when not empty (a CPU backend named as
  // a GPU takes the server's GPU-only start-up steps).
  std::string name;
};

class FaultyBackend final : public Backend {
 public:
  FaultyBackend(std::unique_ptr<Backend> inner, std::shared_ptr<Faults> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}

  std::string name() const override {
    return faults_->name.empty() ? inner_->name() : faults_->name;
  }
  std::string pci_bus_id() const override { return inner_->pci_bus_id(); }
  std::string attention_kernel() const override { return inner_->attention_kernel(); }
  std::string gemm_routes() const override { return inner_->gemm_routes(); }
  int64_t num_pages() const override { return inner_->num_pages(); }
  int64_t kv_pool_bytes() const override { return inner_->kv_pool_bytes(); }
  int64_t device_memory_bytes() const override {
    return faults_->device_memory_bytes >= 0 ? faults_->device_memory_bytes
                                             : inner_->device_memory_bytes();
  }
  int64_t device_weight_bytes() const override { return inner_->device_weight_bytes(); }
  absl::Status Forward(const ForwardBatch& batch, bool keep_hidden, ForwardOutput* out) override {
    ++faults_->forwards;
    if (faults_->device_lost) return absl::InternalError("injected: illegal memory access");
    if (faults_->fail_next_forward.exchange(false)) return absl::InternalError("injected failure");
    return inner_->Forward(batch, keep_hidden, out);
  }
  absl::Status ReadKv(const std::vector<int32_t>& page_ids, int32_t num_tokens,
                      std::vector<float>* out) override {
    return inner_->ReadKv(page_ids, num_tokens, out);
  }
  absl::Status CreateHostPool(int64_t num_pages) override {
    if (faults_->fail_host_pool) {
      return absl::ResourceExhaustedError("injected: cudaMallocHost of the host pool failed");
    }
    return inner_->CreateHostPool(num_pages);
  }
  absl::Status CopyPages(CopyKind kind, const std::vector<int32_t>& src,
                         const std::vector<int32_t>& dst) override {
    if (faults_->device_lost) return absl::InternalError("injected: illegal memory access");
    return inner_->CopyPages(kind, src, dst);
  }
  absl::Status WaitCopies() override { return inner_->WaitCopies(); }
  bool CopiesDone() override { return inner_->CopiesDone(); }
  absl::Status PrefetchPages(const std::vector<int32_t>& src,
                             const std::vector<int32_t>& dst) override {
    ++faults_->prefetches;
    if (faults_->fail_next_prefetch.exchange(false)) return absl::InternalError("injected prefetch failure");
    return inner_->PrefetchPages(src, dst);
  }
  absl::Status MakePrefetchVisible() override { return inner_->MakePrefetchVisible(); }
  bool PrefetchesDone() override { return inner_->PrefetchesDone(); }
  std::optional<CopyTiming> TakeOnloadTiming() override { return inner_->TakeOnloadTiming(); }
  uint64_t graph_replays() const override { return inner_->graph_replays(); }
  uint64_t graph_fallbacks() const override { return inner_->graph_fallbacks(); }
  int64_t page_bytes() const override { return inner_->page_bytes(); }
  absl::Status DeviceStatus() override {
    if (faults_->device_lost) return absl::UnavailableError("injected: the device is lost");
    return inner_->DeviceStatus();
  }

 private:
  std::unique_ptr<Backend> inner_;
  std::shared_ptr<Faults> faults_;
};

// For EngineOptions::wrap_backend.
inline auto WrapWithFaults(std::shared_ptr<Faults> faults) {
  return [faults](std::unique_ptr<Backend> inner) -> std::unique_ptr<Backend> {
    return std::make_unique<FaultyBackend>(std::move(inner), faults);
  };
}

}  // namespace hstu::testing
