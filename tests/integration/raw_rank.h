// Rank over a generic gRPC stub: the request's bytes as given (they need not parse), the reply's
// bytes back. For the tests of what the server does with bytes a typed client cannot send.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace hstu::testing {

inline grpc::Status RankBytes(const std::shared_ptr<grpc::Channel>& channel, const std::string& bytes,
                              std::string* reply) {
  grpc::GenericStub stub(channel);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/hstu.v1.Ranker/Rank", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status s = done.get_future().get();
  std::vector<grpc::Slice> slices;
  reply->clear();
  if (s.ok() && response.Dump(&slices).ok()) {
    for (const auto& sl : slices) reply->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return s;
}

}  // namespace hstu::testing
