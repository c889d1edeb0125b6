#include "server/grpc_log.h"

#include <grpc/support/log.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace hstu::server {

bool LogRateLimiter::Admit(const std::string& key, int level, absl::Time now,
                           std::vector<Suppressed>* ended) {
  std::lock_guard<std::mutex> lock(mu_);
  // Windows that are over: their counts are reported, and the key's next line starts a new one.
  for (auto it = sites_.begin(); it != sites_.end();) {
    if (now - it->second.window_start < window_) {
      ++it;
      continue;
    }
    if (it->second.suppressed > 0)
      ended->push_back({it->first, it->second.suppressed, it->second.level});
    it = sites_.erase(it);
  }
  auto it = sites_.find(key);
  if (it == sites_.end()) {
    if (sites_.size() < kMaxSites) sites_.emplace(key, Site{now, 1, 0, level});
    return true;
  }
  Site& site = it->second;
  if (site.written < burst_) {
    ++site.written;
    return true;
  }
  ++site.suppressed;
  site.level = level;
  return false;
}

std::vector<LogRateLimiter::Suppressed> LogRateLimiter::TakeAll() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Suppressed> out;
  for (auto& [key, site] : sites_) {
    if (site.suppressed > 0) out.push_back({key, site.suppressed, site.level});
    site.suppressed = 0;
  }
  return out;
}

namespace {

// Both live for the process: gRPC's threads may log until its very end.
LogRateLimiter* Limiter() {
  static auto* limiter = new LogRateLimiter(GrpcLogRouter::kBurst, GrpcLogRouter::kWindow);
  return limiter;
}
std::atomic<bool> g_to_spdlog{false};

spdlog::level::level_enum SpdlogLevel(int severity) {
  switch (severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      return spdlog::level::debug;
    case GPR_LOG_SEVERITY_INFO:
      return spdlog::level::info;
    default:
      return spdlog::level::err;
  }
}

void Write(spdlog::level::level_enum level, const std::string& line) {
  if (g_to_spdlog.load()) {
    spdlog::log(level, "{}", line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

void WriteSuppressed(const std::vector<LogRateLimiter::Suppressed>& suppressed) {
  for (const LogRateLimiter::Suppressed& s : suppressed) {
    Write(SpdlogLevel(s.level),
          fmt::format("grpc: {} more line{} from {} not written (at most {} a "
                      "{} s from one line "
                      "of gRPC's code)",
                      s.lines, s.lines == 1 ? "" : "s", s.key, GrpcLogRouter::kBurst,
                      absl::ToInt64Seconds(GrpcLogRouter::kWindow)));
  }
}

void RouteGrpcLog(gpr_log_func_args* args) {
  const char* file = args->file != nullptr ? args->file : "?";
  if (const char* slash = std::strrchr(file, '/'); slash != nullptr) file = slash + 1;
  const std::string key = fmt::format("{}:{}", file, args->line);
  std::vector<LogRateLimiter::Suppressed> ended;
  const bool write = Limiter()->Admit(key, args->severity, absl::Now(), &ended);
  WriteSuppressed(ended);
  if (write) {
    Write(SpdlogLevel(args->severity),
          fmt::format("grpc: {} ({})", args->message != nullptr ? args->message : "", key));
  }
}

}  // namespace

GrpcLogRouter::GrpcLogRouter() {
  g_to_spdlog = true;
  gpr_log_verbosity_init();  // GRPC_VERBOSITY, as grpc_init() reads it (before
                             // it, nothing logs)
  gpr_set_log_function(&RouteGrpcLog);
}

GrpcLogRouter::~GrpcLogRouter() {
  WriteSuppressed(Limiter()->TakeAll());
  g_to_spdlog = false;
}

}  // namespace hstu::server
