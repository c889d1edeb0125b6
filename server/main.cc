// hstu_server: the HSTU ranking service (hstu.v1.Ranker over gRPC, Prometheus on /metrics).
// SIGTERM/SIGINT drain gracefully: health NOT_SERVING, no new calls, in-flight calls finish, exit 0.
// A lost GPU (a sticky CUDA error: nothing more can run in this process) drains the same way and
// exits 1, so that the supervisor (Kubernetes, systemd) restarts the server; a hung one (a batch
// past --engine_stall_timeout_s, before or during a drain) exits 2 at once. A second signal during
// the drain exits 3 at once. SIGHUP stops it as SIGTERM does; SIGPIPE, SIGUSR1 and SIGUSR2 are
// ignored.
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "client/cli_util.h"
#include "google/protobuf/stubs/logging.h"
#include "server/flags.h"
#include "server/grpc_log.h"
#include "server/log_format.h"
#include "server/ranking_server.h"
#include "server/stop_signals.h"
#include "spdlog/spdlog.h"

namespace {

// protobuf's own log lines, through spdlog at debug: a request whose string field is not UTF-8
// logged an ERROR line each time, which the service already answers INVALID_ARGUMENT and counts,
// so any client could fill the log. A FATAL one stays loud (protobuf aborts after it).
void ProtobufLogToSpdlog(google::protobuf::LogLevel level, const char* file, int line,
                         const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    spdlog::critical("protobuf: {} ({}:{})", message, file, line);
  } else {
    spdlog::debug("protobuf: {} ({}:{})", message, file, line);
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "HSTU ranking server.\n"
      "  hstu_server [--model=random:tiny|FILE] [--device=auto|cpu|cpu-bf16|cuda:N] [--listen=0.0.0.0:50051]\n"
      "              [--metrics_listen=0.0.0.0:9464] [batching, cache and limit flags]\n"
      "Serves hstu.v1.Ranker (proto/hstu/v1/ranking.proto), grpc.health.v1 and reflection;\n"
      "Prometheus metrics on http://METRICS_LISTEN/metrics (https with --metrics_tls). See\n"
      "docs/server.md.\n"
      "Exit status: 0 stopped by SIGTERM/SIGINT/SIGHUP and drained, or --help or --version\n"
      "printed; 1 unknown flag or one that does not parse, start-up failure, or the GPU lost\n"
      "(after a drain); 2 a flag value out of its range, a word that is no flag, or a batch past\n"
      "--engine_stall_timeout_s; 3 a second signal during the drain.");
  absl::FlagsUsageConfig usage;
  // --help lists the server's flags (absl's default matches files named after the binary).
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "server/flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  auto args = hstu::NormalizeFlagDashes(argc, argv);
  auto argv2 = hstu::ArgvOf(args);
  if (!hstu::OnlyFlagsGiven(hstu::ParseFlags(argv2))) {
    return 2;
  }

  const std::string level = hstu::server::LogLevelFlag();
  const spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    std::fprintf(stderr, "--log_level=%s: want trace, debug, info, warn, error, critical or off\n",
                 level.c_str());
    return 2;
  }
  spdlog::set_level(lvl);
  if (absl::Status format = hstu::server::SetLogFormat(hstu::server::LogFormatFlag());
      !format.ok()) {
    std::fprintf(stderr, "%s\n", std::string(format.message()).c_str());
    return 2;
  }
  google::protobuf::SetLogHandler(&ProtobufLogToSpdlog);  // before any thread parses a request
  hstu::server::GrpcLogRouter grpc_log;  // before gRPC starts; outlives the server below

  auto options = hstu::server::OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "%s\n", std::string(options.status().message()).c_str());
    return 2;
  }

  // A log reader that went away (a closed pipe on stdout) made the next log line's write kill the
  // process by SIGPIPE, in the middle of a drain; the write fails quietly instead. SIGUSR1 and
  // SIGUSR2 have no use here, and their default action ended the process without a drain.
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGUSR1, SIG_IGN);
  std::signal(SIGUSR2, SIG_IGN);
  // SIGTERM, SIGINT and SIGHUP (a closed terminal, or a "reload" habit: there is nothing to
  // reload, so it stops gracefully) from here on, on whichever thread the kernel hands them to.
  // A SIGHUP ignored by whoever started the server (nohup) stays ignored.
  struct sigaction hup = {};
  sigaction(SIGHUP, nullptr, &hup);
  auto stop = hup.sa_handler == SIG_IGN
                  ? hstu::server::StopSignals::Install({SIGTERM, SIGINT})
                  : hstu::server::StopSignals::Install({SIGTERM, SIGINT, SIGHUP});
  if (!stop.ok()) {
    std::fprintf(stderr, "%s\n", std::string(stop.status().message()).c_str());
    return 1;
  }

  spdlog::info("hstu_server {} starting", hstu::server::ServerVersion());
  // A signal during the start-up ends the process there: nothing is served yet, so nothing drains.
  // (Each log line is flushed as written; the other threads may still be logging.)
  hstu::server::StartupWatch watch(
      [s = *stop](absl::Duration timeout) { return s->Wait(timeout); },
      [](int sig) {
        spdlog::info("received {} during start-up; exiting before serving anything",
                     hstu::server::StopSignalName(sig));
        std::_Exit(0);
      });
  // The start-up's long system calls (pinning gigabytes of host memory, the driver's allocations)
  // are uninterruptible: a signal the kernel hands to this thread waits for them to return (19 s
  // once on an H100). Blocked here, the signals go to an idle thread (the watch's, in poll()), and
  // the threads this one starts during the start-up inherit the block.
  sigset_t stop_set;
  sigemptyset(&stop_set);
  sigaddset(&stop_set, SIGTERM);
  sigaddset(&stop_set, SIGINT);
  sigaddset(&stop_set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_set, nullptr);
  int pending_signal = -1;
  options->before_serving = [&watch, &pending_signal] { pending_signal = watch.Finish(); };
  auto server = hstu::server::RankingServer::Start(*options);
  if (const int sig = watch.Finish(); sig >= 0) pending_signal = sig;  // a failed start-up
  // A signal that came since the watch ended waits in the kernel until here, then drains.
  pthread_sigmask(SIG_UNBLOCK, &stop_set, nullptr);
  if (!server.ok()) {
    spdlog::error("start-up failed: {}", server.status().ToString());
    return 1;
  }
  const int code = hstu::server::ServeUntilStopped(
      **server,
      [s = *stop, &pending_signal](absl::Duration timeout) {
        return pending_signal >= 0 ? std::exchange(pending_signal, -1) : s->Wait(timeout);
      },
      absl::Seconds(hstu::server::ShutdownGraceSeconds()));
  if (code == hstu::server::kEngineStalled || code == hstu::server::kDrainInterrupted) {
    // The engine thread is stuck, or the drain is cut short: no destructors. The log is flushed,
    // not shut down: gRPC's and the engine's threads may still log, and spdlog::shutdown() drops
    // the default logger under them (a line then crashed the process instead of its exit code).
    grpc_log.Flush();
    spdlog::default_logger()->flush();
    std::_Exit(code);
  }
  // Everything is answered by now; the teardown (gRPC's shutdown, the engine's device and pinned
  // memory) only tidies up. So it is bounded, and a signal during it exits at once, with the
  // drain's status either way: a gRPC that has failed to start a thread (a pids limit) does not
  // return from its shutdown. The watchdog writes with write(2), not spdlog: it may wake while
  // the process exits, and once the teardown is done it only returns.
  static std::atomic<bool> teardown_done{false};
  try {
    std::thread([s = *stop, code] {
      constexpr int kTeardownLimitSeconds = 10;
      const bool signalled = s->Wait(absl::Seconds(kTeardownLimitSeconds)) >= 0;
      if (teardown_done.load()) return;
      if (!signalled) {
        constexpr char kMessage[] =
            "hstu_server: the teardown took over 10 s (gRPC or the device did not return); "
            "exiting without it\n";
        [[maybe_unused]] const ssize_t n = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
      }
      std::_Exit(code);
    }).detach();
  } catch (const std::system_error& e) {  // no thread to be had: skip the teardown
    spdlog::warn("no thread for the teardown's watchdog ({}); exiting without the teardown",
                 e.what());
    grpc_log.Flush();
    spdlog::default_logger()->flush();  // not shut down, as above
    std::_Exit(code);
  }
  server->reset();
  teardown_done = true;
  grpc_log.Flush();
  if (code != 0) return code;
  spdlog::info("stopped cleanly");
  return 0;
}
