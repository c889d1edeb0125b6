#include "engine/request.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hstu {

absl::Status ValidateRankRequest(const RankRequest& r, const ModelConfig& c, const RequestLimits& limits) {
  if (r.history_item_ids.size() != r.history_actions.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "history_actions has ", r.history_actions.size(), " entries but history_item_ids has ",
        r.history_item_ids.size(), "; they must have the same length"));
  }
  if (limits.max_history_events > 0 &&
      static_cast<int64_t>(r.history_item_ids.size()) > limits.max_history_events) {
    return absl::InvalidArgumentError(absl::StrCat("history_item_ids has ", r.history_item_ids.size(),
                                                   " events, more than the limit of ",
                                                   limits.max_history_events));
  }
  // Branch-free passes that the compiler vectorises (8 users of 4096 tokens: 8.5 -> 6.5 µs here,
  // the data in L2); only a request that fails them is scanned again to name the first bad entry.
  const int64_t* items = r.history_item_ids.data();
  const int32_t* actions = r.history_actions.data();
  const size_t n = r.history_item_ids.size();
  uint64_t any_negative_item = 0;
  uint32_t any_bad_action = 0;
  // Capped at 2^31: any int32 action at or above the cap as an unsigned value is negative.
  const uint32_t action_rows =
      static_cast<uint32_t>(std::clamp<int64_t>(c.action_rows, 0, int64_t{1} << 31));
  for (size_t i = 0; i < n; ++i) any_negative_item |= static_cast<uint64_t>(items[i]);
  // A negative action wraps to a large unsigned value, so one compare covers both ends.
  for (size_t i = 0; i < n; ++i) {
    any_bad_action |= static_cast<uint32_t>(actions[i]) >= action_rows ? 1u : 0u;
  }
  const bool history_ok = (any_negative_item >> 63) == 0 && any_bad_action == 0;
  for (size_t i = 0; !history_ok && i < r.history_item_ids.size(); ++i) {
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
  uint64_t any_negative_candidate = 0;
  for (int64_t id : r.candidate_item_ids) any_negative_candidate |= static_cast<uint64_t>(id);
  for (size_t i = 0; (any_negative_candidate >> 63) != 0 && i < r.candidate_item_ids.size(); ++i) {
    if (r.candidate_item_ids[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("candidate_item_ids[", i, "] = ", r.candidate_item_ids[i], " is negative"));
    }
  }
  return absl::OkStatus();
}

}  // namespace hstu
