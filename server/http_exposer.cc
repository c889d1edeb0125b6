#include "server/http_exposer.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace hstu::server {
namespace {

constexpr int kPollMs = 100;  // how often a wait checks for shutdown
// One connection at a time, each with this long in all to send its request and take the reply: a
// client that trickles bytes (or never reads) holds the exposer, and the shutdown, for no longer.
constexpr auto kConnectionTimeout = std::chrono::seconds(2);
constexpr size_t kMaxRequestBytes = 16384;

using Clock = std::chrono::steady_clock;

// Waits for `events` on `fd` in slices of kPollMs: false at the deadline, on `stop` or an error.
bool WaitFor(int fd, short events, Clock::time_point deadline, const std::atomic<bool>& stop) {
  while (!stop) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), kPollMs)));
    if (n < 0 && errno != EINTR) return false;
    if (n > 0) return (p.revents & events) != 0;
  }
  return false;
}

bool SendAll(int fd, const std::string& data, Clock::time_point deadline, const std::atomic<bool>& stop) {
  size_t sent = 0;
  while (sent < data.size()) {
    if (!WaitFor(fd, POLLOUT, deadline, stop)) return false;
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(const std::string& listen,
                                                                 std::function<std::string()> body) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", listen, "' is not HOST:PORT"));
  }
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", listen, "': ", ::gai_strerror(rc)));
  }
  std::unique_ptr<HttpExposer> self(new HttpExposer());
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr && self->listen_fd_ < 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      self->listen_fd_ = fd;
    } else {
      last_error = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (self->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", last_error));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(self->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  self->port_ = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  self->body_ = std::move(body);
  self->thread_ = std::thread([p = self.get()] { p->Loop(); });
  return self;
}

HttpExposer::~HttpExposer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void HttpExposer::Loop() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollMs) <= 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    ::close(fd);
  }
}

void HttpExposer::Serve(int fd) {
  const Clock::time_point deadline = Clock::now() + kConnectionTimeout;
  std::string request;
  char buf[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    if (!WaitFor(fd, POLLIN, deadline, stop_)) return;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const std::string line = request.substr(0, request.find("\r\n"));
  std::string status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8", payload;
  if (line.rfind("GET /metrics ", 0) == 0 || line.rfind("GET /metrics?", 0) == 0) {
    payload = body_();
  } else if (line.rfind("GET / ", 0) == 0) {
    type = "text/html; charset=utf-8";
    payload = "<html><body><a href=\"/metrics\">/metrics</a></body></html>\n";
  } else if (line.rfind("GET ", 0) == 0) {
    status = "404 Not Found";
    payload = "not found; metrics are at /metrics\n";
  } else {
    status = "405 Method Not Allowed";
    payload = "only GET is served\n";
  }
  SendAll(fd,
          absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ",
                       payload.size(), "\r\nConnection: close\r\n\r\n", payload),
          deadline, stop_);
}

}  // namespace hstu::server
