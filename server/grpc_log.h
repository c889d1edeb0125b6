// gRPC core's own log lines (gpr_log), through spdlog and rate-limited.
//
// Left to itself gRPC 1.51 writes its lines to stderr in its own format ("E1127 16:29:52.506 21430
// ssl_transport_security.cc:1501] Handshake failed ..."), one per event: a client that speaks
// plaintext to the TLS port, or a scanner, wrote a line for every connection it tried (ten a second
// for one gRPC client's reconnects). Routed here, each line goes through spdlog at its gRPC
// severity (debug, info, error) as "grpc-core: MESSAGE (FILE:LINE)". Lines of one kind (the same
// line of gRPC's code, and the same message once its digits are set aside: a port or an address
// does not make a new kind) write at most `kBurst` lines a `kWindow`; the rest are counted, and
// one line sums them up once the window is over (a timer looks every second) or at exit. With
// GRPC_TRACE set (gRPC's tracers, asked for to debug) nothing is held back. Which severities gRPC
// hands over is its own choice (GRPC_VERBOSITY, ERROR by default).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hstu::server {

// Per-kind rate limit of log lines: `burst` lines of a kind in each `window`, the window starting
// at the kind's first line. Thread-safe.
class LogRateLimiter {
 public:
  using Clock = std::chrono::steady_clock;  // a step of the wall clock moves no window

  struct Suppressed {
    std::string site;          // FILE:LINE
    std::string last_message;  // the last line not written
    uint64_t lines = 0;        // lines not written in the window
    int level = 0;             // the caller's level of the last of them
  };

  LogRateLimiter(int burst, Clock::duration window) : burst_(burst), window_(window) {}

  // Whether a line at `now` is written. `ended` gets the kinds whose window ended by `now` with
  // lines held back in it, each once, to be reported first.
  bool Admit(const std::string& site, const std::string& message, int level, Clock::time_point now,
             std::vector<Suppressed>* ended);
  // The kinds whose window ended by `now` with lines held back (the timer's sweep).
  std::vector<Suppressed> TakeEnded(Clock::time_point now);
  // The kinds with lines held back in their current window, ended or not (at exit); their counts
  // start again from 0.
  std::vector<Suppressed> TakeAll();
  void Clear();

 private:
  struct Kind {
    std::string site;
    Clock::time_point window_start;
    int written = 0;
    uint64_t suppressed = 0;
    std::string last_message;
    int level = 0;
  };
  // Kinds of distinct messages held at most (each is dropped when its window is over); past it a
  // new message is counted as its site's kind, with that kind's burst.
  static constexpr size_t kMaxKinds = 1024;

  void SweepEnded(Clock::time_point now, std::vector<Suppressed>* ended);  // under mu_

  const int burst_;
  const Clock::duration window_;
  std::mutex mu_;
  std::map<std::string, Kind> kinds_;
};

// Installs the router (gpr_set_log_function) on construction, with a timer thread for the
// summaries. Flush() writes the pending summaries now; the destructor flushes and turns the router
// to plain stderr lines, for gRPC threads that still log while the process exits, after spdlog's
// own teardown. One router at a time.
class GrpcLogRouter {
 public:
  static constexpr int kBurst = 5;
  static constexpr std::chrono::seconds kWindow{10};

  GrpcLogRouter();
  ~GrpcLogRouter();
  GrpcLogRouter(const GrpcLogRouter&) = delete;
  GrpcLogRouter& operator=(const GrpcLogRouter&) = delete;

  void Flush();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // under mu_
  std::thread timer_;
};

}  // namespace hstu::server
