// hstu_loadgen results: one row per load level (concurrency or rate), printed as a table and
// written as JSON or CSV.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "client/latency_histogram.h"

namespace hstu::loadgen {

struct LevelResult {
  std::string mode;         // "closed" or "open"
  int32_t concurrency = 0;  // closed loop
  double rate_rps = 0;      // open loop: offered rate
  std::string arrival;      // open loop: constant | poisson
  double duration_s = 0;    // measured window
  int64_t requests = 0;     // sent in the window and answered OK (their latency is measured)
  // With a window of fixed length (--duration): the OK answers that came back inside it, whenever
  // sent (the throughput's count); -1 for a window that ends at the last answer (--requests).
  int64_t ok_in_window = -1;
  std::map<std::string, int64_t> errors;  // gRPC code name → count
  LatencyHistogram latency;               // OK requests only
  // gRPC code name → latency of the measured calls that ended with it (how fast a refusal or an
  // expiry came back); LOADGEN_BACKLOG, never sent, has none.
  std::map<std::string, LatencyHistogram> error_latency;
  int64_t reused_tokens = 0;              // server-reported, summed over OK responses
  int64_t computed_tokens = 0;
  int64_t new_user_visits = 0;
  std::map<std::string, LatencyHistogram> by_cache_result;  // server-reported cache_result → latency
  // Open loop: the calls sent in the window, and how late each left against its schedule (the
  // sender's wake-up and any backlog of its own). Latency and the deadline count from the
  // scheduled time, so they include this lag: a large one means the generator, not the server,
  // fell behind.
  int64_t sent = 0;
  LatencyHistogram sender_lag;
  bool interrupted = false;  // a stop signal ended the level's window early

  double throughput_rps() const {
    return duration_s > 0 ? static_cast<double>(ok_in_window >= 0 ? ok_in_window : requests) / duration_s
                          : 0;
  }
  int64_t error_count() const;
  // Open loop: whether the sender's lag (p99) is large enough to distort the level's latencies.
  bool sender_fell_behind() const;
};

// A sender lag (p99) above this flags an open-loop level: a tenth of a typical GPU batch.
inline constexpr double kSenderLagWarnSeconds = 1e-3;

struct RunInfo {
  std::string target;
  std::string model;
  std::string device;
  int32_t candidates = 0;
  int64_t users = 0;
  double zipf = 0;
  int32_t connections = 0;
  uint64_t seed = 0;
  size_t levels_planned = 0;
  bool interrupted = false;  // a stop signal ended the run before its last level
  // --replay: the file, its request lines and users, and the times it went back to its start.
  std::string replay_file;
  int64_t replay_lines = 0;
  int64_t replay_users = 0;
  int64_t replay_passes = 0;
};

// "c=8" for a closed-loop level, "500 rps poisson" for an open-loop one; " (stopped)" after a level
// a stop signal cut short.
std::string LevelLabel(const LevelResult& l);
std::string FormatTable(const RunInfo& info, const std::vector<LevelResult>& levels);
std::string ToJson(const RunInfo& info, const std::vector<LevelResult>& levels);
std::string ToCsv(const std::vector<LevelResult>& levels);

}  // namespace hstu::loadgen
