#include "server/http_exposer.h"

#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hstu::server {
namespace {

constexpr int kPollMs = 100;  // how often the loop checks for shutdown
// Each connection has this long in all to send its request and take the reply; connections are
// served side by side (poll), so a client that trickles bytes, never reads, or connects and says
// nothing delays no other scrape.
constexpr auto kConnectionTimeout = std::chrono::seconds(2);
constexpr size_t kMaxRequestBytes = 16384;
// Connections held at once; past it the oldest is closed to take the new one.
constexpr size_t kMaxConnections = 64;

using Clock = std::chrono::steady_clock;

// The end of the request's header block ("\r\n\r\n", or a bare "\n\n"), or npos.
size_t HeaderEnd(const std::string& request) {
  const size_t crlf = request.find("\r\n\r\n");
  const size_t lf = request.find("\n\n");
  return std::min(crlf, lf);
}

// The request line's words: method, target and (but for HTTP/0.9) version.
std::vector<std::string> RequestLineWords(const std::string& request) {
  return absl::StrSplit(request.substr(0, request.find_first_of("\r\n")), ' ', absl::SkipEmpty());
}

// Whether all of the request is in: its header block ended, or an HTTP/0.9 request line (no
// version, so no headers follow) ended.
bool RequestComplete(const std::string& request) {
  if (HeaderEnd(request) != std::string::npos) return true;
  return request.find('\n') != std::string::npos && RequestLineWords(request).size() < 3;
}

// The first byte of every TLS connection: a handshake record.
constexpr unsigned char kTlsHandshakeRecord = 0x16;

struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};

// The answer to a plain HTTP request on a TLS port.
std::string PlainRequestToTlsPort() {
  const std::string payload = "this port speaks HTTPS (the server runs with --metrics_tls)\n";
  return absl::StrCat("HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n",
                      "Content-Length: ", payload.size(), "\r\nConnection: close\r\n\r\n",
                      payload);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(const std::string& listen,
                                                                 std::function<std::string()> body,
                                                                 std::function<bool()> serving,
                                                                 TlsSource tls) {
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
  if (tls && tls() == nullptr) return absl::InvalidArgumentError("metrics TLS: no certificate");
  std::unique_ptr<HttpExposer> self(new HttpExposer());
  self->tls_ = std::move(tls);
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
  self->serving_ = std::move(serving);
  self->thread_ = std::thread([p = self.get()] { p->Loop(); });
  return self;
}

HttpExposer::~HttpExposer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

struct HttpExposer::Connection {
  int fd = -1;
  Clock::time_point deadline;
  std::string request;
  std::string reply;  // empty while the request is still being read
  size_t sent = 0;
  bool draining = false;  // reply sent and the write side shut: reading to the client's close
  // TLS: null on a plaintext port, and once a plain HTTP request to a TLS port is seen.
  std::unique_ptr<SSL, SslFree> ssl;
  bool first_byte_seen = false;  // and it was a TLS record's
  bool handshake_done = false;
  short tls_wants = POLLIN;  // what OpenSSL waits for
};

bool HttpExposer::StartTls(Connection& c) const {
  c.ssl.reset(SSL_new(tls_().get()));  // the set in service now; the SSL keeps its context
  if (c.ssl == nullptr) return false;
  SSL_set_min_proto_version(c.ssl.get(), TLS1_2_VERSION);
  // A reply larger than the socket's buffer goes out over several poll rounds.
  SSL_set_mode(c.ssl.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  return SSL_set_fd(c.ssl.get(), c.fd) == 1;
}

bool HttpExposer::TlsStep(Connection& c) const {
  SSL* ssl = c.ssl.get();
  for (;;) {
    int r = 0;
    if (!c.handshake_done) {
      r = SSL_accept(ssl);
      if (r == 1) {
        c.handshake_done = true;
        continue;
      }
    } else if (c.reply.empty()) {
      char buf[2048];
      r = SSL_read(ssl, buf, sizeof(buf));
      if (r > 0) {
        c.request.append(buf, static_cast<size_t>(r));
        if (RequestComplete(c.request) || c.request.size() >= kMaxRequestBytes) {
          c.reply = Reply(c.request);
        }
        continue;
      }
    } else if (c.sent < c.reply.size()) {
      r = SSL_write(ssl, c.reply.data() + c.sent, static_cast<int>(c.reply.size() - c.sent));
      if (r > 0) {
        c.sent += static_cast<size_t>(r);
        continue;
      }
    } else {
      // close_notify (retried while the socket is full), then the lingering close of the
      // plaintext path: the client's last bytes are read raw and dropped.
      r = SSL_shutdown(ssl);
      if (r >= 0) {
        c.draining = true;
        return ::shutdown(c.fd, SHUT_WR) != 0;
      }
    }
    const int error = SSL_get_error(ssl, r);
    ERR_clear_error();  // the queue is this thread's; a failed handshake leaves it full
    if (error == SSL_ERROR_WANT_READ) {
      c.tls_wants = POLLIN;
      return false;
    }
    if (error == SSL_ERROR_WANT_WRITE) {
      c.tls_wants = POLLOUT;
      return false;
    }
    return true;  // a failed handshake, the client's close or a broken connection
  }
}

void HttpExposer::Loop() {
  // OpenSSL writes to the socket with write(2), which raises SIGPIPE on a connection the client
  // reset; blocked on this thread, the signal stays pending here and the write fails with EPIPE
  // (hstu_server ignores SIGPIPE anyway; a program embedding the exposer may not).
  sigset_t pipe_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, nullptr);
  std::vector<Connection> conns;
  auto close_at = [&conns](size_t i) {
    ::close(conns[i].fd);
    conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
  };
  while (!stop_) {
    std::vector<pollfd> fds;
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const Connection& c : conns) {
      short events = c.reply.empty() || c.draining ? POLLIN : POLLOUT;
      if (c.ssl != nullptr && !c.draining) events = c.tls_wants;
      fds.push_back({c.fd, events, 0});
    }
    if (::poll(fds.data(), fds.size(), kPollMs) < 0 && errno != EINTR) continue;
    const Clock::time_point now = Clock::now();
    // Existing connections first (the indices of fds match conns until one is closed).
    for (size_t i = conns.size(); i-- > 0;) {
      Connection& c = conns[i];
      const short revents = fds[i + 1].revents;
      bool done = now >= c.deadline || (revents & (POLLERR | POLLNVAL)) != 0;
      if (!done && c.ssl != nullptr && !c.first_byte_seen && (revents & (POLLIN | POLLHUP)) != 0) {
        // The client's first byte: a TLS handshake? A plain HTTP request gets a plain 400 instead.
        unsigned char first = 0;
        const ssize_t n = ::recv(c.fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
        c.first_byte_seen = n == 1;
        if (n == 1 && first != kTlsHandshakeRecord) {
          c.ssl.reset();
          c.reply = PlainRequestToTlsPort();
        } else if (n == 0) {
          done = true;
        }
      }
      if (done) {
        // past its time, or the socket failed
      } else if (c.ssl != nullptr && !c.draining) {
        if ((revents & (POLLIN | POLLOUT | POLLHUP)) != 0) done = TlsStep(c);
      } else if (c.draining && (revents & (POLLIN | POLLHUP)) != 0) {
        char buf[4096];
        const ssize_t n = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
        done = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
      } else if (c.reply.empty() && (revents & (POLLIN | POLLHUP)) != 0) {
        char buf[2048];
        const ssize_t n = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n > 0) {
          c.request.append(buf, static_cast<size_t>(n));
          if (RequestComplete(c.request) || c.request.size() >= kMaxRequestBytes) {
            c.reply = Reply(c.request);
          }
        } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          done = true;
        }
      } else if (!c.reply.empty() && (revents & POLLOUT) != 0) {
        const ssize_t n = ::send(c.fd, c.reply.data() + c.sent, c.reply.size() - c.sent,
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          c.sent += static_cast<size_t>(n);
          if (c.sent == c.reply.size()) {
            // Lingering close: the client reads the reply, then EOF, and closes.
            c.draining = true;
            done = ::shutdown(c.fd, SHUT_WR) != 0;
          }
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          done = true;
        }
      }
      if (done) close_at(i);
    }
    if ((fds[0].revents & POLLIN) != 0) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        if (conns.size() >= kMaxConnections) close_at(0);  // the oldest
        Connection c;
        c.fd = fd;
        c.deadline = now + kConnectionTimeout;
        if (tls_ && !StartTls(c)) {
          ERR_clear_error();
          ::close(fd);  // out of memory: refused
        } else {
          conns.push_back(std::move(c));
        }
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // The pending connection stays, so the socket stays readable: without a pause the loop
        // would spin until a descriptor frees.
        std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
      }
    }
  }
  for (const Connection& c : conns) ::close(c.fd);
}

std::string HttpExposer::Reply(const std::string& request) const {
  const std::vector<std::string> words = RequestLineWords(request);
  const std::string method = words.empty() ? "" : words[0];
  const std::string path = words.size() < 2 ? "" : words[1];
  const bool head = method == "HEAD";
  std::string status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8", payload;
  std::string extra;
  if (!RequestComplete(request)) {  // cut off at kMaxRequestBytes
    status = "431 Request Header Fields Too Large";
    type = "text/plain; charset=utf-8";
    payload = absl::StrCat("the request's header block is over ", kMaxRequestBytes, " bytes\n");
  } else if (method != "GET" && !head) {
    status = "405 Method Not Allowed";
    type = "text/plain; charset=utf-8";
    extra = "Allow: GET, HEAD\r\n";
    payload = "only GET and HEAD are served\n";
  } else if (path == "/metrics" || path.rfind("/metrics?", 0) == 0) {
    payload = body_();
  } else if ((path == "/healthz" || path.rfind("/healthz?", 0) == 0) && serving_) {
    type = "text/plain; charset=utf-8";
    const bool serving = serving_();
    if (!serving) status = "503 Service Unavailable";
    payload = serving ? "SERVING\n" : "NOT_SERVING\n";
  } else if (path == "/") {
    type = "text/html; charset=utf-8";
    payload = "<html><body><a href=\"/metrics\">/metrics</a></body></html>\n";
  } else {
    status = "404 Not Found";
    type = "text/plain; charset=utf-8";
    payload = "not found; metrics are at /metrics\n";
  }
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ",
                      payload.size(), "\r\n", extra, "Connection: close\r\n\r\n",
                      head ? std::string() : payload);
}

}  // namespace hstu::server
