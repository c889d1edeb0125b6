// hstu_loadgen --replay=FILE: the visits of a JSONL request file (client/request_line.h: the lines
// hstu_rank scores, or what hstu_loadgen --record wrote from another run or another server) sent
// instead of the traffic model's, so that a team can load the server with its own users'
// histories and candidates.
//
// Order: the file's. A line whose user has a visit in flight waits (behind at most kMaxHeld
// others) until that visit is answered, and the lines after it go ahead meanwhile, so that a
// user's visits reach the server one at a time and in the file's order, as one person's app sends
// them (the traffic model's rule; without it a later, longer history could overtake an earlier
// one and cut the user's cache). With `overlapping` every line goes in the file's order at once.
// When every user in reach has a visit in flight, the oldest waiting line goes anyway.
//
// At the end of the file the replay starts again from its first line (passes() counts the
// times). The histories are then those the server already holds: the later passes measure cache
// hits with nothing new to compute, which the report says.
//
// Thread-safety: Next() and Done() are thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "client/traffic.h"

namespace hstu::loadgen {

class ReplayTraffic final : public VisitSource {
 public:
  // Lines waiting for their user's visit in flight, at most.
  static constexpr size_t kMaxHeld = 4096;

  // Reads `path` (blank lines skipped). An error names the file and the line: a line that does
  // not parse (hstu_rank's rules), or a file without a request.
  static absl::StatusOr<std::unique_ptr<ReplayTraffic>> Load(const std::string& path,
                                                             bool overlapping);
  // The same from lines already read (tests); `name` stands for the file in errors.
  static absl::StatusOr<std::unique_ptr<ReplayTraffic>> FromLines(
      const std::vector<std::string>& lines, const std::string& name, bool overlapping);

  Visit Next() override;
  void Done(const Visit& visit) override;

  int64_t lines() const { return static_cast<int64_t>(visits_.size()); }
  int64_t users() const { return static_cast<int64_t>(in_flight_.size()); }
  // Lines that carry 'expected_scores' (ignored here: hstu_rank checks them).
  int64_t lines_with_scores() const { return lines_with_scores_; }
  // Times the replay went back to the file's first line.
  int64_t passes() const;

 private:
  ReplayTraffic(std::vector<Visit> visits, std::vector<int32_t> first_visit_of_user,
                int64_t users, int64_t lines_with_scores, bool overlapping);
  // The visit of line `i`, marked in flight. Under mu_.
  Visit TakeLocked(int64_t i);
  // The next line of the file, wrapping at its end. Under mu_.
  int64_t NextLineLocked();

  const std::vector<Visit> visits_;  // slot: the user's index in in_flight_
  const std::vector<int32_t> first_visit_;  // 1 where the line is its user's first in the file
  const int64_t lines_with_scores_;
  const bool overlapping_;
  mutable std::mutex mu_;
  std::vector<int32_t> in_flight_;  // by user slot
  std::deque<int64_t> held_;        // lines waiting for their user, in the file's order
  int64_t next_ = 0;
  int64_t passes_ = 0;
};

}  // namespace hstu::loadgen
