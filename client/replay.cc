#include "client/replay.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "client/request_line.h"

namespace hstu::loadgen {

// The visits of a file, one line at a time: a line is parsed as it is read, so a recording of
// long histories is held once, as visits, not also as text.
class ReplayTraffic::Builder {
 public:
  explicit Builder(std::string name) : name_(std::move(name)) {}

  // Line `n` (1-based) of the file.
  absl::Status Add(int64_t n, const std::string& line) {
    if (client::IsBlankRequestLine(line)) return absl::OkStatus();
    absl::StatusOr<client::RequestLine> parsed = client::ParseRequestLine(line);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ":", n, ": ", parsed.status().message()));
    }
    if (parsed->expected_scores.has_value()) ++with_scores_;
    Visit v;
    v.user_id = parsed->user_id;
    v.history_item_ids = std::move(parsed->history_item_ids);
    v.history_actions = std::move(parsed->history_actions);
    v.candidate_item_ids = std::move(parsed->candidate_item_ids);
    const auto [it, inserted] = slots_.try_emplace(v.user_id, static_cast<int64_t>(slots_.size()));
    v.slot = it->second;
    first_of_user_.push_back(inserted ? 1 : 0);
    visits_.push_back(std::move(v));
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<ReplayTraffic>> Finish(bool overlapping) {
    if (visits_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(name_, ": no request line to replay"));
    }
    return std::unique_ptr<ReplayTraffic>(
        new ReplayTraffic(std::move(visits_), std::move(first_of_user_),
                          static_cast<int64_t>(slots_.size()), with_scores_, overlapping));
  }

 private:
  const std::string name_;
  std::vector<Visit> visits_;
  std::vector<uint8_t> first_of_user_;
  std::unordered_map<uint64_t, int64_t> slots_;
  int64_t with_scores_ = 0;
};

absl::StatusOr<std::unique_ptr<ReplayTraffic>> ReplayTraffic::Load(const std::string& path,
                                                                   bool overlapping) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("--replay file ", path, " is a directory"));
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --replay file ", path));
  Builder builder(path);
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) {
    if (absl::Status s = builder.Add(++n, line); !s.ok()) return s;
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("reading --replay file ", path, " failed"));
  return builder.Finish(overlapping);
}

absl::StatusOr<std::unique_ptr<ReplayTraffic>> ReplayTraffic::FromLines(
    const std::vector<std::string>& lines, const std::string& name, bool overlapping) {
  Builder builder(name);
  for (size_t n = 0; n < lines.size(); ++n) {
    if (absl::Status s = builder.Add(static_cast<int64_t>(n) + 1, lines[n]); !s.ok()) return s;
  }
  return builder.Finish(overlapping);
}

ReplayTraffic::ReplayTraffic(std::vector<Visit> visits, std::vector<uint8_t> first_of_user,
                             int64_t users, int64_t lines_with_scores, bool overlapping)
    : visits_(std::move(visits)),
      first_of_user_(std::move(first_of_user)),
      lines_with_scores_(lines_with_scores),
      overlapping_(overlapping),
      in_flight_(static_cast<size_t>(users), 0) {}

int64_t ReplayTraffic::passes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sent_pass_;
}

ReplayTraffic::LineOfPass ReplayTraffic::NextLineLocked() {
  if (next_ == num_lines()) {
    next_ = 0;
    ++pass_;
  }
  return LineOfPass{next_++, pass_};
}

ReplayTraffic::LineOfPass ReplayTraffic::TakeLocked(LineOfPass l) {
  ++in_flight_[visits_[l.line].slot];
  sent_pass_ = std::max(sent_pass_, l.pass);
  return l;
}

std::optional<ReplayTraffic::LineOfPass> ReplayTraffic::PickLocked() {
  if (overlapping_) return TakeLocked(NextLineLocked());
  // A waiting line whose user is free goes first: it is older than any line still in the file.
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (in_flight_[visits_[it->line].slot] == 0) {
      const LineOfPass l = *it;
      held_.erase(it);
      return TakeLocked(l);
    }
  }
  // Every waiting line's user is busy, so a free user in the file has no line waiting: its line
  // keeps its user's order. The file's end is not passed while a line of this pass waits.
  while (held_.size() < kMaxHeld && !(next_ == num_lines() && !held_.empty())) {
    const LineOfPass l = NextLineLocked();
    if (in_flight_[visits_[l.line].slot] == 0) return TakeLocked(l);
    held_.push_back(l);
  }
  return std::nullopt;  // every user in reach is busy
}

Visit ReplayTraffic::Next() {
  return *NextUnless([] { return false; });
}

std::optional<Visit> ReplayTraffic::NextUnless(const std::function<bool()>& stop) {
  std::optional<LineOfPass> l;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Busy users are answered (Done) by other threads; the timeout bounds a missed wake-up and
    // how long a stop waits to be seen.
    while (!(l = PickLocked())) {
      if (stop()) return std::nullopt;
      user_free_.wait_for(lock, std::chrono::milliseconds(100));
    }
  }
  // visits_ never changes: the (possibly long) history is copied outside the lock.
  Visit v = visits_[l->line];
  v.new_user = first_of_user_[l->line] != 0 && l->pass == 0;
  return v;
}

void ReplayTraffic::Done(const Visit& visit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A visit not taken from here, or answered twice, changes nothing.
    if (visit.slot < 0 || visit.slot >= num_users() || in_flight_[visit.slot] == 0) return;
    if (--in_flight_[visit.slot] > 0) return;
  }
  user_free_.notify_all();
}

}  // namespace hstu::loadgen
