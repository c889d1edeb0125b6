// hstu_loadgen: load generator for hstu_server (DESIGN §10).
//
// Closed loop (--concurrency=N or a sweep 1:64:x2 / 1,2,8): N workers each send the next request
// when the previous one answers. Open loop (--rate=R[,R2...]): requests are sent on a schedule
// (constant or Poisson gaps) whatever the server does, and latency is measured from the scheduled
// send time, so a slow server cannot hide its queueing (no coordinated omission).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/answer_log.h"
#include "client/cli_util.h"
#include "client/latency_histogram.h"
#include "client/load_driver.h"
#include "client/replay.h"
#include "client/report.h"
#include "client/traffic.h"
#include "engine/atomic_file.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "server/address.h"
#include "server/tls.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "Server address HOST:PORT ([V6]:PORT), or a gRPC target with its scheme: "
          "dns:///HOST:PORT, ipv4:A:PORT[,...], ipv6:[A]:PORT[,...], unix:PATH.");
ABSL_FLAG(bool, tls, false,
          "Connect with TLS, verifying the server against the system's CAs (or --tls_ca_file); "
          "implied by any --tls_*_file flag.");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM CA certificates to verify the server with (TLS).");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate chain to present (mutual TLS), with --tls_key_file.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_server_name, "",
          "The name the server's certificate must carry, when it is not --target's host (e.g. "
          "the server is reached by an IP address its certificate does not list).");
ABSL_FLAG(double, duration, 10, "Seconds measured per load level (after --warmup).");
ABSL_FLAG(int64_t, requests, 0, "Requests per load level instead of --duration (0: use duration).");
ABSL_FLAG(std::string, concurrency, "8",
          "Closed loop: outstanding requests, or a sweep: 1:64:x2 (geometric), 1:16:+4 (linear), "
          "or a list 1,4,16.");
ABSL_FLAG(std::string, rate, "",
          "Open loop: requests per second (or a list 100,200); overrides --concurrency.");
ABSL_FLAG(std::string, arrival, "poisson", "Open loop arrivals: constant or poisson.");
ABSL_FLAG(int64_t, users, 1000, "User population.");
ABSL_FLAG(double, zipf, 1.0, "Zipf exponent of user popularity (0: uniform).");
ABSL_FLAG(double, new_user_rate, 0.01, "Fraction of visits that bring a brand-new user.");
ABSL_FLAG(int32_t, new_events, 4,
          "Each return visit adds uniform [--new_events_min, N] events to the history.");
ABSL_FLAG(int32_t, new_events_min, 1,
          "Fewest events a return visit adds (= --new_events: every visit adds exactly that many).");
ABSL_FLAG(int32_t, initial_events, 0,
          "Largest history (events) of a new user, uniform from --initial_events_min; 0: half the "
          "model's maximum.");
ABSL_FLAG(int32_t, initial_events_min, 1, "Smallest history (events) of a new user.");
ABSL_FLAG(int32_t, max_events, 0,
          "A user whose history would grow past this many events starts over as a new user; 0: "
          "twice the model's maximum (at most 1048576, the most the server accepts), so the "
          "server's truncation is exercised.");
ABSL_FLAG(int32_t, candidates, 0,
          "Candidates per request; 0: the model's candidates per forward pass, at most the "
          "server's --max_candidates.");
ABSL_FLAG(int64_t, timeout_ms, 1000, "Per-RPC deadline in milliseconds.");
ABSL_FLAG(double, warmup, 1, "Seconds of unmeasured load before each level.");
ABSL_FLAG(uint64_t, seed, 0,
          "Traffic seed (users, histories, candidates); 0: a fresh one each run, printed with the "
          "report. A run with the seed of an earlier one against the same server resends histories "
          "the server already holds, so its cache results are not a cold start's.");
ABSL_FLAG(int32_t, connections, 1, "gRPC connections (channels), used round-robin (at most 1024).");
ABSL_FLAG(std::string, json, "", "Write the results as JSON to this file.");
ABSL_FLAG(std::string, csv, "", "Write the results as CSV to this file.");
ABSL_FLAG(double, wait_ready_s, 0,
          "Wait up to this long for the server's health to be SERVING before starting.");
ABSL_FLAG(bool, progress, true, "Live progress line on stderr.");
ABSL_FLAG(int64_t, max_outstanding, 10000,
          "Open loop: sends beyond this many unanswered requests are counted as LOADGEN_BACKLOG "
          "errors instead of sent.");
ABSL_FLAG(double, max_error_rate, 0.01,
          "Exit status 1 when a level's failed calls (and open-loop sends skipped as "
          "LOADGEN_BACKLOG) exceed this share of its measured calls, or none succeeded (1: never; "
          "an overload study that expects errors sets it).");
ABSL_FLAG(int64_t, prewarm_visits, 0,
          "Visits sent before the first level and not reported (at the first level's concurrency, "
          "or 8 callers for a rate), so that the population's first visits, all misses, do not "
          "land in the first level.");
ABSL_FLAG(std::string, record, "",
          "Write the OK answers to this file as JSONL: each request with the scores it got "
          "(expected_scores) and its cache_result, warm-ups included. `hstu_rank --no_cache "
          "--input=FILE` recomputes them and reports each line whose scores differ by more than "
          "its --max_score_diff. The file is created once the server answered GetModelInfo.");
ABSL_FLAG(int64_t, record_every, 1, "With --record: write every Nth OK answer only.");
ABSL_FLAG(bool, overlapping_visits, false,
          "Let a user have several visits in flight (the later ones re-send its history). By "
          "default a visit goes to a user with none in flight while there is one.");
ABSL_FLAG(std::string, replay, "",
          "Send the requests of this JSONL file instead of generated traffic: hstu_rank's lines, "
          "or what --record wrote (expected_scores and cache_result are not checked). In the "
          "file's order, a user's next line waiting while its previous visit is in flight (unless "
          "--overlapping_visits); from the first line again at the end (later passes re-send "
          "histories the server holds). The traffic model's flags (--users, --zipf, "
          "--new_user_rate, --initial_events*, --new_events*, --max_events, --candidates) set to "
          "other than their defaults are an error with it.");

namespace hstu::loadgen {
namespace {

// Bounds that keep every duration a finite time point and every sweep a sane size.
constexpr double kMaxSeconds = 86400;   // --duration, --warmup, --wait_ready_s: at most a day
constexpr int64_t kMaxTimeoutMs = 86'400'000;
constexpr double kMinRate = 0.001, kMaxRate = 1e7;
constexpr int32_t kMaxConcurrency = 10000;  // a thread each
constexpr size_t kMaxLevels = 1000;
constexpr int32_t kMaxConnections = 1024;
// A request's sizes: the model file's bound on candidates (2^20), and the server's bound on
// history events (2^20, engine/request.h: it rejects longer histories; up to that, histories
// longer than the model's maximum are truncated).
constexpr int32_t kMaxCandidates = 1 << 20;
constexpr int32_t kMaxEvents = 1 << 20;

absl::StatusOr<std::vector<int32_t>> ParseConcurrency(const std::string& spec) {
  std::vector<int32_t> out;
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "--concurrency=", spec, ": want N, A:B:xF, A:B:+S or a list A,B,C (each in [1, ",
        kMaxConcurrency, "], at most ", kMaxLevels, " levels)"));
  };
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  if (parts.size() == 3) {
    int32_t lo, hi, step;
    if (!absl::SimpleAtoi(parts[0], &lo) || !absl::SimpleAtoi(parts[1], &hi) || lo < 1 ||
        hi < lo || hi > kMaxConcurrency || parts[2].size() < 2 ||
        !absl::SimpleAtoi(parts[2].substr(1), &step)) {
      return bad();
    }
    if (parts[2][0] == 'x' && step >= 2) {
      for (int64_t c = lo; c <= hi; c *= step) out.push_back(static_cast<int32_t>(c));
    } else if (parts[2][0] == '+' && step >= 1) {
      for (int64_t c = lo; c <= hi && out.size() <= kMaxLevels; c += step) {
        out.push_back(static_cast<int32_t>(c));
      }
    } else {
      return bad();
    }
    if (out.size() > kMaxLevels) return bad();
    return out;
  }
  if (parts.size() != 1) return bad();
  for (absl::string_view p : absl::StrSplit(spec, ',')) {
    int32_t c;
    if (!absl::SimpleAtoi(p, &c) || c < 1 || c > kMaxConcurrency) return bad();
    out.push_back(c);
  }
  if (out.size() > kMaxLevels) return bad();
  return out;
}

absl::StatusOr<std::vector<double>> ParseRates(const std::string& spec) {
  std::vector<double> out;
  for (absl::string_view p : absl::StrSplit(spec, ',')) {
    double r;
    // NaN never ends a level, and a rate below the minimum would wait days for its first send.
    if (!absl::SimpleAtod(p, &r) || !(r >= kMinRate && r <= kMaxRate)) {
      return absl::InvalidArgumentError(absl::StrCat("--rate=", spec,
                                                     ": want R or R1,R2 (each in [", kMinRate, ", ",
                                                     kMaxRate, "] per second)"));
    }
    out.push_back(r);
  }
  if (out.size() > kMaxLevels) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate=", spec, ": at most ", kMaxLevels, " levels"));
  }
  return out;
}

// The channels' credentials and arguments: TLS when any --tls flag asks for it.
struct Connection {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string server_name;  // "": the target's host
};

absl::StatusOr<Connection> ConnectionFromFlags() {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca_file), cert = absl::GetFlag(FLAGS_tls_cert_file),
                    key = absl::GetFlag(FLAGS_tls_key_file);
  Connection c;
  c.server_name = absl::GetFlag(FLAGS_tls_server_name);
  const bool tls = absl::GetFlag(FLAGS_tls) || !ca.empty() || !cert.empty() || !key.empty();
  if (!tls) {
    if (!c.server_name.empty()) {
      return absl::InvalidArgumentError("--tls_server_name needs TLS (--tls or a --tls_*_file)");
    }
    c.credentials = grpc::InsecureChannelCredentials();
    return c;
  }
  auto creds = hstu::server::ClientTlsCredentials(ca, cert, key);
  if (!creds.ok()) return creds.status();
  c.credentials = *std::move(creds);
  return c;
}

grpc::ChannelArguments BaseChannelArgs(const Connection& c) {
  grpc::ChannelArguments args;
  if (!c.server_name.empty()) args.SetSslTargetNameOverride(c.server_name);
  return args;
}

absl::Status WaitReady(const std::string& target, const Connection& conn, double wait_s) {
  const Clock::time_point start = Clock::now();
  std::string last = "no answer";
  while (true) {
    // A fresh channel per try: one whose first connect was refused waits out gRPC's reconnect
    // backoff (seconds) before it tries again.
    auto health = grpc::health::v1::Health::NewStub(
        grpc::CreateCustomChannel(target, conn.credentials, BaseChannelArgs(conn)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status s = health->Check(&ctx, req, &resp);
    if (s.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    last = s.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())
                  : absl::StrCat(CodeName(s.error_code()), ": ", s.error_message());
    if (Since(start) >= wait_s) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::UnavailableError(
      absl::StrCat("server not SERVING after ", wait_s, " s (last: ", last, ")"));
}

// Whether two paths name one regular file, or one path to be created (through links, `.` and
// `..`): the same inode where both exist, else the same absolute path once the links of what
// exists are resolved. Two outputs to one file leave only the last written; an output over the
// --replay input destroys it. A device, FIFO or descriptor both write to (/dev/stdout twice) is
// not refused.
bool SameFile(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (std::filesystem::exists(a, ec) && std::filesystem::exists(b, ec)) {
    // IsReplaceableFile: an existing path that is, is a regular file not named as a descriptor.
    return std::filesystem::equivalent(a, b, ec) && IsReplaceableFile(a) && IsReplaceableFile(b);
  }
  const auto ca = std::filesystem::weakly_canonical(std::filesystem::absolute(a, ec), ec);
  if (ec) return false;
  const auto cb = std::filesystem::weakly_canonical(std::filesystem::absolute(b, ec), ec);
  return !ec && ca == cb;
}

// --target: HOST:PORT with a port in [1, 65535] ([V6]:PORT for an IPv6 address), or a gRPC
// target with its scheme (dns:, ipv4:, ipv6:, unix:, unix-abstract:), passed as it is. Before, a
// port past 65535 reached gRPC's resolver, which took it modulo 65536 and loaded another port.
absl::Status CheckTarget(const std::string& target) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("--target=", target,
                     ": must be HOST:PORT with a port in [1, 65535], or a gRPC target with its "
                     "scheme (dns:///HOST:PORT, ipv4:, ipv6:, unix:PATH)"));
  };
  if (IsUnixSocketAddress(target)) {
    return target.size() > target.find(':') + 1 ? absl::OkStatus() : bad();  // a path after it
  }
  // HOST:PORT ([V6]:PORT) after the scheme: dns:///HOST:PORT, dns://AUTHORITY/HOST:PORT, or
  // ipv4:/ipv6: with addresses joined by ','.
  std::vector<std::string> addresses = {target};
  if (absl::StartsWith(target, "dns:")) {
    const size_t slash = target.rfind('/');
    addresses = {slash == std::string::npos ? target.substr(4) : target.substr(slash + 1)};
  } else if (absl::StartsWith(target, "ipv4:") || absl::StartsWith(target, "ipv6:")) {
    addresses = absl::StrSplit(target.substr(5), ',');
  }
  for (const std::string& address : addresses) {
    size_t colon = std::string::npos;
    if (absl::StartsWith(address, "[")) {
      const size_t close = address.find(']');
      if (close != std::string::npos && close + 1 < address.size() && address[close + 1] == ':') {
        colon = close + 1;
      }
    } else if (const size_t c = address.find(':'); c != std::string::npos && c > 0 &&
                                                   address.find(':', c + 1) == std::string::npos) {
      colon = c;
    }
    const std::optional<uint32_t> port =
        ParsePort(colon == std::string::npos ? "" : address.substr(colon + 1));
    if (!port.has_value() || *port == 0) return bad();
  }
  return absl::OkStatus();
}

// The flags that need no server, checked before connecting (a typo fails at once, naming the
// flag), and the load levels they ask for.
absl::StatusOr<std::vector<LevelResult>> LevelsFromFlags() {
  auto bad = [](const char* flag, auto value, absl::string_view want) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", want));
  };
  if (absl::Status s = CheckTarget(absl::GetFlag(FLAGS_target)); !s.ok()) return s;
  if (absl::GetFlag(FLAGS_connections) < 1 || absl::GetFlag(FLAGS_connections) > kMaxConnections) {
    return bad("connections", absl::GetFlag(FLAGS_connections),
               absl::StrCat("must be in [1, ", kMaxConnections, "]"));
  }
  if (absl::GetFlag(FLAGS_requests) < 0) {
    return bad("requests", absl::GetFlag(FLAGS_requests), "must be >= 0 (0: use --duration)");
  }
  const std::string a_day = absl::StrCat(" and at most ", kMaxSeconds, " (a day)");
  if (absl::GetFlag(FLAGS_requests) == 0 &&
      !(absl::GetFlag(FLAGS_duration) > 0 && absl::GetFlag(FLAGS_duration) <= kMaxSeconds)) {
    return bad("duration", absl::GetFlag(FLAGS_duration),
               absl::StrCat("must be > 0", a_day, " (or give --requests)"));
  }
  if (!(absl::GetFlag(FLAGS_warmup) >= 0 && absl::GetFlag(FLAGS_warmup) <= kMaxSeconds)) {
    return bad("warmup", absl::GetFlag(FLAGS_warmup), absl::StrCat("must be >= 0", a_day));
  }
  if (!(absl::GetFlag(FLAGS_wait_ready_s) >= 0 &&
        absl::GetFlag(FLAGS_wait_ready_s) <= kMaxSeconds)) {
    return bad("wait_ready_s", absl::GetFlag(FLAGS_wait_ready_s),
               absl::StrCat("must be >= 0", a_day));
  }
  if (absl::GetFlag(FLAGS_timeout_ms) < 1 || absl::GetFlag(FLAGS_timeout_ms) > kMaxTimeoutMs) {
    return bad("timeout_ms", absl::GetFlag(FLAGS_timeout_ms),
               absl::StrCat("must be in [1, ", kMaxTimeoutMs, "] (a day)"));
  }
  if (!(absl::GetFlag(FLAGS_max_error_rate) >= 0 && absl::GetFlag(FLAGS_max_error_rate) <= 1)) {
    return bad("max_error_rate", absl::GetFlag(FLAGS_max_error_rate), "must be in [0, 1]");
  }
  if (absl::GetFlag(FLAGS_prewarm_visits) < 0) {
    return bad("prewarm_visits", absl::GetFlag(FLAGS_prewarm_visits), "must be >= 0");
  }
  if (absl::GetFlag(FLAGS_record_every) < 1) {
    return bad("record_every", absl::GetFlag(FLAGS_record_every), "must be >= 1");
  }
  if (absl::GetFlag(FLAGS_record_every) != 1 && absl::GetFlag(FLAGS_record).empty()) {
    return bad("record_every", absl::GetFlag(FLAGS_record_every), "needs --record=FILE");
  }
  // Output files, checked now, not after a run of minutes (the reports are written after each
  // level, the recording once the server answered): each can be written where it goes
  // (engine/atomic_file.h: a file is replaced, a device or FIFO written through), and no two
  // flags, --replay's input among them, name one file (before, --record over the --replay file
  // emptied a team's recording).
  const std::pair<const char*, std::string> files[] = {{"json", absl::GetFlag(FLAGS_json)},
                                                       {"csv", absl::GetFlag(FLAGS_csv)},
                                                       {"record", absl::GetFlag(FLAGS_record)},
                                                       {"replay", absl::GetFlag(FLAGS_replay)}};
  for (size_t i = 0; i < std::size(files); ++i) {
    const auto& [flag, path] = files[i];
    if (path.empty()) continue;
    for (size_t j = 0; j < i; ++j) {
      if (!files[j].second.empty() && SameFile(files[j].second, path)) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": the same file as --",
                                                       files[j].first, "=", files[j].second));
      }
    }
    if (std::string(flag) == "replay") continue;  // an input: Load() says what is wrong with it
    // The reports replace their files whole; the recording is written in place as it goes.
    const WriteMode mode = std::string(flag) == "record" ? WriteMode::kInPlace : WriteMode::kReplace;
    if (absl::Status s = CheckWritable(path, mode); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": ", s.message()));
    }
  }
  const std::string events_bound = absl::StrCat(" and at most ", kMaxEvents);
  if (absl::GetFlag(FLAGS_candidates) < 0 || absl::GetFlag(FLAGS_candidates) > kMaxCandidates) {
    return bad("candidates", absl::GetFlag(FLAGS_candidates),
               absl::StrCat("must be >= 0 (0: the model's candidates per forward) and at most ",
                            kMaxCandidates));
  }
  if (absl::GetFlag(FLAGS_initial_events) < 0 || absl::GetFlag(FLAGS_initial_events) > kMaxEvents) {
    return bad("initial_events", absl::GetFlag(FLAGS_initial_events),
               absl::StrCat("must be >= 0 (0: half the model's maximum)", events_bound));
  }
  if (absl::GetFlag(FLAGS_max_events) < 0 || absl::GetFlag(FLAGS_max_events) > kMaxEvents) {
    return bad("max_events", absl::GetFlag(FLAGS_max_events),
               absl::StrCat("must be >= 0 (0: twice the model's maximum)", events_bound));
  }
  const int64_t users = absl::GetFlag(FLAGS_users);
  if (users < 1 || users > kMaxUsers) {
    return bad("users", users, absl::StrCat("must be in [1, ", kMaxUsers, "]"));
  }
  const double zipf = absl::GetFlag(FLAGS_zipf);
  if (!(zipf >= 0) || !std::isfinite(zipf)) return bad("zipf", zipf, "must be finite and >= 0");
  const double new_user_rate = absl::GetFlag(FLAGS_new_user_rate);
  if (!(new_user_rate >= 0 && new_user_rate <= 1)) {
    return bad("new_user_rate", new_user_rate, "must be in [0, 1]");
  }
  const int32_t new_events_min = absl::GetFlag(FLAGS_new_events_min);
  if (new_events_min < 1) return bad("new_events_min", new_events_min, "must be >= 1");
  if (absl::GetFlag(FLAGS_new_events) < new_events_min ||
      absl::GetFlag(FLAGS_new_events) > kMaxEvents) {
    return bad("new_events", absl::GetFlag(FLAGS_new_events),
               absl::StrCat("must be >= --new_events_min (", new_events_min, ")", events_bound));
  }
  const int32_t initial_events_min = absl::GetFlag(FLAGS_initial_events_min);
  if (initial_events_min < 1 || initial_events_min > kMaxEvents) {
    return bad("initial_events_min", initial_events_min, absl::StrCat("must be >= 1", events_bound));
  }
  const int32_t initial_events = absl::GetFlag(FLAGS_initial_events);
  if (initial_events > 0 && initial_events < initial_events_min) {
    return bad("initial_events", initial_events,
               absl::StrCat("must be >= --initial_events_min (", initial_events_min, ")"));
  }
  const int32_t max_events = absl::GetFlag(FLAGS_max_events);
  const int32_t largest_initial = std::max(initial_events, initial_events_min);
  if (max_events > 0 && max_events < largest_initial) {
    return bad("max_events", max_events,
               absl::StrCat("must be >= --initial_events (", largest_initial, ")"));
  }
  if (absl::GetFlag(FLAGS_max_outstanding) < 1) return bad("max_outstanding", absl::GetFlag(FLAGS_max_outstanding), "must be >= 1");
  const std::string arrival = absl::GetFlag(FLAGS_arrival);
  if (arrival != "constant" && arrival != "poisson") return bad("arrival", arrival, "want constant or poisson");
  std::vector<LevelResult> levels;
  if (const std::string rate = absl::GetFlag(FLAGS_rate); !rate.empty()) {
    auto rates = ParseRates(rate);
    if (!rates.ok()) return rates.status();
    for (double r : *rates) {
      LevelResult l;
      l.mode = "open";
      l.rate_rps = r;
      l.arrival = arrival;
      levels.push_back(l);
    }
  } else {
    auto conc = ParseConcurrency(absl::GetFlag(FLAGS_concurrency));
    if (!conc.ok()) return conc.status();
    for (int32_t c : *conc) {
      LevelResult l;
      l.mode = "closed";
      l.concurrency = c;
      levels.push_back(l);
    }
  }
  return levels;
}

// --replay: the file's visits, read before connecting; an error when a traffic-model flag was
// given too (it would be silently ignored).
absl::StatusOr<std::unique_ptr<ReplayTraffic>> ReplayFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_replay);
  if (path.empty()) return nullptr;
  // A flag set to its default value passes: absl's public API tells values, not presence.
  for (const char* flag : {"users", "zipf", "new_user_rate", "initial_events", "initial_events_min",
                           "new_events", "new_events_min", "max_events", "candidates"}) {
    const absl::CommandLineFlag* f = absl::FindCommandLineFlag(flag);
    if (f != nullptr && f->CurrentValue() != f->DefaultValue()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, " does not apply with --replay (the file gives the users and requests)"));
    }
  }
  return ReplayTraffic::Load(path, absl::GetFlag(FLAGS_overlapping_visits));
}

int Main() {
  // A --record reader that goes away (`--record=/dev/stdout | head`) is a failed write, reported
  // at the end with the reports still written, not a silent death by SIGPIPE (exit 141).
  std::signal(SIGPIPE, SIG_IGN);
  absl::StatusOr<std::vector<LevelResult>> levels = LevelsFromFlags();
  if (!levels.ok()) {
    std::fprintf(stderr, "%s\n", std::string(levels.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<ReplayTraffic>> replay = ReplayFromFlags();
  if (!replay.ok()) {
    std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(replay.status().message()).c_str());
    return 2;
  }
  const std::string target = absl::GetFlag(FLAGS_target);
  absl::StatusOr<Connection> conn = ConnectionFromFlags();
  if (!conn.ok()) {
    std::fprintf(stderr, "%s\n", std::string(conn.status().message()).c_str());
    return 2;
  }
  const int32_t num_connections = absl::GetFlag(FLAGS_connections);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int32_t i = 0; i < num_connections; ++i) {
    grpc::ChannelArguments args = BaseChannelArgs(*conn);
    // Each channel gets its own subchannel (TCP connection) instead of sharing the global pool.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(64 << 20);
    channels.push_back(grpc::CreateCustomChannel(target, conn->credentials, args));
  }
  if (const double wait_s = absl::GetFlag(FLAGS_wait_ready_s); wait_s > 0) {
    if (absl::Status s = WaitReady(target, *conn, wait_s); !s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  hstu::v1::ModelInfo info;
  {
    auto stub = Ranker::NewStub(channels[0]);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status s = stub->GetModelInfo(&ctx, hstu::v1::GetModelInfoRequest(), &info);
    if (!s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: GetModelInfo on %s failed: %s: %s\n", target.c_str(),
                   CodeName(s.error_code()), s.error_message().c_str());
      return 1;
    }
  }
  // Created once the server answered (its directory was checked before connecting): a run that
  // cannot reach the server leaves an earlier recording as it was.
  std::unique_ptr<AnswerLog> answers;
  if (const std::string path = absl::GetFlag(FLAGS_record); !path.empty()) {
    auto log = AnswerLog::Open(path, absl::GetFlag(FLAGS_record_every));
    if (!log.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(log.status().message()).c_str());
      return 1;
    }
    answers = *std::move(log);
  }
  // Every connection up before the first level (the first one is, by the call above): a fresh
  // channel's first call would also time its TCP and HTTP/2 handshake, in the measured window
  // with --warmup=0.
  for (size_t i = 1; i < channels.size(); ++i) {
    if (!channels[i]->WaitForConnected(std::chrono::system_clock::now() +
                                       std::chrono::seconds(10))) {
      std::fprintf(stderr, "hstu_loadgen: connection %zu of %zu to %s not up within 10 s\n", i + 1,
                   channels.size(), target.c_str());
      return 1;
    }
  }

  // Valid requests for the served model: actions below num_actions, histories around its maximum
  // (longer ones are truncated by the server, so growth past it is exercised too).
  const int32_t model_events = std::max<int32_t>(1, static_cast<int32_t>(info.max_history_tokens() / 2));
  TrafficOptions t;
  t.num_users = absl::GetFlag(FLAGS_users);
  t.zipf_s = absl::GetFlag(FLAGS_zipf);
  t.new_user_rate = absl::GetFlag(FLAGS_new_user_rate);
  t.new_events_min = absl::GetFlag(FLAGS_new_events_min);
  t.new_events_max = absl::GetFlag(FLAGS_new_events);
  t.initial_events_min = absl::GetFlag(FLAGS_initial_events_min);
  // The defaults that follow the model give way to the flags given (checked against each other
  // before connecting): a default initial history within [--initial_events_min, --max_events].
  const int32_t max_events_flag = absl::GetFlag(FLAGS_max_events);
  t.initial_events_max = absl::GetFlag(FLAGS_initial_events);
  if (t.initial_events_max == 0) {
    t.initial_events_max = std::max(t.initial_events_min, model_events / 2);
    if (max_events_flag > 0) t.initial_events_max = std::min(t.initial_events_max, max_events_flag);
  }
  t.max_events = max_events_flag > 0
                     ? max_events_flag
                     : std::min(kMaxEvents, std::max(t.initial_events_max, 2 * model_events));
  // Default: one forward pass's worth, within what the server accepts (its --max_candidates).
  int64_t per_forward = info.candidates_per_forward() > 0 ? info.candidates_per_forward()
                                                          : info.max_candidates();
  if (info.max_candidates() > 0) per_forward = std::min<int64_t>(per_forward, info.max_candidates());
  t.num_candidates = absl::GetFlag(FLAGS_candidates) > 0
                         ? absl::GetFlag(FLAGS_candidates)
                         : static_cast<int32_t>(std::max<int64_t>(1, per_forward));
  t.num_actions = info.num_actions() > 0 ? static_cast<int32_t>(info.num_actions()) : 1;
  t.overlapping_visits = absl::GetFlag(FLAGS_overlapping_visits);
  t.seed = absl::GetFlag(FLAGS_seed);
  while (t.seed == 0) {
    t.seed = (static_cast<uint64_t>(std::random_device()()) << 32) ^ std::random_device()() ^
             static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  }
  std::unique_ptr<VisitSource> traffic;
  ReplayTraffic* const replayed = replay->get();
  if (replayed != nullptr) {
    traffic = *std::move(replay);
  } else {
    auto model = TrafficModel::Create(t);
    if (!model.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(model.status().message()).c_str());
      return 2;
    }
    traffic = *std::move(model);
  }

  const std::string arrival = absl::GetFlag(FLAGS_arrival);

  std::vector<std::unique_ptr<Ranker::Stub>> stubs;
  for (const auto& ch : channels) stubs.push_back(Ranker::NewStub(ch));
  Driver driver(std::move(stubs), traffic.get(), absl::GetFlag(FLAGS_timeout_ms), answers.get());
  const double warmup_s = absl::GetFlag(FLAGS_warmup);
  const double duration_s = absl::GetFlag(FLAGS_duration);
  const int64_t num_requests = absl::GetFlag(FLAGS_requests);
  const bool progress = absl::GetFlag(FLAGS_progress);
  const bool tty = isatty(STDERR_FILENO) != 0;

  RunInfo run;
  run.target = target;
  run.model = info.model_name();
  run.device = info.device();
  run.candidates = t.num_candidates;
  run.users = t.num_users;
  run.zipf = t.zipf_s;
  run.connections = num_connections;
  run.seed = t.seed;
  if (replayed != nullptr) {
    run.replay_file = absl::GetFlag(FLAGS_replay);
    run.replay_lines = replayed->num_lines();
    run.replay_users = replayed->num_users();
    std::fprintf(stderr,
                 "hstu_loadgen: replaying %s: %lld lines (%lld with expected_scores, not checked "
                 "here: hstu_rank checks them), %lld users\n",
                 run.replay_file.c_str(), static_cast<long long>(run.replay_lines),
                 static_cast<long long>(replayed->num_lines_with_scores()),
                 static_cast<long long>(run.replay_users));
  }
  run.levels_planned = levels->size();
  // The report files hold every level finished so far, each write whole or not at all: a run cut
  // short, even mid-write, keeps what it measured.
  // After each level (`last` false) only files that are replaced whole are written: a FIFO or
  // stdout gets one report, the last (a reader of a FIFO may stop at its first end of file).
  std::set<std::string> write_errors;  // each said once, not after every level
  const auto report_error = [&write_errors](const absl::Status& s) {
    if (write_errors.insert(std::string(s.message())).second) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
    }
  };
  auto write_reports = [&](const std::vector<LevelResult>& done, bool last) {
    bool ok = true;
    if (replayed != nullptr) run.replay_passes = replayed->passes();
    const auto due = [last](const std::string& path) {
      return !path.empty() && (last || IsReplaceableFile(path));
    };
    if (const std::string path = absl::GetFlag(FLAGS_json); due(path)) {
      if (absl::Status s = WriteFileAtomically(path, ToJson(run, done)); !s.ok()) {
        report_error(s);
        ok = false;
      }
    }
    if (const std::string path = absl::GetFlag(FLAGS_csv); due(path)) {
      if (absl::Status s = WriteFileAtomically(path, ToCsv(done)); !s.ok()) {
        report_error(s);
        ok = false;
      }
    }
    return ok;
  };

  InstallStopSignals();
  int rc = 0;
  if (const int64_t prewarm = absl::GetFlag(FLAGS_prewarm_visits); prewarm > 0) {
    LevelResult scratch;
    Level level(&scratch);
    const int32_t callers = levels->front().mode == "closed" ? levels->front().concurrency : 8;
    std::fprintf(stderr, "hstu_loadgen: prewarm, %lld visits at %d callers\n",
                 static_cast<long long>(prewarm), callers);
    if (absl::Status s = driver.RunClosed(&level, callers, 0, 0, prewarm); !s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  std::vector<LevelResult> done;
  for (LevelResult& l : *levels) {
    if (Interrupted()) break;
    Level level(&l);
    const std::string label = LevelLabel(l);
    std::atomic<bool> running{true};
    std::thread progress_thread;
    if (progress) {
      progress_thread = std::thread([&] {
        int ticks = 0;
        while (running.load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(250));
          if (!running.load()) break;
          // Without a terminal, a line every 2 s instead of a line rewritten in place.
          if (!tty && ++ticks % 8 != 0) continue;
          std::fprintf(stderr, tty ? "\r%-100s" : "%s\n", level.Progress(label).c_str());
        }
        if (tty) std::fprintf(stderr, "\r%-100s\r", "");
      });
    }
    absl::Status ran;
    if (l.mode == "closed") {
      ran = driver.RunClosed(&level, l.concurrency, warmup_s, duration_s, num_requests);
    } else {
      driver.RunOpen(&level, l.rate_rps, arrival == "poisson", warmup_s, duration_s, num_requests,
                     absl::GetFlag(FLAGS_max_outstanding), t.seed);
    }
    running.store(false);
    if (progress_thread.joinable()) progress_thread.join();
    if (!ran.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s: %s\n", label.c_str(),
                   std::string(ran.message()).c_str());
      rc = 1;
      break;
    }
    const bool measured = level.window_opened();
    l.interrupted = Interrupted();
    if (!measured) break;  // stopped in its warm-up: nothing to report
    done.push_back(std::move(l));
    if (!write_reports(done, /*last=*/false)) rc = 1;
  }

  // The last write says whether the run was cut short (also when no level got measured: a file
  // left by an earlier run must not pass for this one's).
  run.interrupted = Interrupted();
  if (!write_reports(done, /*last=*/true)) rc = 1;
  std::printf("%s", FormatTable(run, done).c_str());
  // With SIGPIPE ignored, a closed stdout (`| head -1`, /dev/full) is a failed write to report.
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "hstu_loadgen: writing the table to stdout failed: %s\n",
                 std::strerror(errno));
    rc = 1;
  }
  if (answers != nullptr) {
    // Every call has ended (each level waits for its answers), so no completion writes after this.
    if (absl::Status s = answers->Close(); !s.ok()) {
      std::fprintf(stderr, "hstu_loadgen: %s\n", std::string(s.message()).c_str());
      rc = 1;
    } else {
      std::fprintf(stderr, "hstu_loadgen: recorded %lld answers to %s\n",
                   static_cast<long long>(answers->lines()), absl::GetFlag(FLAGS_record).c_str());
    }
  }
  if (run.interrupted) {
    std::fprintf(stderr, "hstu_loadgen: stopped by a signal after %zu of %zu levels\n", done.size(),
                 levels->size());
    rc = 1;
  }
  // A level that no request got through measured nothing, and one with more failures than
  // --max_error_rate measured a failing server: say so in the exit status, so that a script
  // driving the server does not take such a run (a wrong target model, deadlines too short for
  // the device, a server that died) as a result.
  const double max_error_rate = absl::GetFlag(FLAGS_max_error_rate);
  for (const LevelResult& l : done) {
    if (max_error_rate >= 1) break;  // errors are what the run studies
    const int64_t errors = l.error_count();
    const double share = static_cast<double>(errors) / static_cast<double>(std::max<int64_t>(1, errors + l.requests));
    if (l.requests == 0) {
      std::fprintf(stderr, "hstu_loadgen: no request succeeded at %s (%lld errors)\n",
                   LevelLabel(l).c_str(), static_cast<long long>(errors));
      rc = 1;
    } else if (share > max_error_rate) {
      std::fprintf(stderr,
                   "hstu_loadgen: %s: %lld of %lld calls failed or were not sent (%.2f %%, above "
                   "--max_error_rate %.2f %%)\n",
                   LevelLabel(l).c_str(), static_cast<long long>(errors),
                   static_cast<long long>(errors + l.requests), 100 * share, 100 * max_error_rate);
      rc = 1;
    }
  }
  return rc;
}

}  // namespace
}  // namespace hstu::loadgen

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load generator for hstu_server.\n"
      "  hstu_loadgen --target=HOST:PORT [--concurrency=8 | --concurrency=1:64:x2 | "
      "--rate=500 --arrival=poisson]\n"
      "               [--duration=10 | --requests=N] [--users=1000 --zipf=1.0 | --replay=F.jsonl]\n"
      "               [--json=F --csv=F]\n"
      "Exit status: 0 when every load level ran and answered within --max_error_rate; 1 when a\n"
      "level answered no request or failed more calls than that, or the server could not be\n"
      "reached, or a report file could not be written, or a signal stopped the run (the levels\n"
      "measured are still printed and written), or a flag does not parse; 2 for a flag value out\n"
      "of range, a word that is no flag, a report file in a directory that cannot be written, a\n"
      "--replay file that cannot be read or has a line that does not parse, or a traffic-model\n"
      "flag given with --replay.");
  absl::FlagsUsageConfig usage;
  // --help lists this program's flags (absl's default matches files named after the binary).
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "loadgen_main");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  auto args = hstu::NormalizeFlagDashes(argc, argv);
  auto argv2 = hstu::ArgvOf(args);
  if (!hstu::OnlyFlagsGiven(hstu::ParseFlags(argv2))) {
    return 2;
  }
  return hstu::loadgen::Main();
}
