// What the process tests share: hstu_server as a child process on loopback ports, requests, and
// the check that a program refuses each of a list of flags. The including target defines
// HSTU_SERVER_BIN (tests/integration/CMakeLists.txt).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "tests/integration/test_util.h"

namespace hstu::testing {

// Waits up to `timeout` until the server `proc` at `target` (HOST:PORT or unix:PATH) reports
// SERVING; false if it does not, or exits first.
inline bool WaitServingAt(const std::string& target, Subprocess& proc,
                          std::chrono::seconds timeout = std::chrono::seconds(20)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    // A fresh channel per try: a channel whose first connect was refused waits out gRPC's
    // reconnect backoff (seconds) before trying again.
    auto health = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    grpc::health::v1::HealthCheckResponse resp;
    if (health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
        resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return true;
    }
    if (proc.Wait(std::chrono::milliseconds(0)) >= 0) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// hstu_server on loopback ports the kernel picks (port 0; the server logs the ones it got), SERVING
// when WaitServing() returns true. Ports picked here and handed over would race: two picks in a
// row once returned the same port, and the server then failed to bind its second listener.
class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> extra = {}) : dir_(TempDir()) {
    std::vector<std::string> argv = {HSTU_SERVER_BIN, "--listen=127.0.0.1:0",
                                     "--metrics_listen=127.0.0.1:0", "--device=cpu",
                                     "--model=random:tiny"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc_ = std::make_unique<Subprocess>(argv, dir_ + "/server.log");
    // Both listeners are up before the model loads; the gRPC one is logged last.
    static const std::regex kMetrics(R"(metrics: serving .* \(port (\d+)\))");
    static const std::regex kGrpc(R"(grpc: listening on .* \(port (\d+)\))");
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::smatch m;
    while (std::chrono::steady_clock::now() < end &&
           proc_->Wait(std::chrono::milliseconds(0)) < 0) {
      const std::string log = proc_->Log();
      if (std::regex_search(log, m, kGrpc)) {
        port_ = std::stoi(m[1]);
        if (std::regex_search(log, m, kMetrics)) metrics_port_ = std::stoi(m[1]);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    channel_ = grpc::CreateChannel(target(), grpc::InsecureChannelCredentials());
  }
  bool WaitServing(std::chrono::seconds timeout = std::chrono::seconds(20)) {
    if (port_ == 0) return false;  // it never listened (the log says why)
    if (!WaitServingAt(target(), *proc_, timeout)) return false;
    channel_ = grpc::CreateChannel(target(), grpc::InsecureChannelCredentials());
    return true;
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  int metrics_port() const { return metrics_port_; }
  Subprocess& proc() { return *proc_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int port_ = 0, metrics_port_ = 0;
  std::unique_ptr<Subprocess> proc_;
  std::shared_ptr<grpc::Channel> channel_;
};

inline hstu::v1::RankRequest MakeRequest(uint64_t user, int events, int candidates, uint64_t seed) {
  std::mt19937_64 rng(seed * 31 + user);
  hstu::v1::RankRequest r;
  r.set_user_id(user);
  for (int i = 0; i < events; ++i) {
    r.add_history_item_ids(static_cast<int64_t>(rng() % 100000));
    r.add_history_actions(static_cast<int32_t>(rng() % 16));
  }
  for (int c = 0; c < candidates; ++c)
    r.add_candidate_item_ids(static_cast<int64_t>(rng() % 100000));
  return r;
}

// Runs `program` with each case's flag: it exits `rc` with the case's message in its output.
inline void ExpectEachFlagRejected(const std::string& program,
                                   const std::vector<std::pair<std::string, std::string>>& cases,
                                   int rc) {
  for (const auto& [flag, want] : cases) {
    const auto [got_rc, out] = RunCommand(absl::StrCat(program, " ", flag));
    EXPECT_EQ(got_rc, rc) << flag << ": " << out;
    EXPECT_NE(out.find(want), std::string::npos) << out;
  }
}

}  // namespace hstu::testing
