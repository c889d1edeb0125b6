// TLS for the gRPC port: the server's certificate and key from PEM files, optionally a CA whose
// client certificates are then required (mutual TLS). The files are checked once at start-up
// (a clear error instead of failed handshakes later) and then watched: gRPC re-reads them every
// `reload_interval_s`, so a rotated certificate (cert-manager, a mounted Secret) takes effect for
// new connections without a restart; a rotation that leaves the files unusable keeps the old pair
// (gRPC logs it).
//
// Thread-safety: free functions, no shared state.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

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

// What a TLS setup will serve, once checked.
struct TlsSummary {
  std::string subject;       // the leaf certificate's subject
  absl::Time not_after;      // when it expires
  int client_cas = 0;        // certificates in the client CA file
};

// Checks the files as the handshake will use them: the certificate chain and the key parse, the
// key is the leaf certificate's, the leaf is valid now, and the client CA file (when given) holds
// at least one certificate. Errors name the file and what is wrong (InvalidArgument), or the
// flag combination (a key without a certificate, a client CA without a certificate).
absl::StatusOr<TlsSummary> CheckTlsFiles(const TlsFiles& files);

// The gRPC credentials for the listening port: TLS from the watched files, or plaintext when
// `files` is not enabled. Call CheckTlsFiles first.
std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsFiles& files);

// Client side (hstu_loadgen, tests): TLS verifying the server against `ca_file` (empty: the
// system's roots), presenting `cert_file` + `key_file` when given. Errors name the file.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientTlsCredentials(
    const std::string& ca_file, const std::string& cert_file, const std::string& key_file);

}  // namespace hstu::server
