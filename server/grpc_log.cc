#include "server/grpc_log.h"

#include <grpc/support/log.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "spdlog/spdlog.h"

namespace hstu::server {

bool LogRateLimiter::Admit(const std::string& site, const std::string& message, int level,
                           Clock::time_point now, std::vector<Suppressed>* ended) {
  // The kind: the site and the message with each run of digits as one '#' (ports, addresses,
  // counts).
  std::string key = site + "\n";
  for (size_t i = 0; i < message.size(); ++i) {
    const bool digit = std::isdigit(static_cast<unsigned char>(message[i])) != 0;
    if (!digit) {
      key += message[i];
    } else if (i == 0 || std::isdigit(static_cast<unsigned char>(message[i - 1])) == 0) {
      key += '#';
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  SweepEnded(now, ended);
  auto it = kinds_.find(key);
  if (it == kinds_.end() && kinds_.size() >= kMaxKinds) {
    key = site;  // the site's own kind
    it = kinds_.find(key);
  }
  if (it == kinds_.end()) {
    // (A site's own kind is always kept: gRPC's lines of code are a bounded set.)
    if (kinds_.size() < kMaxKinds || key == site) {
      kinds_.emplace(key, Kind{site, now, 1, 0, {}, level});
    }
    return true;
  }
  Kind& kind = it->second;
  if (kind.written < burst_) {
    ++kind.written;
    return true;
  }
  ++kind.suppressed;
  kind.last_message = message;
  kind.level = level;
  return false;
}

void LogRateLimiter::SweepEnded(Clock::time_point now, std::vector<Suppressed>* ended) {
  for (auto it = kinds_.begin(); it != kinds_.end();) {
    const Kind& kind = it->second;
    if (now - kind.window_start < window_) {
      ++it;
      continue;
    }
    if (kind.suppressed > 0) {
      ended->push_back({kind.site, kind.last_message, kind.suppressed, kind.level});
    }
    it = kinds_.erase(it);  // its next line starts a new window
  }
}

std::vector<LogRateLimiter::Suppressed> LogRateLimiter::TakeEnded(Clock::time_point now) {
  std::vector<Suppressed> ended;
  std::lock_guard<std::mutex> lock(mu_);
  SweepEnded(now, &ended);
  return ended;
}

std::vector<LogRateLimiter::Suppressed> LogRateLimiter::TakeAll() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Suppressed> out;
  for (auto& [key, kind] : kinds_) {
    if (kind.suppressed > 0)
      out.push_back({kind.site, kind.last_message, kind.suppressed, kind.level});
    kind.suppressed = 0;
  }
  return out;
}

void LogRateLimiter::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  kinds_.clear();
}

namespace {

// Both live for the process: gRPC's threads may log until its very end.
LogRateLimiter* Limiter() {
  static auto* limiter = new LogRateLimiter(GrpcLogRouter::kBurst, GrpcLogRouter::kWindow);
  return limiter;
}
std::atomic<bool> g_to_spdlog{false};
std::atomic<bool> g_limit{true};

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
    Write(
        SpdlogLevel(s.level),
        fmt::format("grpc-core: {} more line{} like this were not written (at most {} of a kind "
                    "in {} s): {} ({})",
                    s.lines, s.lines == 1 ? "" : "s", GrpcLogRouter::kBurst,
                    std::chrono::seconds(GrpcLogRouter::kWindow).count(), s.last_message, s.site));
  }
}

void RouteGrpcLog(gpr_log_func_args* args) {
  const char* file = args->file != nullptr ? args->file : "?";
  if (const char* slash = std::strrchr(file, '/'); slash != nullptr) file = slash + 1;
  const std::string site = fmt::format("{}:{}", file, args->line);
  const std::string message = args->message != nullptr ? args->message : "";
  bool write = true;
  if (g_limit.load()) {
    std::vector<LogRateLimiter::Suppressed> ended;
    write = Limiter()->Admit(site, message, args->severity, LogRateLimiter::Clock::now(), &ended);
    WriteSuppressed(ended);
  }
  if (write) Write(SpdlogLevel(args->severity), fmt::format("grpc-core: {} ({})", message, site));
}

}  // namespace

GrpcLogRouter::GrpcLogRouter() {
  const char* trace = std::getenv("GRPC_TRACE");
  g_limit = trace == nullptr || *trace == '\0';
  Limiter()->Clear();
  g_to_spdlog = true;
  gpr_log_verbosity_init();  // GRPC_VERBOSITY, as grpc_init() reads it (before it, nothing logs)
  gpr_set_log_function(&RouteGrpcLog);
  timer_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; })) {
      WriteSuppressed(Limiter()->TakeEnded(LogRateLimiter::Clock::now()));
    }
  });
}

GrpcLogRouter::~GrpcLogRouter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  timer_.join();
  Flush();
  g_to_spdlog = false;
}

void GrpcLogRouter::Flush() { WriteSuppressed(Limiter()->TakeAll()); }

}  // namespace hstu::server
