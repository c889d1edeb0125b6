#include "server/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <tuple>
#include <vector>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/str_cat.h"

namespace hstu::server {
namespace {

absl::StatusOr<std::string> ReadWholeFile(const std::string& flag, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": is a directory"));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": cannot read it"));
  std::stringstream ss;
  ss << f.rdbuf();
  if (!f.good() && !f.eof()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": reading it failed"));
  }
  return ss.str();
}

// OpenSSL's most recent error, as text (its queue cleared).
std::string OpenSslError() {
  const unsigned long e = ERR_get_error();  // NOLINT(runtime/int): OpenSSL's type
  ERR_clear_error();
  if (e == 0) return "no detail";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

// Every certificate of a PEM text, in order.
std::vector<X509Ptr> Certificates(const std::string& pem) {
  std::vector<X509Ptr> out;
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  while (bio != nullptr) {
    X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (x == nullptr) break;
    out.emplace_back(x);
  }
  ERR_clear_error();  // the end of the text reads as an error
  return out;
}

// A passphrase callback that has none: an encrypted key fails instead of prompting on a terminal.
int NoPassphrase(char*, int, int, void*) { return 0; }

absl::Time AsTime(const ASN1_TIME* t) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTimeT(timegm(&tm));
}

std::string Subject(X509* x) {
  char buf[512];
  X509_NAME_oneline(X509_get_subject_name(x), buf, sizeof(buf));
  return buf;
}

}  // namespace

absl::StatusOr<TlsSummary> CheckTlsFiles(const TlsFiles& files) {
  if (files.cert_file.empty()) {
    if (!files.key_file.empty()) {
      return absl::InvalidArgumentError("--tls_key_file needs --tls_cert_file");
    }
    if (!files.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file needs --tls_cert_file and --tls_key_file (mutual TLS is TLS)");
    }
    return TlsSummary{};
  }
  if (files.key_file.empty()) return absl::InvalidArgumentError("--tls_cert_file needs --tls_key_file");
  if (files.reload_interval_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_reload_interval_s=", files.reload_interval_s, ": must be >= 1"));
  }
  auto cert_pem = ReadWholeFile("tls_cert_file", files.cert_file);
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = ReadWholeFile("tls_key_file", files.key_file);
  if (!key_pem.ok()) return key_pem.status();

  std::vector<X509Ptr> chain = Certificates(*cert_pem);
  if (chain.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert_file=", files.cert_file, ": no PEM certificate in it"));
  }
  BioPtr key_bio(BIO_new_mem_buf(key_pem->data(), static_cast<int>(key_pem->size())));
  KeyPtr key(key_bio == nullptr ? nullptr
                                : PEM_read_bio_PrivateKey(key_bio.get(), nullptr, NoPassphrase, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key_file=", files.key_file,
        ": not an unencrypted PEM private key (", OpenSslError(), ")"));
  }
  X509* leaf = chain.front().get();
  if (X509_check_private_key(leaf, key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key_file=", files.key_file, ": not the key of the certificate in --tls_cert_file=",
        files.cert_file, " (", Subject(leaf), ")"));
  }
  TlsSummary summary;
  summary.subject = Subject(leaf);
  summary.not_after = AsTime(X509_get0_notAfter(leaf));
  const absl::Time not_before = AsTime(X509_get0_notBefore(leaf));
  const absl::Time now = absl::Now();
  if (summary.not_after < now) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert_file=", files.cert_file, ": the certificate (", summary.subject,
        ") expired at ", absl::FormatTime(summary.not_after, absl::UTCTimeZone())));
  }
  if (not_before > now) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert_file=", files.cert_file, ": the certificate (", summary.subject,
        ") is not valid before ", absl::FormatTime(not_before, absl::UTCTimeZone())));
  }
  if (!files.client_ca_file.empty()) {
    auto ca_pem = ReadWholeFile("tls_client_ca_file", files.client_ca_file);
    if (!ca_pem.ok()) return ca_pem.status();
    summary.client_cas = static_cast<int>(Certificates(*ca_pem).size());
    if (summary.client_cas == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls_client_ca_file=", files.client_ca_file, ": no PEM certificate in it"));
    }
  }
  return summary;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key_file, files.cert_file, files.client_ca_file,
      static_cast<unsigned int>(files.reload_interval_s));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca_file.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientTlsCredentials(
    const std::string& ca_file, const std::string& cert_file, const std::string& key_file) {
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file go together");
  }
  grpc::SslCredentialsOptions options;
  for (auto [flag, path, out] : {std::make_tuple("tls_ca_file", &ca_file, &options.pem_root_certs),
                                 std::make_tuple("tls_cert_file", &cert_file, &options.pem_cert_chain),
                                 std::make_tuple("tls_key_file", &key_file, &options.pem_private_key)}) {
    if (path->empty()) continue;
    auto pem = ReadWholeFile(flag, *path);
    if (!pem.ok()) return pem.status();
    *out = *std::move(pem);
  }
  if (!ca_file.empty() && Certificates(options.pem_root_certs).empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_ca_file=", ca_file, ": no PEM certificate in it"));
  }
  return grpc::SslCredentials(options);
}

}  // namespace hstu::server
