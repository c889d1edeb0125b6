// Assembles the server: metrics exposer, gRPC server (Ranker, health, reflection), engine and
// scheduler, in the order that keeps health honest (NOT_SERVING until the engine is warm, SERVING,
// NOT_SERVING while draining). main.cc and the integration tests both run it.
//
// Thread-safety: Shutdown() may be called from any thread, once or more.
#pragma once

#include <signal.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "server/address.h"
#include "server/metrics.h"
#include "server/rank_service.h"
#include "server/scheduler.h"
#include "server/tls.h"

namespace hstu::server {

// How the gRPC port keeps its connections (gRPC's keepalive and connection-age channel
// arguments), in seconds.
struct ConnectionOptions {
  // A connection idle this long is pinged; a client that does not answer within
  // `keepalive_timeout_s` is gone (a machine lost without a FIN, a NAT that dropped the flow) and
  // its connection is closed. 0: no pings.
  int32_t keepalive_time_s = 60;
  int32_t keepalive_timeout_s = 20;
  // Client keepalive pings are accepted this often, with or without calls in flight; pings more
  // often end the connection (GOAWAY "too_many_pings", gRPC's rule, at the third while the
  // server sends nothing). gRPC's own default is 5 minutes, and without calls 2 hours: a client
  // with a shorter keepalive, common in production, had its idle connections closed. 0: no limit.
  int32_t min_client_ping_interval_s = 10;
  // A connection older than this is asked to reconnect (GOAWAY), so that clients spread over
  // replicas added since; calls in flight on it get `max_connection_age_grace_s`. 0: no limit.
  int32_t max_connection_age_s = 0;
  int32_t max_connection_age_grace_s = 30;
  // A connection without calls for this long is closed (GOAWAY; gRPC 1.51 closes between 1 and 2
  // times it after the last call). 0: never.
  int32_t max_connection_idle_s = 0;
};

// The ranges of each (errors name the flag): [0, 2147483] s (gRPC takes milliseconds as int32),
// the timeout at least 1 s.
absl::Status CheckConnectionOptions(const ConnectionOptions& c);

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";         // port 0 picks a free one (see port())
  std::string metrics_listen = "0.0.0.0:9464";  // "" disables the exposer
  TlsFiles tls;                                 // the gRPC port's TLS; plaintext when not enabled
  bool metrics_tls = false;  // the metrics port speaks HTTPS with `tls`'s certificate (needs it)
  EngineOptions engine;
  SchedulerOptions scheduler;
  int64_t max_message_bytes = 16 << 20;  // gRPC receive/send limit
  // Streams one client connection may hold open at once (HTTP/2 SETTINGS); 0: gRPC's default,
  // none. Each open stream holds ~12 KB of server memory.
  int32_t max_concurrent_streams = 1024;
  // Threads gRPC may run its synchronous services on (server reflection: one a stream); past it
  // such calls are refused. 0: no bound.
  int32_t max_grpc_threads = 128;
  ConnectionOptions connections;
  RequestLogOptions request_log;         // the slow-request log (server/request_log.h)
  bool warmup = true;                    // one request through the engine before SERVING
  bool prefetch_onload = true;           // start queued host hits' onloads before their batch
  // A batch running longer than this means a hung GPU (ServeUntilStopped then exits). -1: 60 s
  // when the engine runs on a GPU, off on the CPU; 0: off.
  int32_t engine_stall_timeout_s = -1;
  // Called once the start-up is done, right before the service takes calls and health turns
  // SERVING (main() ends its watch for stop signals there: from then on a signal drains).
  std::function<void()> before_serving;
  // Tests only: runs each batch instead of the engine, with the engine's run as `run`.
  std::function<std::vector<absl::StatusOr<RankResult>>(absl::Span<const RankRequest>,
                                                        const Scheduler::RunBatchFn& run)>
      batch_interceptor;
};

class RankingServer {
 public:
  // Returns once the server is SERVING; errors name the step that failed.
  static absl::StatusOr<std::unique_ptr<RankingServer>> Start(const ServerOptions& options);
  ~RankingServer();  // Shutdown()s
  RankingServer(const RankingServer&) = delete;
  RankingServer& operator=(const RankingServer&) = delete;

  // Graceful drain: health NOT_SERVING, no new calls, in-flight calls finish (cancelled after
  // `grace`), the scheduler drains, the exposer stops.
  void Shutdown(absl::Duration grace = absl::Seconds(30));

  // OK while the engine can serve; its error once its device is lost (Engine::health). Health is
  // then NOT_SERVING and stays so: main() drains and exits with status 1, for the supervisor to
  // restart the process, which is the only way back to a working GPU.
  absl::Status engine_health() const { return engine_->health(); }
  // OK unless the batch now running has run longer than the stall timeout (a hung GPU): then
  // DEADLINE_EXCEEDED naming the time, and health turns NOT_SERVING. Thread-safe.
  absl::Status CheckStall();
  absl::Duration stall_timeout() const { return stall_timeout_; }

  // The slow-request log's count of lines held back in a second that is over, if any.
  void FlushSlowRequestLog() {
    if (service_ != nullptr) service_->request_log().FlushEnded();
  }

  int port() const { return port_; }
  int metrics_port() const { return http_ ? http_->port() : 0; }
  const Engine& engine() const { return *engine_; }
  ServerMetrics& metrics() { return *metrics_; }
  Scheduler& scheduler() { return *scheduler_; }

 private:
  RankingServer() = default;
  void SetServing(bool serving);
  // After each batch: health NOT_SERVING once the engine reports its device lost.
  void NoteEngineHealth();

  ServerOptions options_;
  std::unique_ptr<ServerMetrics> metrics_;
  // Before http_ and grpc_server_: it outlives the exposer thread that reads its stats and the
  // gRPC server that reads its files.
  std::unique_ptr<TlsReloader> tls_;
  std::unique_ptr<MetricsHttpServer> http_;
  std::unique_ptr<RankService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Scheduler> scheduler_;
  int port_ = 0;
  // What health says, for /healthz on the metrics port (shared with the exposer's thread, which
  // Shutdown() ends).
  std::shared_ptr<std::atomic<bool>> serving_ = std::make_shared<std::atomic<bool>>(false);
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
  absl::Duration stall_timeout_ = absl::ZeroDuration();  // zero: off
};

// Waits up to `timeout` for a request to stop (a signal); returns the signal's number, or -1.
using StopWait = std::function<int(absl::Duration timeout)>;

// main()'s life after start-up: waits for a stop signal (`wait_stop`), then drains with `grace`
// and returns 0; or, once the engine reports its device lost, drains the same way and returns 1
// (restart the process). Once a batch has run past the stall timeout, before or during the
// drain, it returns kEngineStalled at once without waiting for the drain: the engine thread is
// stuck. A second signal during the drain returns kDrainInterrupted at once, unless it is the
// same signal, already waiting when the first was taken or within kDuplicateSignalWindow of the
// watch's start (a supervisor such as timeout(1) sends its signal to the process and to its
// group: one request to stop, not two). After either,
// main() must end the process without destructors (std::_Exit): the drain may still be running.
inline constexpr int kEngineStalled = 2;
inline constexpr int kDrainInterrupted = 3;
inline constexpr absl::Duration kDuplicateSignalWindow = absl::Milliseconds(100);
int ServeUntilStopped(RankingServer& server, const StopWait& wait_stop, absl::Duration grace);

// The version reported in hstu_build_info and the start-up log.
const char* ServerVersion();

}  // namespace hstu::server
