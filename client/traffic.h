// Returning-user traffic for hstu_loadgen (DESIGN §10): a population of users with Zipf
// popularity; each visit re-sends the user's full history grown by a few events since the last
// visit, plus candidates; a fraction of visits bring a brand-new user who replaces the slot.
//
// Histories are not stored: event i of user u is a pure function of (seed, u, i), so millions of
// users with long histories cost 16 bytes each.
//
// Thread-safety: Next() and Done() are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <vector>

#include "absl/status/statusor.h"

namespace hstu::loadgen {

// Largest user population: the model keeps 24 bytes a user (its CDF and slot), 2.4 GB at this cap.
inline constexpr int64_t kMaxUsers = 100'000'000;

struct TrafficOptions {
  int64_t num_users = 1000;
  double zipf_s = 1.0;           // popularity of the user at rank r is proportional to r^-s
  double new_user_rate = 0.01;   // fraction of visits that bring a new user
  int32_t initial_events_min = 1;
  int32_t initial_events_max = 64;  // a new user's history length is uniform in [min, max]
  int32_t new_events_min = 1;
  int32_t new_events_max = 4;       // each return visit adds uniform [min, max] events
  int32_t max_events = 512;         // a user whose history would exceed this starts over
  int32_t num_candidates = 64;
  int64_t item_space = 1000000;     // item ids are drawn from [0, item_space)
  int32_t num_actions = 16;         // action ids are drawn from [0, num_actions)
  uint64_t seed = 1;
  // false: a visit goes to a user with no visit in flight (drawn again by popularity, else the
  // next such user), as one person's app asks one request at a time; only when every user has one
  // in flight does a second go out. true: the user is drawn by popularity alone, and a visit drawn
  // while another of the same user is in flight re-sends its history (a second surface of the app
  // asking at once). With a small population at high concurrency that queues a popular user's
  // identical requests behind each other in the server.
  bool overlapping_visits = false;
};

struct Visit {
  uint64_t user_id = 0;
  std::vector<int64_t> history_item_ids;
  std::vector<int32_t> history_actions;
  std::vector<int64_t> candidate_item_ids;
  bool new_user = false;
  int64_t slot = -1;  // the user's place in the population, for Done()
};

// Where a run's visits come from: the traffic model below, or a replayed file (replay.h).
// Thread-safe.
class VisitSource {
 public:
  virtual ~VisitSource() = default;
  // The next visit to send, marked in flight until Done(). May wait for a visit in flight to be
  // answered (ReplayTraffic).
  virtual Visit Next() = 0;
  // As Next(), but a wait ends, with none, once `stop` says so (polled; a stop signal).
  virtual std::optional<Visit> NextUnless(const std::function<bool()>& /*stop*/) { return Next(); }
  // The answer to `visit` came back, its call failed, or it was never sent.
  virtual void Done(const Visit& visit) = 0;
};

class TrafficModel final : public VisitSource {
 public:
  static absl::StatusOr<std::unique_ptr<TrafficModel>> Create(const TrafficOptions& options);
  // The next visit, its user drawn by popularity (see overlapping_visits) and marked in flight
  // until Done(). A user's history grows only at a visit drawn while none of the user's visits is
  // in flight (every earlier one answered, so the server has committed it); a second visit in
  // flight re-sends the same history. Before, it grew, and could reach the server ahead of the
  // shorter one, which then cut the user's cache (a traffic artefact reported as partial or
  // hash-mismatch results).
  Visit Next() override;
  void Done(const Visit& visit) override;
  // Rank (0-based) drawn from the Zipf distribution; exposed for tests.
  int64_t SampleRank(double u) const;

 private:
  struct UserSlot {
    uint64_t user_id = 0;
    int32_t num_events = 0;  // 0: not visited yet
    int32_t in_flight = 0;   // visits sent and not yet Done()
  };
  explicit TrafficModel(const TrafficOptions& options);
  // The slot of the next visit: drawn by popularity, avoiding users with a visit in flight unless
  // overlapping_visits (or every user has one). Under mu_.
  int64_t PickSlotLocked();
  // The id of the population's k-th user (k counts every user ever created, restarts included).
  uint64_t UserId(uint64_t k) const;

  const TrafficOptions options_;
  std::vector<double> cdf_;  // [num_users], cumulative Zipf probabilities
  std::mutex mu_;
  std::mt19937_64 rng_;
  std::vector<UserSlot> slots_;
  uint64_t next_user_id_ = 0;
  uint64_t visit_counter_ = 0;
  int64_t users_in_flight_ = 0;  // slots with in_flight > 0
};

// splitmix64: the deterministic mixer behind event and candidate ids.
uint64_t Mix64(uint64_t x);

}  // namespace hstu::loadgen
