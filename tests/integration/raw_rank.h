// Rank over a generic gRPC stub: the request's bytes as given (they need not parse), the reply's
// bytes back. For the tests of what the server does with bytes a typed client cannot send.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hstu/v1/ranking.pb.h"

namespace hstu::testing {

// `r`'s bytes with a request_id of one byte, 0xff: not UTF-8, which a proto3 string must be.
// (Fields may come in any order: field 5, length-delimited, is appended.)
inline std::string WithNonUtf8RequestId(hstu::v1::RankRequest r) {
  r.clear_request_id();
  return r.SerializeAsString() + std::string("\x2a\x01\xff", 3);
}

// Calls `method` ("/hstu.v1.Ranker/Rank") with `bytes` as the request; *reply gets the answer's.
inline grpc::Status CallBytes(const std::shared_ptr<grpc::Channel>& channel,
                              const std::string& method, const std::string& bytes,
                              std::string* reply) {
  grpc::GenericStub stub(channel);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status s = done.get_future().get();
  std::vector<grpc::Slice> slices;
  reply->clear();
  if (s.ok() && response.Dump(&slices).ok()) {
    for (const auto& sl : slices) reply->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return s;
}

inline grpc::Status RankBytes(const std::shared_ptr<grpc::Channel>& channel, const std::string& bytes,
                              std::string* reply) {
  return CallBytes(channel, "/hstu.v1.Ranker/Rank", bytes, reply);
}

// Starts a Rank call and never sends its message: the call's headers only, then `end` (a cancel,
// or its deadline `timeout` passing). Returns once the client has seen the call end.
enum class CallEnd { kCancel, kDeadline };
inline void RankWithoutAMessage(const std::shared_ptr<grpc::Channel>& channel, CallEnd end,
                                std::chrono::milliseconds timeout) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&ctx, "/hstu.v1.Ranker/Rank", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);  // the headers went out
  if (end == CallEnd::kCancel) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server has the call
    ctx.TryCancel();
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(2));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(2)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace hstu::testing
