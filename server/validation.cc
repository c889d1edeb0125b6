#include "server/validation.h"

namespace hstu::server {

RankRequest FromProto(const hstu::v1::RankRequest& proto) {
  RankRequest r;
  r.user_id = proto.user_id();
  r.history_item_ids.assign(proto.history_item_ids().begin(), proto.history_item_ids().end());
  r.history_actions.assign(proto.history_actions().begin(), proto.history_actions().end());
  r.candidate_item_ids.assign(proto.candidate_item_ids().begin(),
                              proto.candidate_item_ids().end());
  return r;
}

void ToProto(const RankResult& result, const std::string& request_id,
             hstu::v1::RankResponse* proto) {
  proto->set_num_tasks(static_cast<uint32_t>(result.num_tasks));
  proto->mutable_scores()->Assign(result.scores.begin(), result.scores.end());
  proto->set_request_id(request_id);
  proto->set_reused_tokens(result.reused_tokens);
  proto->set_computed_tokens(result.computed_tokens);
  proto->set_cache_result(LookupResultName(result.cache_result));
}

absl::Status ValidateForEngine(const RankRequest& request, const Engine& engine) {
  // The engine owns the rules (ids, actions, candidate limits); its messages name the fields,
  // which are spelled as in ranking.proto.
  return engine.Validate(request);
}

hstu::v1::ModelInfo MakeModelInfo(const Engine& engine) {
  const ModelConfig& c = engine.config();
  hstu::v1::ModelInfo info;
  info.set_model_name(c.model_name);
  info.set_num_layers(static_cast<uint32_t>(c.num_layers));
  info.set_hidden_dim(static_cast<uint32_t>(c.hidden_dim));
  info.set_num_heads(static_cast<uint32_t>(c.num_heads));
  info.set_head_dim(static_cast<uint32_t>(c.head_dim));
  info.set_num_tasks(static_cast<uint32_t>(c.num_tasks));
  info.set_max_history_tokens(static_cast<uint32_t>(c.max_history_tokens));
  const int64_t limit = engine.options().limits.max_candidates;
  info.set_max_candidates(static_cast<uint32_t>(limit > 0 ? limit : c.max_candidates));
  info.set_device(engine.device_name());
  info.set_page_size(static_cast<uint32_t>(engine.options().page_size));
  info.set_num_actions(static_cast<uint32_t>(c.action_rows));
  info.set_item_rows(static_cast<uint64_t>(c.item_rows));
  info.set_truncation_stride(static_cast<uint32_t>(c.truncation_stride()));
  info.set_candidates_per_forward(static_cast<uint32_t>(c.max_candidates));
  return info;
}

}  // namespace hstu::server
