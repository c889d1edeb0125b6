#include "server/rank_service.h"

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/validation.h"

namespace hstu::server {
namespace {

// What a raw method answers when gRPC calls it with no message: the client cancelled or timed
// out before sending one.
constexpr char kNoMessage[] =
    "no request message came (the client cancelled, timed out or sent none)";

// Parses a raw method's request bytes, from a copy that shares their slices (the parse consumes
// its buffer).
template <typename Message>
bool ParseRequest(const grpc::ByteBuffer& bytes, Message* message) {
  grpc::ByteBuffer copy(bytes);
  return grpc::SerializationTraits<Message>::Deserialize(&copy, message).ok();
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl::StatusCode and grpc::StatusCode share their numbering (both follow google.rpc.Code).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

const char* GrpcCodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return "OK";
    case absl::StatusCode::kCancelled: return "CANCELLED";
    case absl::StatusCode::kUnknown: return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound: return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted: return "ABORTED";
    case absl::StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal: return "INTERNAL";
    case absl::StatusCode::kUnavailable: return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss: return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

absl::Status AsSeenByTheClient(absl::Status status, Clock::time_point deadline,
                               Clock::time_point now) {
  if (!status.ok() && !absl::IsCancelled(status)) return status;  // the server's own failure
  if (deadline != Clock::time_point::max() &&
      now + kDeadlineSlack >= deadline) {
    return absl::DeadlineExceededError("deadline expired before the answer");
  }
  return absl::CancelledError("call was cancelled before the answer");
}

absl::Status AsCounted(absl::Status status, bool cancelled, Clock::time_point deadline,
                       Clock::time_point now) {
  if (cancelled || (status.ok() && now >= deadline)) {
    return AsSeenByTheClient(std::move(status), deadline, now);
  }
  return status;
}

std::optional<std::chrono::nanoseconds> TimeLeft(gpr_timespec deadline, gpr_timespec now) {
  if (gpr_time_cmp(deadline, gpr_inf_future(deadline.clock_type)) == 0) return std::nullopt;
  const gpr_timespec left = gpr_time_sub(deadline, now);
  if (left.tv_sec < 0) return std::chrono::nanoseconds(0);
  if (left.tv_sec >= std::chrono::duration_cast<std::chrono::seconds>(kFarDeadline).count()) {
    return std::nullopt;
  }
  return std::chrono::seconds(left.tv_sec) + std::chrono::nanoseconds(left.tv_nsec);
}

void RankService::Attach(const Engine* engine, Scheduler* scheduler) {
  attached_holder_ = std::make_unique<Attached>(Attached{engine, scheduler, MakeModelInfo(*engine)});
  attached_.store(attached_holder_.get(), std::memory_order_release);
}

grpc::ServerUnaryReactor* RankService::GetModelInfo(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const Attached* a = attached_.load(std::memory_order_acquire);
  hstu::v1::GetModelInfoRequest parsed;
  if (a == nullptr) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "model is loading"));
  } else if (!admitting_.load()) {  // as Rank: a draining server takes no new calls
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is shutting down"));
  } else if (!request->Valid()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::CANCELLED, kNoMessage));
  } else if (!ParseRequest(*request, &parsed)) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "the request does not parse as hstu.v1.GetModelInfoRequest "
                                 "(truncated or invalid wire data)"));
  } else {
    bool own_buffer;
    reactor->Finish(
        grpc::SerializationTraits<hstu::v1::ModelInfo>::Serialize(a->info, response, &own_buffer)
                .ok()
            ? grpc::Status::OK
            : grpc::Status(grpc::StatusCode::INTERNAL, "the model info could not be serialized"));
  }
  return reactor;
}

grpc::ServerUnaryReactor* RankService::Rank(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request_bytes,
                                            grpc::ByteBuffer* response) {
  const Clock::time_point arrived = Clock::now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  metrics_->AddInflight(1);
  inflight_.fetch_add(1);
  ServerMetrics* metrics = metrics_;
  // The call's deadline on both clocks, from gRPC's raw time (its std::chrono conversion overflows
  // for the far deadlines some clients send).
  const gpr_timespec raw_deadline = context->raw_deadline();
  const std::optional<std::chrono::nanoseconds> left =
      TimeLeft(raw_deadline, gpr_now(raw_deadline.clock_type));
  const Clock::time_point client_deadline =
      left ? arrived + std::chrono::duration_cast<Clock::duration>(*left) : Clock::time_point::max();
  // Answers the RPC, the one way every answer ends.
  auto answer = [this, reactor, metrics](const absl::Status& status) {
    metrics->AddInflight(-1);
    reactor->Finish(ToGrpcStatus(status));
    inflight_.fetch_sub(1);
  };
  // Answers the RPC exactly once, from whichever thread finishes it, counted in the metrics and,
  // when slow, in the slow-request log (`record`: what the call got to).
  RequestLog* log = &request_log_;
  auto finish = [answer, metrics, log, arrived, context, client_deadline](
                    absl::Status status, RequestRecord record = {}) {
    // A call the client gave up on got no answer, whatever the batch computed: it is counted as
    // the client saw it. (What is sent stays the answer: gRPC drops it when the call has ended.)
    const Clock::time_point now = Clock::now();
    const absl::Status counted = AsCounted(status, context->IsCancelled(), client_deadline, now);
    const double total = std::chrono::duration<double>(now - arrived).count();
    metrics->ObserveRequest(GrpcCodeName(counted.code()), total);
    answer(status);
    // Logged once answered: the line's I/O holds up no answer (this may be the scheduler's
    // thread, with the rest of the batch still to answer).
    if (log->Slow(total)) {
      record.total_seconds = total;
      record.code = counted.code();
      record.error = counted.message();
      log->Write(record);
    }
  };

  // The refusals of a server not serving (still loading, or draining) are counted as such, not
  // as answers in hstu_requests_total, where an UNAVAILABLE reads as the server's failure (clients
  // probing a restarting replica would push the error ratio alert towards firing).
  const Attached* a = attached_.load(std::memory_order_acquire);
  if (a == nullptr) {
    metrics->CountQueueRejection(SubmitRejectionName(SubmitRejection::kStarting));
    answer(absl::UnavailableError("model is loading"));
    return reactor;
  }
  if (!admitting_.load()) {
    metrics->CountQueueRejection(SubmitRejectionName(SubmitRejection::kShuttingDown));
    answer(absl::UnavailableError("server is shutting down"));
    return reactor;
  }
  // No bytes at all (not even an empty message): the client cancelled or timed out before its
  // message came, and gRPC calls the method anyway. Counted as the client ended it, not as a
  // request that does not parse.
  if (!request_bytes->Valid()) {
    finish(AsSeenByTheClient(absl::CancelledError(kNoMessage), client_deadline, Clock::now()));
    return reactor;
  }
  // Parsed here, after the refusals above (which need no request).
  hstu::v1::RankRequest request;
  if (!ParseRequest(*request_bytes, &request)) {
    finish(absl::InvalidArgumentError(
        "the request does not parse as hstu.v1.RankRequest (truncated or invalid wire data, or "
        "a string field such as request_id that is not UTF-8)"));
    return reactor;
  }
  // The slow-request log's view of the request. Its request_id views `request`, which lives until
  // this method returns; the callback below points it at its own copy.
  RequestRecord seen;
  seen.parsed = true;
  seen.request_id = request.request_id();
  seen.user_id = request.user_id();
  seen.num_events = request.history_item_ids_size();
  seen.num_candidates = request.candidate_item_ids_size();
  if (request.request_id().size() > kMaxRequestIdBytes) {
    finish(absl::InvalidArgumentError(absl::StrCat("request_id has ", request.request_id().size(),
                                                   " bytes, more than the limit of ",
                                                   kMaxRequestIdBytes)),
           seen);
    return reactor;
  }
  RankRequest rank_request = FromProto(request);
  if (absl::Status s = ValidateForEngine(rank_request, *a->engine); !s.ok()) {
    finish(s, seen);
    return reactor;
  }

  PendingRank pending;
  pending.request = std::move(rank_request);
  if (left) pending.deadline = arrived + std::chrono::duration_cast<Clock::duration>(*left);
  pending.is_cancelled = [context] { return context->IsCancelled(); };
  std::string request_id = request.request_id();
  pending.done = [finish, response, metrics, seen, request_id = std::move(request_id)](
                     absl::StatusOr<RankResult> result, const RequestTiming& timing) {
    metrics->ObserveQueue(timing.queue_seconds);
    RequestRecord record = seen;
    record.request_id = request_id;
    record.queued = true;
    record.queue_seconds = timing.queue_seconds;
    record.batch_size = timing.batch_size;
    record.compute_seconds = timing.compute_seconds;
    absl::Status status = result.status();
    if (result.ok()) {
      record.answered = true;
      record.reused_tokens = result->reused_tokens;
      record.computed_tokens = result->computed_tokens;
      record.cache_result = LookupResultName(result->cache_result);
      hstu::v1::RankResponse reply;
      ToProto(*result, request_id, &reply);
      bool own_buffer;
      if (!grpc::SerializationTraits<hstu::v1::RankResponse>::Serialize(reply, response, &own_buffer)
               .ok()) {
        status = absl::InternalError("the answer could not be serialized");
      }
    }
    finish(status, record);
  };
  SubmitRejection rejection;
  if (absl::Status s = a->scheduler->Submit(std::move(pending), &rejection); !s.ok()) {
    metrics->CountQueueRejection(SubmitRejectionName(rejection));
    // A full queue is an answer (RESOURCE_EXHAUSTED, counted with the others); a drain that
    // began after the admission check above is a refusal like the check's own, counted only as
    // shutting_down (before: also an UNAVAILABLE in hstu_requests_total, the error ratio's).
    if (rejection == SubmitRejection::kShuttingDown) {
      answer(s);
    } else {
      finish(s, seen);
    }
  }
  return reactor;
}

}  // namespace hstu::server
