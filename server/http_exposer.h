// A minimal HTTP/1.1 endpoint for Prometheus scrapes: `GET /metrics` (and `/`; HEAD too), and
// `GET /healthz` for probes that cannot speak gRPC over TLS (200 "SERVING" or 503 "NOT_SERVING",
// the gRPC health status), on a
// thread of its own that serves up to 64 connections side by side (poll), each given 2 s in all,
// `Connection: close`. A request whose header block passes 16 KiB gets 431. After its reply a
// connection is half-closed and what the client still sends is read and dropped until it closes
// (or its 2 s end): closing with unread bytes would send a reset that can destroy the reply on
// its way (an oversize request, a second pipelined one).
//
// Why not prometheus-cpp's pull library: it serves through civetweb (Debian's embeddable server),
// which starts its worker threads with a fixed ~100 KB stack, which is smaller than the static TLS
// of the CUDA libraries (cuBLASLt alone has ~94 KB), so it cannot start at all in a CUDA build.
// Scrapes are rare and small; one poll loop is all this needs.
//
// Thread-safety: Start/destructor from one thread; `body` and `serving` are called on the
// exposer's thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace hstu::server {

class HttpExposer {
 public:
  // `listen` is HOST:PORT (IPv4 or [IPv6]); port 0 picks a free one (see port()). `serving`
  // answers /healthz (no function: 404 there).
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(const std::string& listen,
                                                            std::function<std::string()> body,
                                                            std::function<bool()> serving = {});
  ~HttpExposer();
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;
  int port() const { return port_; }

 private:
  HttpExposer() = default;
  struct Connection;
  void Loop();
  // The whole HTTP reply to `request` (its header block; 431 when it is not complete within
  // 16 KiB).
  std::string Reply(const std::string& request) const;

  std::function<std::string()> body_;
  std::function<bool()> serving_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hstu::server
