// The CUDA backend (DESIGN §2.4): bf16 weights, activations and KV pages, fp32 residual stream,
// statistics and accumulation; cuBLAS GEMMs and the kernels of kernels/cuda.
//
// Threading: a backend is used by one thread at a time (the engine worker); it owns one device, one
// stream and one cuBLAS handle. Every CUDA or cuBLAS error becomes an absl::Status here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"

namespace hstu {

// Hooks beyond the Backend interface, for hstu_bench and the GPU tests: stage a batch once, then
// enqueue parts of the forward repeatedly and time them with CUDA events on the backend's stream.
class CudaBackend : public Backend {
 public:
  // Validates and uploads the plan of `batch` (no compute).
  virtual absl::Status Stage(const ForwardBatch& batch) = 0;
  // Enqueues embedding gather + all layers for the staged batch (appends K/V to the pages).
  virtual absl::Status EnqueueLayerStack() = 0;
  // Enqueues the attention of one layer alone (inputs: whatever the last layer stack left).
  virtual absl::Status EnqueueAttention(int layer) = 0;
  // Runs `fn` `warmup` times, then `reps` times each between two CUDA events; milliseconds per rep.
  virtual absl::StatusOr<std::vector<float>> Time(const std::function<absl::Status()>& fn,
                                                  int warmup, int reps) = 0;
  // Attention work items and chosen key-chunk length of the staged batch (for reports).
  virtual int attention_items() const = 0;
  virtual int attention_chunk_blocks() const = 0;
  virtual std::string gpu_name() const = 0;
  // Tests: fill every activation buffer with NaN before each batch (and the KV pool now), so a
  // row or page that is read before it is written shows up as NaN.
  virtual absl::Status SetDebugPoison(bool on) = 0;
};

// UNAVAILABLE when no CUDA device is present (or `device_index` does not exist), INVALID_ARGUMENT
// for a model the kernels do not support (head dim not 64/128/256, widths not multiples of 8).
absl::StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackendExt(const ModelWeights& weights,
                                                                  int32_t page_size,
                                                                  int64_t num_pages,
                                                                  int device_index);

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const ModelWeights& weights,
                                                           int32_t page_size, int64_t num_pages,
                                                           int device_index);

// True when at least one CUDA device is usable (tests skip otherwise).
bool CudaDeviceAvailable();

}  // namespace hstu
