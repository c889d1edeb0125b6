#include "server/tls.h"

#include <fcntl.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <system_error>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace hstu::server {
namespace {

// gRPC re-reads the private copy this often; a published set reaches new connections within it.
constexpr unsigned int kProviderRefreshSeconds = 1;

absl::Status Invalid(absl::string_view flag, const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": ", what));
}

// The most a TLS file may hold: certificate bundles are kilobytes.
constexpr off_t kMaxTlsFileBytes = 1 << 20;

// A regular file's bytes. Opened without blocking and checked with fstat first: a FIFO or a
// device at the path would otherwise hang the reload thread (and the shutdown behind it).
absl::StatusOr<std::string> ReadWholeFile(absl::string_view flag, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return Invalid(flag, path, absl::StrCat("cannot read it (", std::strerror(errno), ")"));
  struct stat st {};
  std::string out;
  absl::Status status;
  if (::fstat(fd, &st) != 0) {
    status = Invalid(flag, path, absl::StrCat("cannot read it (", std::strerror(errno), ")"));
  } else if (S_ISDIR(st.st_mode)) {
    status = Invalid(flag, path, "is a directory");
  } else if (!S_ISREG(st.st_mode)) {
    status = Invalid(flag, path, "is not a regular file");
  } else if (st.st_size > kMaxTlsFileBytes) {
    status = Invalid(
        flag, path,
        absl::StrCat("is ", st.st_size, " bytes, more than a TLS file's ", kMaxTlsFileBytes));
  } else {
    out.resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        status = Invalid(flag, path, absl::StrCat("cannot read it (", std::strerror(errno), ")"));
        break;
      }
      if (n == 0) break;  // shrank while read: what was there
      done += static_cast<size_t>(n);
    }
    out.resize(done);
    if (status.ok() && out.empty()) status = Invalid(flag, path, "is empty");
  }
  ::close(fd);
  if (!status.ok()) return status;
  return out;
}

// The first error in OpenSSL's queue, as text; the queue is cleared.
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
struct CtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

BioPtr MemoryBio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

std::string Subject(X509* x) {
  char buf[512];
  X509_NAME_oneline(X509_get_subject_name(x), buf, sizeof(buf));
  return buf;
}

// Every certificate of a PEM text, in order; an error when a CERTIFICATE block does not parse
// (a truncated or corrupt file), not only when none does. Text around the blocks is allowed.
absl::StatusOr<std::vector<X509Ptr>> Certificates(absl::string_view flag, const std::string& path,
                                                  const std::string& pem) {
  std::vector<X509Ptr> out;
  ERR_clear_error();
  BioPtr bio = MemoryBio(pem);
  while (bio != nullptr) {
    X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (x == nullptr) break;
    out.emplace_back(x);
  }
  const unsigned long e = ERR_peek_last_error();  // NOLINT(runtime/int)
  const bool clean_end =
      e == 0 || (ERR_GET_LIB(e) == ERR_LIB_PEM && ERR_GET_REASON(e) == PEM_R_NO_START_LINE);
  if (!clean_end) {
    return Invalid(flag, path,
                   absl::StrCat("certificate ", out.size() + 1,
                                " does not parse (truncated or corrupt? ", OpenSslError(), ")"));
  }
  ERR_clear_error();
  if (out.empty()) return Invalid(flag, path, "no PEM certificate in it");
  return out;
}

// A passphrase callback that has none: an encrypted key fails instead of prompting on a terminal.
int NoPassphrase(char*, int, int, void*) { return 0; }

absl::StatusOr<KeyPtr> PrivateKey(const std::string& path, const std::string& pem) {
  ERR_clear_error();
  BioPtr bio = MemoryBio(pem);
  KeyPtr key(bio == nullptr ? nullptr
                            : PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  if (key == nullptr) {
    return Invalid("tls_key_file", path,
                   absl::StrCat("not an unencrypted PEM private key (", OpenSslError(), ")"));
  }
  return key;
}

absl::Time AsTime(const ASN1_TIME* t) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTimeT(timegm(&tm));
}

using CtxPtr = std::unique_ptr<SSL_CTX, CtxFree>;

// A server context with the chain and key: OpenSSL's security level (key sizes, signature
// digests) and the key's match are checked as the handshake's own context will check them.
absl::StatusOr<CtxPtr> ServerContext(const TlsFiles& files, const std::vector<X509Ptr>& chain,
                                     EVP_PKEY* key) {
  ERR_clear_error();
  CtxPtr ctx(SSL_CTX_new(TLS_server_method()));
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpenSslError()));
  if (SSL_CTX_use_certificate(ctx.get(), chain.front().get()) != 1) {
    return Invalid("tls_cert_file", files.cert_file,
                   absl::StrCat("OpenSSL refuses the certificate (", OpenSslError(), ")"));
  }
  for (size_t i = 1; i < chain.size(); ++i) {
    if (SSL_CTX_add1_chain_cert(ctx.get(), chain[i].get()) != 1) {
      return Invalid("tls_cert_file", files.cert_file,
                     absl::StrCat("OpenSSL refuses certificate ", i + 1, " (",
                                  Subject(chain[i].get()), "): ", OpenSslError()));
    }
  }
  // use_PrivateKey checks the match itself (a mismatch reads as one); any other refusal is the
  // key's own (its type, its size at the security level), said as OpenSSL says it.
  bool mismatch = false;
  if (SSL_CTX_use_PrivateKey(ctx.get(), key) != 1) {
    const unsigned long e = ERR_peek_error();  // NOLINT(runtime/int)
    mismatch = ERR_GET_LIB(e) == ERR_LIB_X509 && (ERR_GET_REASON(e) == X509_R_KEY_VALUES_MISMATCH ||
                                                  ERR_GET_REASON(e) == X509_R_KEY_TYPE_MISMATCH);
    if (!mismatch) {
      return Invalid("tls_key_file", files.key_file,
                     absl::StrCat("OpenSSL refuses the key (", OpenSslError(), ")"));
    }
  }
  if (mismatch || SSL_CTX_check_private_key(ctx.get()) != 1) {
    ERR_clear_error();
    return Invalid("tls_key_file", files.key_file,
                   absl::StrCat("not the key of the certificate in --tls_cert_file=",
                                files.cert_file, " (", Subject(chain.front().get()), ")"));
  }
  return ctx;
}

bool WriteFile(const std::string& path, const std::string& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  return ::close(fd) == 0 && done == data.size();
}

// Where the private copies live: $TMPDIR when set, else /dev/shm (memory: the key's copy is not
// written to a file system on disk), else /tmp.
std::string PrivateBase() {
  if (const char* t = std::getenv("TMPDIR"); t != nullptr && *t != '\0') return t;
  struct stat st {};
  if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && ::access("/dev/shm", W_OK) == 0) {
    return "/dev/shm";
  }
  return "/tmp";
}

// Each private copy holds an exclusive flock on its .lock for its owner's life, which a PID
// cannot tell across PID namespaces (containers sharing /dev/shm or /tmp).
constexpr char kLockName[] = ".lock";

// Removes the private copies of this user that no process holds (a killed server's, or one that
// ended without its destructors).
void SweepStaleCopies(const std::string& base) {
  std::error_code ec;
  std::filesystem::directory_iterator it(base, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::filesystem::path path = it->path();
    if (path.filename().string().rfind("hstu_tls_", 0) != 0) continue;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
      continue;
    }
    const int fd = ::open((path / kLockName).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;  // being made, or not ours to judge
    const bool unheld = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (unheld) {
      std::error_code rm;
      std::filesystem::remove_all(path, rm);
      if (!rm) spdlog::info("tls: removed {}, a private copy no process holds", path.string());
    }
    ::close(fd);
  }
}

// Clears OpenSSL's error queue of this thread when the scope ends, on every path: entries a
// check leaves behind would show up in gRPC's later error reports on the same thread.
struct ClearOpenSslErrors {
  ~ClearOpenSslErrors() { ERR_clear_error(); }
};

}  // namespace

absl::StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files) {
  // Checked with TLS off too: a value out of range would otherwise surface only when TLS is
  // turned on.
  if (files.reload_interval_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_reload_interval_s=", files.reload_interval_s, ": must be >= 1"));
  }
  if (files.cert_file.empty()) {
    if (!files.key_file.empty()) {
      return absl::InvalidArgumentError("--tls_key_file needs --tls_cert_file");
    }
    if (!files.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file needs --tls_cert_file and --tls_key_file (mutual TLS is TLS)");
    }
    return TlsPem{};
  }
  if (files.key_file.empty())
    return absl::InvalidArgumentError("--tls_cert_file needs --tls_key_file");
  TlsPem pem;
  for (auto [flag, path, out] :
       {std::make_tuple("tls_cert_file", &files.cert_file, &pem.cert),
        std::make_tuple("tls_key_file", &files.key_file, &pem.key),
        std::make_tuple("tls_client_ca_file", &files.client_ca_file, &pem.client_ca)}) {
    if (path->empty()) continue;
    auto text = ReadWholeFile(flag, *path);
    if (!text.ok()) return text.status();
    *out = *std::move(text);
  }
  return pem;
}

absl::StatusOr<TlsSummary> CheckTlsPem(const TlsFiles& files, const TlsPem& pem, absl::Time now) {
  ClearOpenSslErrors clear_at_end;
  auto chain = Certificates("tls_cert_file", files.cert_file, pem.cert);
  if (!chain.ok()) return chain.status();
  auto key = PrivateKey(files.key_file, pem.key);
  if (!key.ok()) return key.status();
  // Leaf first, each certificate issued by the next (a chain in another order serves a leaf that
  // clients cannot connect to its issuer).
  for (size_t i = 0; i + 1 < chain->size(); ++i) {
    if (X509_check_issued((*chain)[i + 1].get(), (*chain)[i].get()) != X509_V_OK) {
      return Invalid("tls_cert_file", files.cert_file,
                     absl::StrCat("certificate ", i + 2, " (", Subject((*chain)[i + 1].get()),
                                  ") did not issue certificate ", i + 1, " (",
                                  Subject((*chain)[i].get()), "); the chain goes leaf first"));
    }
  }
  auto ctx = ServerContext(files, *chain, key->get());
  if (!ctx.ok()) return ctx.status();
  X509* leaf = chain->front().get();
  TlsSummary summary;
  summary.server_context = std::shared_ptr<SSL_CTX>(ctx->release(), SSL_CTX_free);
  summary.subject = Subject(leaf);
  summary.not_after = AsTime(X509_get0_notAfter(leaf));
  const absl::Time not_before = AsTime(X509_get0_notBefore(leaf));
  if (summary.not_after < now) {
    return Invalid("tls_cert_file", files.cert_file,
                   absl::StrCat("the certificate (", summary.subject, ") expired at ",
                                absl::FormatTime(summary.not_after, absl::UTCTimeZone())));
  }
  if (not_before > now + kTlsClockSkew) {
    return Invalid("tls_cert_file", files.cert_file,
                   absl::StrCat("the certificate (", summary.subject, ") is not valid before ",
                                absl::FormatTime(not_before, absl::UTCTimeZone())));
  }
  if (!files.client_ca_file.empty()) {
    auto cas = Certificates("tls_client_ca_file", files.client_ca_file, pem.client_ca);
    if (!cas.ok()) return cas.status();
    for (size_t i = 0; i < cas->size(); ++i) {
      if (X509_check_ca((*cas)[i].get()) < 1) {
        return Invalid("tls_client_ca_file", files.client_ca_file,
                       absl::StrCat("certificate ", i + 1, " (", Subject((*cas)[i].get()),
                                    ") is not a CA certificate"));
      }
    }
    summary.num_client_cas = static_cast<int>(cas->size());
  }
  return summary;
}

absl::StatusOr<TlsSummary> CheckTlsFiles(const TlsFiles& files) {
  auto pem = ReadTlsFiles(files);
  if (!pem.ok()) return pem.status();
  if (!files.enabled()) return TlsSummary{};
  return CheckTlsPem(files, *pem, absl::Now());
}

absl::StatusOr<std::unique_ptr<TlsReloader>> TlsReloader::Start(const TlsFiles& files,
                                                                std::string private_base) {
  auto pem = ReadTlsFiles(files);
  if (!pem.ok()) return pem.status();
  if (!files.enabled()) return absl::InvalidArgumentError("TlsReloader needs --tls_cert_file");
  auto summary = CheckTlsPem(files, *pem, absl::Now());
  if (!summary.ok()) return summary.status();
  std::unique_ptr<TlsReloader> r(new TlsReloader());
  r->files_ = files;
  const std::string base = private_base.empty() ? PrivateBase() : std::move(private_base);
  SweepStaleCopies(base);
  std::string tmpl = absl::StrCat(base, "/hstu_tls_", ::getpid(), "_XXXXXX");
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("TLS: cannot make a private directory for the checked certificate files in ",
                     base, " ($TMPDIR, else /dev/shm or /tmp): ", std::strerror(errno)));
  }
  r->dir_ = tmpl;
  r->lock_fd_ =
      ::open((r->dir_ + "/" + kLockName).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (r->lock_fd_ < 0 || ::flock(r->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return absl::UnavailableError(
        absl::StrCat("TLS: cannot lock ", r->dir_, "/", kLockName, ": ", std::strerror(errno)));
  }
  {
    std::lock_guard<std::mutex> lock(r->mu_);
    if (absl::Status s = r->Publish(*pem); !s.ok()) return s;
    r->stats_.serving = *summary;
  }
  r->thread_ = std::thread([p = r.get()] { p->Loop(); });
  return r;
}

TlsReloader::~TlsReloader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

absl::Status TlsReloader::Publish(const TlsPem& pem) {
  // dir/gen-N/{tls.crt,tls.key,ca.crt}; dir/..data -> gen-N, swapped by a rename; the names gRPC
  // reads, dir/tls.crt etc., point through ..data, so the pair changes in one step.
  const int64_t next = generation_ + 1;
  const std::string gen = absl::StrCat("gen-", next);
  const std::string gen_dir = dir_ + "/" + gen;
  std::error_code ec;
  std::filesystem::remove_all(gen_dir, ec);  // a half-written one from a failed attempt
  if (::mkdir(gen_dir.c_str(), 0700) != 0 || !WriteFile(gen_dir + "/tls.crt", pem.cert) ||
      !WriteFile(gen_dir + "/tls.key", pem.key) || !WriteFile(gen_dir + "/ca.crt", pem.client_ca)) {
    const std::string why = std::strerror(errno);
    std::filesystem::remove_all(gen_dir, ec);
    return absl::UnavailableError(
        absl::StrCat("cannot write the checked TLS files to ", gen_dir, ": ", why));
  }
  const std::string tmp_link = dir_ + "/..data_tmp";
  ::unlink(tmp_link.c_str());
  if (::symlink(gen.c_str(), tmp_link.c_str()) != 0 ||
      ::rename(tmp_link.c_str(), (dir_ + "/..data").c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::filesystem::remove_all(gen_dir, ec);
    return absl::UnavailableError(
        absl::StrCat("cannot publish the TLS files in ", dir_, ": ", why));
  }
  generation_ = next;
  for (const char* name : {"tls.crt", "tls.key", "ca.crt"}) {
    const std::string link = dir_ + "/" + name;
    struct stat st {};
    if (::lstat(link.c_str(), &st) == 0) continue;  // made by the first publish
    if (::symlink(absl::StrCat("..data/", name).c_str(), link.c_str()) != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot link the TLS files in ", dir_, ": ", std::strerror(errno)));
    }
  }
  // Only this generation and the one before (gRPC, re-reading every second, may still be on it).
  const std::string previous = absl::StrCat("gen-", generation_ - 1);
  std::filesystem::directory_iterator it(dir_, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("gen-", 0) == 0 && name != gen && name != previous) {
      std::error_code rm;
      std::filesystem::remove_all(it->path(), rm);
    }
  }
  published_ = pem;
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> TlsReloader::credentials() const {
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      dir_ + "/tls.key", dir_ + "/tls.crt", files_.client_ca_file.empty() ? "" : dir_ + "/ca.crt",
      kProviderRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files_.client_ca_file.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<ssl_ctx_st> TlsReloader::server_context() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.serving.server_context;
}

TlsReloader::Stats TlsReloader::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s = stats_;
  s.failing = !last_error_.empty();
  return s;
}

void TlsReloader::CheckNow() {
  absl::StatusOr<TlsPem> pem = ReadTlsFiles(files_);
  std::lock_guard<std::mutex> lock(mu_);
  if (pem.ok() && *pem == published_) {  // unchanged, or changed back
    last_error_.clear();
    return;
  }
  absl::StatusOr<TlsSummary> summary =
      pem.ok() ? CheckTlsPem(files_, *pem, absl::Now()) : absl::StatusOr<TlsSummary>(pem.status());
  absl::Status published = summary.ok() ? Publish(*pem) : summary.status();
  if (published.ok()) {
    ++stats_.num_reloads;
    stats_.serving = *summary;
    last_error_.clear();
    spdlog::info("tls: new TLS files in service: certificate {} (expires {}){}", summary->subject,
                 absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", summary->not_after, absl::UTCTimeZone()),
                 files_.client_ca_file.empty()
                     ? std::string()
                     : absl::StrCat(", ", summary->num_client_cas, " client CAs"));
    return;
  }
  ++stats_.num_reload_errors;
  // Logged when the error changes, counted at each check.
  const std::string error = std::string(published.message());
  if (error != last_error_) {
    last_error_ = error;
    spdlog::error(
        "tls: the TLS files changed but {}, so the previous certificate ({}) stays in "
        "service: {}",
        summary.ok() ? "cannot be put in service" : "fail the start-up checks",
        stats_.serving.subject, error);
  }
}

void TlsReloader::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::seconds(files_.reload_interval_s), [this] { return stop_; });
    if (stop_) break;
    lock.unlock();
    CheckNow();
    lock.lock();
  }
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientTlsCredentials(
    const std::string& ca_file, const std::string& cert_file, const std::string& key_file) {
  ClearOpenSslErrors clear_at_end;
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file go together");
  }
  grpc::SslCredentialsOptions options;
  for (auto [flag, path, out] :
       {std::make_tuple("tls_ca_file", &ca_file, &options.pem_root_certs),
        std::make_tuple("tls_cert_file", &cert_file, &options.pem_cert_chain),
        std::make_tuple("tls_key_file", &key_file, &options.pem_private_key)}) {
    if (path->empty()) continue;
    auto pem = ReadWholeFile(flag, *path);
    if (!pem.ok()) return pem.status();
    *out = *std::move(pem);
  }
  if (!ca_file.empty()) {
    if (auto cas = Certificates("tls_ca_file", ca_file, options.pem_root_certs); !cas.ok()) {
      return cas.status();
    }
  }
  if (!cert_file.empty()) {
    auto chain = Certificates("tls_cert_file", cert_file, options.pem_cert_chain);
    if (!chain.ok()) return chain.status();
    auto key = PrivateKey(key_file, options.pem_private_key);
    if (!key.ok()) return key.status();
    if (X509_check_private_key(chain->front().get(), key->get()) != 1) {
      ERR_clear_error();
      return Invalid("tls_key_file", key_file,
                     absl::StrCat("not the key of the certificate in --tls_cert_file=", cert_file));
    }
  }
  return grpc::SslCredentials(options);
}

}  // namespace hstu::server
