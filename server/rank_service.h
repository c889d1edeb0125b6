// The hstu.v1.Ranker front end (gRPC callback API) over the Scheduler. Until Attach() the model is
// still loading and both RPCs answer UNAVAILABLE.
//
// Thread-safety: RPC handlers run on gRPC threads; Attach() may be called once from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>

#include <grpc/support/time.h>
#include <grpcpp/grpcpp.h>

#include "engine/engine.h"
#include "hstu/v1/ranking.grpc.pb.h"
#include "server/metrics.h"
#include "server/request_log.h"
#include "server/scheduler.h"

namespace hstu::server {

// Both methods take the request's bytes (raw methods) and parse them themselves: bytes that do
// not parse are answered INVALID_ARGUMENT (Rank's also counted). (gRPC's own parse refuses them
// as UNIMPLEMENTED, with no message, as if the method did not exist, before any metric sees them.)
class RankService final
    : public hstu::v1::Ranker::WithRawCallbackMethod_GetModelInfo<
          hstu::v1::Ranker::WithRawCallbackMethod_Rank<hstu::v1::Ranker::CallbackService>> {
 public:
  explicit RankService(ServerMetrics* metrics, const RequestLogOptions& request_log = {})
      : metrics_(metrics), request_log_(request_log) {}

  // `engine` and `scheduler` must outlive every RPC (the server shuts down before they go).
  void Attach(const Engine* engine, Scheduler* scheduler);

  // request: a serialized hstu.v1.RankRequest; response: the serialized hstu.v1.RankResponse.
  grpc::ServerUnaryReactor* Rank(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  // request: a serialized hstu.v1.GetModelInfoRequest; response: the serialized hstu.v1.ModelInfo.
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

  // From now on Rank and GetModelInfo answer UNAVAILABLE ("server is shutting down") at once
  // (the drain).
  void StopAdmitting() { admitting_.store(false); }
  // Rank calls received and not yet answered.
  int64_t InFlight() const { return inflight_.load(); }
  // The slow-request log, for its counts of the lines held back (RequestLog::Flush, FlushEnded).
  RequestLog& request_log() { return request_log_; }

 private:
  struct Attached {
    const Engine* engine;
    Scheduler* scheduler;
    hstu::v1::ModelInfo info;
  };
  ServerMetrics* const metrics_;
  RequestLog request_log_;
  std::unique_ptr<Attached> attached_holder_;
  std::atomic<const Attached*> attached_{nullptr};
  std::atomic<bool> admitting_{true};
  std::atomic<int64_t> inflight_{0};
};

grpc::Status ToGrpcStatus(const absl::Status& status);
// "OK", "INVALID_ARGUMENT", ... (the gRPC code names, used as the metrics' code label).
const char* GrpcCodeName(absl::StatusCode code);

// A client's deadline passes about one network trip before the server's copy of it (gRPC sends a
// timeout, which the server counts from when the call arrives): a cancel this close to the
// server's deadline is taken for the deadline.
inline constexpr std::chrono::milliseconds kDeadlineSlack{5};

// The time left before a call's deadline `deadline` at `now` (gRPC's raw times, of one clock
// type), or nullopt when the call has none: no deadline, or one further than kFarDeadline (a
// client's "forever" is often ~292 years, past what std::chrono's nanosecond clocks hold).
inline constexpr std::chrono::hours kFarDeadline{24 * 365};
std::optional<std::chrono::nanoseconds> TimeLeft(gpr_timespec deadline, gpr_timespec now);

// The status of a call the client gave up on (cancelled, or past its deadline) before the server
// answered, as the client saw it: DEADLINE_EXCEEDED within kDeadlineSlack of `deadline` (the
// server's copy), otherwise CANCELLED. The server's own failures (other than CANCELLED) are kept:
// they are what an operator needs to see.
absl::Status AsSeenByTheClient(absl::Status status, Clock::time_point deadline,
                               Clock::time_point now);

// The status a finished call is counted with: as the client saw it (AsSeenByTheClient) when the
// call shows as cancelled, or when an OK answer was ready only at or after the server's copy of the
// deadline (gRPC drops that answer, though the call may not show as cancelled yet: the deadline's
// timer races the thread that answers); otherwise the status answered. Times on the steady clock
// (a system clock stepped by NTP would move the deadline).
absl::Status AsCounted(absl::Status status, bool cancelled, Clock::time_point deadline,
                       Clock::time_point now);

}  // namespace hstu::server
