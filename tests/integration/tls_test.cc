// TLS on the gRPC port (server/tls.h) with the test certificates of tests/data/tls
// (make_certs.sh): a TLS client is served and a plaintext one is not; with a client CA, only
// clients with a certificate that CA signed are; a rotated certificate is served to new
// connections without a restart, and a rotation to files that fail the checks (empty, a key of
// another certificate) keeps the previous one in service; the start-up check names each wrong
// file.

#include "server/tls.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "server/ranking_server.h"
#include "tests/integration/server_fixture.h"
#include "tests/integration/test_util.h"

namespace hstu::server {
namespace {


std::string Data(const std::string& name) {
  return absl::StrCat(HSTU_SOURCE_DIR, "/tests/data/tls/", name);
}

TlsFiles ServerFiles(int n = 1) {
  TlsFiles f;
  f.cert_file = Data(absl::StrCat("hstu-test-server-", n, ".crt"));
  f.key_file = Data(absl::StrCat("hstu-test-server-", n, ".key"));
  return f;
}

absl::StatusOr<std::unique_ptr<RankingServer>> StartServer(const TlsFiles& tls,
                                                           bool metrics_tls = false) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "127.0.0.1:0";
  o.engine.device = "cpu";
  o.tls = tls;
  o.metrics_tls = metrics_tls;
  return RankingServer::Start(o);
}

std::unique_ptr<RankingServer> StartTlsServer(const TlsFiles& tls, bool metrics_tls = false) {
  auto s = StartServer(tls, metrics_tls);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

struct Call {
  grpc::Status status;
  std::string server_common_name;  // from the handshake, when it succeeded
};

// One Rank over a fresh connection to 127.0.0.1:port with `creds` (the certificates list that
// address; a host name would go through c-ares, whose resolver allocations LeakSanitizer reports).
Call RankOver(int port, const std::shared_ptr<grpc::ChannelCredentials>& creds) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a new connection, a new handshake
  auto stub = hstu::v1::Ranker::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), creds, args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  hstu::v1::RankResponse resp;
  Call call;
  call.status = stub->Rank(&ctx, fixture::MakeRequest(7, 5, 3, 1), &resp);
  if (call.status.ok()) {
    EXPECT_EQ(resp.scores_size(), 3 * resp.num_tasks());
    if (auto auth = ctx.auth_context(); auth != nullptr) {
      for (const auto& v : auth->FindPropertyValues("x509_common_name")) {
        call.server_common_name.assign(v.data(), v.size());
      }
    }
  }
  return call;
}

std::shared_ptr<grpc::ChannelCredentials> Client(const std::string& ca,
                                                 const std::string& cert = "",
                                                 const std::string& key = "") {
  auto creds = ClientTlsCredentials(ca.empty() ? "" : Data(ca), cert.empty() ? "" : Data(cert),
                                    key.empty() ? "" : Data(key));
  EXPECT_TRUE(creds.ok()) << creds.status();
  return creds.ok() ? *creds : grpc::InsecureChannelCredentials();
}

struct HttpsAnswer {
  std::string reply;               // the whole HTTP reply
  std::string server_common_name;  // of the certificate the handshake verified
};

// GET `path` from https://127.0.0.1:port, verifying the server against `ca` (a file of
// tests/data/tls) and the address; an error when the connection or the handshake fails.
absl::StatusOr<HttpsAnswer> HttpsGet(int port, const std::string& path,
                                     const std::string& ca = "test-ca.crt") {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        SSL_CTX_free);
  if (ctx == nullptr || SSL_CTX_load_verify_locations(ctx.get(), Data(ca).c_str(), nullptr) != 1) {
    return absl::InternalError("client context");
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  const int fd = testing::ConnectLoopback(port);
  if (fd < 0) return absl::UnavailableError("connect");
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()), "127.0.0.1");
  SSL_set_fd(ssl.get(), fd);
  HttpsAnswer answer;
  absl::Status status;
  if (SSL_connect(ssl.get()) != 1) {
    char buf[256];
    ERR_error_string_n(ERR_get_error(), buf, sizeof(buf));
    status = absl::UnavailableError(absl::StrCat("handshake: ", buf));
  } else {
    if (X509* peer = SSL_get1_peer_certificate(ssl.get()); peer != nullptr) {
      char cn[256] = {};
      X509_NAME_get_text_by_NID(X509_get_subject_name(peer), NID_commonName, cn, sizeof(cn));
      answer.server_common_name = cn;
      X509_free(peer);
    }
    const std::string request = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n");
    SSL_write(ssl.get(), request.data(), static_cast<int>(request.size()));
    char buf[4096];
    for (int n; (n = SSL_read(ssl.get(), buf, sizeof(buf))) > 0;) {
      answer.reply.append(buf, static_cast<size_t>(n));
    }
  }
  ERR_clear_error();
  ::close(fd);
  if (!status.ok()) return status;
  return answer;
}

TEST(TlsTest, ATlsClientIsServedAndAPlaintextOneIsNot) {
  auto server = StartTlsServer(ServerFiles());
  ASSERT_NE(server, nullptr);
  const Call tls = RankOver(server->port(), Client("test-ca.crt"));
  EXPECT_TRUE(tls.status.ok()) << tls.status.error_message();
  EXPECT_EQ(tls.server_common_name, "hstu-test-server-1");
  // The certificate's expiry and the reload counters, for alerts (the test certificates expire in
  // 2126; plaintext servers have no hstu_tls_* series).
  auto body = testing::HttpGet(server->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto m = testing::ParseExposition(*body);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->Sum("hstu_tls_certificate_expiry_timestamp_seconds"), 4.9e9);
  EXPECT_EQ(m->Sum("hstu_tls_reloads_total", {{"result", "ok"}}), 0);
  EXPECT_EQ(RankOver(server->port(), grpc::InsecureChannelCredentials()).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // A client that trusts another CA refuses the server.
  EXPECT_EQ(RankOver(server->port(), Client("untrusted-ca.crt")).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  server->Shutdown(absl::ZeroDuration());
}

TEST(TlsTest, WithMetricsTlsTheMetricsPortSpeaksHttpsOnly) {
  // Mutual TLS on the gRPC port; the metrics port asks no client certificate (probes and most
  // scrapers present none).
  TlsFiles files = ServerFiles();
  files.client_ca_file = Data("test-ca.crt");
  auto server = StartTlsServer(files, /*metrics_tls=*/true);
  ASSERT_NE(server, nullptr);
  const int port = server->metrics_port();
  absl::StatusOr<HttpsAnswer> metrics = HttpsGet(port, "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->server_common_name, "hstu-test-server-1");
  EXPECT_EQ(metrics->reply.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << metrics->reply;
  EXPECT_NE(metrics->reply.find("\nhstu_build_info{"), std::string::npos) << metrics->reply;
  absl::StatusOr<HttpsAnswer> missing = HttpsGet(port, "/nothing-here");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->reply.rfind("HTTP/1.1 404 Not Found\r\n", 0), 0u) << missing->reply;
  absl::StatusOr<HttpsAnswer> health = HttpsGet(port, "/healthz");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_NE(health->reply.find("\r\n\r\nSERVING\n"), std::string::npos) << health->reply;
  // Plain HTTP is answered with a plain 400 that says why; a client that trusts another CA
  // refuses the server.
  const std::string plain = testing::RawHttp(port, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(plain.rfind("HTTP/1.1 400 Bad Request\r\n", 0), 0u) << plain;
  EXPECT_NE(plain.find("this port speaks HTTPS"), std::string::npos) << plain;
  EXPECT_FALSE(HttpsGet(port, "/metrics", "untrusted-ca.crt").ok());
  // A handshake that stalls after its first byte, and one that is garbage after it, hold up no
  // scrape (the handshake is non-blocking, in the exposer's poll loop), and the garbage one is
  // refused.
  const int stalled = testing::ConnectLoopback(port);
  ASSERT_GE(stalled, 0);
  ASSERT_EQ(::write(stalled, "\x16", 1), 1);
  // (A whole TLS record of 5 bytes, which are no ClientHello.)
  const std::string garbage = testing::RawHttp(port, std::string("\x16\x03\x01\x00\x05hello", 10));
  EXPECT_EQ(garbage.find("HTTP/"), std::string::npos) << garbage;  // at most a TLS alert
  absl::StatusOr<HttpsAnswer> again = HttpsGet(port, "/metrics");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->reply.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << again->reply;
  ::close(stalled);
  server->Shutdown(absl::ZeroDuration());
  // It needs the gRPC port's certificate.
  auto no_cert = StartServer(TlsFiles{}, /*metrics_tls=*/true);
  ASSERT_FALSE(no_cert.ok());
  EXPECT_NE(no_cert.status().message().find("--metrics_tls needs --tls_cert_file"),
            std::string::npos)
      << no_cert.status();
}

TEST(TlsTest, WithAClientCaOnlyClientsItSignedAreServed) {
  TlsFiles files = ServerFiles();
  files.client_ca_file = Data("test-ca.crt");
  auto server = StartTlsServer(files);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(RankOver(server->port(),
                       Client("test-ca.crt", "hstu-test-client.crt", "hstu-test-client.key"))
                  .status.ok());
  // No certificate, or one from a CA the server does not trust: the handshake fails.
  EXPECT_EQ(RankOver(server->port(), Client("test-ca.crt")).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(RankOver(server->port(),
                     Client("test-ca.crt", "untrusted-client.crt", "untrusted-client.key"))
                .status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  server->Shutdown(absl::ZeroDuration());
}

TEST(TlsTest, ARotatedCertificateIsServedToNewConnectionsWithoutARestart) {
  // The server's files are copies the test replaces, as a mounted Secret is replaced.
  const std::string dir = testing::TempDir();
  TlsFiles files;
  files.cert_file = dir + "/tls.crt";
  files.key_file = dir + "/tls.key";
  files.reload_interval_s = 1;
  auto install = [&](int n) {
    const TlsFiles from = ServerFiles(n);
    // Written beside, then renamed over: a reader never sees a half-written file.
    for (auto [src, dst] :
         {std::pair{from.cert_file, files.cert_file}, std::pair{from.key_file, files.key_file}}) {
      std::filesystem::copy_file(src, dst + ".new",
                                 std::filesystem::copy_options::overwrite_existing);
      std::filesystem::rename(dst + ".new", dst);
    }
  };
  install(1);
  // The metrics port serves the same certificate over HTTPS (--metrics_tls) and follows it.
  auto server = StartTlsServer(files, /*metrics_tls=*/true);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(RankOver(server->port(), Client("test-ca.crt")).server_common_name,
            "hstu-test-server-1");
  auto metrics_cn = [&server] {
    absl::StatusOr<HttpsAnswer> got = HttpsGet(server->metrics_port(), "/healthz");
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return std::string();
    EXPECT_EQ(got->reply.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << got->reply;
    return got->server_common_name;
  };
  EXPECT_EQ(metrics_cn(), "hstu-test-server-1");
  install(2);
  std::string seen, seen_on_metrics;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while ((seen != "hstu-test-server-2" || seen_on_metrics != "hstu-test-server-2") &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    const Call c = RankOver(server->port(), Client("test-ca.crt"));
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();  // never a failed handshake
    seen = c.server_common_name;
    seen_on_metrics = metrics_cn();
  }
  EXPECT_EQ(seen, "hstu-test-server-2");
  EXPECT_EQ(seen_on_metrics, "hstu-test-server-2");
  // Files that fail the checks, for three reload intervals each: an empty certificate (a writer
  // that truncates first; before: gRPC aborted the process), then server 1's certificate beside
  // server 2's key (before: every handshake failed until the files were fixed). The certificate
  // in service stays, and every connection is served.
  for (const std::string& cert : {std::string(), testing::ReadFile(ServerFiles(1).cert_file)}) {
    std::ofstream(files.cert_file, std::ios::trunc) << cert;
    for (int i = 0; i < 12; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      const Call c = RankOver(server->port(), Client("test-ca.crt"));
      ASSERT_TRUE(c.status.ok()) << c.status.error_message();
      EXPECT_EQ(c.server_common_name, "hstu-test-server-2");
      EXPECT_EQ(metrics_cn(), "hstu-test-server-2");
    }
  }
  server->Shutdown(absl::ZeroDuration());
}

TEST(TlsTest, AReloadPutsOnlyCheckedFilesInServiceAndCountsTheRest) {
  const std::string dir = testing::TempDir();
  TlsFiles files;
  files.cert_file = dir + "/tls.crt";
  files.key_file = dir + "/tls.key";
  files.reload_interval_s = 3600;  // only CheckNow() reloads
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::trunc) << text;
  };
  write(files.cert_file, testing::ReadFile(ServerFiles(1).cert_file));
  write(files.key_file, testing::ReadFile(ServerFiles(1).key_file));
  // The private copy goes under $TMPDIR; a copy left by a process that is gone (a killed
  // server: here a child that exited) is removed, another live process's is not.
  const std::string tmp = testing::TempDir();
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_GT(gone, 0);
  waitpid(gone, nullptr, 0);
  const std::string stale = absl::StrCat(tmp, "/hstu_tls_", gone, "_abcdef");
  const std::string live = absl::StrCat(tmp, "/hstu_tls_", gone, "_ghijkl");
  for (const std::string& d : {stale, live}) {
    std::filesystem::create_directories(d + "/gen-1");
    std::ofstream(d + "/.lock");
  }
  // The live one's lock is held (by this test, as its owner would): a PID says nothing across
  // PID namespaces, the lock does.
  const int held = open((live + "/.lock").c_str(), O_RDONLY);
  ASSERT_GE(held, 0);
  ASSERT_EQ(flock(held, LOCK_EX | LOCK_NB), 0);
  auto reloader = TlsReloader::Start(files, tmp);
  close(held);
  ASSERT_TRUE(reloader.ok()) << reloader.status();
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live));
  std::string mine;
  for (const auto& e : std::filesystem::directory_iterator(tmp)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(absl::StrCat("hstu_tls_", getpid(), "_"), 0) == 0) mine = e.path().string();
  }
  ASSERT_FALSE(mine.empty());
  EXPECT_EQ(std::filesystem::status(mine).permissions(), std::filesystem::perms::owner_all);
  auto& r = **reloader;
  EXPECT_EQ(r.stats().serving.subject, "/CN=hstu-test-server-1");
  r.CheckNow();  // unchanged: nothing
  EXPECT_EQ(r.stats().num_reloads, 0);
  EXPECT_EQ(r.stats().num_reload_errors, 0);
  // Half a rotation: the new certificate beside the old key fails, and is counted at each check.
  write(files.cert_file, testing::ReadFile(ServerFiles(2).cert_file));
  r.CheckNow();
  r.CheckNow();
  EXPECT_EQ(r.stats().num_reload_errors, 2);
  EXPECT_TRUE(r.stats().failing);
  EXPECT_EQ(r.stats().serving.subject, "/CN=hstu-test-server-1");
  // The rest of it: in service.
  write(files.key_file, testing::ReadFile(ServerFiles(2).key_file));
  r.CheckNow();
  EXPECT_EQ(r.stats().num_reloads, 1);
  EXPECT_FALSE(r.stats().failing);
  EXPECT_EQ(r.stats().serving.subject, "/CN=hstu-test-server-2");
  // An expired pair is refused on a reload as at start-up; a missing file too.
  write(files.cert_file, testing::ReadFile(Data("expired-server.crt")));
  write(files.key_file, testing::ReadFile(Data("expired-server.key")));
  r.CheckNow();
  std::filesystem::remove(files.key_file);
  r.CheckNow();
  EXPECT_EQ(r.stats().num_reload_errors, 4);
  EXPECT_EQ(r.stats().num_reloads, 1);
  EXPECT_EQ(r.stats().serving.subject, "/CN=hstu-test-server-2");
  // A FIFO at the key's path (or a device) would block a read: refused without reading.
  ASSERT_EQ(mkfifo(files.key_file.c_str(), 0600), 0);
  r.CheckNow();
  EXPECT_EQ(r.stats().num_reload_errors, 5);
  reloader->reset();
  EXPECT_FALSE(std::filesystem::exists(mine));  // the key's copy goes with the reloader
}

TEST(TlsTest, TheStartUpCheckNamesEachWrongFile) {
  const TlsFiles good = ServerFiles();
  auto check = [](TlsFiles f) { return CheckTlsFiles(f).status(); };
  EXPECT_TRUE(check(good).ok());
  EXPECT_TRUE(check(TlsFiles{}).ok());  // plaintext
  struct Case {
    TlsFiles files;
    std::string want;
  };
  TlsFiles no_key = good;
  no_key.key_file = "";
  TlsFiles key_only;
  key_only.key_file = good.key_file;
  TlsFiles ca_only;
  ca_only.client_ca_file = Data("test-ca.crt");
  TlsFiles other_key = good;
  other_key.key_file = Data("hstu-test-server-2.key");
  TlsFiles missing = good;
  missing.cert_file = Data("no-such.crt");
  TlsFiles key_as_cert = good;
  key_as_cert.cert_file = good.key_file;
  TlsFiles cert_as_key = good;
  cert_as_key.key_file = good.cert_file;
  TlsFiles expired;
  expired.cert_file = Data("expired-server.crt");
  expired.key_file = Data("expired-server.key");
  TlsFiles bad_ca = good;
  bad_ca.client_ca_file = good.key_file;
  TlsFiles directory = good;
  directory.key_file = Data("");
  // A chain of two (leaf, then its CA), cut inside the second; the same two in the wrong order.
  const std::string dir = testing::TempDir();
  const std::string leaf = testing::ReadFile(good.cert_file), ca = testing::ReadFile(Data("test-ca.crt"));
  std::ofstream(dir + "/chain.crt") << leaf << ca;
  std::ofstream(dir + "/cut.crt") << leaf << ca.substr(0, ca.size() / 2);
  std::ofstream(dir + "/reversed.crt") << ca << leaf;
  TlsFiles chain = good;
  chain.cert_file = dir + "/chain.crt";
  EXPECT_TRUE(check(chain).ok()) << check(chain);
  TlsFiles cut = good;
  cut.cert_file = dir + "/cut.crt";
  TlsFiles reversed = good;
  reversed.cert_file = dir + "/reversed.crt";
  // 1024-bit RSA: refused at OpenSSL's security level 2, Debian 12's and Ubuntu 24.04's default.
  TlsFiles weak;
  weak.cert_file = Data("weak-server.crt");
  weak.key_file = Data("weak-server.key");
  TlsFiles leaf_as_ca = good;
  leaf_as_ca.client_ca_file = Data("hstu-test-client.crt");
  TlsFiles zero_interval = good;
  zero_interval.reload_interval_s = 0;
  TlsFiles zero_interval_plaintext;  // checked without TLS too (before: only with it)
  zero_interval_plaintext.reload_interval_s = 0;
  const Case cases[] = {
      {no_key, "--tls_cert_file needs --tls_key_file"},
      {key_only, "--tls_key_file needs --tls_cert_file"},
      {ca_only, "--tls_client_ca_file needs --tls_cert_file"},
      {other_key, "not the key of the certificate in --tls_cert_file="},
      {missing, "no-such.crt: cannot read it (No such file or directory)"},
      {key_as_cert, "hstu-test-server-1.key: no PEM certificate in it"},
      {cert_as_key, "hstu-test-server-1.crt: not an unencrypted PEM private key"},
      {expired, "expired at 2020-01-02"},
      {bad_ca, "--tls_client_ca_file=" + good.key_file + ": no PEM certificate in it"},
      {zero_interval, "--tls_reload_interval_s=0: must be >= 1"},
      {zero_interval_plaintext, "--tls_reload_interval_s=0: must be >= 1"},
      {directory, "tests/data/tls/: is a directory"},
      // Before: each passed the check, and the server then served a leaf without its chain,
      // failed every handshake, or refused every client.
      {cut, "cut.crt: certificate 2 does not parse"},
      {reversed,
       "reversed.crt: certificate 2 (/CN=hstu-test-server-1) did not issue certificate 1"},
      {weak, "weak-server.crt: OpenSSL refuses the certificate"},
      {leaf_as_ca, "certificate 1 (/CN=hstu-test-client) is not a CA certificate"},
  };
  for (const Case& c : cases) {
    const absl::Status s = check(c.files);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_NE(s.message().find(c.want), std::string::npos) << s << "\n  want: " << c.want;
  }
  // RankingServer::Start makes the same check (a caller that builds ServerOptions itself).
  auto s = StartServer(other_key);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("not the key of the certificate"), std::string::npos);
}

}  // namespace
}  // namespace hstu::server
