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
// With a TLS source (`--metrics_tls`) every connection is HTTPS, from the server context the
// source gives at its accept (the gRPC port's checked set, reloaded with it), TLS 1.2 or later,
// no client certificate asked. The handshake runs in the same poll loop, non-blocking, within the
// same 2 s.
// A plain HTTP request to it (its first byte is no TLS record) gets a plain-text 400 that says
// the port speaks HTTPS, so that a scraper configured with the wrong scheme says why.
//
// Thread-safety: Start/destructor from one thread; `body`, `serving` and `tls` are called on the
// exposer's thread (and `tls` once by Start, on its caller's).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace hstu::server {

class HttpExposer {
 public:
  // The server context a new TLS connection is served from (TlsReloader::server_context).
  using TlsSource = std::function<std::shared_ptr<ssl_ctx_st>()>;

  // `listen` is HOST:PORT (IPv4 or [IPv6]); port 0 picks a free one (see port()). `serving`
  // answers /healthz (no function: 404 there). With `tls`, the port speaks HTTPS only; it must
  // have a context now (else the error, and nothing listens).
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(const std::string& listen,
                                                            std::function<std::string()> body,
                                                            std::function<bool()> serving = {},
                                                            TlsSource tls = {});
  ~HttpExposer();
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;
  int port() const { return port_; }

 private:
  HttpExposer() = default;
  struct Connection;
  void Loop();
  // Gives a new connection its SSL (false: out of memory).
  bool StartTls(Connection& c) const;
  // A TLS connection moved on as far as it goes without blocking; true when it is finished.
  bool TlsStep(Connection& c) const;
  // The whole HTTP reply to `request` (its header block; 431 when it is not complete within
  // 16 KiB).
  std::string Reply(const std::string& request) const;

  std::function<std::string()> body_;
  std::function<bool()> serving_;
  TlsSource tls_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hstu::server
