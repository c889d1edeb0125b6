// Engine facade: model + backend + KV cache. Create(options) → Rank(batch) → Stats().
//
// Threading: Rank() must be called by one thread at a time (the server's engine worker); Stats(),
// config() and device_name() are thread-safe.
#pragma once

#include <cstdint>
#include <limits>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "engine/onload_policy.h"
#include "engine/request.h"
#include "kvcache/cache_manager.h"

namespace hstu {

// Bounds on the pools' sizes (page ids are 32-bit: kvcache/page_allocator.h) and on the offload
// backlog (its bytes must fit 64 bits), checked by Engine::Create.
inline constexpr int64_t kMaxPoolPages = std::numeric_limits<int32_t>::max();
inline constexpr int64_t kMaxOffloadBacklogMib = int64_t{1} << 20;  // 1 TiB

struct EngineOptions {
  std::string model = "random:tiny";  // file path or random:PRESET
  uint64_t seed = 1;                  // for random models
  std::string device = "cpu";         // cpu | cpu-bf16 | cuda:N | auto
  int32_t page_size = 32;             // tokens per KV page
  int64_t cache_pages = 0;            // KV pool size in pages; 0 = room for 64 users of max history
  int64_t host_cache_pages = 0;       // host (pinned) KV tier in pages; 0 = none; -1 = auto (on a
                                      // GPU: 2x the GPU pool, within 1/4 of the RAM and 32 GiB;
                                      // on the CPU: none)
  int64_t offload_backlog_mib = 128;  // write-behind: host copies in flight at most (MiB, at least
                                      // one user's pages); full pages past it stay GPU-only
  bool enable_cache = true;           // false: every request recomputes its whole history
  bool keep_hidden = false;           // fill RankResult::hidden (tests, parity checks)
  bool use_cuda_graphs = true;        // CUDA backend: replay the decode step from CUDA graphs
  std::vector<GraphBucket> graph_buckets;  // their (users, rows) buckets; empty = backend defaults
  // Host hits (engine/onload_policy.h): kCost onloads a user's host pages only when the copy,
  // behind the copies already queued, finishes no later than recomputing them; otherwise the
  // request recomputes them (lookup result host_recompute). kAlways onloads every host hit.
  OnloadPolicy onload_policy = OnloadPolicy::kCost;
  // The cost rule's rates: > 0 fixes one (tests); 0 measures it online (onload bandwidth from the
  // backend's copy timings, GPU seconds per forward row from the forwards that waited for no copy).
  double onload_bytes_per_second = 0;
  double recompute_seconds_per_token = 0;
  RequestLimits limits;
  // Tests only: wraps the backend the engine creates (fault injection).
  std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>)> wrap_backend;
};

struct EngineStats {
  CacheStats cache;
  uint64_t batches = 0;
  uint64_t requests = 0;
  uint64_t forward_passes = 0;
  double compute_seconds = 0;       // total time inside backend forwards
  double device_seconds = 0;        // of which the device ran the steps (0 on the CPU backend)
  int64_t device_memory_bytes = 0;  // weights + KV pool + workspace on the device (0 on the CPU)
  int64_t kv_pool_bytes = 0;
  int64_t weight_bytes = 0;
  int64_t kv_page_bytes = 0;        // one page over all layers
  uint64_t kv_offload_bytes = 0;    // GPU → host
  uint64_t kv_onload_bytes = 0;     // host → GPU
  uint64_t graph_replays = 0;       // forward passes replayed from a CUDA graph
  uint64_t graph_fallbacks = 0;     // passes that fit a bucket's size but ran eagerly
  bool device_lost = false;         // Engine::health() is not OK: nothing more can run
  uint64_t onload_waits = 0;        // forward passes that waited for host → GPU KV copies
  double onload_wait_seconds = 0;   // the device time their compute stalled on those copies
  // The onload policy's current estimates (fixed or measured; see EngineOptions).
  double onload_bytes_per_second = 0;
  double recompute_seconds_per_token = 0;
};

// The range checks of the options alone (page size, pool sizes, backlog, onload estimates), which
// Engine::Create makes first: a tool can check its flags before it loads a model.
absl::Status CheckEngineOptions(const EngineOptions& options);

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  // With weights already in memory (tests, tools that generated them).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                        ModelWeights weights);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Scores a batch. One result per request, in order; a bad or unservable request fails alone.
  // Requests of one user run one after another, the later one reusing the earlier one's cache.
  std::vector<absl::StatusOr<RankResult>> Rank(absl::Span<const RankRequest> batch);

  // Starts the onload of queued requests' users whose KV lives only on the host, so the copies
  // overlap the batches that run before theirs (DESIGN §6). Uses free GPU pages only; a no-op
  // without a host tier. Same threading contract as Rank().
  // `running`: the batch about to run, whose users are never evicted to make room.
  void Prefetch(absl::Span<const RankRequest* const> running,
                absl::Span<const RankRequest* const> queued);
  // Whether Prefetch() can do anything: the cache is on and has a host tier.
  bool has_host_tier() const { return options_.enable_cache && cache_->Stats().host_pages_total > 0; }

  absl::Status Validate(const RankRequest& request) const;
  // OK when the KV pool holds one user of the model's longest history; else an error saying so
  // (a front end that would otherwise fail every such request refuses to start).
  absl::Status CheckPoolHoldsTheLongestHistory() const;
  // Forgets what the cache holds of one user once its offloads are done (the server's warm-up
  // request leaves nothing behind). Called from the thread that calls Rank(), not during one.
  // True when nothing of the user is cached now.
  bool Forget(uint64_t user_id);
  // The onload rule's measured rates (copy bandwidth, recompute time) back at their start values
  // (EngineOptions): after a start-up's warm-up, whose forwards include the GEMM tuner's timings.
  // Called from the thread that calls Rank(), not during one.
  void ResetMeasuredRates();
  const ModelConfig& config() const { return config_; }
  const EngineOptions& options() const { return options_; }
  std::string device_name() const { return backend_->name(); }
  std::string device_pci_bus_id() const { return backend_->pci_bus_id(); }
  std::string attention_kernel() const { return backend_->attention_kernel(); }
  std::string gemm_routes() const { return backend_->gemm_routes(); }
  EngineStats Stats() const;
  // OK while the engine can serve. Once its device is lost (Backend::DeviceStatus, checked after a
  // failed device call) that error, for good: every later Rank answers UNAVAILABLE at once without
  // touching the device, and only a new process can serve again. Thread-safe.
  absl::Status health() const;
  // The stalls of the forward passes that waited for host → GPU KV copies since the last call
  // (seconds each, ForwardOutput::onload_wait_seconds; at most the last 4096), for a histogram.
  std::vector<double> TakeOnloadWaits();

 private:
  Engine(const EngineOptions& options, ModelConfig config, std::unique_ptr<Backend> backend,
         std::unique_ptr<CacheManager> cache);
  // Marks finished write-behind offloads complete; with `wait`, waits for all of them first.
  void SettleOffloads(bool wait);
  // Runs one wave of requests in which each user appears at most once. Returns the positions in
  // `wave` of the requests deferred because the pages they need are pinned by the wave's other
  // requests (they fit once those commit); their results are left untouched.
  std::vector<size_t> RankWave(absl::Span<const RankRequest* const> wave,
                               absl::Span<absl::StatusOr<RankResult>* const> results);
  // The onload filter of the configured policy (null for kAlways). `wave_rows` (null: none), read
  // at each call: the rows the copies' own wave computes whichever way the user goes
  // (OverlapSeconds); `before_rows`: rows of a batch that runs whole while the copies proceed (a
  // prefetch's).
  OnloadFilter MakeOnloadFilter(const double* wave_rows, double before_rows = 0);
  // The rows of a request's first forward pass that are not history: its first candidate chunk.
  int64_t FirstChunkCandidates(const RankRequest& r) const;
  // Forgets the estimated copy backlog once no host → GPU copy can still be running.
  void NoteCopiesIdleIfNoPrefetch();
  // Takes the backend's latest onload timing, and mirrors the rates into stats_.
  void UpdateOnloadRates();
  // After a failed backend call: asks the backend whether its device is lost, and if so keeps
  // that as health_.
  void CheckDevice();
  // OK while healthy, else the UNAVAILABLE every request is answered once the device is lost.
  absl::Status Unavailable() const;

  EngineOptions options_;
  ModelConfig config_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<CacheManager> cache_;
  OnloadCostModel onload_cost_;  // used by the thread that calls Rank() and Prefetch()
  mutable std::mutex stats_mu_;
  EngineStats stats_;
  std::vector<double> onload_waits_;  // not yet taken (TakeOnloadWaits), under stats_mu_
  absl::Status health_;               // under stats_mu_; not OK once the device is lost
};

// The memory this process may use, in bytes: the machine's RAM, or its cgroup's limit where that
// is lower (a container's; cgroup v2 `memory.max`, or v1 `memory/memory.limit_in_bytes`, under
// `cgroup_root`). Sizes the automatic host tier.
int64_t UsableMemoryBytes(const std::string& cgroup_root = "/sys/fs/cgroup");

}  // namespace hstu
