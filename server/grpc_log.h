// gRPC core's own log lines (gpr_log), through spdlog and rate-limited.
//
// Left to itself gRPC 1.51 writes its lines to stderr in its own format ("E1127 16:29:52.506 21430
// ssl_transport_security.cc:1501] Handshake failed ..."), one per event: a client that speaks
// plaintext to the TLS port, or a scanner, wrote a line for every connection it tried (ten a second
// for one gRPC client's reconnects). Routed here, each line goes through spdlog at its gRPC
// severity (debug, info, error) with "grpc:" and its source file and line, and each source line
// writes at most `kBurst` lines a `kWindow`; what it would have written past that is counted and
// summed up in one line, written with gRPC's first line after that window (or at exit). Which
// severities gRPC hands over is still gRPC's choice (GRPC_VERBOSITY, ERROR by default).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace hstu::server {

// Per-key rate limit of log lines: `burst` lines a key in each `window`, the window starting at the
// key's first line. Thread-safe.
class LogRateLimiter {
 public:
  struct Suppressed {
    std::string key;
    uint64_t lines = 0;  // lines of `key` not written in its window
    int level = 0;       // the caller's level of the last of them
  };

  LogRateLimiter(int burst, absl::Duration window) : burst_(burst), window_(window) {}

  // Whether a line of `key` at `now` is written. `ended` gets the keys whose window ended by `now`
  // with lines suppressed in it (`key`'s own included), each once, to be reported first.
  bool Admit(const std::string& key, int level, absl::Time now, std::vector<Suppressed>* ended);
  // The keys with lines suppressed in their current window, whether it ended or not (at shutdown).
  std::vector<Suppressed> TakeAll();

 private:
  struct Site {
    absl::Time window_start;
    int written = 0;
    uint64_t suppressed = 0;
    int level = 0;
  };
  // Keys held at most (each is dropped when its window is over); past it, a new key's lines are
  // written untracked.
  static constexpr size_t kMaxSites = 4096;

  const int burst_;
  const absl::Duration window_;
  std::mutex mu_;
  std::map<std::string, Site> sites_;
};

// Installs the router (gpr_set_log_function) on construction. The destructor writes the pending
// summaries and turns the router to plain stderr lines, for gRPC threads that still log while the
// process exits, after spdlog's own teardown.
class GrpcLogRouter {
 public:
  static constexpr int kBurst = 5;
  static constexpr absl::Duration kWindow = absl::Seconds(10);

  GrpcLogRouter();
  ~GrpcLogRouter();
  GrpcLogRouter(const GrpcLogRouter&) = delete;
  GrpcLogRouter& operator=(const GrpcLogRouter&) = delete;
};

}  // namespace hstu::server
