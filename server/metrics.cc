#include "server/metrics.h"


#include <chrono>
#include <cstring>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"
#include "server/scheduler.h"

namespace hstu::server {

std::vector<double> LatencyBucketsSeconds() {
  return {0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
          0.01,   0.015,   0.02,   0.03,    0.05,  0.075,  0.1,   0.15,  0.25,  0.5,    1.0};
}

namespace {

std::vector<double> BatchSizeBuckets() { return {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128}; }

std::vector<double> BatchTokenBuckets() {
  std::vector<double> b;
  for (double v = 16; v <= 262144; v *= 2) b.push_back(v);
  return b;
}

}  // namespace

ServerMetrics::ServerMetrics(const std::string& version)
    : version_(version),
      request_duration_(RegisterHistogram(
          registry_, "hstu_request_duration_seconds",
          "Rank RPC latency in the server, from arrival to the answer, by gRPC status code.",
          LatencyBucketsSeconds(), {"code"})),
      request_queue_(RegisterHistogram(
          registry_, "hstu_request_queue_seconds",
          "Time a Rank request waited in the scheduler queue before its batch started.",
          LatencyBucketsSeconds())),
      batch_compute_(RegisterHistogram(registry_, "hstu_batch_compute_seconds",
                                       "Engine time of one batch (all its forward passes).",
                                       LatencyBucketsSeconds())),
      kv_onload_wait_(RegisterHistogram(
          registry_, "hstu_kv_onload_wait_seconds",
          "Device time a forward pass's compute stalled on KV pages coming back from the host "
          "tier (onloads, prefetches), one observation per pass that waited (none on the CPU "
          "backend, whose copies are synchronous).",
          LatencyBucketsSeconds())),
      batch_size_(RegisterHistogram(registry_, "hstu_batch_size", "Requests per engine batch.",
                                    BatchSizeBuckets())),
      batch_tokens_(RegisterHistogram(
          registry_, "hstu_batch_tokens",
          "Estimated tokens per engine batch (history tokens plus candidates, before cache reuse).",
          BatchTokenBuckets())),
      requests_total_(RegisterCounter(registry_, "hstu_requests_total",
                                      "Finished Rank RPCs by gRPC status code.", {"code"})),
      queue_rejections_(RegisterCounter(
          registry_, "hstu_queue_rejections_total",
          "Rank requests turned away before any engine work, by reason: queue_full "
          "(--max_queue or --max_queued_tokens), user_queue_full (--max_queue_per_user), "
          "shutting_down (refused during the drain), starting (refused while the model loads); "
          "these last two are not in hstu_requests_total.",
          {"reason"})),
      process_start_time_(RegisterGauge(
          registry_, "process_start_time_seconds",
          "Start time of the process since the Unix epoch in seconds (a restart changes it).")),
      inflight_(RegisterGauge(registry_, "hstu_inflight_requests",
                              "Rank RPCs received and not yet answered.")),
      queue_depth_(
          RegisterGauge(registry_, "hstu_queue_depth", "Requests waiting in the scheduler queue.")),
      kv_lookups_(RegisterCounter(registry_, "hstu_kv_lookups_total",
                                  "KV cache lookups by outcome.", {"result"})),
      kv_tokens_(RegisterCounter(registry_, "hstu_kv_tokens_total",
                                 "History tokens served from the cache (reused) or computed.",
                                 {"kind"})),
      kv_pages_(RegisterGauge(registry_, "hstu_kv_pages", "KV cache pages by tier and state.",
                              {"tier", "state"})),
      kv_transfer_bytes_(RegisterCounter(registry_, "hstu_kv_transfer_bytes_total",
                                         "KV bytes moved between the GPU and the host tier.",
                                         {"direction"})),
      kv_evictions_(RegisterCounter(registry_, "hstu_kv_evictions_total",
                                    "KV cache entries evicted to make room, by tier.", {"tier"})),
      kv_dropped_(RegisterCounter(
          registry_, "hstu_kv_dropped_entries_total",
          "KV cache entries dropped because their request failed or they could not be kept.")),
      kv_prefetched_(RegisterCounter(
          registry_, "hstu_kv_prefetch_pages_total",
          "KV pages whose host-to-GPU onload started before their request's batch (prefetch).",
          {})),
      kv_window_released_(RegisterCounter(
          registry_, "hstu_kv_window_released_pages_total",
          "GPU KV pages released because no request reads them again under the model's sliding "
          "window.",
          {})),
      kv_onload_bandwidth_(RegisterGauge(
          registry_, "hstu_kv_onload_bandwidth_bytes_per_second",
          "Host-to-GPU KV onload bandwidth the onload policy assumes: measured from completed "
          "onloads (a start value until the first one), or fixed.")),
      kv_recompute_cost_(RegisterGauge(
          registry_, "hstu_kv_recompute_seconds_per_token",
          "GPU seconds per forward row (history token or candidate) the onload policy assumes: "
          "measured from forward passes that waited for no copy (a start value until the first), "
          "or fixed.")),
      cuda_graph_replays_(RegisterCounter(registry_, "hstu_cuda_graph_replays_total",
                                          "Forward passes replayed from captured CUDA graphs.")),
      cuda_graph_fallbacks_(RegisterCounter(
          registry_, "hstu_cuda_graph_fallbacks_total",
          "Forward passes that fit a captured graph bucket's size but ran eagerly: their attention "
          "plan was of another kind (cluster or not) or larger than the capture holds. Passes "
          "larger than every bucket are not counted.")),
      gpu_memory_(RegisterGauge(registry_, "hstu_gpu_memory_bytes",
                                "Device memory held by the engine, by kind (0 on the CPU).",
                                {"kind"})),
      gpu_sm_clock_(RegisterGauge(registry_, "hstu_gpu_sm_clock_hertz",
                                  "The GPU's SM clock at the scrape (NVML; no series on the "
                                  "CPU). Under sustained load the power limit lowers it.")),
      gpu_power_(RegisterGauge(registry_, "hstu_gpu_power_watts",
                               "The GPU board's power draw at the scrape (NVML).")),
      gpu_clock_event_(RegisterGauge(
          registry_, "hstu_gpu_clock_event_active",
          "1 while the driver holds the SM clock down for this reason at the scrape (NVML clock "
          "event reasons: power_cap = the software power limit, thermal = temperature), else 0.",
          {"reason"})),
      gpu_energy_(RegisterCounter(
          registry_, "hstu_gpu_energy_joules_total",
          "The GPU board's energy since the driver loaded (NVML); its rate is the mean power.")),
      gpu_throttled_(RegisterCounter(registry_, "hstu_gpu_throttled_seconds_total",
                                     "Time the GPU's clock was held below its target, by cause "
                                     "(NVML violation counters, since "
                                     "the driver loaded); its rate is the share of time throttled.",
                                     {"reason"})),
      engine_compute_(RegisterCounter(registry_, "hstu_engine_compute_seconds_total",
                                      "Total time inside the engine's backend forward passes.")),
      engine_device_(RegisterCounter(
          registry_, "hstu_engine_device_seconds_total",
          "Of the forward passes' time, the device's time on their steps, from the first kernel to "
          "the score read-back (CUDA events; 0 on the CPU). The rest is host work.")),
      engine_batches_(
          RegisterCounter(registry_, "hstu_engine_batches_total", "Batches the engine has run.")),
      engine_healthy_(RegisterGauge(
          registry_, "hstu_engine_healthy",
          "1 while the engine can run work; 0 once its device is lost (a sticky CUDA error): "
          "requests are then answered UNAVAILABLE, health is NOT_SERVING, and the process exits "
          "to be restarted.")),
      tls_expiry_(RegisterGauge(
          registry_, "hstu_tls_certificate_expiry_timestamp_seconds",
          "When the gRPC port's certificate in service expires (Unix time; no series without "
          "TLS). A rotation that fails its checks leaves the old one, and this, in place.")),
      tls_reloads_(RegisterCounter(
          registry_, "hstu_tls_reloads_total",
          "Changed TLS files found at a reload check: put in service (result=ok), or failing "
          "the start-up checks and kept out (result=error, counted at every check until fixed).",
          {"result"})),
      tls_reload_failing_(RegisterGauge(
          registry_, "hstu_tls_reload_failing",
          "1 while the TLS files on disk differ from the set in service and fail the checks "
          "(the previous certificate serves on); 0 otherwise.")),
      build_info_(RegisterGauge(registry_, "hstu_build_info",
                                "Always 1; labels say the version, device and model.",
                                {"version", "device", "model"})) {
  // Children that must exist before the first observation, so dashboards and alerts see zeros.
  request_duration_.WithLabels({"OK"});
  // Every code the server answers with, so that the first failure is a step from 0 that rate()
  // sees, not a new series at its value.
  for (const char* code : {"OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                           "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "INTERNAL",
                           "UNAVAILABLE"}) {
    requests_total_.WithLabels({code});
  }
  for (const SubmitRejection r : {SubmitRejection::kQueueFull, SubmitRejection::kUserQueueFull,
                                  SubmitRejection::kShuttingDown, SubmitRejection::kStarting}) {
    queue_rejections_.WithLabels({SubmitRejectionName(r)});
  }
  process_start_time_.WithLabels({}).Set(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  request_queue_.WithLabels({});
  batch_compute_.WithLabels({});
  kv_onload_wait_.WithLabels({});
  batch_size_.WithLabels({});
  batch_tokens_.WithLabels({});
  inflight_.WithLabels({});
  queue_depth_.WithLabels({});
  for (int r = 0; r < static_cast<int>(LookupResult::kNumResults); ++r) {
    kv_lookups_.WithLabels({LookupResultName(static_cast<LookupResult>(r))});
  }
  kv_lookups_.WithLabels({"host_hit"});  // named here too, in case the enum lacks it
  kv_tokens_.WithLabels({"reused"});
  kv_tokens_.WithLabels({"computed"});
  for (const char* tier : {"gpu", "host"}) {
    for (const char* state : {"used", "free"}) kv_pages_.WithLabels({tier, state});
    kv_evictions_.WithLabels({tier});
  }
  kv_pages_.WithLabels({"gpu", "pinned"});  // pinning applies to GPU pages only
  kv_transfer_bytes_.WithLabels({"offload"});
  kv_transfer_bytes_.WithLabels({"onload"});
  kv_dropped_.WithLabels({});
  kv_prefetched_.WithLabels({});
  kv_window_released_.WithLabels({});
  kv_onload_bandwidth_.WithLabels({});
  kv_recompute_cost_.WithLabels({});
  cuda_graph_replays_.WithLabels({});
  cuda_graph_fallbacks_.WithLabels({});
  for (const char* kind : {"total", "kv_pool", "weights"}) gpu_memory_.WithLabels({kind});
  engine_compute_.WithLabels({});
  engine_batches_.WithLabels({});
  engine_healthy_.WithLabels({}).Set(1);
}

void ServerMetrics::SetGpuTelemetry(std::unique_ptr<GpuTelemetry> telemetry) {
  std::lock_guard<std::mutex> lock(mu_);
  gpu_telemetry_ = std::move(telemetry);
}

void ServerMetrics::SetEngineStatsSource(std::function<EngineStats()> stats,
                                         const std::string& device, const std::string& model) {
  std::lock_guard<std::mutex> lock(mu_);
  engine_stats_ = std::move(stats);
  build_info_.WithLabels({version_, device, model}).Set(1);
}

void ServerMetrics::SetTlsSource(std::function<TlsReloader::Stats()> tls) {
  std::lock_guard<std::mutex> lock(mu_);
  tls_source_ = std::move(tls);
}

void ServerMetrics::SetQueueDepthSource(std::function<int64_t()> depth) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_depth_source_ = std::move(depth);
}

void ServerMetrics::ObserveRequest(const std::string& code, double seconds) {
  request_duration_.WithLabels({code}).Observe(seconds);
  requests_total_.WithLabels({code}).Increment();
}

void ServerMetrics::CountQueueRejection(const std::string& reason) {
  queue_rejections_.WithLabels({reason}).Increment();
}

void ServerMetrics::ObserveQueue(double seconds) { request_queue_.WithLabels({}).Observe(seconds); }

void ServerMetrics::ObserveBatch(const BatchInfo& info) {
  batch_compute_.WithLabels({}).Observe(info.compute_seconds);
  batch_size_.WithLabels({}).Observe(info.num_requests);
  batch_tokens_.WithLabels({}).Observe(static_cast<double>(info.num_tokens));
}

void ServerMetrics::ObserveOnloadWait(double seconds) {
  kv_onload_wait_.WithLabels({}).Observe(seconds);
}

EngineStats CountersSince(const EngineStats& now, const EngineStats& base) {
  EngineStats d = now;
  for (int r = 0; r < static_cast<int>(LookupResult::kNumResults); ++r) {
    d.cache.lookups[r] -= base.cache.lookups[r];
  }
  d.cache.tokens_reused -= base.cache.tokens_reused;
  d.cache.tokens_computed -= base.cache.tokens_computed;
  d.cache.evictions -= base.cache.evictions;
  d.cache.host_evictions -= base.cache.host_evictions;
  d.cache.dropped_entries -= base.cache.dropped_entries;
  d.cache.pages_offloaded -= base.cache.pages_offloaded;
  d.cache.pages_onloaded -= base.cache.pages_onloaded;
  d.cache.offloads_skipped -= base.cache.offloads_skipped;
  d.cache.pages_prefetched -= base.cache.pages_prefetched;
  d.cache.window_pages_released -= base.cache.window_pages_released;
  d.batches -= base.batches;
  d.requests -= base.requests;
  d.forward_passes -= base.forward_passes;
  d.compute_seconds -= base.compute_seconds;
  d.device_seconds -= base.device_seconds;
  d.kv_offload_bytes -= base.kv_offload_bytes;
  d.kv_onload_bytes -= base.kv_onload_bytes;
  d.graph_replays -= base.graph_replays;
  d.graph_fallbacks -= base.graph_fallbacks;
  d.onload_waits -= base.onload_waits;
  d.onload_wait_seconds -= base.onload_wait_seconds;
  return d;
}

void ServerMetrics::AddInflight(int delta) { inflight_.WithLabels({}).Increment(delta); }

std::string ServerMetrics::Serialize() const {
  std::lock_guard<std::mutex> lock(scrape_mu_);
  Collect();
  return prometheus::TextSerializer().Serialize(registry_.Collect());
}

void ServerMetrics::Collect() const {
  std::function<EngineStats()> stats_fn;
  std::function<int64_t()> depth_fn;
  std::function<TlsReloader::Stats()> tls_fn;
  std::shared_ptr<const GpuTelemetry> telemetry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_fn = engine_stats_;
    depth_fn = queue_depth_source_;
    tls_fn = tls_source_;
    telemetry = gpu_telemetry_;
  }
  if (depth_fn) queue_depth_.WithLabels({}).Set(static_cast<double>(depth_fn()));
  if (tls_fn) {
    const TlsReloader::Stats t = tls_fn();
    tls_expiry_.WithLabels({}).Set(absl::ToDoubleSeconds(t.serving.not_after - absl::UnixEpoch()));
    MirrorTotal(tls_reloads_.WithLabels({"ok"}), static_cast<double>(t.num_reloads));
    MirrorTotal(tls_reloads_.WithLabels({"error"}), static_cast<double>(t.num_reload_errors));
    tls_reload_failing_.WithLabels({}).Set(t.failing ? 1 : 0);
  }
  if (telemetry != nullptr) {
    // A failed read leaves the previous values: a scrape is not the place to report it.
    if (const absl::StatusOr<GpuReading> r = telemetry->Read(); r.ok()) {
      gpu_sm_clock_.WithLabels({}).Set(r->sm_clock_hz);
      gpu_power_.WithLabels({}).Set(r->power_watts);
      gpu_clock_event_.WithLabels({"power_cap"})
          .Set((r->clock_event_reasons & kClockEventSwPowerCap) != 0 ? 1 : 0);
      gpu_clock_event_.WithLabels({"thermal"})
          .Set((r->clock_event_reasons & kClockEventThermal) != 0 ? 1 : 0);
      if (r->energy_joules >= 0) MirrorTotal(gpu_energy_.WithLabels({}), r->energy_joules);
      if (r->power_throttled_seconds >= 0) {
        MirrorTotal(gpu_throttled_.WithLabels({"power"}), r->power_throttled_seconds);
      }
      if (r->thermal_throttled_seconds >= 0) {
        MirrorTotal(gpu_throttled_.WithLabels({"thermal"}), r->thermal_throttled_seconds);
      }
    }
  }
  if (!stats_fn) return;
  const EngineStats s = stats_fn();
  const CacheStats& c = s.cache;
  for (int r = 0; r < static_cast<int>(LookupResult::kNumResults); ++r) {
    MirrorTotal(kv_lookups_.WithLabels({LookupResultName(static_cast<LookupResult>(r))}),
        static_cast<double>(c.lookups[r]));
  }
  MirrorTotal(kv_tokens_.WithLabels({"reused"}), static_cast<double>(c.tokens_reused));
  MirrorTotal(kv_tokens_.WithLabels({"computed"}), static_cast<double>(c.tokens_computed));
  kv_pages_.WithLabels({"gpu", "used"}).Set(static_cast<double>(c.pages_total - c.pages_free));
  kv_pages_.WithLabels({"gpu", "free"}).Set(static_cast<double>(c.pages_free));
  kv_pages_.WithLabels({"gpu", "pinned"}).Set(static_cast<double>(c.pages_pinned));
  kv_pages_.WithLabels({"host", "used"})
      .Set(static_cast<double>(c.host_pages_total - c.host_pages_free));
  kv_pages_.WithLabels({"host", "free"}).Set(static_cast<double>(c.host_pages_free));
  MirrorTotal(kv_evictions_.WithLabels({"gpu"}), static_cast<double>(c.evictions));
  MirrorTotal(kv_evictions_.WithLabels({"host"}), static_cast<double>(c.host_evictions));
  MirrorTotal(kv_transfer_bytes_.WithLabels({"offload"}), static_cast<double>(s.kv_offload_bytes));
  MirrorTotal(kv_transfer_bytes_.WithLabels({"onload"}), static_cast<double>(s.kv_onload_bytes));
  MirrorTotal(kv_dropped_.WithLabels({}), static_cast<double>(c.dropped_entries));
  MirrorTotal(kv_prefetched_.WithLabels({}), static_cast<double>(c.pages_prefetched));
  MirrorTotal(kv_window_released_.WithLabels({}), static_cast<double>(c.window_pages_released));
  kv_onload_bandwidth_.WithLabels({}).Set(s.onload_bytes_per_second);
  kv_recompute_cost_.WithLabels({}).Set(s.recompute_seconds_per_token);
  MirrorTotal(cuda_graph_replays_.WithLabels({}), static_cast<double>(s.graph_replays));
  MirrorTotal(cuda_graph_fallbacks_.WithLabels({}), static_cast<double>(s.graph_fallbacks));
  // On the CPU backend the "gpu" tier is the engine's primary KV pool in host memory, and the
  // device memory is 0: the labels keep their meaning when the CUDA backend lands.
  gpu_memory_.WithLabels({"total"}).Set(static_cast<double>(s.device_memory_bytes));
  const bool on_device = s.device_memory_bytes > 0;
  gpu_memory_.WithLabels({"kv_pool"}).Set(on_device ? static_cast<double>(s.kv_pool_bytes) : 0);
  gpu_memory_.WithLabels({"weights"}).Set(on_device ? static_cast<double>(s.weight_bytes) : 0);
  MirrorTotal(engine_compute_.WithLabels({}), s.compute_seconds);
  MirrorTotal(engine_device_.WithLabels({}), s.device_seconds);
  MirrorTotal(engine_batches_.WithLabels({}), static_cast<double>(s.batches));
  engine_healthy_.WithLabels({}).Set(s.device_lost ? 0 : 1);
}

// ---- HTTP ------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, const ServerMetrics* metrics, std::function<bool()> serving,
    HttpExposer::TlsSource tls) {
  auto exposer = HttpExposer::Start(listen, [metrics] { return metrics->Serialize(); },
                                    std::move(serving), std::move(tls));
  if (!exposer.ok()) return exposer.status();
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->port_ = (*exposer)->port();
  server->exposer_ = *std::move(exposer);
  return server;
}

MetricsHttpServer::~MetricsHttpServer() = default;

}  // namespace hstu::server
