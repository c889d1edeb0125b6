// How the gRPC port keeps its connections (ConnectionOptions in server/ranking_server.h): client
// keepalive pings accepted down to --min_client_ping_interval_s and refused below it (GOAWAY
// too_many_pings), a peer that never answers the server's pings closed, old connections asked to
// reconnect without failing a call, idle ones closed.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "server/ranking_server.h"
#include "tests/integration/server_fixture.h"
#include "tests/integration/test_util.h"

namespace hstu::server {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

absl::StatusOr<std::unique_ptr<RankingServer>> TryStart(const ConnectionOptions& connections) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.engine.device = "cpu";
  o.connections = connections;
  return RankingServer::Start(o);
}

std::unique_ptr<RankingServer> StartServer(const ConnectionOptions& connections) {
  auto s = TryStart(connections);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// A channel of its own (its own connection), pinging every `ping_ms` when given, calls or not.
std::shared_ptr<grpc::Channel> Channel(int port, int ping_ms = 0) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (ping_ms > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ping_ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, ping_ms);
  }
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}

grpc::Status Rank(const std::shared_ptr<grpc::Channel>& channel, uint64_t user) {
  auto stub = hstu::v1::Ranker::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
  hstu::v1::RankResponse resp;
  return stub->Rank(&ctx, fixture::MakeRequest(user, 5, 3, 1), &resp);
}

// Whether the channel, READY now, leaves READY within `within` (a GOAWAY or a closed connection).
bool LeavesReady(const std::shared_ptr<grpc::Channel>& channel, Clock::duration within) {
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  return channel->WaitForStateChange(GRPC_CHANNEL_READY, std::chrono::system_clock::now() + within);
}

TEST(ConnectionTest, ClientPingsAreAcceptedDownToTheMinimumIntervalAndNotBelow) {
  // A client pinging every 2 s without calls: a server that accepts pings every 1 s keeps the
  // connection; one at the default 10 s ends it after two strikes (the 4th ping, ~8 s in).
  ConnectionOptions permissive, strict;
  permissive.min_client_ping_interval_s = 1;
  auto a = StartServer(permissive);
  auto b = StartServer(strict);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto to_a = Channel(a->port(), 2000);
  auto to_b = Channel(b->port(), 2000);
  ASSERT_TRUE(Rank(to_a, 1).ok());
  ASSERT_TRUE(Rank(to_b, 1).ok());
  auto b_left = std::async(std::launch::async, [&] { return LeavesReady(to_b, seconds(20)); });
  EXPECT_FALSE(LeavesReady(to_a, seconds(9)));
  EXPECT_TRUE(b_left.get());
  EXPECT_TRUE(Rank(to_a, 2).ok());
  a->Shutdown(absl::ZeroDuration());
  b->Shutdown(absl::ZeroDuration());
}

// An HTTP/2 peer that takes the server's SETTINGS but never answers a PING; whether the server
// closed the connection within `within`, and whether it sent a PING first.
struct SilentPeer {
  bool closed = false;
  bool pinged = false;
};
SilentPeer RunSilentPeer(int port, Clock::duration within) {
  SilentPeer peer;
  const int fd = testing::ConnectLoopback(port);
  EXPECT_GE(fd, 0);
  if (fd < 0) return peer;
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  const std::string settings("\0\0\0\4\0\0\0\0\0", 9);      // SETTINGS, no parameters
  const std::string settings_ack("\0\0\0\4\1\0\0\0\0", 9);  // SETTINGS with ACK
  EXPECT_EQ(send(fd, (preface + settings).data(), preface.size() + settings.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(preface.size() + settings.size()));
  timeval tv{0, 200000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string in;
  const Clock::time_point end = Clock::now() + within;
  while (!peer.closed && Clock::now() < end) {
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      peer.closed = true;
      break;
    }
    if (n > 0) in.append(buf, static_cast<size_t>(n));
    // Whole frames: 3 bytes of length, type, flags, 4 bytes of stream id, the payload.
    while (in.size() >= 9) {
      const size_t length = (static_cast<uint8_t>(in[0]) << 16) |
                            (static_cast<uint8_t>(in[1]) << 8) | static_cast<uint8_t>(in[2]);
      if (in.size() < 9 + length) break;
      const uint8_t type = static_cast<uint8_t>(in[3]), flags = static_cast<uint8_t>(in[4]);
      if (type == 4 && (flags & 1) == 0)
        send(fd, settings_ack.data(), settings_ack.size(), MSG_NOSIGNAL);
      if (type == 6 && (flags & 1) == 0) peer.pinged = true;
      in.erase(0, 9 + length);
    }
  }
  close(fd);
  return peer;
}

TEST(ConnectionTest, APeerThatNeverAnswersTheServersPingIsClosed) {
  ConnectionOptions pinging, quiet;
  pinging.keepalive_time_s = 1;
  pinging.keepalive_timeout_s = 1;
  quiet.keepalive_time_s = 0;  // no pings
  auto a = StartServer(pinging);
  auto b = StartServer(quiet);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto quiet_peer =
      std::async(std::launch::async, [&] { return RunSilentPeer(b->port(), seconds(5)); });
  const SilentPeer pinged = RunSilentPeer(a->port(), seconds(15));
  EXPECT_TRUE(pinged.pinged);
  EXPECT_TRUE(pinged.closed);
  const SilentPeer quiet_result = quiet_peer.get();
  EXPECT_FALSE(quiet_result.closed);  // without pings the silent peer stays connected
  EXPECT_FALSE(quiet_result.pinged);
  a->Shutdown(absl::ZeroDuration());
  b->Shutdown(absl::ZeroDuration());
}

TEST(ConnectionTest, OldConnectionsAreAskedToReconnectWithoutFailingACall) {
  ConnectionOptions aging;
  aging.max_connection_age_s = 1;
  aging.max_connection_age_grace_s = 2;
  auto server = StartServer(aging);
  ASSERT_NE(server, nullptr);
  auto channel = Channel(server->port());
  ASSERT_TRUE(Rank(channel, 1).ok());
  // The channel's states on a thread of their own: each new connection is a READY.
  std::mutex mu;
  std::vector<grpc_connectivity_state> states;
  std::atomic<bool> stop{false};
  std::thread watch([&] {
    grpc_connectivity_state state = channel->GetState(false);
    while (!stop) {
      if (channel->WaitForStateChange(state,
                                      std::chrono::system_clock::now() + milliseconds(100))) {
        state = channel->GetState(false);
        std::lock_guard<std::mutex> lock(mu);
        states.push_back(state);
      }
    }
  });
  int failed = 0;
  const Clock::time_point end = Clock::now() + milliseconds(4500);
  for (uint64_t user = 2; Clock::now() < end; ++user) {
    if (!Rank(channel, user).ok()) ++failed;
    std::this_thread::sleep_for(milliseconds(50));
  }
  stop = true;
  watch.join();
  EXPECT_EQ(failed, 0);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_GE(std::count(states.begin(), states.end(), GRPC_CHANNEL_READY), 2);
  server->Shutdown(absl::ZeroDuration());
}

TEST(ConnectionTest, IdleConnectionsAreClosed) {
  ConnectionOptions idle;
  idle.max_connection_idle_s = 1;
  auto server = StartServer(idle);
  ASSERT_NE(server, nullptr);
  auto channel = Channel(server->port());
  ASSERT_TRUE(Rank(channel, 1).ok());
  EXPECT_TRUE(LeavesReady(channel, seconds(10)));
  EXPECT_TRUE(Rank(channel, 2).ok());  // a new connection serves the next call
  server->Shutdown(absl::ZeroDuration());
}

TEST(ConnectionTest, OutOfRangeSettingsNameTheirFlag) {
  EXPECT_EQ(CheckConnectionOptions({}).code(), absl::StatusCode::kOk);
  ConnectionOptions c;
  c.keepalive_timeout_s = 0;
  EXPECT_EQ(CheckConnectionOptions(c).message(),
            "--keepalive_timeout_s=0: must be in [1, 2147483]");
  c = {};
  c.max_connection_age_s = 2147484;  // its milliseconds pass int32
  EXPECT_EQ(CheckConnectionOptions(c).message(),
            "--max_connection_age_s=2147484: must be in [0, 2147483]");
  c = {};
  c.min_client_ping_interval_s = -1;
  auto s = TryStart(c);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "--min_client_ping_interval_s=-1: must be in [0, 2147483]");
}

}  // namespace
}  // namespace hstu::server
