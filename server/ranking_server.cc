#include "server/ranking_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/warmup.h"
#include "server/stop_signals.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace hstu::server {

const char* ServerVersion() { return HSTU_VERSION; }

namespace {

// A small request through every layer, so the first real request does not pay for first-touch
// page faults or lazy initialisation. Its cache entry is forgotten afterwards: a client's user
// with this id starts as a miss like any other.
RankRequest WarmupRequest() {
  RankRequest r;
  r.user_id = ~uint64_t{0};
  r.history_item_ids = {1, 2, 3, 4};
  r.history_actions = {0, 0, 0, 0};
  r.candidate_item_ids = {5, 6};
  return r;
}

// A memory size for the log: GiB from 1 GiB up, else MiB (a small pool is not "0.00 GiB").
std::string SizeText(double bytes) {
  constexpr double kMiB = 1 << 20, kGiB = 1 << 30;
  return bytes >= kGiB ? absl::StrFormat("%.2f GiB", bytes / kGiB)
                       : absl::StrFormat("%.2f MiB", bytes / kMiB);
}

// Settings that would let the server report SERVING and then fail requests it accepted: a KV pool
// that cannot hold one user of the model's longest history (every such request would answer
// RESOURCE_EXHAUSTED, which clients read as "back off"), or a message limit below the largest
// reply (the engine would run the batch and gRPC then refuse to send its scores).
absl::Status CheckServingLimits(const ServerOptions& options, const Engine& engine) {
  const ModelConfig& c = engine.config();
  if (absl::Status pool = engine.CheckPoolHoldsTheLongestHistory(); !pool.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cache_pages=", options.engine.cache_pages, ": ", pool.message()));
  }
  const int64_t candidates = options.engine.limits.max_candidates;
  const int64_t largest_reply = candidates * c.num_tasks * 4 + kMaxRequestIdBytes + 1024;
  if (options.max_message_bytes < largest_reply) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_message_bytes=", options.max_message_bytes, ": smaller than the largest reply, ",
        largest_reply, " bytes (--max_candidates=", candidates, " x ", c.num_tasks,
        " tasks x 4 bytes, the request_id, 1 KiB of framing)"));
  }
  return absl::OkStatus();
}

// gRPC unlinks a unix socket's file before it binds, so a second server on the path took it over
// from the first, which went on reporting SERVING to no one (and lost it for good when the
// second stopped and removed the file). A socket that takes a connection is in use: refused, as
// a TCP port in use is. One that refuses it (ECONNREFUSED) was left by a process that is gone,
// and gRPC replaces it. unix-abstract: names have no file; their bind fails while in use.
absl::Status CheckUnixSocketFree(const std::string& address) {
  if (address.rfind("unix:", 0) != 0) return absl::OkStatus();
  std::string path = address.substr(5);
  if (path.rfind("//", 0) == 0) path = path.substr(2);  // unix:///abs/path
  struct stat st {};
  sockaddr_un addr{};
  if (::stat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) ||
      path.size() >= sizeof(addr.sun_path)) {
    return absl::OkStatus();  // nothing there, or what gRPC's own bind reports
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::OkStatus();
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  if (rc != 0 && (err == ECONNREFUSED || err == ENOENT)) return absl::OkStatus();  // stale, gone
  if (rc == 0 || err == EAGAIN) {  // EAGAIN: its backlog is full, so it listens
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", address,
                                               ": another process is serving on that socket"));
  }
  // Another user's socket (EACCES), another kind of socket (EPROTOTYPE): not ours to replace.
  return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", address,
                                             ": a socket is there that may be in use (connecting "
                                             "to it: ",
                                             std::strerror(err), "); remove it if it is not"));
}

}  // namespace

absl::Status CheckConnectionOptions(const ConnectionOptions& c) {
  constexpr int32_t kMaxSeconds = INT32_MAX / 1000;
  const std::tuple<const char*, int32_t, int32_t> ranges[] = {
      {"keepalive_time_s", c.keepalive_time_s, 0},
      {"keepalive_timeout_s", c.keepalive_timeout_s, 1},
      {"min_client_ping_interval_s", c.min_client_ping_interval_s, 0},
      {"max_connection_age_s", c.max_connection_age_s, 0},
      {"max_connection_age_grace_s", c.max_connection_age_grace_s, 0},
      {"max_connection_idle_s", c.max_connection_idle_s, 0}};
  for (const auto& [flag, value, min] : ranges) {
    if (value < min || value > kMaxSeconds) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, "=", value, ": must be in [", min, ", ", kMaxSeconds, "]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RankingServer>> RankingServer::Start(const ServerOptions& options) {
  if (absl::Status s = CheckConnectionOptions(options.connections); !s.ok()) return s;
  if (absl::Status s = CheckRequestLogOptions(options.request_log); !s.ok()) return s;
  std::unique_ptr<RankingServer> s(new RankingServer());
  s->options_ = options;
  s->metrics_ = std::make_unique<ServerMetrics>(ServerVersion());

  // TLS: the files are checked here too (OptionsFromFlags checked them for the flags; a caller
  // building ServerOptions itself gets the same errors), then kept current by the reloader.
  if (options.tls.enabled()) {
    auto tls = TlsReloader::Start(options.tls);
    if (!tls.ok()) return tls.status();
    s->tls_ = std::move(*tls);
    s->metrics_->SetTlsSource([tls = s->tls_.get()] { return tls->stats(); });
  } else if (auto plain = CheckTlsFiles(options.tls); !plain.ok()) {
    return plain.status();  // a key or client CA without a certificate
  }
  if (options.metrics_tls && s->tls_ == nullptr) {
    return absl::InvalidArgumentError(
        "--metrics_tls needs --tls_cert_file and --tls_key_file (it serves their certificate)");
  }

  if (!options.metrics_listen.empty()) {
    HttpExposer::TlsSource metrics_tls;
    if (options.metrics_tls) metrics_tls = [tls = s->tls_.get()] { return tls->server_context(); };
    auto http = MetricsHttpServer::Start(options.metrics_listen, s->metrics_.get(),
                                         [serving = s->serving_] { return serving->load(); },
                                         std::move(metrics_tls));
    if (!http.ok()) return http.status();
    s->http_ = std::move(*http);
    spdlog::info("metrics: serving Prometheus text format on {}://{}/metrics (port {}){}",
                 options.metrics_tls ? "https" : "http", options.metrics_listen, s->http_->port(),
                 options.metrics_tls ? ", the gRPC port's certificate, no client certificate asked"
                                     : "");
  } else {
    spdlog::warn("metrics: exposer disabled (--metrics_listen is empty)");
  }

  // The gRPC server starts before the model loads so that health checks see NOT_SERVING (rather
  // than a refused connection) while a large model loads and warms up.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  s->service_ = std::make_unique<RankService>(s->metrics_.get(), options.request_log);
  grpc::ServerBuilder builder;
  // A port another process listens on is an error, not shared: with SO_REUSEPORT (gRPC's default)
  // a second server on the same port silently took half of the new connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Without these one client could grow the server without bound: 200,000 streams opened on one
  // connection (headers only, ~15 bytes each) took 2.3 GB, and each open reflection stream held
  // a thread of its own (3,000 streams, 3,000 threads).
  if (options.max_concurrent_streams > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  }
  if (options.max_grpc_threads > 0) {
    grpc::ResourceQuota quota("hstu_server");
    quota.SetMaxThreads(options.max_grpc_threads);
    builder.SetResourceQuota(quota);
  }
  // Keepalive both ways and the connections' age (ConnectionOptions says why each).
  const ConnectionOptions& conn = options.connections;
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, conn.keepalive_time_s > 0
                                                             ? conn.keepalive_time_s * 1000
                                                             : INT32_MAX);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, conn.keepalive_timeout_s * 1000);
  // Without calls too: an idle connection is where a lost peer goes unnoticed, and (on the
  // receiving side) gRPC takes client pings on an idle connection at most every 2 hours without.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // The server's own pings need no data between them (gRPC's default stops after 2).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             conn.min_client_ping_interval_s * 1000);
  if (conn.max_connection_age_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, conn.max_connection_age_s * 1000);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               conn.max_connection_age_grace_s * 1000);
  }
  if (conn.max_connection_idle_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, conn.max_connection_idle_s * 1000);
  }
  if (absl::Status free = CheckUnixSocketFree(options.listen); !free.ok()) return free;
  builder.AddListeningPort(options.listen,
                           s->tls_ != nullptr ? s->tls_->credentials()
                                              : grpc::InsecureServerCredentials(),
                           &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  s->grpc_server_ = builder.BuildAndStart();
  if (s->grpc_server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", options.listen));
  }
  s->SetServing(false);
  const bool unix_socket = IsUnixSocketAddress(options.listen);  // gRPC reports port 1 for these
  spdlog::info("grpc: listening on {}{}, max message {} bytes; health NOT_SERVING until the model "
               "is warm",
               options.listen, unix_socket ? "" : absl::StrCat(" (port ", s->port_, ")"),
               options.max_message_bytes);
  spdlog::info(
      "grpc: connections: keepalive {}; client pings accepted {}; age limit {}; idle limit {}",
      conn.keepalive_time_s > 0 ? absl::StrCat("ping after ", conn.keepalive_time_s, " s idle (",
                                               conn.keepalive_timeout_s, " s to answer)")
                                : std::string("off"),
      conn.min_client_ping_interval_s > 0
          ? absl::StrCat("every ", conn.min_client_ping_interval_s, " s or more")
          : std::string("at any rate"),
      conn.max_connection_age_s > 0
          ? absl::StrCat(conn.max_connection_age_s, " s (", conn.max_connection_age_grace_s,
                         " s grace)")
          : std::string("none"),
      conn.max_connection_idle_s > 0 ? absl::StrCat(conn.max_connection_idle_s, " s")
                                     : std::string("none"));
  if (s->tls_ != nullptr) {
    const TlsSummary tls = s->tls_->stats().serving;
    spdlog::info("grpc: TLS with {} (certificate {}, expires {}), {}; the files are re-read every "
                 "{} s, checked copies in {}",
                 options.tls.cert_file, tls.subject,
                 absl::FormatTime("%Y-%m-%d", tls.not_after, absl::UTCTimeZone()),
                 options.tls.client_ca_file.empty()
                     ? std::string("no client certificate asked")
                     : absl::StrCat("client certificates required, verified against ",
                                    options.tls.client_ca_file, " (", tls.num_client_cas, " CAs)"),
                 options.tls.reload_interval_s, s->tls_->dir());
  } else {
    spdlog::info("grpc: plaintext (no --tls_cert_file)");
  }

  spdlog::info("engine: loading model '{}' on device '{}' (page size {}, cache pages {}, cache {})",
               options.engine.model, options.engine.device, options.engine.page_size,
               options.engine.cache_pages == 0 ? std::string("auto")
                                               : std::to_string(options.engine.cache_pages),
               options.engine.enable_cache ? "on" : "off");
  auto engine = Engine::Create(options.engine);
  if (!engine.ok()) {
    s->Shutdown(absl::ZeroDuration());
    return absl::Status(engine.status().code(),
                        absl::StrCat("engine: ", engine.status().message()));
  }
  s->engine_ = std::move(*engine);
  const ModelConfig& c = s->engine_->config();
  if (absl::Status fit = CheckServingLimits(options, *s->engine_); !fit.ok()) {
    s->Shutdown(absl::ZeroDuration());
    return fit;
  }
  spdlog::info("engine: model '{}': {} layers, hidden {}, {} heads x {}, {} tasks, max history {} "
               "tokens, {} candidates per forward; device {}",
               c.model_name, c.num_layers, c.hidden_dim, c.num_heads, c.head_dim, c.num_tasks,
               c.max_history_tokens, c.max_candidates, s->engine_->device_name());
  const bool on_cpu = s->engine_->device_name().rfind("cpu", 0) == 0;
  if (on_cpu) {
    spdlog::warn("engine: running on the CPU reference backend ({}), not on a GPU",
                 s->engine_->device_name());
  }
  const EngineStats stats = s->engine_->Stats();
  if (stats.cache.host_pages_total == 0) {
    spdlog::warn("engine: no host KV tier (--host_cache_pages={}{}); users evicted from the KV pool "
                 "are recomputed",
                 options.engine.host_cache_pages,
                 options.engine.host_cache_pages == -1 ? ": auto, none on this backend" : "");
  } else {
    spdlog::info("engine: host KV tier of {} pages ({}{}); onload policy {}",
                 stats.cache.host_pages_total,
                 SizeText(static_cast<double>(stats.cache.host_pages_total) *
                          static_cast<double>(stats.kv_page_bytes)),
                 on_cpu ? "" : " pinned", OnloadPolicyName(options.engine.onload_policy));
  }
  spdlog::info("engine: KV pool {} pages of {} tokens ({}); CUDA graphs {}",
               stats.cache.pages_total, options.engine.page_size,
               SizeText(static_cast<double>(stats.cache.pages_total) *
                        static_cast<double>(stats.kv_page_bytes)),
               on_cpu ? "none (CPU backend)" : options.engine.use_cuda_graphs ? "on" : "off");
  spdlog::info("engine: attention: {}", s->engine_->attention_kernel());

  if (options.warmup) {
    const auto warm = s->engine_->Rank(std::vector<RankRequest>{WarmupRequest()});
    if (warm.size() != 1 || !warm[0].ok()) {
      s->Shutdown(absl::ZeroDuration());
      return absl::InternalError(absl::StrCat(
          "engine: warm-up request failed: ",
          warm.empty() ? "no result" : std::string(warm[0].status().message())));
    }
    if (!s->engine_->Forget(WarmupRequest().user_id)) {
      spdlog::warn("engine: the warm-up request's cache entry is still in use; it stays");
    }
    spdlog::info("engine: warm-up request done");
  }
  // On a GPU, the eager steps' shapes too (engine/warmup.h): the GEMM tuner's first-call timing
  // of a row class would otherwise land on the first batches of misses.
  if (options.warmup && !on_cpu) {
    const absl::Time start = absl::Now();
    const absl::StatusOr<EagerWarmupSummary> warmed = WarmUpEagerSteps(
        *s->engine_, options.scheduler.max_batch_size, options.scheduler.max_batch_tokens);
    if (!warmed.ok()) {
      s->Shutdown(absl::ZeroDuration());
      return absl::InternalError(absl::StrCat("engine: ", warmed.status().message()));
    }
    if (warmed->num_kept > 0) {
      spdlog::warn("engine: {} warm-up users' cache entries are still in use", warmed->num_kept);
    }
    spdlog::info("engine: warm-up of the eager steps done: {} batches of misses, up to {} rows "
                 "({} ms)",
                 warmed->num_batches, warmed->most_rows,
                 absl::ToInt64Milliseconds(absl::Now() - start));
  }
  // After the graph warm-up and the warm-up requests: the row classes seen so far are tuned.
  spdlog::info("engine: UVQK GEMM route per row class: {}", s->engine_->gemm_routes());

  SchedulerOptions sched = options.scheduler;
  if (!sched.token_cost) {
    const int64_t max_history = c.max_history_tokens;
    sched.token_cost = [max_history](const RankRequest& r) {
      return std::min<int64_t>(2 * static_cast<int64_t>(r.history_item_ids.size()), max_history) +
             static_cast<int64_t>(r.candidate_item_ids.size());
    };
  }
  Engine* engine_ptr = s->engine_.get();
  if (options.prefetch_onload && engine_ptr->has_host_tier()) {
    sched.prefetch = [engine_ptr](absl::Span<const RankRequest* const> batch,
                                  absl::Span<const RankRequest* const> queued) {
      engine_ptr->Prefetch(batch, queued);
    };
  }
  Scheduler::RunBatchFn run = [engine_ptr](absl::Span<const RankRequest> batch) {
    return engine_ptr->Rank(batch);
  };
  if (options.batch_interceptor) {
    run = [interceptor = options.batch_interceptor, inner = run](
              absl::Span<const RankRequest> batch) { return interceptor(batch, inner); };
  }
  run = [server = s.get(), inner = std::move(run)](absl::Span<const RankRequest> batch) {
    auto results = inner(batch);
    server->NoteEngineHealth();
    return results;
  };
  ServerMetrics* metrics = s->metrics_.get();
  auto scheduler = Scheduler::Create(sched, std::move(run),
                                     [metrics, engine_ptr](const BatchInfo& info) {
                                       metrics->ObserveBatch(info);
                                       for (const double s : engine_ptr->TakeOnloadWaits()) {
                                         metrics->ObserveOnloadWait(s);
                                       }
                                     });
  if (!scheduler.ok()) {
    s->Shutdown(absl::ZeroDuration());
    return absl::Status(scheduler.status().code(),
                        absl::StrCat("scheduler: ", scheduler.status().message()));
  }
  s->scheduler_ = std::move(*scheduler);
  spdlog::info("scheduler: max batch {} requests / {} tokens, batch timeout {} us{}, queue {} ({} "
               "a user)",
               sched.max_batch_size, sched.max_batch_tokens, sched.batch_timeout.count(),
               sched.batch_timeout.count() > 0 && sched.adaptive_fill ? " (adaptive fill)" : "",
               sched.max_queue, sched.max_queue_per_user);
  if (const RequestLogOptions& rl = options.request_log; rl.slow_request_ms >= 0) {
    spdlog::info("requests: a line for each call of at least {} ms in the server ({})",
                 rl.slow_request_ms,
                 rl.max_lines_per_s > 0 ? absl::StrCat("at most ", rl.max_lines_per_s, " a second")
                                        : std::string("no rate limit"));
  }
  Scheduler* sched_ptr = s->scheduler_.get();
  metrics->SetQueueDepthSource([sched_ptr] { return sched_ptr->QueueDepth(); });
  // Counted from here on: the graph warm-up and the warm-up request are not served traffic.
  metrics->SetEngineStatsSource(
      [engine_ptr, base = engine_ptr->Stats()] { return CountersSince(engine_ptr->Stats(), base); },
      s->engine_->device_name(), c.model_name);
  if (const std::string bus_id = s->engine_->device_pci_bus_id(); !bus_id.empty()) {
    if (auto telemetry = GpuTelemetry::Open(bus_id); telemetry.ok()) {
      metrics->SetGpuTelemetry(*std::move(telemetry));
      spdlog::info("metrics: GPU clock, power and throttling of {} through NVML", bus_id);
    } else {
      spdlog::warn("metrics: no GPU clock and power metrics ({})",
                   std::string(telemetry.status().message()));
    }
  }

  // The stall timeout: on a GPU a decode step takes milliseconds and a whole no-cache batch well
  // under a second, so a minute means a hung kernel; CPU batches of large models take minutes.
  const int32_t stall_s = options.engine_stall_timeout_s >= 0 ? options.engine_stall_timeout_s
                                                               : (on_cpu ? 0 : 60);
  s->stall_timeout_ = absl::Seconds(stall_s);
  spdlog::info("engine: stall timeout {}", stall_s > 0 ? absl::StrCat(stall_s, " s (a batch "
                                                         "running longer ends the process)")
                                                       : std::string("off"));

  if (options.before_serving) options.before_serving();
  s->service_->Attach(s->engine_.get(), s->scheduler_.get());
  s->SetServing(true);
  spdlog::info("ready: health SERVING on {}",
               unix_socket ? options.listen : absl::StrCat("port ", s->port_));
  return s;
}

void RankingServer::SetServing(bool serving) {
  serving_->store(serving && grpc_server_ != nullptr);
  if (grpc_server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = grpc_server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);                     // the whole server ("")
  health->SetServingStatus("hstu.v1.Ranker", serving);  // and the service by name
}

void RankingServer::NoteEngineHealth() {
  // The engine logged the loss. Not under shutdown_mu_: Shutdown() holds it while the scheduler
  // drains, i.e. while this runs; the health service takes updates from any thread (repeats
  // included) and ignores them once shut down.
  if (!engine_->health().ok()) SetServing(false);
}

void RankingServer::Shutdown(absl::Duration grace) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (grpc_server_ != nullptr) {
    SetServing(false);
    // New Rank calls are refused at once (UNAVAILABLE); those in flight finish, within the grace.
    // Only then is gRPC shut down, with no wait: its own wait would also hold for the streams
    // that never end by themselves (health Watch), the whole grace. Whatever is still running
    // then is cancelled.
    // The queued calls run from now on without waiting out --batch_timeout_us for fuller batches:
    // no call can join them any more.
    const absl::Time until = absl::Now() + grace;
    if (service_ != nullptr) {
      service_->StopAdmitting();
      if (scheduler_ != nullptr) scheduler_->StopWaitingForFullerBatches();
      while (service_->InFlight() > 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
    }
    grpc_server_->Shutdown(std::chrono::system_clock::now());
    grpc_server_->Wait();
  }
  if (scheduler_ != nullptr) scheduler_->Drain();
  if (service_ != nullptr) service_->request_log().Flush();
  http_.reset();
}

RankingServer::~RankingServer() { Shutdown(absl::ZeroDuration()); }

absl::Status RankingServer::CheckStall() {
  if (stall_timeout_ <= absl::ZeroDuration() || scheduler_ == nullptr) return absl::OkStatus();
  const absl::Duration busy = scheduler_->BusyFor();
  if (busy <= stall_timeout_) return absl::OkStatus();
  SetServing(false);
  return absl::DeadlineExceededError(absl::StrCat(
      "the engine has been running one batch for ", absl::FormatDuration(busy),
      ", more than the stall timeout of ", absl::FormatDuration(stall_timeout_),
      " (--engine_stall_timeout_s): the GPU looks hung"));
}

int ServeUntilStopped(RankingServer& server, const StopWait& wait_stop, absl::Duration grace) {
  // Waits of 200 ms for a signal, the engine's health and progress looked at between them.
  const absl::Duration poll = absl::Milliseconds(200);
  const auto stalled = [&server]() -> bool {
    const absl::Status stall = server.CheckStall();
    if (stall.ok()) return false;
    spdlog::critical("{}; exiting with status {} without draining, so that the process is "
                     "restarted",
                     std::string(stall.message()), kEngineStalled);
    return true;
  };
  int sig = -1;
  absl::Status engine_health;
  while (sig < 0 && engine_health.ok()) {
    sig = wait_stop(poll);
    if (stalled()) return kEngineStalled;
    engine_health = server.engine_health();
    server.FlushSlowRequestLog();
  }
  const int first_sig = sig;
  // A copy of the same signal already waiting (timeout(1) signals the process and its group) is
  // taken now, before the log line and the drain's thread could push it past the window on a
  // loaded machine. Another signal already waiting is kept for the watch below.
  int waiting = first_sig >= 0 ? wait_stop(absl::ZeroDuration()) : -1;
  if (!engine_health.ok()) {
    spdlog::error("engine lost its device ({}); draining (up to {} s) and exiting with status 1 "
                  "so that the process is restarted",
                  std::string(engine_health.message()), absl::ToInt64Seconds(grace));
  } else {
    spdlog::info("received {}, draining (health NOT_SERVING, up to {} s for in-flight requests; "
                 "a second signal exits at once)",
                 StopSignalName(sig), absl::ToInt64Seconds(grace));
  }
  // The drain waits for the batch on the engine, so it runs beside this thread, which keeps
  // watching: a batch that hangs during the drain, or a second signal, ends the wait. The drain's
  // thread is then left running (the caller ends the process without destructors); its state
  // is shared so that it never touches this frame.
  auto drained = std::make_shared<std::atomic<bool>>(false);
  std::thread drain([&server, grace, drained] {
    server.Shutdown(grace);
    drained->store(true);
  });
  // The duplicate's window starts here, not when the first was taken: the log line and the
  // thread's start above must not use it up on a loaded machine.
  const absl::Time watch_from = absl::Now();
  while (!drained->load()) {
    const bool at_once = waiting >= 0;
    sig = at_once ? std::exchange(waiting, -1) : wait_stop(poll);
    if (drained->load()) break;
    if (stalled()) {
      drain.detach();
      return kEngineStalled;
    }
    if (sig >= 0 && sig == first_sig &&
        (at_once || absl::Now() - watch_from < kDuplicateSignalWindow)) {
      spdlog::info("received {} again at once (one request to stop, sent twice); draining on",
                   StopSignalName(sig));
      continue;
    }
    if (sig >= 0) {
      spdlog::warn("received {} while draining; exiting with status {} without finishing the "
                   "drain",
                   StopSignalName(sig), kDrainInterrupted);
      drain.detach();
      return kDrainInterrupted;
    }
  }
  drain.join();
  return engine_health.ok() ? 0 : 1;
}

}  // namespace hstu::server
