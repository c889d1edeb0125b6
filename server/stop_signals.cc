#include "server/stop_signals.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace hstu::server {
namespace {

int g_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  // Non-blocking: with the pipe full (thousands of unread signals) a signal is dropped, not waited on.
  [[maybe_unused]] const ssize_t n = write(g_pipe[1], &b, 1);
  errno = saved;
}

}  // namespace

const char* StopSignalName(int sig) {
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGHUP) return "SIGHUP";
  static thread_local char name[24];
  std::snprintf(name, sizeof(name), "signal %d", sig);
  return name;
}

absl::StatusOr<StopSignals*> StopSignals::Install(std::initializer_list<int> signals) {
  static std::mutex mu;
  static StopSignals instance;
  std::lock_guard<std::mutex> lock(mu);
  if (g_pipe[0] < 0) {
    if (pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      return absl::InternalError(absl::StrCat("pipe2 for the stop signals: ", std::strerror(errno)));
    }
  }
  for (const int sig : signals) {
    struct sigaction sa = {};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // other threads' system calls resume rather than fail with EINTR
    if (sigaction(sig, &sa, nullptr) != 0) {
      return absl::InternalError(
          absl::StrCat("sigaction(", sig, ") for the stop signals: ", std::strerror(errno)));
    }
    // Delivered to this thread too, whatever mask it inherited.
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  }
  return &instance;
}

int StopSignals::Wait(absl::Duration timeout) {
  pollfd p = {g_pipe[0], POLLIN, 0};
  const int ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(timeout)));
  if (poll(&p, 1, ms) <= 0 || (p.revents & POLLIN) == 0) return -1;
  unsigned char b = 0;
  return read(g_pipe[0], &b, 1) == 1 ? static_cast<int>(b) : -1;
}

StartupWatch::StartupWatch(WaitFn wait, std::function<void(int)> on_signal)
    : thread_([this, wait = std::move(wait), on_signal = std::move(on_signal)] {
        for (;;) {
          const int sig = wait(absl::Milliseconds(50));
          std::lock_guard<std::mutex> lock(mu_);
          if (finished_) {
            unhandled_ = sig;
            return;
          }
          if (sig >= 0) {
            on_signal(sig);  // main() does not return from it; a test's does
            return;
          }
        }
      }) {}

int StartupWatch::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(unhandled_, -1);
}

}  // namespace hstu::server
