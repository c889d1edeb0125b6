// The CUDA backend (DESIGN §2.4): bf16 weights, activations and KV pages, fp32 residual stream,
// statistics and accumulation; cuBLAS GEMMs and the kernels of kernels/cuda.
//
// Threading: a backend is used by one thread at a time (the engine worker), except graph_replays()
// and graph_fallbacks() (thread-safe); it owns one device, a compute stream, two copy streams (host tier: onload and
// offload, one copy engine each) and one cuBLAS handle. Every CUDA or cuBLAS error becomes an
// absl::Status here.
//
// Host tier (DESIGN §6): a pinned host pool with the GPU pool's layout. Onloads (host → GPU) are
// queued by CopyPages and issued at the start of the next Forward (or WaitCopies), layer by layer on
// the onload stream with one event per layer; layer l of the forward waits for its event right
// before its append/attention, so the copy overlaps staging and the earlier layers. Offloads
// (GPU → host) wait for the compute stream (the forward that wrote the pages) and run on the
// offload stream; CopiesDone() polls both streams, WaitCopies() blocks on them.
//
// CUDA graphs (DESIGN §7): at creation, after a warm-up, the decode step (the gather and the
// layers but the last one's candidate-row tail; that tail and the head run eagerly after the
// replay, on the real candidate rows) is captured once per bucket into static buffers; a batch that fits a bucket is padded (padding
// users own no rows; padding rows belong to no user and are never appended or read back), its
// metadata is copied into the static buffers, the attention nodes get the batch's work-item count
// as their grid, and the graph is replayed. The per-layer onload waits are external event-wait
// nodes inside the graph. Larger batches run eagerly.
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
  // Enqueues embedding gather + all layers for the staged batch (appends K/V to the pages). The
  // last layer's attention, LayerNorm · u and output projection run on the candidate rows only
  // (DESIGN §2.3 reads nothing else), the result compacted to one row per candidate.
  virtual absl::Status EnqueueLayerStack() = 0;
  // Enqueues the attention of one layer alone (inputs: whatever the last layer stack left).
  virtual absl::Status EnqueueAttention(int layer) = 0;
  // Runs `fn` `warmup` times, then `reps` times each between two CUDA events; milliseconds per rep.
  virtual absl::StatusOr<std::vector<float>> Time(const std::function<absl::Status()>& fn,
                                                  int warmup, int reps) = 0;
  // Attention work items and chosen key-chunk length of the staged batch (for reports).
  virtual int attention_items() const = 0;
  virtual int attention_chunk_blocks() const = 0;
  // The staged batch's attention plan is a cluster plan of this many CTAs a cluster (0: not).
  virtual int attention_cluster() const = 0;
  virtual std::string gpu_name() const = 0;
  // Tests: fill every activation buffer with NaN before each batch (and the KV pool now), so a
  // row or page that is read before it is written shows up as NaN.
  virtual absl::Status SetDebugPoison(bool on) = 0;

  // A whole decode step (gather → layers → head), staged once and enqueued repeatedly. With
  // use_graph, a batch that fits a graph bucket is staged padded into that bucket's static buffers;
  // returns whether it was (else it is staged for eager execution).
  virtual absl::StatusOr<bool> StageStep(const ForwardBatch& batch, bool use_graph) = 0;
  virtual absl::Status EnqueueStep() = 0;
  // Tests: false runs a bucketed step eagerly on the very same padded inputs instead of replaying.
  virtual void SetGraphReplay(bool on) = 0;
  virtual int num_graphs() const = 0;
  // Replays of the bucket's graph with per-layer onload waits (onloads or prefetches were issued
  // since the last step); the other replays run the graph without those wait nodes.
  virtual uint64_t graph_wait_replays() const = 0;
  // Reports: the captured graphs' edges, and how many of them are programmatic (kernels launched
  // as programmatic dependents keep that in the graph).
  virtual std::string graph_summary() const = 0;
  // How page runs go to the copy engines (benchmarks compare them); kBatch is the default.
  enum class CopyMethod { kPerRun, kBatch };
  virtual void SetCopyMethod(CopyMethod method) = 0;
};

// The buckets used when GraphOptions::buckets is empty: users {1, 4, 16, 64} × rows
// {256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192}.
std::vector<GraphBucket> DefaultGraphBuckets();

// UNAVAILABLE when no CUDA device is present (or `device_index` does not exist), INVALID_ARGUMENT
// for a model the kernels do not support (head dim not 64/128/256, widths not multiples of 8).
absl::StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackendExt(const ModelWeights& weights,
                                                                  int32_t page_size,
                                                                  int64_t num_pages,
                                                                  int device_index,
                                                                  const GraphOptions& graphs = {});

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const ModelWeights& weights,
                                                           int32_t page_size, int64_t num_pages,
                                                           int device_index,
                                                           const GraphOptions& graphs = {});

// True when at least one CUDA device is usable (tests skip otherwise).
bool CudaDeviceAvailable();

// CudaRunsModel (engine/backend.h) of a CUDA build: the model shapes the kernels run.
absl::Status CudaBackendRunsModel(const ModelConfig& config);

}  // namespace hstu
