// hstu_loadgen --replay=FILE: the visits of a JSONL request file (client/request_line.h: the lines
// hstu_rank scores, or what hstu_loadgen --record wrote from another run or another server) sent
// instead of the traffic model's, so that a team can load the server with its own users'
// histories and candidates.
//
// Order: the file's. A line whose user has a visit in flight waits (behind at most kMaxHeld
// others) until that visit is answered, and the lines after it go ahead meanwhile, so that a
// user's visits reach the server one at a time and in the file's order, as one person's app sends
// them (the traffic model's rule; without it a later, longer history could overtake an earlier
// one and cut the user's cache). No line of the next pass goes while one of this pass waits.
// When every user in reach has a visit in flight, Next() waits until one is answered: a run
// cannot have more visits in flight than the file has users ready. With `overlapping` every line
// goes in the file's order at once, and Next() never waits.
//
// At the end of the file the replay starts again from its first line (passes() counts the
// times). The histories are then those the server already holds: the later passes measure cache
// hits with nothing new to compute, which the report says.
//
// Thread-safety: Next() and Done() are thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
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

  // Waits while every user in reach has a visit in flight (not with `overlapping`).
  Visit Next() override;
  std::optional<Visit> NextUnless(const std::function<bool()>& stop) override;
  void Done(const Visit& visit) override;

  int64_t num_lines() const { return static_cast<int64_t>(visits_.size()); }
  int64_t num_users() const { return static_cast<int64_t>(in_flight_.size()); }
  // Lines that carry 'expected_scores' (not checked here: hstu_rank checks them).
  int64_t num_lines_with_scores() const { return lines_with_scores_; }
  // Times the replay went back to the file's first line: the pass of the latest line sent.
  int64_t passes() const;

 private:
  class Builder;
  // A line of the file in one pass through it (0: the first).
  struct LineOfPass {
    int64_t line = 0;
    int64_t pass = 0;
  };
  ReplayTraffic(std::vector<Visit> visits, std::vector<uint8_t> first_of_user, int64_t users,
                int64_t lines_with_scores, bool overlapping);
  // Which line goes next, marked in flight; none while every user in reach is busy. Under mu_.
  std::optional<LineOfPass> PickLocked();
  // `l` marked in flight. Under mu_.
  LineOfPass TakeLocked(LineOfPass l);
  // The file's next line; at its end, the first line of the next pass. Under mu_.
  LineOfPass NextLineLocked();

  const std::vector<Visit> visits_;           // slot: the user's index in in_flight_
  const std::vector<uint8_t> first_of_user_;  // 1 where the line is its user's first in the file
  const int64_t lines_with_scores_;
  const bool overlapping_;
  mutable std::mutex mu_;
  std::condition_variable user_free_;  // a user's last visit in flight was answered
  std::vector<int32_t> in_flight_;     // by user slot
  std::deque<LineOfPass> held_;        // lines waiting for their user, in the file's order
  int64_t next_ = 0;                   // the file's next line to read in pass `pass_`
  int64_t pass_ = 0;
  int64_t sent_pass_ = 0;  // the pass of the latest line sent
};

}  // namespace hstu::loadgen
