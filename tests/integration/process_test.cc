// hstu_server as a real process on loopback: every program's help, flags and start-up, graceful
// SIGTERM under load, reflection, promtool, a real Prometheus scraping it, and the deploy/ files.
// tool_process_test.cc runs hstu_loadgen and hstu_rank against it.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection_client.grpc.pb.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/integration/raw_rank.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_util.h"

namespace hstu::testing {
namespace {

using namespace std::chrono_literals;

TEST(ProcessTest, HelpDocumentsEveryFlag) {
  // A help asked for is a success (before: absl's exit status 1).
  for (const char* program : {HSTU_SERVER_BIN, HSTU_LOADGEN_BIN, HSTU_RANK_BIN, HSTU_MODEL_BIN}) {
    for (const char* flag : {"--help", "--helpfull"}) {
      const auto [rc, out] = RunCommand(absl::StrCat(program, " ", flag, " > /dev/null"));
      EXPECT_EQ(rc, 0) << program << " " << flag << ": " << out;
    }
  }
  // --version says the program and the project's version (before: absl's "Debug build").
  for (const auto& [program, name] : std::vector<std::pair<std::string, std::string>>{
           {HSTU_SERVER_BIN, "hstu_server"}, {HSTU_LOADGEN_BIN, "hstu_loadgen"},
           {HSTU_RANK_BIN, "hstu_rank"}, {HSTU_MODEL_BIN, "hstu_model"}}) {
    const auto [version_rc, version] = RunCommand(program + " --version");
    EXPECT_EQ(version_rc, 0) << version;
    EXPECT_EQ(version, absl::StrCat(name, " ", HSTU_VERSION, "\n"));
  }
  // An unknown flag is still an error.
  EXPECT_EQ(RunCommand(absl::StrCat(HSTU_SERVER_BIN, " --no_such_flag")).first, 1);
  const auto [rc, out] = RunCommand(absl::StrCat(HSTU_SERVER_BIN, " --help"));
  for (const char* flag :
       {"listen", "metrics_listen", "tls_cert_file", "tls_key_file", "tls_client_ca_file",
        "tls_reload_interval_s", "metrics_tls", "model", "seed", "device", "max_batch_size", "max_batch_tokens",
        "batch_timeout_us", "max_queue", "max_queue_per_user", "max_queued_tokens",
        "max_candidates", "max_message_bytes", "keepalive_time_s", "keepalive_timeout_s",
        "min_client_ping_interval_s", "max_connection_age_s", "max_connection_age_grace_s",
        "max_connection_idle_s", "page_size", "cache_pages", "host_cache_pages", "onload_policy", "enable_cache", "no_cache",
        "slow_request_ms", "slow_request_log_per_s", "log_level", "log_format"}) {
    EXPECT_NE(out.find(absl::StrCat("--", flag, " (")), std::string::npos) << flag;
  }
  const auto [rc2, out2] = RunCommand(absl::StrCat(HSTU_LOADGEN_BIN, " --help"));
  for (const char* flag : {"target", "duration", "requests", "concurrency", "rate", "arrival",
                           "users", "zipf", "candidates", "timeout_ms", "warmup", "seed",
                           "connections", "json", "csv", "new_user_rate", "wait_ready_s",
                           "max_outstanding", "max_error_rate", "prewarm_visits",
                           "overlapping_visits", "record", "record_every", "replay"}) {
    EXPECT_NE(out2.find(absl::StrCat("--", flag, " (")), std::string::npos) << flag;
  }
}

#if !defined(__SANITIZE_THREAD__)  // random:base's 4 GB of tables, under TSan's shadow memory
TEST(ProcessTest, AStopSignalDuringTheStartUpEndsItAtOnce) {
  // random:base builds 4 GB of embedding tables first: seconds of start-up (minutes under ASan).
  // Before, a SIGTERM then waited for the whole start-up, reported SERVING, and drained.
  ServerProcess server({"--model=random:base"});
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (server.proc().Log().find("engine: loading model") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline && server.proc().Wait(0ms) < 0) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_NE(server.proc().Log().find("engine: loading model"), std::string::npos)
      << server.proc().Log();
  const auto sent = std::chrono::steady_clock::now();
  server.proc().Signal(SIGTERM);
  EXPECT_EQ(server.proc().Wait(60s), 0) << server.proc().Log();
  EXPECT_LT(std::chrono::steady_clock::now() - sent, 5s);
  const std::string log = server.proc().Log();
  EXPECT_NE(log.find("received SIGTERM during start-up"), std::string::npos) << log;
  EXPECT_EQ(log.find("ready: health SERVING"), std::string::npos) << log;
}
#endif

TEST(ProcessTest, SighupDrainsAndUserSignalsAreIgnored) {
  // Before: SIGHUP, SIGUSR1 and SIGUSR2 took their default action and ended the process at once,
  // with no drain and the calls in flight lost.
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  server.proc().Signal(SIGUSR1);
  server.proc().Signal(SIGUSR2);
  std::this_thread::sleep_for(200ms);
  ASSERT_EQ(server.proc().Wait(0ms), -1) << server.proc().Log();
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  server.proc().Signal(SIGHUP);
  EXPECT_EQ(server.proc().Wait(60s), 0) << server.proc().Log();
  const std::string log = server.proc().Log();
  EXPECT_NE(log.find("received SIGHUP, draining"), std::string::npos) << log;
  EXPECT_NE(log.find("stopped cleanly"), std::string::npos) << log;
}

TEST(ProcessTest, AClosedLogPipeDoesNotEndTheServer) {
  // The server's output goes to a pipe whose reader then goes away (a log shipper that died).
  // Before: the next log line's write raised SIGPIPE, which ended the process in the middle of
  // whatever it did (a drain's first line: exit by signal, the calls in flight lost).
  const std::string dir = TempDir();
  const std::string fifo = dir + "/log";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::string socket = "unix:" + dir + "/grpc.sock";
  // The child's open of the FIFO for writing waits for this reader.
  Subprocess proc({HSTU_SERVER_BIN, "--listen=" + socket, "--metrics_listen=", "--device=cpu",
                   "--model=random:tiny"},
                  fifo);
  const int reader = open(fifo.c_str(), O_RDONLY);
  ASSERT_GE(reader, 0);
  char first[64];
  ASSERT_GT(read(reader, first, sizeof(first)), 0);  // the server writes to the pipe...
  close(reader);                                      // ...and from here on to no one
  ASSERT_TRUE(WaitServingAt(socket, proc)) << "exit status " << proc.Wait(0ms);
  proc.Signal(SIGTERM);
  EXPECT_EQ(proc.Wait(60s), 0);  // 141 (SIGPIPE) before
}

TEST(ProcessTest, ASecondServerOnAUnixSocketInUseFailsToStart) {
  // Before: gRPC unlinked the first server's socket and bound its own, so the first went on
  // reporting SERVING, unreachable (for good once the second stopped and removed the file).
  const std::string dir = TempDir();
  const std::string path = dir + "/grpc.sock";
  // A socket file whose process is gone (bound, never listened on): replaced, not in the way.
  {
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    close(fd);
  }
  const std::string socket_address = "unix:" + path;
  Subprocess first({HSTU_SERVER_BIN, "--listen=" + socket_address, "--metrics_listen=",
                    "--device=cpu", "--model=random:tiny"},
                   dir + "/first.log");
  ASSERT_TRUE(WaitServingAt(socket_address, first)) << first.Log();
  for (const std::string& address : {socket_address, "unix://" + path}) {
    Subprocess second({HSTU_SERVER_BIN, "--listen=" + address, "--metrics_listen=",
                       "--device=cpu", "--model=random:tiny"},
                      dir + "/second.log");
    EXPECT_EQ(second.Wait(60s), 1) << second.Log();
    EXPECT_NE(second.Log().find("another process is serving on that socket"), std::string::npos)
        << second.Log();
  }
  ASSERT_TRUE(WaitServingAt(socket_address, first)) << first.Log();
  first.Signal(SIGTERM);
  EXPECT_EQ(first.Wait(60s), 0) << first.Log();
}

TEST(ProcessTest, ASighupIgnoredByTheParentStaysIgnored) {
  // `nohup hstu_server &`: the server outlives its terminal, as the caller asked.
  const std::string dir = TempDir();
  const std::string socket = "unix:" + dir + "/grpc.sock";
  Subprocess proc({"/usr/bin/nohup", HSTU_SERVER_BIN, "--listen=" + socket, "--metrics_listen=",
                   "--device=cpu", "--model=random:tiny"},
                  dir + "/server.log");
  ASSERT_TRUE(WaitServingAt(socket, proc)) << proc.Log();
  proc.Signal(SIGHUP);
  std::this_thread::sleep_for(300ms);
  ASSERT_EQ(proc.Wait(0ms), -1) << proc.Log();
  ASSERT_TRUE(WaitServingAt(socket, proc)) << proc.Log();
  proc.Signal(SIGTERM);
  EXPECT_EQ(proc.Wait(60s), 0) << proc.Log();
}

TEST(ProcessTest, WithJsonLogsEveryLineIsAJsonObject) {
  // At debug level, with a request whose request_id is not UTF-8: protobuf's routed line (which
  // quotes the field) goes through the formatter too.
  ServerProcess server({"--log_format=json", "--log_level=debug"});
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  auto stub = hstu::v1::Ranker::NewStub(server.channel());
  grpc::ClientContext ctx;
  hstu::v1::RankResponse resp;
  ASSERT_TRUE(stub->Rank(&ctx, MakeRequest(1, 8, 4, 2), &resp).ok());
  std::string reply;
  EXPECT_EQ(hstu::testing::RankBytes(server.channel(),
                                     hstu::testing::WithNonUtf8RequestId(MakeRequest(3, 5, 2, 1)),
                                     &reply)
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  server.proc().Signal(SIGTERM);
  ASSERT_EQ(server.proc().Wait(30s), 0) << server.proc().Log();
  std::istringstream log(server.proc().Log());
  std::string line;
  std::vector<std::string> messages;
  const std::set<std::string> levels = {"trace", "debug", "info", "warning", "error", "critical"};
  const std::regex time(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)");
  while (std::getline(log, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_TRUE(j.is_object()) << line;
    ASSERT_EQ(j.size(), 4u) << line;  // time, level, thread, message: nothing else
    ASSERT_TRUE(j["time"].is_string() && j["level"].is_string() && j["thread"].is_number() &&
                j["message"].is_string())
        << line;
    EXPECT_TRUE(std::regex_match(j["time"].get<std::string>(), time)) << line;
    EXPECT_TRUE(levels.count(j["level"].get<std::string>())) << line;
    messages.push_back(j["message"].get<std::string>());
  }
  EXPECT_NE(std::find_if(messages.begin(), messages.end(),
                         [](const std::string& m) { return m.rfind("protobuf: ", 0) == 0; }),
            messages.end());
  // The start-up, the drain and the clean stop all went through it.
  ASSERT_GT(messages.size(), 5u);
  EXPECT_EQ(messages.front().rfind("hstu_server ", 0), 0u) << messages.front();
  EXPECT_EQ(messages.back(), "stopped cleanly");
  EXPECT_NE(std::find_if(messages.begin(), messages.end(),
                         [](const std::string& m) { return m.rfind("ready: health SERVING", 0) == 0; }),
            messages.end());
}

TEST(ProcessTest, RequestsThatDoNotParseAreAnsweredWithoutALogLine) {
  // A request_id that is not UTF-8: protobuf logged an ERROR line for each such request, which
  // any client could repeat to fill the log (DESIGN §8: no per-request lines by default). Now its
  // log goes to spdlog's debug level, and the call is an INVALID_ARGUMENT like any bad request.
  const std::string bytes = hstu::testing::WithNonUtf8RequestId(MakeRequest(3, 5, 2, 1));
  for (const char* level : {"info", "debug"}) {
    ServerProcess server({absl::StrCat("--log_level=", level)});
    ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
    std::string reply;
    for (int i = 0; i < 3; ++i) {
      const grpc::Status s = hstu::testing::RankBytes(server.channel(), bytes, &reply);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    }
    server.proc().Signal(SIGTERM);
    EXPECT_EQ(server.proc().Wait(30s), 0);
    const std::string log = server.proc().Log();
    const size_t lines = static_cast<size_t>(std::count(log.begin(), log.end(), '\n'));
    EXPECT_EQ(log.find("libprotobuf"), std::string::npos) << log;
    const std::string protobuf_line = "protobuf: String field 'hstu.v1.RankRequest.request_id' contains invalid UTF-8";
    if (std::string(level) == "info") {
      EXPECT_EQ(log.find(protobuf_line), std::string::npos) << log;
    } else {
      EXPECT_NE(log.find(protobuf_line), std::string::npos) << log;
    }
    EXPECT_GT(lines, 5u) << log;  // the start-up's lines are there: the log was read
  }
}

TEST(ProcessTest, BadFlagValuesAreRejectedNamingTheFlag) {
  // getaddrinfo takes port 99999 modulo 65536: without the check the server bound port 34463.
  ExpectEachFlagRejected(
      absl::StrCat(HSTU_SERVER_BIN, " --device=cpu"),
      {{"--onload_policy=never", "--onload_policy=never: must be cost or always"},
       {"--listen=127.0.0.1:99999", "--listen=127.0.0.1:99999: must be HOST:PORT with a port in [0, 65535]"},
       {"--listen=127.0.0.1", "--listen=127.0.0.1: must be HOST:PORT"},
       {"--metrics_listen=127.0.0.1:65536", "--metrics_listen=127.0.0.1:65536: must be HOST:PORT"},
       {"--metrics_listen=127.0.0.1:-1", "--metrics_listen=127.0.0.1:-1: must be HOST:PORT"},
       {"--shutdown_grace_s=-4", "--shutdown_grace_s=-4: must be >= 0"},
       {"--max_concurrent_streams=-1", "--max_concurrent_streams=-1: must be >= 0"},
       {"--max_grpc_threads=2", "--max_grpc_threads=2: must be 0 (no limit) or >= 4"},
       // Before: accepted, then overflowing the scheduler's wake-up time (no wait at all).
       {"--batch_timeout_us=9300000000000000", "--batch_timeout_us=9300000000000000: must be in [0, 10000000]"},
       // Before: accepted here, then refused by the engine at start-up (exit 1).
       {"--page_size=8192", "--page_size=8192: must be a power of two in [1, 4096]"},
       // Before: silently clamped to 2^31 - 1 while the log said the value given.
       {"--max_message_bytes=99999999999", "--max_message_bytes=99999999999: must be in [1024, 2147483647]"},
       // Before: accepted here, then "Name or service not known" at start-up (exit 1).
       {"--metrics_listen=unix:/tmp/m.sock", "--metrics_listen=unix:/tmp/m.sock: must be HOST:PORT (no unix sockets here)"},
       {"--max_queued_tokens=-1", "--max_queued_tokens=-1: must be >= 0"},
       // TLS files checked before the ports open (server/tls.h; every case in tls_test.cc).
       {absl::StrCat("--tls_key_file=", HSTU_SOURCE_DIR, "/tests/data/tls/hstu-test-server-1.key"),
        "--tls_key_file needs --tls_cert_file"},
       {absl::StrCat("--tls_cert_file=", HSTU_SOURCE_DIR, "/tests/data/tls/hstu-test-server-1.crt",
                     " --tls_key_file=", HSTU_SOURCE_DIR, "/tests/data/tls/hstu-test-server-2.key"),
        "not the key of the certificate"},
       {"--metrics_tls", "--metrics_tls needs --tls_cert_file and --tls_key_file"},
       {absl::StrCat("--metrics_tls --metrics_listen= --tls_cert_file=", HSTU_SOURCE_DIR,
                     "/tests/data/tls/hstu-test-server-1.crt --tls_key_file=", HSTU_SOURCE_DIR,
                     "/tests/data/tls/hstu-test-server-1.key"),
        "--metrics_tls needs --metrics_listen"},
       {"--max_queue_per_user=-1", "--max_queue_per_user=-1: must be >= 0"},
       {"--log_format=xml", "--log_format=xml: want text or json"},
       {"--slow_request_ms=nan",
        "--slow_request_ms=nan: must be a number of milliseconds up to a day"},
       {"--slow_request_log_per_s=-1", "--slow_request_log_per_s=-1: must be >= 0 (0: no limit)"},
       // gRPC takes these in milliseconds as int32 (ConnectionOptions).
       {"--keepalive_timeout_s=0", "--keepalive_timeout_s=0: must be in [1, 2147483]"},
       {"--max_connection_idle_s=9999999", "--max_connection_idle_s=9999999: must be in [0, 2147483]"},
       // Before: std::bad_alloc out of the engine's start-up (the process aborted).
       {"--host_cache_pages=99999999999", "--host_cache_pages=99999999999: must be in [0, 2147483647], or -1 for auto"},
       {"--offload_backlog_mib=99999999999999", "--offload_backlog_mib=99999999999999: must be in [1, 1048576]"},
       // Before: accepted, then int32 overflow in the bucket's static sizes.
       {"--graph_buckets=8x2147483000", "--graph_buckets: '8x2147483000' is not USERSxROWS with users in [1, 4096] and rows in [1, 1048576]"},
       // Every program takes the dashed spelling of its flags (README).
       {"--shutdown-grace-s=-4", "--shutdown_grace_s=-4: must be >= 0"},
       // Before: "false" was dropped and the warm-up ran.
       {"--warmup false", "error: unexpected argument 'false'"},
       // Before: refused by the engine once the ports were open (exit 1).
       {"--device=gpu", "--device=gpu: device 'gpu' is not one of cpu, cpu-bf16, cuda:N, auto"}},
      2);
}

TEST(ProcessTest, LimitsThatWouldFailAcceptedRequestsStopTheStartUp) {
  // random:tiny: 256-token histories (8 pages of 32), 3 tasks.
  ExpectEachFlagRejected(
      absl::StrCat(HSTU_SERVER_BIN, " --device=cpu --listen=127.0.0.1:0 --metrics_listen="),
      {{"--cache_pages=4", "--cache_pages=4: the KV pool of 4 pages must hold one user of the model's maximum "
                           "history, 256 tokens = 8 pages of 32"},
       {"--max_message_bytes=4096", "--max_message_bytes=4096: smaller than the largest reply"}},
      1);
}

TEST(ProcessTest, ReflectionListsTheRankerAndHealthServices) {
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(server.channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("*");
  ASSERT_TRUE(stream->Write(req));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  std::set<std::string> services;
  for (const auto& s : resp.list_services_response().service()) services.insert(s.name());
  EXPECT_TRUE(services.contains("hstu.v1.Ranker"));
  EXPECT_TRUE(services.contains("grpc.health.v1.Health"));
  while (stream->Read(&resp)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(ProcessTest, ReflectionStreamsPastTheThreadLimitAreRefused) {
  // Server reflection runs on gRPC's synchronous threads, one an open stream. Before the limit,
  // 3,000 streams a client held open took 3,000 threads.
  ServerProcess server({"--max_grpc_threads=4"});
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(server.channel());
  using Stream = grpc::ClientReaderWriter<grpc::reflection::v1alpha::ServerReflectionRequest,
                                          grpc::reflection::v1alpha::ServerReflectionResponse>;
  constexpr int kStreams = 12;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<bool> answered;
  for (int i = 0; i < kStreams; ++i) {  // each asks once and stays open
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + 60s);
    streams.push_back(stub->ServerReflectionInfo(contexts.back().get()));
    grpc::reflection::v1alpha::ServerReflectionRequest req;
    req.set_list_services("*");
    grpc::reflection::v1alpha::ServerReflectionResponse resp;
    answered.push_back(streams.back()->Write(req) && streams.back()->Read(&resp));
  }
  int refused = 0;
  for (int i = 0; i < kStreams; ++i) {
    grpc::Status s;
    if (answered[i]) {  // the answered ones end when this side is done
      streams[i]->WritesDone();
      grpc::reflection::v1alpha::ServerReflectionResponse resp;
      while (streams[i]->Read(&resp)) {
      }
      s = streams[i]->Finish();
      EXPECT_TRUE(s.ok()) << i << ": " << s.error_message();
    } else {
      s = streams[i]->Finish();
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << i << ": " << s.error_message();
      ++refused;
    }
  }
  EXPECT_GT(kStreams - refused, 0);
  EXPECT_GT(refused, 0);
  // Rank and health take no such thread: both are served.
  ASSERT_TRUE(server.WaitServing(5s));
  auto ranker = hstu::v1::Ranker::NewStub(server.channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  hstu::v1::RankResponse resp;
  EXPECT_TRUE(ranker->Rank(&ctx, MakeRequest(1, 5, 2, 1), &resp).ok());
}

TEST(ProcessTest, OneConnectionHoldsAtMostTheStreamLimit) {
  // Four calls on one connection to a server whose batches wait 10 s to fill: with a limit of two
  // streams, two calls reach its queue and the client holds the others back.
  ServerProcess server({"--max_concurrent_streams=2", "--batch_timeout_us=10000000",
                        "--adaptive_batching=false"});
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  auto stub = hstu::v1::Ranker::NewStub(server.channel());
  constexpr int kCalls = 4;
  grpc::ClientContext contexts[kCalls];
  hstu::v1::RankRequest requests[kCalls];
  hstu::v1::RankResponse responses[kCalls];
  std::atomic<int> finished{0}, ok{0};
  for (int i = 0; i < kCalls; ++i) {
    contexts[i].set_deadline(std::chrono::system_clock::now() + 60s);
    requests[i] = MakeRequest(i + 1, 5, 2, 1);
    stub->async()->Rank(&contexts[i], &requests[i], &responses[i], [&](grpc::Status s) {
      if (s.ok()) ++ok;
      ++finished;
    });
  }
  auto depth = [&] {
    auto body = HttpGet(server.metrics_port(), "/metrics");
    auto expo = body.ok() ? ParseExposition(*body) : absl::StatusOr<Exposition>(body.status());
    return expo.ok() ? expo->Sum("hstu_queue_depth") : -1.0;
  };
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (depth() < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
  }
  std::this_thread::sleep_for(300ms);  // time for more calls to arrive, were they let through
  EXPECT_EQ(depth(), 2.0);
  // The drain runs the two queued calls at once; the held-back ones then find it draining.
  server.proc().Signal(SIGTERM);
  EXPECT_EQ(server.proc().Wait(60s), 0) << server.proc().Log();
  for (int i = 0; i < 600 && finished.load() < kCalls; ++i) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(finished.load(), kCalls);
  EXPECT_EQ(ok.load(), 2);
}

TEST(ProcessTest, SigtermUnderLoadDrainsAndExitsZero) {
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, unavailable{0}, other{0};
  std::atomic<int> ok_across_signal{0};  // sent before SIGTERM, answered OK after it
  std::atomic<int> in_flight{0};         // calls sent and not yet answered
  // When SIGTERM is sent, as steady-clock ticks (0 = not yet).
  std::atomic<int64_t> signalled_at{0};
  // The longest call that finished before the signal, in ticks: how long a call may take to reach
  // the server here (a sanitizer build is ~10x slower).
  std::atomic<int64_t> longest_before{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      auto stub = hstu::v1::Ranker::NewStub(server.channel());
      for (int i = 0; !stop; ++i) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + 30s);
        hstu::v1::RankResponse resp;
        const hstu::v1::RankRequest req = MakeRequest(t * 1000 + i % 7, 60, 32, i);
        ++in_flight;
        const auto sent = std::chrono::steady_clock::now();
        const grpc::Status s = stub->Rank(&ctx, req, &resp);
        const auto done = std::chrono::steady_clock::now();
        --in_flight;
        const int64_t sig = signalled_at.load();
        const int64_t took = (done - sent).count();
        if (sig == 0) {
          int64_t seen = longest_before.load();
          while (took > seen && !longest_before.compare_exchange_weak(seen, took)) {
          }
        }
        // A call still on its way when the drain began is refused by gRPC before the server ever
        // admits it: UNAVAILABLE, or CANCELLED for a stream that was open but not yet matched.
        // Calls sent well before the signal (50 ms, or twice the longest call before it where
        // that is more) were admitted and must finish OK.
        const int64_t window = std::max<int64_t>(
            std::chrono::steady_clock::duration(50ms).count(), 2 * longest_before.load());
        const bool in_drain_window = sig != 0 && sent.time_since_epoch().count() > sig - window;
        if (s.ok()) {
          ++ok;
          if (sig != 0 && sent.time_since_epoch().count() < sig &&
              done.time_since_epoch().count() > sig) {
            ++ok_across_signal;
          }
        } else if (in_drain_window && (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                                       s.error_code() == grpc::StatusCode::CANCELLED)) {
          ++unavailable;  // refused after the drain began: never admitted, never lost
          std::this_thread::sleep_for(5ms);
        } else {
          ++other;
          ADD_FAILURE() << "unexpected status " << s.error_code() << ": " << s.error_message()
                        << (sig != 0 ? " (a call sent before the drain began)" : "");
        }
      }
    });
  }
  // Some calls answered first (a fixed sleep was a guess on a loaded, sanitized machine).
  const auto load_until = std::chrono::steady_clock::now() + 30s;
  while (ok.load() < 8 && std::chrono::steady_clock::now() < load_until) {
    std::this_thread::sleep_for(10ms);
  }
  const int ok_before = ok.load();
  // Signalled while a call is on its way (the clients' own work between calls is slow in a
  // sanitizer build: all four were between calls at the signal in about one run of four).
  while (in_flight.load() == 0 && std::chrono::steady_clock::now() < load_until) {
    std::this_thread::yield();
  }
  signalled_at = std::chrono::steady_clock::now().time_since_epoch().count();
  server.proc().Signal(SIGTERM);
  const int rc = server.proc().Wait(60s);
  stop = true;
  for (auto& c : clients) c.join();
  EXPECT_EQ(rc, 0) << server.proc().Log();
  EXPECT_GT(ok_before, 0);
  // The drain finished calls that were in flight when it began (four clients always have some).
  EXPECT_GT(ok_across_signal.load(), 0);
  EXPECT_EQ(other.load(), 0);
  const std::string log = server.proc().Log();
  EXPECT_NE(log.find("draining"), std::string::npos) << log;
  EXPECT_NE(log.find("stopped cleanly"), std::string::npos) << log;
}

TEST(ProcessTest, MetricsPassPromtoolAndDeployFilesUseOnlyExportedMetrics) {
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  auto stub = hstu::v1::Ranker::NewStub(server.channel());
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext ctx;
    hstu::v1::RankResponse resp;
    ASSERT_TRUE(stub->Rank(&ctx, MakeRequest(1, 10 + i, 4, 1), &resp).ok());
  }
  auto body = HttpGet(server.metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  const std::string path = server.dir() + "/metrics.txt";
  std::ofstream(path) << *body;
  const auto [rc, out] = RunCommand(absl::StrCat("promtool check metrics < ", path));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("problem"), std::string::npos) << out;

  auto expo = ParseExposition(*body);
  ASSERT_TRUE(expo.ok()) << expo.status();
  // The restart alert reads the standard start-time gauge.
  EXPECT_EQ(expo->types["process_start_time_seconds"], "gauge");
  EXPECT_GT(expo->Sum("process_start_time_seconds"), 1.7e9);
  // Every hstu_* name in the dashboard and the rules must be an exported family (or one of a
  // histogram's _bucket/_sum/_count series). A family with no series is not on the page (the
  // hstu_gpu_* families on this CPU server, hstu_tls_* without TLS): such a name must be one the
  // server registers.
  const std::string registered = ReadFile(absl::StrCat(HSTU_SOURCE_DIR, "/server/metrics.cc"));
  ASSERT_FALSE(registered.empty());
  const std::regex metric_re("hstu_[a-z0-9_]+");
  for (const char* file : {"deploy/grafana/hstu_dashboard.json", "deploy/prometheus/rules.yml"}) {
    const std::string text = ReadFile(absl::StrCat(HSTU_SOURCE_DIR, "/", file));
    ASSERT_FALSE(text.empty()) << file;
    std::set<std::string> names;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), metric_re);
         it != std::sregex_iterator(); ++it) {
      names.insert(it->str());
    }
    EXPECT_GE(names.size(), 5u) << file;
    for (std::string name : names) {
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        const std::string s(suffix);
        if (name.size() > s.size() && name.ends_with(s)) {
          const std::string base = name.substr(0, name.size() - s.size());
          if (expo->types.contains(base) && expo->types.at(base) == "histogram") name = base;
        }
      }
      // Families with no series on this server: the GPU's (a CPU server), TLS's (plaintext).
      const bool conditional =
          (name.starts_with("hstu_gpu_") || name.starts_with("hstu_tls_")) &&
          registered.find(absl::StrCat("\"", name, "\"")) != std::string::npos;
      EXPECT_TRUE(expo->types.contains(name) || conditional)
          << file << " uses " << name << ", not exported";
    }
  }
  const auto [rc2, out2] = RunCommand(
      absl::StrCat("promtool check rules ", HSTU_SOURCE_DIR, "/deploy/prometheus/rules.yml"));
  EXPECT_EQ(rc2, 0) << out2;
  const auto [rc3, out3] = RunCommand(
      absl::StrCat("promtool check config ", HSTU_SOURCE_DIR, "/deploy/prometheus/prometheus.yml"));
  EXPECT_EQ(rc3, 0) << out3;
  // The alerts fire on their cause only (deploy/prometheus/rules_test.yml).
  const auto [rc4, out4] = RunCommand(absl::StrCat("cd ", HSTU_SOURCE_DIR,
                                                   "/deploy/prometheus && promtool test rules "
                                                   "rules_test.yml"));
  EXPECT_EQ(rc4, 0) << out4;
  // The dashboard is valid JSON.
  const auto dash = nlohmann::json::parse(
      ReadFile(absl::StrCat(HSTU_SOURCE_DIR, "/deploy/grafana/hstu_dashboard.json")), nullptr,
      false);
  EXPECT_FALSE(dash.is_discarded());
}

// Runs Prometheus scraping 127.0.0.1:metrics_port (`scrape` is more of its scrape config, indented
// for the job) until `query` (URL-encoded) answers `want`, for at most 45 s; the last value seen.
double PrometheusValue(int metrics_port, const std::string& scrape, const std::string& query,
                       double want) {
  const std::string dir = TempDir();
  std::ofstream(dir + "/prometheus.yml")
      << "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: hstu\n" << scrape
      << "    static_configs:\n      - targets: ['127.0.0.1:" << metrics_port << "']\n";
  std::string last;
  double value = -1;
  std::unique_ptr<Subprocess> prom;
  const auto end = std::chrono::steady_clock::now() + 45s;
  // Prometheus takes a port picked here: another process can take it first, and Prometheus
  // then exits at once. It is started again on another port (three tries).
  std::string logs;  // every attempt's
  for (int attempt = 0; attempt < 3 && value != want && std::chrono::steady_clock::now() < end;
       ++attempt) {
    if (prom) logs += prom->Log();
    const int prom_port = FreePort();
    prom = std::make_unique<Subprocess>(
        std::vector<std::string>{"/usr/bin/prometheus", "--config.file=" + dir + "/prometheus.yml",
                                 absl::StrCat("--storage.tsdb.path=", dir, "/data", attempt),
                                 absl::StrCat("--web.listen-address=127.0.0.1:", prom_port),
                                 "--log.level=warn"},
        absl::StrCat(dir, "/prometheus", attempt, ".log"));
    EXPECT_TRUE(prom->started());
    if (!prom->started()) return value;
    while (std::chrono::steady_clock::now() < end && value != want && prom->Wait(0ms) < 0) {
      std::this_thread::sleep_for(300ms);
      auto body = HttpGet(prom_port, "/api/v1/query?query=" + query);
      if (!body.ok()) {
        last = std::string(body.status().message());
        continue;
      }
      last = *body;
      const auto j = nlohmann::json::parse(*body, nullptr, false);
      if (j.is_discarded() || j.value("status", "") != "success") continue;
      const auto& result = j["data"]["result"];
      if (result.empty()) continue;
      value = std::stod(result[0]["value"][1].get<std::string>());
    }
  }
  EXPECT_EQ(value, want) << "last answer: " << last << "\n" << logs << prom->Log();
  prom->Signal(SIGTERM);
  prom->Wait(10s);
  return value;
}

TEST(ProcessTest, RealPrometheusScrapesTheRequestCount) {
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  constexpr int kRequests = 7;
  auto stub = hstu::v1::Ranker::NewStub(server.channel());
  for (int i = 0; i < kRequests; ++i) {
    grpc::ClientContext ctx;
    hstu::v1::RankResponse resp;
    ASSERT_TRUE(stub->Rank(&ctx, MakeRequest(i, 8, 4, 2), &resp).ok());
  }
  // sum(hstu_requests_total{job="hstu",code="OK"}), URL-encoded.
  PrometheusValue(server.metrics_port(), "",
                  "sum(hstu_requests_total%7Bjob%3D%22hstu%22%2Ccode%3D%22OK%22%7D)", kRequests);
}

TEST(ProcessTest, RealPrometheusScrapesOverHttpsWithMetricsTls) {
  const std::string tls = absl::StrCat(HSTU_SOURCE_DIR, "/tests/data/tls/");
  ServerProcess server({"--metrics_tls", "--tls_cert_file=" + tls + "hstu-test-server-1.crt",
                        "--tls_key_file=" + tls + "hstu-test-server-1.key"});
  ASSERT_GT(server.metrics_port(), 0) << server.proc().Log();
  EXPECT_NE(server.proc().Log().find("serving Prometheus text format on https://"),
            std::string::npos)
      << server.proc().Log();
  // Prometheus verifies the server against the test CA (the certificate names 127.0.0.1);
  // count(hstu_build_info{job="hstu"}), URL-encoded: 1 once a scrape over HTTPS succeeded.
  PrometheusValue(server.metrics_port(),
                  absl::StrCat("    scheme: https\n    tls_config:\n      ca_file: ", tls,
                               "test-ca.crt\n"),
                  "count(hstu_build_info%7Bjob%3D%22hstu%22%7D)", 1);
}

}  // namespace
}  // namespace hstu::testing
