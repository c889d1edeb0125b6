#include "server/flags.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/backend.h"
#include "server/address.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "gRPC listen address HOST:PORT (port 0 picks a free port) or unix:PATH.");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "Prometheus exposer address HOST:PORT serving /metrics; empty disables it.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain (leaf first) for TLS on the gRPC port; empty: plaintext. Re-read "
          "every --tls_reload_interval_s, so a rotated certificate needs no restart. /metrics "
          "stays plain HTTP unless --metrics_tls.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key (unencrypted) of --tls_cert_file.");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA certificates: when given, every client must present a certificate they signed "
          "(mutual TLS); empty: no client certificate is asked for.");
ABSL_FLAG(int32_t, tls_reload_interval_s, 60,
          "How often the TLS files are re-read for rotation, in seconds (>= 1).");
ABSL_FLAG(bool, metrics_tls, false,
          "Serve /metrics and /healthz over HTTPS with the gRPC port's certificate and key "
          "(--tls_cert_file, --tls_key_file; rotated with them). No client certificate is asked "
          "for there.");
ABSL_FLAG(std::string, model, "random:tiny",
          "Model: a safetensors file, or random:PRESET (tiny, base) for a seeded random model.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of random:PRESET models.");
ABSL_FLAG(std::string, device, "auto",
          "Device: auto (cuda:0 when a usable GPU is present, else cpu with a warning; a model "
          "the GPU's kernels do not run, such as random:tiny, is then an error, not moved to the "
          "CPU), cpu, cpu-bf16 (the CPU reference rounded as the GPU rounds), or cuda:N.");
ABSL_FLAG(int32_t, max_batch_size, 8, "Most requests (users) in one engine batch.");
ABSL_FLAG(int64_t, max_batch_tokens, 65536,
          "Most estimated tokens (kept history tokens + candidates) in one engine batch; a larger "
          "single request still runs, alone.");
ABSL_FLAG(int64_t, batch_timeout_us, 0,
          "How long a partly filled batch may wait for more requests, counted from its oldest "
          "request's arrival. 0: an idle engine takes whatever is queued at once.");
ABSL_FLAG(bool, adaptive_batching, true,
          "With --batch_timeout_us > 0: a partly filled batch is full once it holds as many "
          "requests as the batch before it (closed-loop callers regroup without waiting out the "
          "timeout); false: only at --max_batch_size.");
ABSL_FLAG(int32_t, max_queue, 1024,
          "Most requests waiting for the engine; beyond it Rank answers RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_queued_tokens, int64_t{1} << 25,
          "Most estimated tokens (2 per history event plus the candidates) of the requests waiting "
          "for the engine, which bounds the queue's memory (~15 bytes a token); beyond it Rank "
          "answers RESOURCE_EXHAUSTED, except behind an empty queue. 0: no bound.");
ABSL_FLAG(int32_t, max_queue_per_user, 32,
          "Most requests of one user waiting for the engine (they run one per batch); beyond it "
          "that user's calls answer RESOURCE_EXHAUSTED. 0: no per-user limit.");
ABSL_FLAG(int64_t, max_candidates, 1024,
          "Most candidates per request (INVALID_ARGUMENT beyond). Requests with more candidates "
          "than the model scores per forward are scored in chunks with identical results.");
ABSL_FLAG(int64_t, max_message_bytes, 16 << 20,
          "Largest gRPC message accepted or sent, in bytes (larger: RESOURCE_EXHAUSTED).");
ABSL_FLAG(int32_t, max_concurrent_streams, 1024,
          "Most calls (HTTP/2 streams) one client connection may have open at once; its further "
          "calls wait in the client. 0: no limit.");
ABSL_FLAG(int32_t, max_grpc_threads, 128,
          "Most threads for gRPC's synchronous services (server reflection takes one per open "
          "stream; Rank and health take none); beyond it such calls are refused. 0: no limit, "
          "else at least 4.");
ABSL_FLAG(int32_t, keepalive_time_s, 60,
          "Ping a gRPC connection idle this long; a client that does not answer within "
          "--keepalive_timeout_s is gone and its connection closed. 0: no pings.");
ABSL_FLAG(int32_t, keepalive_timeout_s, 20, "How long a keepalive ping may go unanswered (>= 1).");
ABSL_FLAG(int32_t, min_client_ping_interval_s, 10,
          "Accept client keepalive pings this often, with or without calls in flight; more often "
          "ends the connection (GOAWAY too_many_pings). 0: no limit. gRPC's own default is 300 s "
          "(2 h without calls).");
ABSL_FLAG(int32_t, max_connection_age_s, 0,
          "Ask connections older than this to reconnect (GOAWAY), so that clients spread over new "
          "replicas; calls in flight get --max_connection_age_grace_s. 0: no limit.");
ABSL_FLAG(int32_t, max_connection_age_grace_s, 30,
          "How long calls in flight on a connection past --max_connection_age_s may still run.");
ABSL_FLAG(int32_t, max_connection_idle_s, 0,
          "Close connections without calls for this long (GOAWAY; gRPC closes between 1 and 2 "
          "times it after the last call). 0: never.");
ABSL_FLAG(int32_t, page_size, 32, "KV cache page size in tokens (a power of two, at most 4096).");
ABSL_FLAG(int64_t, cache_pages, 0,
          "KV cache pool size in pages; 0 = auto: 16 GiB of pages on a GPU, 1 GiB on the CPU, at "
          "least two users of the model's maximum history. Start-up fails below one such user, "
          "and on a GPU above 8388608 pages.");
ABSL_FLAG(int64_t, host_cache_pages, -1,
          "Host (pinned memory) KV tier in pages; 0 disables the tier (evicted users are "
          "recomputed); -1 = auto: on a GPU 2x the GPU pool within 1/4 of the RAM (or the cgroup "
          "limit) and 32 GiB, on the CPU none.");
ABSL_FLAG(int64_t, offload_backlog_mib, 128,
          "Host tier write-behind: MiB of GPU -> host page copies in flight at most (at least one "
          "user's pages); pages committed past it stay GPU-only until their user's next commit.");
ABSL_FLAG(bool, prefetch_onload, true,
          "Start the KV onload of queued requests whose users live on the host tier before their "
          "batch runs, so the copy overlaps the batches ahead of them.");
ABSL_FLAG(std::string, onload_policy, "cost",
          "Users whose KV is only in the host tier: cost = onload it over PCIe only when the copy, "
          "queued behind the copies already in flight, finishes no later than recomputing those "
          "tokens on the GPU would (both rates measured online), else recompute them "
          "(hstu_kv_lookups_total{result=\"host_recompute\"}); always = onload every host hit.");
ABSL_FLAG(bool, cuda_graphs, true,
          "CUDA backend: replay the decode step from CUDA graphs captured at start-up "
          "(--nocuda_graphs runs every step eagerly).");
ABSL_FLAG(std::string, graph_buckets, "",
          "CUDA graph buckets as USERSxROWS,... (e.g. 1x512,8x4096); a batch runs in the smallest "
          "bucket that holds it, eagerly beyond all. Empty = the backend's defaults.");
ABSL_FLAG(bool, enable_cache, true,
          "Keep users' KV between requests (--noenable_cache or --no_cache recomputes every "
          "history).");
ABSL_FLAG(bool, no_cache, false, "Same as --noenable_cache.");
ABSL_FLAG(bool, warmup, true,
          "Run one request through the engine before reporting SERVING; on a GPU also one batch "
          "of misses for each GEMM row class up to the largest batch the scheduler forms.");
ABSL_FLAG(int32_t, shutdown_grace_s, 30,
          "On SIGTERM/SIGINT/SIGHUP, how long in-flight requests may take before gRPC cancels "
          "them (UNAVAILABLE). A batch already on the engine still runs to its end before the "
          "process exits (a second signal exits at once, status 3).");
ABSL_FLAG(int32_t, engine_stall_timeout_s, -1,
          "A batch still running after this many seconds means a hung GPU: the server exits with "
          "status 2 at once (it cannot drain; also while a drain waits for that batch) for its "
          "supervisor to restart it. -1 = 60 on a GPU and off on the CPU (whose batches of large "
          "models can take minutes); 0 = off.");
ABSL_FLAG(double, slow_request_ms, -1,
          "Log one line (info level) for each Rank call that spent at least this many "
          "milliseconds in the server: its request_id, user, sizes, time in the queue and on the "
          "engine, batch size, cache result and code. < 0: off; 0: every call counted in "
          "hstu_requests_total (an access log, with --slow_request_log_per_s=0).");
ABSL_FLAG(int32_t, slow_request_log_per_s, 10,
          "Most slow-request lines a second; the rest are counted in one line. 0: no limit.");
ABSL_FLAG(std::string, log_level, "info", "spdlog level: trace, debug, info, warn, error, critical, off.");
ABSL_FLAG(std::string, log_format, "text",
          "Log lines as text, or as json: one object a line with time (UTC), level, thread and "
          "message, for log pipelines.");

namespace hstu::server {
namespace {

// HOST:PORT with a decimal port in [0, 65535]: an out-of-range port must not reach the resolver,
// which takes it modulo 65536 and binds some other port. gRPC's unix: addresses pass as they are.
absl::Status CheckListenAddress(const char* flag, const std::string& address,
                                bool unix_socket_ok = true) {
  if (IsUnixSocketAddress(address)) {
    if (unix_socket_ok) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", address, ": must be HOST:PORT (no unix sockets here)"));
  }
  const size_t colon = address.rfind(':');
  if (!ParsePort(colon == std::string::npos ? "" : address.substr(colon + 1)).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", address, ": must be HOST:PORT with a port in [0, 65535] (0 picks a free port)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string LogLevelFlag() { return absl::GetFlag(FLAGS_log_level); }
std::string LogFormatFlag() { return absl::GetFlag(FLAGS_log_format); }

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  ServerOptions o;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  o.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  o.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  o.tls.reload_interval_s = absl::GetFlag(FLAGS_tls_reload_interval_s);
  o.metrics_tls = absl::GetFlag(FLAGS_metrics_tls);
  // Before the start-up: a wrong file or pair exits 2, naming it.
  if (auto tls = CheckTlsFiles(o.tls); !tls.ok()) return tls.status();
  if (o.metrics_tls && !o.tls.enabled()) {
    return absl::InvalidArgumentError(
        "--metrics_tls needs --tls_cert_file and --tls_key_file (it serves their certificate)");
  }
  if (o.metrics_tls && o.metrics_listen.empty()) {
    return absl::InvalidArgumentError("--metrics_tls needs --metrics_listen (it is empty)");
  }
  o.engine.model = absl::GetFlag(FLAGS_model);
  o.engine.seed = absl::GetFlag(FLAGS_seed);
  o.engine.device = absl::GetFlag(FLAGS_device);
  // Before the start-up (before: refused by the engine once the ports were open, exit 1).
  if (absl::Status name = CheckDeviceName(o.engine.device); !name.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--device=", o.engine.device, ": ", name.message()));
  }
#ifndef HSTU_WITH_CUDA
  // A build without CUDA can only run on the CPU; resolving "auto" here also sizes the default KV
  // pool for host memory rather than for a GPU.
  if (o.engine.device == "auto") o.engine.device = "cpu";
#endif
  o.engine.page_size = absl::GetFlag(FLAGS_page_size);
  o.engine.cache_pages = absl::GetFlag(FLAGS_cache_pages);
  o.engine.host_cache_pages = absl::GetFlag(FLAGS_host_cache_pages);
  o.engine.use_cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  o.prefetch_onload = absl::GetFlag(FLAGS_prefetch_onload);
  o.engine.offload_backlog_mib = absl::GetFlag(FLAGS_offload_backlog_mib);
  const std::string onload_policy = absl::GetFlag(FLAGS_onload_policy);
  if (auto p = ParseOnloadPolicy(onload_policy); p.ok()) {
    o.engine.onload_policy = *p;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--onload_policy=", onload_policy, ": must be cost or always"));
  }
  for (absl::string_view item : absl::StrSplit(absl::GetFlag(FLAGS_graph_buckets), ',',
                                                absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(item, 'x');
    GraphBucket b;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &b.max_users) ||
        !absl::SimpleAtoi(parts[1], &b.max_rows) || b.max_users < 1 || b.max_rows < 1 ||
        b.max_users > kMaxGraphBucketUsers || b.max_rows > kMaxGraphBucketRows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--graph_buckets: '", item, "' is not USERSxROWS with users in [1, ",
          kMaxGraphBucketUsers, "] and rows in [1, ", kMaxGraphBucketRows, "] (e.g. 8x4096)"));
    }
    o.engine.graph_buckets.push_back(b);
  }
  o.engine.enable_cache = absl::GetFlag(FLAGS_enable_cache) && !absl::GetFlag(FLAGS_no_cache);
  o.engine.limits.max_candidates = absl::GetFlag(FLAGS_max_candidates);
  o.scheduler.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  o.scheduler.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.scheduler.batch_timeout = std::chrono::microseconds(absl::GetFlag(FLAGS_batch_timeout_us));
  o.scheduler.adaptive_fill = absl::GetFlag(FLAGS_adaptive_batching);
  o.scheduler.max_queue = absl::GetFlag(FLAGS_max_queue);
  o.scheduler.max_queue_per_user = absl::GetFlag(FLAGS_max_queue_per_user);
  o.scheduler.max_queued_tokens = absl::GetFlag(FLAGS_max_queued_tokens);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  o.max_grpc_threads = absl::GetFlag(FLAGS_max_grpc_threads);
  o.connections.keepalive_time_s = absl::GetFlag(FLAGS_keepalive_time_s);
  o.connections.keepalive_timeout_s = absl::GetFlag(FLAGS_keepalive_timeout_s);
  o.connections.min_client_ping_interval_s = absl::GetFlag(FLAGS_min_client_ping_interval_s);
  o.connections.max_connection_age_s = absl::GetFlag(FLAGS_max_connection_age_s);
  o.connections.max_connection_age_grace_s = absl::GetFlag(FLAGS_max_connection_age_grace_s);
  o.connections.max_connection_idle_s = absl::GetFlag(FLAGS_max_connection_idle_s);
  o.request_log.slow_request_ms = absl::GetFlag(FLAGS_slow_request_ms);
  o.request_log.max_lines_per_s = absl::GetFlag(FLAGS_slow_request_log_per_s);
  o.warmup = absl::GetFlag(FLAGS_warmup);
  o.engine_stall_timeout_s = absl::GetFlag(FLAGS_engine_stall_timeout_s);

  auto bad = [](const char* flag, auto value, absl::string_view want) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", want));
  };
  if (auto s = CheckListenAddress("listen", o.listen); !s.ok()) return s;
  if (!o.metrics_listen.empty()) {
    if (auto s = CheckListenAddress("metrics_listen", o.metrics_listen, /*unix_socket_ok=*/false);
        !s.ok()) {
      return s;
    }
  }
  if (absl::GetFlag(FLAGS_shutdown_grace_s) < 0) {
    return bad("shutdown_grace_s", absl::GetFlag(FLAGS_shutdown_grace_s), "must be >= 0");
  }
  if (o.scheduler.max_batch_size < 1) return bad("max_batch_size", o.scheduler.max_batch_size, "must be >= 1");
  if (o.scheduler.max_batch_tokens < 1) return bad("max_batch_tokens", o.scheduler.max_batch_tokens, "must be >= 1");
  if (o.scheduler.batch_timeout.count() < 0 || o.scheduler.batch_timeout.count() > 10'000'000) {
    return bad("batch_timeout_us", o.scheduler.batch_timeout.count(),
               "must be in [0, 10000000] (10 s)");
  }
  if (o.scheduler.max_queue < 1) return bad("max_queue", o.scheduler.max_queue, "must be >= 1");
  if (o.scheduler.max_queued_tokens < 0) {
    return bad("max_queued_tokens", o.scheduler.max_queued_tokens, "must be >= 0 (0: no bound)");
  }
  if (o.scheduler.max_queue_per_user < 0) {
    return bad("max_queue_per_user", o.scheduler.max_queue_per_user, "must be >= 0 (0: no limit)");
  }
  if (o.engine.limits.max_candidates < 1) return bad("max_candidates", o.engine.limits.max_candidates, "must be >= 1");
  if (o.max_message_bytes < 1024 || o.max_message_bytes > INT32_MAX) {
    return bad("max_message_bytes", o.max_message_bytes, "must be in [1024, 2147483647]");
  }
  if (o.max_concurrent_streams < 0) {
    return bad("max_concurrent_streams", o.max_concurrent_streams, "must be >= 0 (0: no limit)");
  }
  if (o.max_grpc_threads < 0 || (o.max_grpc_threads > 0 && o.max_grpc_threads < 4)) {
    return bad("max_grpc_threads", o.max_grpc_threads, "must be 0 (no limit) or >= 4");
  }
  if (absl::Status s = CheckConnectionOptions(o.connections); !s.ok()) return s;
  if (absl::Status s = CheckRequestLogOptions(o.request_log); !s.ok()) return s;
  const int32_t ps = o.engine.page_size;
  if (ps < 1 || ps > 4096 || (ps & (ps - 1)) != 0) {
    return bad("page_size", ps, "must be a power of two in [1, 4096]");
  }
  if (o.engine.cache_pages < 0 || o.engine.cache_pages > kMaxPoolPages) {
    return bad("cache_pages", o.engine.cache_pages, absl::StrCat("must be in [0, ", kMaxPoolPages, "]"));
  }
  if (o.engine.offload_backlog_mib < 1 || o.engine.offload_backlog_mib > kMaxOffloadBacklogMib) {
    return bad("offload_backlog_mib", o.engine.offload_backlog_mib,
               absl::StrCat("must be in [1, ", kMaxOffloadBacklogMib, "]"));
  }
  if (o.engine_stall_timeout_s < -1) {
    return bad("engine_stall_timeout_s", o.engine_stall_timeout_s, "must be >= 0, or -1 for auto");
  }
  if (o.engine.host_cache_pages < -1 || o.engine.host_cache_pages > kMaxPoolPages) {
    return bad("host_cache_pages", o.engine.host_cache_pages,
               absl::StrCat("must be in [0, ", kMaxPoolPages, "], or -1 for auto"));
  }
  return o;
}

int32_t ShutdownGraceSeconds() { return absl::GetFlag(FLAGS_shutdown_grace_s); }

}  // namespace hstu::server
