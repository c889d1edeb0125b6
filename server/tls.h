// TLS for the gRPC port: the server's certificate and key from PEM files, optionally a CA whose
// client certificates are then required (mutual TLS).
//
// gRPC never reads the operator's files. TlsReloader checks them (CheckTlsPem: they parse, the
// key is the leaf's, the chain is in order, OpenSSL's security level accepts the key and
// signatures, the leaf is valid now, the client CAs are CA certificates) and copies a checked set
// into a private directory, which gRPC's file-watcher provider serves. Every
// `reload_interval_s` it reads the files again: a changed set that passes the same checks is
// published there (a symlink swap, so the certificate and key change together) and reaches new
// connections within about a second; a set that fails them is logged (when the error changes),
// counted, and the previous set stays in service. A file caught half-written (empty, truncated, a
// new certificate beside the old key) is such a set: the next check finds it whole.
//
// Thread-safety: CheckTlsPem and the client functions are free functions without shared state;
// TlsReloader is thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace grpc {
class ServerCredentials;
class ChannelCredentials;
}  // namespace grpc

namespace hstu::server {

struct TlsFiles {
  std::string cert_file;       // PEM: the certificate chain, leaf first; empty: plaintext
  std::string key_file;        // PEM: the leaf's private key (unencrypted)
  std::string client_ca_file;  // PEM: CAs of the clients; empty: no client certificate asked
  int32_t reload_interval_s = 60;

  bool enabled() const { return !cert_file.empty(); }
};

// The files' contents, as read at one time.
struct TlsPem {
  std::string cert, key, client_ca;
  bool operator==(const TlsPem&) const = default;
};

// What a checked set serves.
struct TlsSummary {
  std::string subject;     // the leaf certificate's subject
  absl::Time not_after;    // when it expires
  int num_client_cas = 0;  // certificates in the client CA file
  // The chain and key as the OpenSSL server context the check made of them (the metrics port
  // serves its connections from it, HttpExposer).
  std::shared_ptr<ssl_ctx_st> server_context;
};

// A leaf not yet valid by at most this much is taken (a certificate issued on a machine whose
// clock is a little ahead of this one's).
inline constexpr absl::Duration kTlsClockSkew = absl::Minutes(5);

// The flag combination (a key without a certificate, a client CA without a certificate, the
// reload interval), then the files read whole. Errors name the flag and file (InvalidArgument).
absl::StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files);

// Checks a set as the handshake will use it, at time `now`; errors name the file (from `files`)
// and what is wrong.
absl::StatusOr<TlsSummary> CheckTlsPem(const TlsFiles& files, const TlsPem& pem, absl::Time now);

// ReadTlsFiles, then CheckTlsPem now (plaintext, not enabled: an empty summary).
absl::StatusOr<TlsSummary> CheckTlsFiles(const TlsFiles& files);

// Serves a TLS set to gRPC and keeps it current (see the top of this file).
class TlsReloader {
 public:
  struct Stats {
    TlsSummary serving;             // the set in service
    int64_t num_reloads = 0;        // changed sets that passed and went into service
    int64_t num_reload_errors = 0;  // checks that found the files changed and failing
    bool failing = false;           // the last check found them so (a logged error stands)
  };

  // Checks the files (the errors of CheckTlsFiles), publishes them in a private directory
  // hstu_tls_<pid>_XXXXXX (mode 0700, removed by the destructor) under $TMPDIR, else /dev/shm,
  // else /tmp (`private_base` instead, when given), and starts the watch. The directory's .lock
  // is flocked for the reloader's life; such directories of this user that no process holds (a
  // killed server's) are removed first.
  static absl::StatusOr<std::unique_ptr<TlsReloader>> Start(const TlsFiles& files,
                                                            std::string private_base = "");
  ~TlsReloader();
  TlsReloader(const TlsReloader&) = delete;
  TlsReloader& operator=(const TlsReloader&) = delete;

  // The listening port's credentials, watching the private copy.
  std::shared_ptr<grpc::ServerCredentials> credentials() const;
  Stats stats() const;
  // The server context of the set in service (a new one at each reload that goes into
  // service): the metrics port serves the same certificate (HttpExposer).
  std::shared_ptr<ssl_ctx_st> server_context() const;
  // The private directory gRPC reads the checked copies from.
  const std::string& dir() const { return dir_; }
  // Reads and checks the files now, as the watch does every interval (tests).
  void CheckNow();

 private:
  TlsReloader() = default;
  absl::Status Publish(const TlsPem& pem);  // under mu_
  void Loop();

  TlsFiles files_;
  std::string dir_;   // the private copy
  int lock_fd_ = -1;  // its .lock, flocked
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;       // under mu_
  TlsPem published_;        // under mu_
  std::string last_error_;  // under mu_: the failed reload last logged; empty once one passes
  int64_t generation_ = 0;  // under mu_
  Stats stats_;             // under mu_
  std::thread thread_;
};

// Client side (hstu_loadgen, tests): TLS verifying the server against `ca_file` (empty: the
// system's roots), presenting `cert_file` + `key_file` when given (checked: they parse and the key
// is the certificate's). Errors name the flag and file.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientTlsCredentials(
    const std::string& ca_file, const std::string& cert_file, const std::string& key_file);

}  // namespace hstu::server
