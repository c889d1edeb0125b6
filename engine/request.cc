#include "engine/request.h"

#include "absl/strings/str_cat.h"

namespace hstu {

absl::Status ValidateRankRequest(const RankRequest& r, const ModelConfig& c, const RequestLimits& limits) {
  if (r.history_item_ids.size() != r.history_actions.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "history_actions has ", r.history_actions.size(), " entries but history_item_ids has ",
        r.history_item_ids.size(), "; they must have the same length"));
  }
  if (static_cast<int64_t>(r.history_item_ids.size()) > limits.max_history_events) {
    return absl::InvalidArgumentError(absl::StrCat("history_item_ids has ", r.history_item_ids.size(),
                                                   " events, more than the limit of ",
                                                   limits.max_history_events));
  }
  for (size_t i = 0; i < r.history_item_ids.size(); ++i) {
    if (r.history_item_ids[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("history_item_ids[", i, "] = ", r.history_item_ids[i], " is negative"));
    }
    if (r.history_actions[i] < 0 || r.history_actions[i] >= c.action_rows) {
      return absl::InvalidArgumentError(absl::StrCat("history_actions[", i, "] = ", r.history_actions[i],
                                                     " is out of range [0, ", c.action_rows, ")"));
    }
  }
  if (r.candidate_item_ids.empty()) {
    return absl::InvalidArgumentError("candidate_item_ids is empty: at least one candidate is needed");
  }
  if (limits.max_candidates > 0 && static_cast<int64_t>(r.candidate_item_ids.size()) > limits.max_candidates) {
    return absl::InvalidArgumentError(absl::StrCat("candidate_item_ids has ", r.candidate_item_ids.size(),
                                                   " entries, more than the limit of ",
                                                   limits.max_candidates));
  }
  for (size_t i = 0; i < r.candidate_item_ids.size(); ++i) {
    if (r.candidate_item_ids[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("candidate_item_ids[", i, "] = ", r.candidate_item_ids[i], " is negative"));
    }
  }
  return absl::OkStatus();
}

}  // namespace hstu
