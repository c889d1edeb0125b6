#include "client/traffic.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace hstu::loadgen {

uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

absl::StatusOr<std::unique_ptr<TrafficModel>> TrafficModel::Create(const TrafficOptions& o) {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (o.num_users < 1 || o.num_users > kMaxUsers) {
    return bad(absl::StrCat("users must be in [1, ", kMaxUsers, "], got ", o.num_users));
  }
  if (!(o.zipf_s >= 0) || !std::isfinite(o.zipf_s)) {
    return bad(absl::StrCat("zipf must be finite and >= 0, got ", o.zipf_s));
  }
  if (!(o.new_user_rate >= 0 && o.new_user_rate <= 1)) {
    return bad(absl::StrCat("new_user_rate must be in [0, 1], got ", o.new_user_rate));
  }
  if (o.initial_events_min < 1 || o.initial_events_max < o.initial_events_min) {
    return bad(absl::StrCat("initial events range [", o.initial_events_min, ", ",
                            o.initial_events_max, "] is empty or starts below 1"));
  }
  if (o.new_events_min < 1 || o.new_events_max < o.new_events_min) {
    return bad(absl::StrCat("new events range [", o.new_events_min, ", ", o.new_events_max,
                            "] is empty or starts below 1"));
  }
  if (o.max_events < o.initial_events_max) {
    return bad(absl::StrCat("max_events (", o.max_events, ") < initial_events_max (",
                            o.initial_events_max, ")"));
  }
  if (o.num_candidates < 1) return bad("candidates must be >= 1");
  if (o.item_space < 1 || o.num_actions < 1) return bad("item_space and num_actions must be >= 1");
  return std::unique_ptr<TrafficModel>(new TrafficModel(o));
}

TrafficModel::TrafficModel(const TrafficOptions& options)
    : options_(options), rng_(Mix64(options.seed)) {
  cdf_.resize(options_.num_users);
  double acc = 0;
  for (int64_t r = 0; r < options_.num_users; ++r) {
    acc += std::pow(static_cast<double>(r + 1), -options_.zipf_s);
    cdf_[r] = acc;
  }
  for (double& c : cdf_) c /= acc;
  slots_.resize(options_.num_users);
  for (auto& s : slots_) s.user_id = UserId(next_user_id_++);
}

uint64_t TrafficModel::UserId(uint64_t k) const {
  // Spread out (not 0..N) so that hashing load balancers see realistic keys, and keyed by the
  // seed's mix, so that two seeds' populations do not share ids (with `seed * C + k` the user
  // k + C of one seed was the user k of the next).
  return Mix64(Mix64(options_.seed) ^ k) >> 1;
}

int64_t TrafficModel::SampleRank(double u) const {
  const auto it = std::lower_bound(cdf_.begin(), cdf_.end(), u);
  return std::min<int64_t>(it - cdf_.begin(), options_.num_users - 1);
}

void TrafficModel::Done(const Visit& visit) {
  if (visit.slot < 0 || visit.slot >= options_.num_users) return;
  std::lock_guard<std::mutex> lock(mu_);
  int32_t& in_flight = slots_[visit.slot].in_flight;
  if (in_flight == 0) return;
  if (--in_flight == 0) --users_in_flight_;
}

int64_t TrafficModel::PickSlotLocked() {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int64_t first = SampleRank(unit(rng_));
  if (options_.overlapping_visits || slots_[first].in_flight == 0 ||
      users_in_flight_ >= options_.num_users) {
    return first;
  }
  // Popularity among the users free now: draw again while the draws keep hitting users in
  // flight, then take the next free user after the last draw (a busy population's tail).
  int64_t slot = first;
  for (int tries = 0; tries < 64; ++tries) {
    slot = SampleRank(unit(rng_));
    if (slots_[slot].in_flight == 0) return slot;
  }
  for (int64_t i = 1; i < options_.num_users; ++i) {
    const int64_t s = (slot + i) % options_.num_users;
    if (slots_[s].in_flight == 0) return s;
  }
  return first;  // not reached: users_in_flight_ < num_users
}

Visit TrafficModel::Next() {
  Visit v;
  int32_t num_events = 0;
  uint64_t visit_idx = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    v.slot = PickSlotLocked();
    UserSlot& slot = slots_[v.slot];
    // A user with a visit in flight keeps its history (and its id) for this one.
    if (slot.in_flight++ == 0) {
      ++users_in_flight_;
      const bool churn = unit(rng_) < options_.new_user_rate;
      std::uniform_int_distribution<int32_t> add(options_.new_events_min, options_.new_events_max);
      const int32_t grown = slot.num_events + add(rng_);
      if (churn || (slot.num_events > 0 && grown > options_.max_events)) {
        slot.user_id = UserId(next_user_id_++);
        slot.num_events = 0;
      }
      if (slot.num_events == 0) {
        std::uniform_int_distribution<int32_t> initial(options_.initial_events_min,
                                                       options_.initial_events_max);
        slot.num_events = initial(rng_);
        v.new_user = true;
      } else {
        slot.num_events = grown;
      }
    }
    v.user_id = slot.user_id;
    num_events = slot.num_events;
    visit_idx = visit_counter_++;
  }
  v.history_item_ids.resize(num_events);
  v.history_actions.resize(num_events);
  const uint64_t user_key = Mix64(v.user_id ^ Mix64(options_.seed));
  for (int32_t i = 0; i < num_events; ++i) {
    const uint64_t h = Mix64(user_key + static_cast<uint64_t>(i));
    v.history_item_ids[i] = static_cast<int64_t>(h % static_cast<uint64_t>(options_.item_space));
    v.history_actions[i] = static_cast<int32_t>((h >> 40) % static_cast<uint64_t>(options_.num_actions));
  }
  v.candidate_item_ids.resize(options_.num_candidates);
  const uint64_t visit_key = Mix64(visit_idx ^ Mix64(options_.seed + 17));
  for (int32_t c = 0; c < options_.num_candidates; ++c) {
    v.candidate_item_ids[c] = static_cast<int64_t>(
        Mix64(visit_key + static_cast<uint64_t>(c)) % static_cast<uint64_t>(options_.item_space));
  }
  return v;
}

}  // namespace hstu::loadgen
