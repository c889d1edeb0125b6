// The server's Prometheus families (DESIGN §9), built once here, and the HTTP exposer that serves
// them on /metrics. The engine and the cache fill plain stats structs; this file alone maps them to
// metric families (mirrored at scrape time). Labels are low-cardinality enums only.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/gpu_telemetry.h"
#include "server/http_exposer.h"
#include "server/tls.h"
#include "prometheus/registry.h"
#include "server/prom_family.h"

namespace hstu::server {

struct BatchInfo;

// Latency buckets from 0.1 ms to 1 s (sub-millisecond CPU work up to slow GPU batches).
std::vector<double> LatencyBucketsSeconds();

// The engine's counters since `base` (the gauges as in `now`): what the server exports, so that
// start-up work (graph warm-up, the warm-up request) is not counted as served traffic.
EngineStats CountersSince(const EngineStats& now, const EngineStats& base);

class ServerMetrics {
 public:
  // `stats` is polled at each scrape (Engine::Stats(), thread-safe); may be null until the engine
  // exists, then set with SetEngineStatsSource().
  explicit ServerMetrics(const std::string& version);
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  void SetEngineStatsSource(std::function<EngineStats()> stats, const std::string& device,
                            const std::string& model);
  // One finished RPC of Rank: `code` is the gRPC code name ("OK", "INVALID_ARGUMENT", ...).
  void ObserveRequest(const std::string& code, double seconds);
  void ObserveQueue(double seconds);
  // One request the scheduler turned away: `reason` is SubmitRejectionName() of why.
  void CountQueueRejection(const std::string& reason);
  void ObserveBatch(const BatchInfo& info);
  // One forward pass's stall on host → GPU KV copies (Engine::TakeOnloadWaits).
  void ObserveOnloadWait(double seconds);
  void AddInflight(int delta);
  void SetQueueDepthSource(std::function<int64_t()> depth);
  // The gRPC port's TLS reloader, read at each scrape (the hstu_tls_* families; none without).
  void SetTlsSource(std::function<TlsReloader::Stats()> tls);
  // The GPU's clock, power, energy and throttling, read at each scrape (the hstu_gpu_* families
  // below have no series without it: on the CPU, or without NVML).
  void SetGpuTelemetry(std::unique_ptr<GpuTelemetry> telemetry);

  // The text exposition format 0.0.4, after mirroring the engine's stats and the GPU's telemetry.
  std::string Serialize() const;

 private:
  void Collect() const;  // under scrape_mu_

  prometheus::Registry registry_;
  const std::string version_;
  const LabeledFamily<prometheus::Histogram> request_duration_;
  const LabeledFamily<prometheus::Histogram> request_queue_;
  const LabeledFamily<prometheus::Histogram> batch_compute_;
  const LabeledFamily<prometheus::Histogram> kv_onload_wait_;
  const LabeledFamily<prometheus::Histogram> batch_size_;
  const LabeledFamily<prometheus::Histogram> batch_tokens_;
  const LabeledFamily<prometheus::Counter> requests_total_;
  const LabeledFamily<prometheus::Counter> queue_rejections_;
  const LabeledFamily<prometheus::Gauge> process_start_time_;
  const LabeledFamily<prometheus::Gauge> inflight_;
  const LabeledFamily<prometheus::Gauge> queue_depth_;
  const LabeledFamily<prometheus::Counter> kv_lookups_;
  const LabeledFamily<prometheus::Counter> kv_tokens_;
  const LabeledFamily<prometheus::Gauge> kv_pages_;
  const LabeledFamily<prometheus::Counter> kv_transfer_bytes_;
  const LabeledFamily<prometheus::Counter> kv_evictions_;
  const LabeledFamily<prometheus::Counter> kv_dropped_;
  const LabeledFamily<prometheus::Counter> kv_prefetched_;
  const LabeledFamily<prometheus::Counter> kv_window_released_;
  const LabeledFamily<prometheus::Gauge> kv_onload_bandwidth_;
  const LabeledFamily<prometheus::Gauge> kv_recompute_cost_;
  const LabeledFamily<prometheus::Counter> cuda_graph_replays_;
  const LabeledFamily<prometheus::Counter> cuda_graph_fallbacks_;
  const LabeledFamily<prometheus::Gauge> gpu_memory_;
  const LabeledFamily<prometheus::Gauge> gpu_sm_clock_;
  const LabeledFamily<prometheus::Gauge> gpu_power_;
  const LabeledFamily<prometheus::Gauge> gpu_clock_event_;
  const LabeledFamily<prometheus::Counter> gpu_energy_;
  const LabeledFamily<prometheus::Counter> gpu_throttled_;
  const LabeledFamily<prometheus::Counter> engine_compute_;
  const LabeledFamily<prometheus::Counter> engine_device_;
  const LabeledFamily<prometheus::Counter> engine_batches_;
  const LabeledFamily<prometheus::Gauge> engine_healthy_;
  const LabeledFamily<prometheus::Gauge> tls_expiry_;
  const LabeledFamily<prometheus::Counter> tls_reloads_;
  const LabeledFamily<prometheus::Gauge> tls_reload_failing_;
  const LabeledFamily<prometheus::Gauge> build_info_;

  mutable std::mutex scrape_mu_;  // one scrape at a time: the mirrored counters step by deltas
  mutable std::mutex mu_;  // guards the sources below
  std::function<EngineStats()> engine_stats_;
  std::function<int64_t()> queue_depth_source_;
  std::function<TlsReloader::Stats()> tls_source_;
  std::shared_ptr<const GpuTelemetry> gpu_telemetry_;
};

// Serves `GET /metrics` (and `/` with a pointer to it) on its own port (server/http_exposer.h).
class MetricsHttpServer {
 public:
  // `listen` is HOST:PORT; port 0 picks a free one (see port()).
  // `serving` answers GET /healthz (the gRPC health status, for probes without gRPC). With `tls`
  // the port speaks HTTPS only (HttpExposer).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, const ServerMetrics* metrics, std::function<bool()> serving = {},
      HttpExposer::TlsSource tls = {});
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;

  std::unique_ptr<HttpExposer> exposer_;
  int port_ = 0;
};

}  // namespace hstu::server
