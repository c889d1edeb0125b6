// Conversion between the wire messages (hstu.v1) and the engine's request/result structs, and the
// checks a request passes before it is queued (DESIGN §8: INVALID_ARGUMENT naming the field).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "engine/engine.h"
#include "engine/request.h"
#include "hstu/v1/ranking.pb.h"

namespace hstu::server {

// Longest request_id echoed back (INVALID_ARGUMENT beyond): it counts in the largest reply.
inline constexpr size_t kMaxRequestIdBytes = 256;

RankRequest FromProto(const hstu::v1::RankRequest& proto);
void ToProto(const RankResult& result, const std::string& request_id,
             hstu::v1::RankResponse* proto);
// INVALID_ARGUMENT naming the field when the request cannot be served by `engine`.
absl::Status ValidateForEngine(const RankRequest& request, const Engine& engine);
// What GetModelInfo answers.
hstu::v1::ModelInfo MakeModelInfo(const Engine& engine);

}  // namespace hstu::server
