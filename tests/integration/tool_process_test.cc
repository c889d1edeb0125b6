// The client programs as real processes against hstu_server on loopback: hstu_loadgen's runs,
// failures and reports, parity with hstu_rank, hstu_rank's and hstu_model's input errors.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
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
#include "tests/util/tolerance.h"

namespace hstu::testing {
namespace {

using namespace std::chrono_literals;

TEST(ProcessTest, LoadgenShortRunsReportZeroErrors) {
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  const std::string dir = TempDir();
  const auto [rc, out] = RunCommand(absl::StrCat(
      HSTU_LOADGEN_BIN, " --target=", server.target(),
      // A fixed seed, and a deadline far from what these correctness checks time: one slow call
      // on a loaded, sanitized machine is not an error here.
      " --requests=300 --concurrency=1:4:x2 --warmup=0.2 --users=40 --seed=1 --timeout_ms=30000"
      " --progress=false --json=", dir,
      "/closed.json --csv=", dir, "/closed.csv"));
  ASSERT_EQ(rc, 0) << out;
  const auto j = nlohmann::json::parse(ReadFile(dir + "/closed.json"), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  ASSERT_EQ(j["levels"].size(), 3u);  // 1, 2, 4
  for (const auto& level : j["levels"]) {
    EXPECT_EQ(level["requests"].get<int64_t>(), 300) << out;
    EXPECT_TRUE(level["errors"].empty()) << level.dump();
    EXPECT_GT(level["throughput_rps"].get<double>(), 0);
    const auto& lat = level["latency_ms"];
    EXPECT_GT(lat["p50"].get<double>(), 0);
    EXPECT_LE(lat["p50"].get<double>(), lat["p90"].get<double>());
    EXPECT_LE(lat["p90"].get<double>(), lat["p99"].get<double>());
    EXPECT_LE(lat["p99"].get<double>(), lat["p999"].get<double>());
    // Returning users: most history tokens come from the cache.
    EXPECT_GT(level["reused_tokens"].get<int64_t>(), level["computed_tokens"].get<int64_t>());
    // Latency split by the server-reported cache result: shares add up to every OK request, and
    // returning users make GPU hits the largest group.
    int64_t split = 0;
    for (const auto& [name, r] : level["by_cache_result"].items()) split += r["requests"].get<int64_t>();
    EXPECT_EQ(split, 300) << level.dump();
    ASSERT_TRUE(level["by_cache_result"].contains("gpu_hit")) << level.dump();
    EXPECT_GT(level["by_cache_result"]["gpu_hit"]["share"].get<double>(), 0.5) << level.dump();
  }
  for (const char* key : {"throughput_rps", "latency_ms", "requests", "errors", "reused_tokens"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  const std::string csv = ReadFile(dir + "/closed.csv");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 4) << csv;  // header + 3 levels
  const std::vector<std::string> rows = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  const std::vector<std::string> header = absl::StrSplit(rows[0], ',');
  const auto col = std::find(header.begin(), header.end(), "requests_by_cache_result") - header.begin();
  ASSERT_LT(col, static_cast<long>(header.size())) << rows[0];
  for (size_t i = 1; i < rows.size(); ++i) {
    const std::vector<std::string> row = absl::StrSplit(rows[i], ',');
    ASSERT_EQ(row.size(), header.size()) << rows[i];
    int64_t split = 0;  // "gpu_hit:250;miss:50": the cache results add up to the level's requests
    for (absl::string_view pair : absl::StrSplit(row[col], ';')) {
      int64_t n = 0;
      ASSERT_TRUE(absl::SimpleAtoi(pair.substr(pair.find(':') + 1), &n)) << row[col];
      split += n;
    }
    EXPECT_EQ(split, 300) << rows[i];
  }

  // Open loop at a constant rate for 1 s: about that many requests, all OK. 150 rps, or half of
  // what one caller reached above where that is less (a sanitizer build serves far slower, and an
  // open loop past the server's rate only measures its queue).
  const int64_t rate = std::clamp<int64_t>(
      static_cast<int64_t>(j["levels"][0]["throughput_rps"].get<double>() / 2), 20, 150);
  const auto [rc2, out2] = RunCommand(absl::StrCat(
      HSTU_LOADGEN_BIN, " --target=", server.target(), " --rate=", rate,
      " --arrival=constant --duration=1 --warmup=0.2 --seed=1 --timeout_ms=30000"
      " --progress=false --json=", dir,
      "/open.json"));
  ASSERT_EQ(rc2, 0) << out2;
  const auto o = nlohmann::json::parse(ReadFile(dir + "/open.json"), nullptr, false);
  ASSERT_FALSE(o.is_discarded());
  EXPECT_TRUE(o["errors"].empty()) << out2;
  EXPECT_NEAR(o["requests"].get<int64_t>(), rate, 3) << out2;
  // Every measured slot's call was sent (none skipped as backlog), and the report has the
  // sender's lag behind its schedule (its size depends on the machine's load).
  const auto& level = o["levels"][0];
  EXPECT_EQ(level["sent"].get<int64_t>(), o["requests"].get<int64_t>()) << out2;
  EXPECT_TRUE(level["sender_lag_ms"].contains("p99")) << out2;
  EXPECT_NE(out2.find("open-loop sender"), std::string::npos) << out2;
  // The server saw them all.
  auto body = HttpGet(server.metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok());
  auto expo = ParseExposition(*body);
  ASSERT_TRUE(expo.ok());
  EXPECT_GE(expo->Sum("hstu_requests_total", {{"code", "OK"}}), 900 + rate - 5);
  EXPECT_EQ(expo->Sum("hstu_requests_total") - expo->Sum("hstu_requests_total", {{"code", "OK"}}), 0);
}

TEST(ProcessTest, LoadgenDrivesAServerOverMutualTls) {
  const std::string tls = absl::StrCat(HSTU_SOURCE_DIR, "/tests/data/tls/");
  ServerProcess server({"--tls_cert_file=" + tls + "hstu-test-server-1.crt",
                        "--tls_key_file=" + tls + "hstu-test-server-1.key",
                        "--tls_client_ca_file=" + tls + "test-ca.crt"});
  ASSERT_NE(server.target(), "127.0.0.1:0") << server.proc().Log();
  const std::string dir = TempDir();
  const std::string run = absl::StrCat(
      HSTU_LOADGEN_BIN, " --target=", server.target(), " --wait_ready_s=30 --requests=100",
      " --concurrency=2 --warmup=0 --users=20 --timeout_ms=30000 --progress=false",
      " --tls_ca_file=", tls, "test-ca.crt");
  const auto [rc, out] = RunCommand(absl::StrCat(run, " --tls_cert_file=", tls,
                                                 "hstu-test-client.crt --tls_key_file=", tls,
                                                 "hstu-test-client.key --json=", dir, "/tls.json"));
  ASSERT_EQ(rc, 0) << out << server.proc().Log();
  const auto j = nlohmann::json::parse(ReadFile(dir + "/tls.json"), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["levels"][0]["requests"].get<int64_t>(), 100) << out;
  EXPECT_TRUE(j["levels"][0]["errors"].empty()) << out;
  // Without a client certificate, or without TLS, the server is never reached.
  for (const std::string& wrong : {run, absl::StrCat(HSTU_LOADGEN_BIN, " --target=", server.target(),
                                                     " --progress=false")}) {
    const auto [rc2, out2] = RunCommand(absl::StrCat(wrong, " --wait_ready_s=1 --requests=1"));
    EXPECT_EQ(rc2, 1) << out2;
    EXPECT_NE(out2.find("server not SERVING after 1 s"), std::string::npos) << out2;
  }
  // SIGTERM: a clean exit removes the private copy of the key (the log names it).
  std::smatch copy;
  const std::string log = server.proc().Log();
  ASSERT_TRUE(std::regex_search(log, copy, std::regex(R"(checked copies in (\S+))"))) << log;
  ASSERT_TRUE(std::filesystem::exists(copy[1].str())) << copy[1];
  server.proc().Signal(SIGTERM);
  EXPECT_EQ(server.proc().Wait(std::chrono::seconds(30)), 0) << server.proc().Log();
  EXPECT_FALSE(std::filesystem::exists(copy[1].str())) << copy[1];
  // The refused handshakes are in the log through spdlog (server/grpc_log.h), not in gRPC's own
  // format: at most 5 lines of a kind, the rest summed up by the end.
  const std::string final_log = server.proc().Log();
  EXPECT_FALSE(std::regex_search(final_log, std::regex(R"((^|\n)[EIDW]\d{4} )"))) << final_log;
  std::map<std::string, int> per_kind;
  const std::regex grpc_line(R"(\[error\] grpc-core: ([^\n]*\(\w+\.cc:\d+\))\n)");
  for (auto it = std::sregex_iterator(final_log.begin(), final_log.end(), grpc_line);
       it != std::sregex_iterator(); ++it) {
    if ((*it)[1].str().find("more line") == std::string::npos) ++per_kind[(*it)[1].str()];
  }
  // Each wrong client's refusal (no certificate; plaintext) is there, with its own cause.
  EXPECT_GE(per_kind.size(), 2u) << final_log;
  for (const auto& [kind, lines] : per_kind) EXPECT_LE(lines, 5) << kind << "\n" << final_log;
  EXPECT_NE(final_log.find("more lines like this were not written"), std::string::npos)
      << final_log;
  // The TLS flags' own errors come before any connection.
  ExpectEachFlagRejected(
      absl::StrCat(HSTU_LOADGEN_BIN, " --target=127.0.0.1:1"),
      {{"--tls_server_name=x", "--tls_server_name needs TLS"},
       {absl::StrCat("--tls_cert_file=", tls, "hstu-test-client.crt"),
        "--tls_cert_file and --tls_key_file go together"},
       {"--tls_ca_file=/nonexistent/ca.crt", "--tls_ca_file=/nonexistent/ca.crt: cannot read it"},
       {absl::StrCat("--tls_ca_file=", tls, "hstu-test-client.key"), "no PEM certificate in it"},
       {absl::StrCat("--tls_cert_file=", tls, "hstu-test-client.crt --tls_key_file=", tls,
                     "hstu-test-server-1.key"),
        "not the key of the certificate in --tls_cert_file="}},
      2);
}

TEST(ProcessTest, LoadgenFailsOnBadFlagsAndWhenNoRequestSucceeds) {
  // A bad flag fails before connecting (no server at port 1), naming the flag.
  ExpectEachFlagRejected(absl::StrCat(HSTU_LOADGEN_BIN, " --target=127.0.0.1:1"),
                         {{"--duration=-1", "--duration=-1: must be > 0"},
                          {"--timeout_ms=0", "--timeout_ms=0: must be in [1, 86400000]"},
                          {"--requests=-3", "--requests=-3: must be >= 0"},
                          {"--arrival=weird", "--arrival=weird: want constant or poisson"},
                          {"--rate=nan", "--rate=nan: want R or R1,R2 (each in [0.001, 1e+07]"},
                          // Before: accepted, then overflowing (every call DEADLINE_EXCEEDED at
                          // once), a zero-length window, a run that never ended, 16 GB of levels.
                          {"--timeout_ms=9223372036854775807", "--timeout_ms=9223372036854775807: must be in [1, 86400000]"},
                          {"--duration=inf", "--duration=inf: must be > 0 and at most 86400"},
                          {"--rate=1e-300", "--rate=1e-300: want R or R1,R2"},
                          {"--concurrency=1:1000000:+1", "--concurrency=1:1000000:+1: want N"},
                          {"--max_error_rate=2", "--max_error_rate=2: must be in [0, 1]"},
                          // Before: gRPC took the port modulo 65536 and loaded another one.
                          {"--target=127.0.0.1:112646", "--target=127.0.0.1:112646: must be HOST:PORT with a port in [1, 65535]"},
                          {"--target=127.0.0.1:-18426", "--target=127.0.0.1:-18426: must be HOST:PORT"},
                          {"--target=", "--target=: must be HOST:PORT"},
                          {"--target=localhost", "--target=localhost: must be HOST:PORT"},
                          {"--target=[::1]", "--target=[::1]: must be HOST:PORT"},
                          {"--target=dns:///127.0.0.1:112646", "--target=dns:///127.0.0.1:112646: must be HOST:PORT"},
                          {"--target=ipv4:127.0.0.1:1,127.0.0.1:99999", "must be HOST:PORT with a port in [1, 65535]"},
                          // Before: found only after the whole run.
                          {"--json=/nonexistent/dir/r.json", "--json=/nonexistent/dir/r.json: directory /nonexistent/dir is missing"},
                          {"--record=/nonexistent/dir/a.jsonl", "--record=/nonexistent/dir/a.jsonl: directory /nonexistent/dir is missing"},
                          {"--record=/tmp", "--record=/tmp: is a directory"},
                          // Before: the second file written over the first, the recording
                          // over the file being replayed.
                          {"--json=/tmp/hstu_lg_same --csv=/tmp/hstu_lg_same", "--csv=/tmp/hstu_lg_same: the same file as --json=/tmp/hstu_lg_same"},
                          {"--replay=/tmp/hstu_lg_rec.jsonl --record=/tmp/./hstu_lg_rec.jsonl", "--replay=/tmp/hstu_lg_rec.jsonl: the same file as --record=/tmp/./hstu_lg_rec.jsonl"},
                          {"--record_every=0 --record=/tmp/a.jsonl", "--record_every=0: must be >= 1"},
                          {"--record_every=3", "--record_every=3: needs --record=FILE"},
                          // The traffic model's flags too (before: checked after connecting).
                          {"--users=0", "--users=0: must be in [1, 100000000]"},
                          {"--zipf=nan", "--zipf=nan: must be finite and >= 0"},
                          {"--new_user_rate=1.5", "--new_user_rate=1.5: must be in [0, 1]"},
                          {"--new_events=2 --new_events_min=3", "--new_events=2: must be >= --new_events_min (3)"},
                          {"--initial_events=4 --initial_events_min=5", "--initial_events=4: must be >= --initial_events_min (5)"},
                          {"--initial_events=64 --max_events=32", "--max_events=32: must be >= --initial_events (64)"},
                          // Before: 2.4 GB of channels and no output; std::bad_alloc (exit 134).
                          {"--connections=2000000000", "--connections=2000000000: must be in [1, 1024]"},
                          {"--candidates=2000000000", "--candidates=2000000000: must be >= 0 (0: the model's candidates per forward) and at most 1048576"},
                          {"--initial_events=2000000000", "--initial_events=2000000000: must be >= 0 (0: half the model's maximum) and at most 1048576"},
                          // Before: "false" was dropped and the progress line printed.
                          {"--progress false", "error: unexpected argument 'false'"},
                          // The dashed spelling names the same flag.
                          {"--timeout-ms=0", "--timeout_ms=0: must be in [1, 86400000]"}},
                         2);
  // Every request rejected (more candidates than the server takes): the report is printed, and
  // the exit status says that nothing was measured.
  ServerProcess server({"--max_candidates=4"});
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  const std::string dir = TempDir();
  const auto [rc, out] = RunCommand(absl::StrCat(HSTU_LOADGEN_BIN, " --target=", server.target(),
                                                 " --candidates=8 --requests=20 --warmup=0 --progress=false --csv=",
                                                 dir, "/fail.csv"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("INVALID_ARGUMENT:20"), std::string::npos) << out;
  // The CSV has the errors by code too (DESIGN §10), in a column of its own.
  std::vector<std::string> rows = absl::StrSplit(ReadFile(dir + "/fail.csv"), '\n', absl::SkipEmpty());
  ASSERT_EQ(rows.size(), 2u);
  const std::vector<std::string> header = absl::StrSplit(rows[0], ','), row = absl::StrSplit(rows[1], ',');
  ASSERT_EQ(header.size(), row.size()) << rows[1];
  const auto col = std::find(header.begin(), header.end(), "errors_by_code") - header.begin();
  ASSERT_LT(col, static_cast<long>(header.size())) << rows[0];
  EXPECT_EQ(row[col], "INVALID_ARGUMENT:20");
  EXPECT_NE(out.find("no request succeeded at c=8 (20 errors)"), std::string::npos) << out;
  // By default the loadgen sends what the server accepts: 4 candidates here, not the model's 64
  // a forward.
  const auto [rc2, out2] = RunCommand(absl::StrCat(HSTU_LOADGEN_BIN, " --target=", server.target(),
                                                   " --requests=20 --warmup=0 --seed=1"
                                                   " --timeout_ms=30000 --progress=false"));
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find(", 4 candidates,"), std::string::npos) << out2;
  // Without a warm-up every call sent is a call counted: the server saw exactly the 20 + 20
  // (before: each caller's first call went out before the window opened, uncounted).
  auto body = HttpGet(server.metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok());
  auto expo = ParseExposition(*body);
  ASSERT_TRUE(expo.ok());
  EXPECT_EQ(expo->Sum("hstu_requests_total", {{"code", "INVALID_ARGUMENT"}}), 20) << *body;
  EXPECT_EQ(expo->Sum("hstu_requests_total", {{"code", "OK"}}), 20) << *body;
}

TEST(ProcessTest, LoadgenReportsWhatItMeasuredWhenStoppedAndFailsWhenTheServerDies) {
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  const std::string dir = TempDir();
  // Waits (60 s at most) until `done` holds; the steps below follow the programs' progress, not
  // the clock, so a slow sanitizer build or a loaded machine only makes them wait longer.
  auto wait_for = [](const std::function<bool()>& done) {
    for (int i = 0; i < 3000 && !done(); ++i) std::this_thread::sleep_for(20ms);
    return done();
  };
  const auto ok_answers = [&]() -> double {
    const auto body = HttpGet(server.metrics_port(), "/metrics");
    if (!body.ok()) return -1;
    const auto expo = ParseExposition(*body);
    return expo.ok() ? expo->Sum("hstu_requests_total", {{"code", "OK"}}) : -1;
  };
  // A stop signal in the middle of a sweep: the levels measured so far are printed and written,
  // the one cut short marked (before: exit 143, no table, no file). The report is rewritten after
  // each level, before the next starts; without a warm-up every call of the second level is
  // measured. The signal goes once the server has answered three more calls after the first
  // report appeared: with two callers, one of them then had its first answer back and sent
  // again, so the second level has measured an answer (before: a fixed 0.6 s, which a loaded
  // machine's 1 s calls outlasted).
  {
    const std::string json = dir + "/stopped.json";
    Subprocess loadgen({HSTU_LOADGEN_BIN, absl::StrCat("--target=", server.target()),
                        "--concurrency=1,2,4", "--duration=6", "--warmup=0", "--seed=1",
                        "--timeout_ms=30000", "--progress=false",
                        absl::StrCat("--json=", json)},
                       dir + "/loadgen_stopped.log");
    ASSERT_TRUE(wait_for([&] { return !ReadFile(json).empty(); })) << loadgen.Log();
    const double first_level_done = ok_answers();
    ASSERT_GE(first_level_done, 1);
    ASSERT_TRUE(wait_for([&] { return ok_answers() >= first_level_done + 3; })) << loadgen.Log();
    // Twice at once, as timeout(1) sends it (to the process, then to its group): one stop
    // (before: the second ended the process, with no report, in about one run of three).
    loadgen.Signal(SIGTERM);
    loadgen.Signal(SIGTERM);
    EXPECT_EQ(loadgen.Wait(30s), 1) << loadgen.Log();
    EXPECT_NE(loadgen.Log().find("stopped by a signal after 2 of 3 levels"), std::string::npos)
        << loadgen.Log();
    const nlohmann::json report = nlohmann::json::parse(ReadFile(json));
    EXPECT_TRUE(report["interrupted"].get<bool>()) << report.dump();
    EXPECT_EQ(report["levels_planned"].get<int>(), 3) << report.dump();
    ASSERT_EQ(report["levels"].size(), 2u) << report.dump();
    EXPECT_FALSE(report["levels"][0]["interrupted"].get<bool>()) << report.dump();
    EXPECT_TRUE(report["levels"][1]["interrupted"].get<bool>()) << report.dump();
    EXPECT_GT(report["levels"][1]["requests"].get<int64_t>(), 0) << report.dump();
    // The calls that the signal cancelled are not the server's answers: no CANCELLED errors.
    EXPECT_EQ(report["levels"][1]["error_count"].get<int64_t>(), 0) << report.dump();
  }
  // The server dies mid-level: the callers back off instead of spinning through failed calls
  // (before: ~48,000 UNAVAILABLE a second), and the exit status says the run failed (before: 0,
  // with 99 % of the calls failed). It is killed once it has answered some of the level's calls.
  const double before = ok_answers();
  ASSERT_GT(before, 0);  // the first part's
  const auto answered = [&] { return ok_answers() > before + 10; };
  Subprocess loadgen({HSTU_LOADGEN_BIN, absl::StrCat("--target=", server.target()),
                      "--concurrency=4", "--duration=8", "--warmup=0", "--seed=1", "--progress=false",
                      absl::StrCat("--json=", dir, "/died.json")},
                     dir + "/loadgen_died.log");
  ASSERT_TRUE(wait_for(answered)) << loadgen.Log();
  ASSERT_LT(loadgen.Wait(0ms), 0) << "the level ended before the server was killed\n" << loadgen.Log();
  server.proc().Signal(SIGKILL);
  EXPECT_EQ(loadgen.Wait(60s), 1) << loadgen.Log();
  EXPECT_NE(loadgen.Log().find("above --max_error_rate"), std::string::npos) << loadgen.Log();
  const nlohmann::json died = nlohmann::json::parse(ReadFile(dir + "/died.json"));
  EXPECT_GT(died["levels"][0]["errors"].value("UNAVAILABLE", int64_t{0}), 0) << died.dump();
  EXPECT_LT(died["levels"][0]["error_count"].get<int64_t>(), 1000) << died.dump();
}

TEST(ProcessTest, LoadgenBacksOffAFullQueue) {
  // Every request is larger than the queue's token budget: RESOURCE_EXHAUSTED at once, every
  // time. The callers back off as after UNAVAILABLE (before: they spun, ~800 refusals a second
  // at 8 callers on a CPU server with a queue of 6).
  ServerProcess server({"--max_queued_tokens=10"});
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  const std::string dir = TempDir();
  const auto [rc, out] = RunCommand(absl::StrCat(
      HSTU_LOADGEN_BIN, " --target=", server.target(),
      " --concurrency=4 --duration=2 --warmup=0 --progress=false --max_error_rate=1"
      " --initial_events_min=50 --initial_events=50 --json=", dir, "/full.json"));
  EXPECT_EQ(rc, 0) << out;
  const nlohmann::json report = nlohmann::json::parse(ReadFile(dir + "/full.json"));
  const int64_t refused = report["levels"][0]["errors"].value("RESOURCE_EXHAUSTED", int64_t{0});
  EXPECT_GT(refused, 0) << report.dump();
  EXPECT_LT(refused, 1000) << report.dump();  // about 25 a caller at most
}

TEST(ProcessTest, ScoresEqualHstuRankForTheSameRequests) {
  // Returning users with growing and one edited history, 100 candidates (chunked by 64).
  std::vector<hstu::v1::RankRequest> reqs;
  const auto a = MakeRequest(11, 90, 100, 3), b = MakeRequest(12, 50, 7, 4);
  auto prefix = [](hstu::v1::RankRequest r, int n) {
    r.mutable_history_item_ids()->Truncate(n);
    r.mutable_history_actions()->Truncate(n);
    return r;
  };
  reqs = {prefix(a, 20), prefix(b, 50), prefix(a, 60), prefix(a, 90), prefix(b, 30), prefix(a, 90)};
  const std::string dir = TempDir();
  {
    std::ofstream f(dir + "/requests.jsonl");
    for (const auto& r : reqs) {
      nlohmann::json j;
      j["user_id"] = r.user_id();
      j["history_item_ids"] = std::vector<int64_t>(r.history_item_ids().begin(), r.history_item_ids().end());
      j["history_actions"] = std::vector<int32_t>(r.history_actions().begin(), r.history_actions().end());
      j["candidate_item_ids"] = std::vector<int64_t>(r.candidate_item_ids().begin(), r.candidate_item_ids().end());
      f << j.dump() << "\n";
    }
  }
  const auto [rc, out] = RunCommand(absl::StrCat("{ ", HSTU_RANK_BIN, " --model=random:tiny --device=cpu --input=",
                                                 dir, "/requests.jsonl 2>/dev/null; }"));
  ASSERT_EQ(rc, 0) << out;
  std::vector<nlohmann::json> ref;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("scores")) ref.push_back(j);
  }
  ASSERT_EQ(ref.size(), reqs.size()) << out;

  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  auto stub = hstu::v1::Ranker::NewStub(server.channel());
  for (size_t i = 0; i < reqs.size(); ++i) {
    grpc::ClientContext ctx;
    hstu::v1::RankResponse resp;
    ASSERT_TRUE(stub->Rank(&ctx, reqs[i], &resp).ok());
    const auto& scores = ref[i]["scores"];
    ASSERT_EQ(scores.size() * resp.num_tasks(), static_cast<size_t>(resp.scores_size())) << i;
    for (size_t c = 0; c < scores.size(); ++c) {
      for (size_t t = 0; t < resp.num_tasks(); ++t) {
        EXPECT_FLOAT_EQ(resp.scores(static_cast<int>(c * resp.num_tasks() + t)),
                        scores[c][t].get<float>())
            << "request " << i << " candidate " << c << " task " << t;
      }
    }
    EXPECT_EQ(resp.reused_tokens(), ref[i]["reused_tokens"].get<uint32_t>()) << i;
    EXPECT_EQ(resp.computed_tokens(), ref[i]["computed_tokens"].get<uint32_t>()) << i;
  }
}

// --record to a FIFO without a reader is an error at once (before: a blocking open that hung,
// and a stop signal could not end); to a pipe whose reader leaves, a failed write reported at
// the end, with the reports still written (before: killed by SIGPIPE, exit 141, no report).
TEST(ProcessTest, LoadgenRecordingToAFifoWithoutAReaderOrAPipeThatCloses) {
  ServerProcess server;
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  const std::string dir = TempDir();
  const std::string fifo = dir + "/answers.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::string loadgen = absl::StrCat(HSTU_LOADGEN_BIN, " --target=", server.target(),
                                           " --concurrency=2 --seed=4 --timeout_ms=60000");
  const auto [rc, out] =
      RunCommand(absl::StrCat("timeout 20 ", loadgen, " --duration=1 --record=", fifo));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("--record=" + fifo + ": cannot create it: no process reads it"),
            std::string::npos)
      << out;
  // A reader that opens the FIFO a moment after the load generator does is waited for (here
  // through a dns:/// target, which --target accepts with its port checked).
  const auto [rc_late, out_late] = RunCommand(absl::StrCat(
      "bash -c '(sleep 1; cat ", fifo, " >", dir, "/got) & ", HSTU_LOADGEN_BIN, " --target=dns:///",
      server.target(), " --concurrency=2 --seed=4 --timeout_ms=60000 --duration=1 --record=", fifo,
      "; rc=$?; wait; exit $rc'"));
  EXPECT_EQ(rc_late, 0) << out_late;
  EXPECT_NE(ReadFile(dir + "/got").find("\"expected_scores\""), std::string::npos) << out_late;
  const auto [rc_pipe, out_pipe] = RunCommand(absl::StrCat(
      "bash -c 'set -o pipefail; ", loadgen, " --duration=2 --record=/dev/stdout --json=", dir,
      "/r.json 2>", dir, "/err | head -c 100 >/dev/null'"));
  const std::string err = ReadFile(dir + "/err");
  EXPECT_EQ(rc_pipe, 1) << out_pipe << err;
  EXPECT_NE(err.find("--record=/dev/stdout: writing failed (Broken pipe), the recording is "
                     "incomplete"),
            std::string::npos)
      << err;
  const auto report = nlohmann::json::parse(ReadFile(dir + "/r.json"), nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << err;
  EXPECT_GT(report["levels"][0]["requests"].get<int64_t>(), 0) << report.dump();
}

TEST(ProcessTest, LoadgenRecordsAnswersThatHstuRankRecomputesWithoutTheCache) {
  // A pool and a host tier far smaller than the 120 users: GPU hits, host hits, hash mismatches
  // (edited histories) and misses, each answer recorded with its scores. hstu_rank recomputes
  // every line from its whole history: on the CPU the cache's reuse gives the same scores.
  ServerProcess server({"--cache_pages=40", "--host_cache_pages=80"});
  ASSERT_TRUE(server.WaitServing()) << server.proc().Log();
  const std::string dir = TempDir();
  const auto [rc, out] = RunCommand(absl::StrCat(
      HSTU_LOADGEN_BIN, " --target=", server.target(),
      " --requests=400 --concurrency=4 --warmup=0.2 --users=120 --seed=5 --timeout_ms=30000"
      " --progress=false --record=", dir, "/answers.jsonl"));
  ASSERT_EQ(rc, 0) << out;
  // Every OK answer the server gave, warm-up included, and no other line.
  auto body = HttpGet(server.metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok());
  auto expo = ParseExposition(*body);
  ASSERT_TRUE(expo.ok());
  const int64_t answered = static_cast<int64_t>(expo->Sum("hstu_requests_total", {{"code", "OK"}}));
  EXPECT_NE(out.find(absl::StrCat("recorded ", answered, " answers to ")), std::string::npos)
      << answered << " " << out;
  const std::string recorded = ReadFile(dir + "/answers.jsonl");
  EXPECT_EQ(std::count(recorded.begin(), recorded.end(), '\n'), answered);
  std::map<std::string, int> results;
  for (absl::string_view line : absl::StrSplit(recorded, '\n', absl::SkipEmpty())) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << line;
    ++results[j.value("cache_result", "")];
  }
  for (const char* result : {"gpu_hit", "host_hit", "miss"}) {
    EXPECT_GT(results[result], 0) << result << " " << recorded.size();
  }

  // Its report and errors (stderr) only.
  auto rank = [&](const std::string& input_and_flags) {
    return RunCommand(absl::StrCat("{ ", HSTU_RANK_BIN, " --model=random:tiny --device=cpu --no_cache --input=",
                                   dir, input_and_flags, " >/dev/null; }"));
  };
  const auto [rc2, out2] = rank("/answers.jsonl");
  EXPECT_EQ(rc2, 0) << out2;
  // fp32 on both sides, but not bit for bit: BLAS sums a row in an order that can depend on how
  // many rows its call has (OpenBLAS on AMD Zen 5 does), and a batch or a cached suffix has other
  // row counts than hstu_rank's one request. A wrong reuse moves scores by ~1e-2.
  std::smatch largest;
  ASSERT_TRUE(std::regex_search(out2, largest,
                                std::regex(absl::StrCat(answered, " lines checked against "
                                                        "expected_scores: largest difference (\\S+) "))))
      << out2;
  EXPECT_LE(std::stod(largest[1].str()), hstu::test::kF32Abs) << out2;

  // One score changed by 0.01 and one candidate's scores dropped: both lines fail, named.
  std::vector<std::string> lines = absl::StrSplit(recorded, '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 10u);
  auto edit = [&](size_t i, const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = nlohmann::json::parse(lines[i]);
    change(j);
    lines[i] = j.dump();
  };
  edit(3, [](nlohmann::json& j) { j["expected_scores"][0][1] = j["expected_scores"][0][1].get<double>() + 0.01; });
  edit(7, [](nlohmann::json& j) { j["expected_scores"].erase(j["expected_scores"].size() - 1); });
  {
    std::ofstream f(dir + "/edited.jsonl");
    for (size_t i = 0; i < 10; ++i) f << lines[i] << "\n";
  }
  const auto [rc3, out3] = rank("/edited.jsonl");
  EXPECT_EQ(rc3, 1) << out3;
  EXPECT_NE(out3.find("line 4: user "), std::string::npos) << out3;
  EXPECT_NE(out3.find("candidate 0 task 1 scored"), std::string::npos) << out3;
  EXPECT_NE(out3.find("above --max_score_diff=0.002"), std::string::npos) << out3;
  EXPECT_NE(out3.find("line 8: field 'expected_scores' has 63 rows for 64 candidates"),
            std::string::npos)
      << out3;
  EXPECT_NE(out3.find("9 lines checked against expected_scores: largest difference 0.01 (line 4), mean "),
            std::string::npos)
      << out3;
  EXPECT_NE(out3.find("; 1 above --max_score_diff=0.002"), std::string::npos) << out3;
  // The same lines pass with a tolerance above the change.
  const auto [rc4, out4] = rank("/edited.jsonl --max_score_diff=0.02");
  EXPECT_EQ(rc4, 1) << out4;  // line 8's shape is still wrong
  EXPECT_NE(out4.find("; 0 above --max_score_diff=0.02"), std::string::npos) << out4;

  // Every 3rd answer only.
  ServerProcess second;
  ASSERT_TRUE(second.WaitServing()) << second.proc().Log();
  const auto [rc5, out5] = RunCommand(absl::StrCat(
      HSTU_LOADGEN_BIN, " --target=", second.target(),
      " --requests=50 --concurrency=1 --warmup=0 --users=20 --seed=5 --timeout_ms=30000"
      " --progress=false --record_every=3 --record=", dir, "/every3.jsonl"));
  ASSERT_EQ(rc5, 0) << out5;
  const std::string every3 = ReadFile(dir + "/every3.jsonl");
  EXPECT_EQ(std::count(every3.begin(), every3.end(), '\n'), 17) << out5;  // answers 1, 4, ..., 49
  EXPECT_NE(out5.find("recorded 17 answers"), std::string::npos) << out5;
  // A run that cannot reach its server leaves an earlier recording as it was.
  const auto [rc6, out6] = RunCommand(absl::StrCat(HSTU_LOADGEN_BIN, " --target=127.0.0.1:1 --requests=5",
                                                   " --progress=false --record=", dir, "/every3.jsonl"));
  EXPECT_EQ(rc6, 1) << out6;
  EXPECT_EQ(ReadFile(dir + "/every3.jsonl"), every3);
}

// A recorded run replayed into a fresh server of the same model, one caller at a time, is the
// same traffic: every answer, its scores and how the cache served it, equal the recording's.
TEST(ProcessTest, LoadgenReplaysARecordingIntoTheSameAnswers) {
  const std::string dir = TempDir();
  auto run = [&](const ServerProcess& server, const std::string& flags) {
    return RunCommand(absl::StrCat(HSTU_LOADGEN_BIN, " --target=", server.target(),
                                   " --concurrency=1 --warmup=0 --timeout_ms=30000 --progress=false ",
                                   flags));
  };
  ServerProcess first({"--cache_pages=40"});
  ASSERT_TRUE(first.WaitServing()) << first.proc().Log();
  const auto [rc, out] =
      run(first, absl::StrCat("--requests=60 --users=15 --seed=9 --record=", dir, "/first.jsonl"));
  ASSERT_EQ(rc, 0) << out;
  const std::string recorded = ReadFile(dir + "/first.jsonl");
  ASSERT_EQ(std::count(recorded.begin(), recorded.end(), '\n'), 60);

  ServerProcess second({"--cache_pages=40"});
  ASSERT_TRUE(second.WaitServing()) << second.proc().Log();
  const auto [rc2, out2] = run(second, absl::StrCat("--requests=60 --replay=", dir, "/first.jsonl",
                                                     " --record=", dir, "/second.jsonl --json=",
                                                     dir, "/second.json"));
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_EQ(ReadFile(dir + "/second.jsonl"), recorded);
  EXPECT_NE(out2.find(absl::StrCat("replaying ", dir, "/first.jsonl (60 lines, ")),
            std::string::npos)
      << out2;
  const auto report = nlohmann::json::parse(ReadFile(dir + "/second.json"), nullptr, false);
  ASSERT_FALSE(report.is_discarded());
  EXPECT_EQ(report["replay"]["lines"], 60);
  EXPECT_EQ(report["replay"]["passes"], 0);
  EXPECT_FALSE(report.contains("zipf"));

  // At four callers the batches differ, but each user's visits still reach the server one at a
  // time and in the file's order: with a pool that holds every user, each user's answers have the
  // same histories and cache results, in the same order, as at one caller.
  auto per_user = [](const std::string& jsonl) {
    std::map<uint64_t, std::vector<std::string>> users;
    for (absl::string_view line : absl::StrSplit(jsonl, '\n', absl::SkipEmpty())) {
      const auto j = nlohmann::json::parse(line);
      users[j["user_id"].get<uint64_t>()].push_back(
          absl::StrCat(j["history_item_ids"].size(), " ", j["cache_result"].get<std::string>()));
    }
    return users;
  };
  ServerProcess one;
  ServerProcess four;
  ASSERT_TRUE(one.WaitServing()) << one.proc().Log();
  ASSERT_TRUE(four.WaitServing()) << four.proc().Log();
  const auto [rc6, out6] = run(one, absl::StrCat("--requests=60 --replay=", dir,
                                                 "/first.jsonl --record=", dir, "/one.jsonl"));
  ASSERT_EQ(rc6, 0) << out6;
  const auto [rc7, out7] = run(four, absl::StrCat("--requests=60 --replay=", dir,
                                                  "/first.jsonl --record=", dir, "/four.jsonl",
                                                  " --concurrency=4"));
  ASSERT_EQ(rc7, 0) << out7;
  EXPECT_EQ(per_user(ReadFile(dir + "/four.jsonl")), per_user(ReadFile(dir + "/one.jsonl")));
  EXPECT_NE(out7.find("60 lines, "), std::string::npos) << out7;
  EXPECT_EQ(out7.find("went back"), std::string::npos) << out7;

  // Past the file's end it starts again, and says so.
  const auto [rc3, out3] =
      run(second, absl::StrCat("--requests=90 --replay=", dir, "/first.jsonl --json=", dir,
                               "/third.json"));
  ASSERT_EQ(rc3, 0) << out3;
  EXPECT_NE(out3.find("went back to its first line 1 time(s)"), std::string::npos) << out3;
  const auto third = nlohmann::json::parse(ReadFile(dir + "/third.json"), nullptr, false);
  ASSERT_FALSE(third.is_discarded());
  EXPECT_EQ(third["replay"]["passes"], 1);

  // A traffic-model flag with --replay, and a file that does not parse: exit 2, named.
  const auto [rc4, out4] =
      run(second, absl::StrCat("--requests=5 --zipf=2 --replay=", dir, "/first.jsonl"));
  EXPECT_EQ(rc4, 2) << out4;
  EXPECT_NE(out4.find("--zipf does not apply with --replay"), std::string::npos) << out4;
  {
    std::ofstream f(dir + "/bad.jsonl");
    f << recorded.substr(0, recorded.find('\n') + 1) << "{\"user_id\": -1}\n";
  }
  const auto [rc5, out5] = run(second, absl::StrCat("--requests=5 --replay=", dir, "/bad.jsonl"));
  EXPECT_EQ(rc5, 2) << out5;
  EXPECT_NE(out5.find(absl::StrCat(dir, "/bad.jsonl:2: field 'user_id'")), std::string::npos)
      << out5;
}

TEST(ProcessTest, HstuRankRejectsIntegersOutOfTheirFieldsRange) {
  // A value that does not fit its proto field is an error naming the field, never wrapped: action
  // 2^32 + 1 must not score as action 1. The whole uint64 range of user_id is accepted.
  const std::string dir = TempDir();
  {
    std::ofstream f(dir + "/requests.jsonl");
    f << R"({"user_id": 1, "history_item_ids": [5], "history_actions": [4294967297], "candidate_item_ids": [3]})" "\n"
      << R"({"user_id": 1, "history_item_ids": [18446744073709551615], "history_actions": [1], "candidate_item_ids": [3]})" "\n"
      << R"({"user_id": -3, "history_item_ids": [5], "history_actions": [1], "candidate_item_ids": [3]})" "\n"
      << R"({"user_id": 18446744073709551615, "history_item_ids": [5], "history_actions": [1], "candidate_item_ids": [3]})" "\n"
      // Before: "is not an integer" (the literal is read as a double), and "-0" out of range.
      << R"({"user_id": 18446744073709551616, "history_item_ids": [5], "history_actions": [1], "candidate_item_ids": [3]})" "\n"
      << R"({"user_id": -0, "history_item_ids": [5], "history_actions": [1], "candidate_item_ids": [3]})" "\n";
  }
  const auto [rc, out] = RunCommand(absl::StrCat("{ ", HSTU_RANK_BIN, " --model=random:tiny --device=cpu --input=",
                                                 dir, "/requests.jsonl 2>/dev/null; }"));
  EXPECT_EQ(rc, 1) << out;
  std::vector<nlohmann::json> lines;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    lines.push_back(nlohmann::json::parse(line, nullptr, false));
  }
  ASSERT_EQ(lines.size(), 6u) << out;
  EXPECT_EQ(lines[0].value("error", ""), "field 'history_actions[0]' = 4294967297 is out of the range of int32");
  EXPECT_EQ(lines[1].value("error", ""),
            "field 'history_item_ids[0]' = 18446744073709551615 is out of the range of int64");
  EXPECT_EQ(lines[2].value("error", ""), "field 'user_id' = -3 is out of the range of uint64");
  ASSERT_TRUE(lines[3].contains("scores")) << out;
  EXPECT_EQ(lines[3]["user_id"].get<uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(lines[4].value("error", ""),
            "field 'user_id' = 1.8446744073709552e+19 is not an integer in the range of uint64");
  ASSERT_TRUE(lines[5].contains("scores")) << out;
  EXPECT_EQ(lines[5]["user_id"].get<uint64_t>(), 0u);
}

TEST(ProcessTest, HstuRankNamesUnknownAndRepeatedFieldsAndJsonErrors) {
  // Before: a misspelt key was ignored (the request scored with no history, exit 0), a repeated
  // key kept its last value, and every syntax error read "not a JSON object".
  const std::string dir = TempDir();
  {
    std::ofstream f(dir + "/requests.jsonl");
    f << R"({"user_id": 1, "history_items": [1, 2], "history_action": [1, 2], "candidate_item_ids": [3]})" "\n"
      << R"({"user_id": 2, "user_id": 3, "history_item_ids": [], "history_actions": [], "candidate_item_ids": [3]})" "\n"
      << R"({"user_id": 4, "history_item_ids": [1], "history_actions": [1], "candidate_item_ids": [3]} x)" "\n"
      << R"([1, 2])" "\n"
      << R"({"user_id": 1e999, "history_item_ids": [], "history_actions": [], "candidate_item_ids": [3]})" "\n"
      // A syntax error beside non-ASCII text, and a byte that is not UTF-8: the error's quote
      // of the line cuts the character (before: the error line's dump threw, exit 134, and the
      // lines after were never scored).
      << "{\"user_id\": 7, \"history_item_ids\": [1\xc3\xa9]}\n"
      << "{\"user_id\": \"\xff\"}\n"
      << R"({"user_id": 5, "history_item_ids": [1], "history_actions": [1], "candidate_item_ids": [3]})" "\n";
  }
  const auto [rc, out] = RunCommand(absl::StrCat("{ ", HSTU_RANK_BIN,
                                                 " --model=random:tiny --device=cpu --input=", dir,
                                                 "/requests.jsonl 2>/dev/null; }"));
  EXPECT_EQ(rc, 1) << out;
  std::vector<nlohmann::json> lines;
  for (absl::string_view l : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    lines.push_back(nlohmann::json::parse(l, nullptr, false));
  }
  ASSERT_EQ(lines.size(), 8u) << out;
  EXPECT_EQ(lines[0].value("error", ""),
            "unknown field 'history_action' (the fields: user_id, history_item_ids, "
            "history_actions, candidate_item_ids, expected_scores, cache_result)");
  EXPECT_EQ(lines[1].value("error", ""), "field 'user_id' is given twice");
  EXPECT_NE(lines[2].value("error", "").find("not valid JSON: parse error at line 1, column"),
            std::string::npos)
      << lines[2];
  EXPECT_EQ(lines[3].value("error", ""), "not a JSON object");
  // A number past a double: nlohmann's out_of_range, which ended the process.
  EXPECT_NE(lines[4].value("error", "").find("not valid JSON: number overflow"), std::string::npos)
      << lines[4];
  for (int i : {5, 6}) {
    EXPECT_NE(lines[i].value("error", "").find("not valid JSON: parse error"), std::string::npos)
        << lines[i];
  }
  EXPECT_NE(lines[6].value("error", "").find("\xef\xbf\xbd"), std::string::npos)  // U+FFFD
      << lines[6];
  EXPECT_TRUE(lines[7].contains("scores")) << out;
  // As hstu_server: a pool that cannot hold one user of the longest history is refused up front
  // (before: a warning, then every long line failed and cut its user's cache).
  ExpectEachFlagRejected(
      absl::StrCat(HSTU_RANK_BIN, " --model=random:tiny --device=cpu --input=", dir,
                   "/requests.jsonl"),
      {{"--page_size=32 --cache_pages=3", "error: --cache_pages=3: the KV pool of 3 pages must hold one user"},
       {"--page_size=0", "error: --page_size=0: must be in [1, 4096]"},
       // Before: exit 1, as if the model could not be used.
       {"--cache_pages=-1", "error: --cache_pages=-1: must be in [0, 2147483647]"},
       {"--host_cache_pages=-2",
        "error: --host_cache_pages=-2: must be in [0, 2147483647], or -1 for auto"},
       {"--max_score_diff=-1", "error: --max_score_diff=-1: must be >= 0 (inf: report only)"},
       {"--max_score_diff=nan", "error: --max_score_diff=nan: must be >= 0 (inf: report only)"}},
      2);
  // The checked fields, malformed: each line an error naming the field.
  {
    std::ofstream f(dir + "/expected.jsonl");
    const std::string request = R"("user_id": 5, "history_item_ids": [1], "history_actions": [1], "candidate_item_ids": [3])";
    f << "{" << request << R"(, "expected_scores": 0.5})" "\n"
      << "{" << request << R"(, "expected_scores": [[0.5, "high", 0.5]]})" "\n"
      << "{" << request << R"(, "expected_scores": [0.5]})" "\n"
      << "{" << request << R"(, "expected_scores": [[0.5]]})" "\n"
      << "{" << request << R"(, "cache_result": 7})" "\n"
      << "{" << request << R"(, "expected_scores": [[0.5, 1e39, 0.5]]})" "\n"
      << "{" << request << R"(, "expected_scores": [[0.5, null, 0.5]]})" "\n";
  }
  const auto [rc2, out2] = RunCommand(absl::StrCat("{ ", HSTU_RANK_BIN,
                                                   " --model=random:tiny --device=cpu --input=", dir,
                                                   "/expected.jsonl 2>/dev/null; }"));
  EXPECT_EQ(rc2, 1) << out2;
  lines.clear();
  for (absl::string_view l : absl::StrSplit(out2, '\n', absl::SkipEmpty())) {
    lines.push_back(nlohmann::json::parse(l, nullptr, false));
  }
  ASSERT_EQ(lines.size(), 7u) << out2;
  EXPECT_EQ(lines[0].value("error", ""),
            "field 'expected_scores' must be an array of arrays of numbers, one per candidate");
  EXPECT_EQ(lines[1].value("error", ""), "field 'expected_scores[0][1]' is not a number");
  EXPECT_EQ(lines[2].value("error", ""),
            "field 'expected_scores[0]' must be an array of arrays of numbers, one per candidate");
  EXPECT_EQ(lines[3].value("error", ""),
            "field 'expected_scores[0]' has 1 scores for the model's 3 tasks");
  EXPECT_EQ(lines[4].value("error", ""), "field 'cache_result' must be a string");
  EXPECT_EQ(lines[5].value("error", ""), "field 'expected_scores[0][1]' = 1e+39 is out of the range of a float");
  EXPECT_EQ(lines[6].value("error", ""), "field 'expected_scores[0][1]' is not a number");
}

TEST(ProcessTest, HstuRankAndHstuModelFailLoudly) {
  const std::string dir = TempDir();
  {
    std::ofstream f(dir + "/requests.jsonl");
    f << R"({"user_id": 1, "history_item_ids": [5], "history_actions": [1], "candidate_item_ids": [3]})" "\n";
  }
  const std::string rank = absl::StrCat(HSTU_RANK_BIN, " --model=random:tiny --device=cpu ");
  // Before: each of these exited 0. A stray word (here a bool flag's value given apart from it,
  // which silently left --no-cache on); a directory as the input (no output at all); results
  // that could not be written.
  ExpectEachFlagRejected(rank, {{absl::StrCat("--input=", dir, "/requests.jsonl --no-cache false"),
                                 "error: unexpected argument 'false'"},
                                {absl::StrCat("--input=", dir), "is a directory"},
                                // Before: exit 1, as a device that is named right but absent.
                                {absl::StrCat("--input=", dir, "/requests.jsonl --device=cuda"),
                                 "--device=cuda: device 'cuda' is not one of cpu, cpu-bf16, cuda:N, auto"}},
                         2);
  const auto [rc, out] = RunCommand(
      absl::StrCat("{ ", rank, "--input=", dir, "/requests.jsonl >/dev/full; }"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("writing the results to stdout failed"), std::string::npos) << out;
  // A reader that goes away after one line: exit 1 with the same error (before: killed by
  // SIGPIPE, exit 141), and the rest of the input is not scored.
  {
    std::ofstream f(dir + "/many.jsonl");
    for (int i = 0; i < 3000; ++i) {
      f << R"({"user_id": 1, "history_item_ids": [5], "history_actions": [1], "candidate_item_ids": [3]})" "\n";
    }
  }
  const auto [rc_pipe, out_pipe] =
      RunCommand(absl::StrCat("bash -c 'set -o pipefail; ", rank, "--input=", dir,
                              "/many.jsonl 2>", dir, "/pipe.err | head -c 1 >/dev/null'"));
  EXPECT_EQ(rc_pipe, 1) << out_pipe << ReadFile(dir + "/pipe.err");
  EXPECT_NE(ReadFile(dir + "/pipe.err").find("writing the results to stdout failed"),
            std::string::npos);
  // hstu_model names what it did not understand (before: the usage text alone).
  ExpectEachFlagRejected(HSTU_MODEL_BIN, {{"init extra", "error: init takes flags only, not 'extra'"},
                                          {"infos x", "error: unknown command 'infos'"}},
                         2);
}

// An output path that cannot be written fails before the work, naming the flag and what is
// wrong (before: hstu_bench ran its benchmark, minutes on a GPU, and then could not write the
// results; hstu_model drew every weight first).
TEST(ProcessTest, OutputPathsAreCheckedBeforeTheWork) {
  const std::string dir = TempDir();
  const std::string missing = dir + "/missing/m.safetensors";
  ExpectEachFlagRejected(
      HSTU_MODEL_BIN,
      {{"init --preset=tiny --out=" + missing,
        "error: --out=" + missing + ": directory " + dir + "/missing is missing"},
       {"init --preset=tiny --out=" + dir, "error: --out=" + dir + ": is a directory"},
       {"init --preset=tiny --out=/dev/fd/0 </dev/null",
        "error: --out=/dev/fd/0: the descriptor is open for reading only"}},
      2);
  std::filesystem::create_symlink("nowhere/m.safetensors", dir + "/dangling");
  ExpectEachFlagRejected(HSTU_MODEL_BIN,
                         {{"init --preset=tiny --out=" + dir + "/dangling",
                           "is a symbolic link to a missing file"}},
                         2);
  // To stdout: the file alone (before, the "wrote" line went into it and the model did not load).
  const auto [rc_out, out_out] = RunCommand(absl::StrCat(
      HSTU_MODEL_BIN, " init --preset=tiny --out=/dev/stdout 2>&1 >", dir, "/piped.safetensors && ",
      HSTU_MODEL_BIN, " info ", dir, "/piped.safetensors"));
  EXPECT_EQ(rc_out, 0) << out_out;
  EXPECT_NE(out_out.find("wrote /dev/stdout"), std::string::npos) << out_out;
  EXPECT_NE(out_out.find("num_layers"), std::string::npos) << out_out;
  // A good path is written (the check is not a refusal of everything).
  const auto [rc, out] = RunCommand(absl::StrCat(HSTU_MODEL_BIN, " init --preset=tiny --out=", dir,
                                                 "/m.safetensors"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(std::filesystem::is_regular_file(dir + "/m.safetensors"));
#ifdef HSTU_BENCH_BIN
  // Checked before the GPU is looked for: exit 2 here, with or without one.
  ExpectEachFlagRejected(
      HSTU_BENCH_BIN,
      {{"block --json=" + dir + "/missing/r.json",
        "--json=" + dir + "/missing/r.json: directory " + dir + "/missing is missing"},
       {"block --json=" + dir, "--json=" + dir + ": is a directory"},
       // Before: these reached the GPU (or "no CUDA device present", exit 1).
       {"kernels --cached=4096", "--cached=4096: must be in [0, 4096)"},
       {"timeline --cached=-1", "--cached=-1: must be in [0, 4096)"},
       {"block --window=-5", "--window=-5: must be >= 0"},
       {"block --sustained_ms=-5", "--sustained_ms=-5: must be in [0, 600000]"},
       {"attention --batches=1,99999999", "--batches=1,99999999: want a comma-separated list of "
                                          "integers in [1, 1024]"}},
      2);
#endif
}

}  // namespace
}  // namespace hstu::testing
