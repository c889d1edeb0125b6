#include "client/replay.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "client/request_line.h"

namespace hstu::loadgen {

absl::StatusOr<std::unique_ptr<ReplayTraffic>> ReplayTraffic::Load(const std::string& path,
                                                                   bool overlapping) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --replay file ", path));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  if (in.bad()) return absl::DataLossError(absl::StrCat("reading --replay file ", path, " failed"));
  return FromLines(lines, path, overlapping);
}

absl::StatusOr<std::unique_ptr<ReplayTraffic>> ReplayTraffic::FromLines(
    const std::vector<std::string>& lines, const std::string& name, bool overlapping) {
  std::vector<Visit> visits;
  std::vector<int32_t> first_visit;
  std::unordered_map<uint64_t, int64_t> slots;
  int64_t with_scores = 0;
  for (size_t n = 0; n < lines.size(); ++n) {
    if (lines[n].find_first_not_of(" \t\r") == std::string::npos) continue;
    absl::StatusOr<client::RequestLine> parsed = client::ParseRequestLine(lines[n]);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ":", n + 1, ": ", parsed.status().message()));
    }
    if (parsed->expected_scores.has_value()) ++with_scores;
    Visit v;
    v.user_id = parsed->user_id;
    v.history_item_ids = std::move(parsed->history_item_ids);
    v.history_actions = std::move(parsed->history_actions);
    v.candidate_item_ids = std::move(parsed->candidate_item_ids);
    const auto [it, inserted] = slots.try_emplace(v.user_id, static_cast<int64_t>(slots.size()));
    v.slot = it->second;
    first_visit.push_back(inserted ? 1 : 0);
    visits.push_back(std::move(v));
  }
  if (visits.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no request line to replay"));
  }
  return std::unique_ptr<ReplayTraffic>(new ReplayTraffic(
      std::move(visits), std::move(first_visit), static_cast<int64_t>(slots.size()), with_scores,
      overlapping));
}

ReplayTraffic::ReplayTraffic(std::vector<Visit> visits, std::vector<int32_t> first_visit_of_user,
                             int64_t users, int64_t lines_with_scores, bool overlapping)
    : visits_(std::move(visits)),
      first_visit_(std::move(first_visit_of_user)),
      lines_with_scores_(lines_with_scores),
      overlapping_(overlapping),
      in_flight_(static_cast<size_t>(users), 0) {}

int64_t ReplayTraffic::passes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return passes_;
}

int64_t ReplayTraffic::NextLineLocked() {
  if (next_ == lines()) {
    next_ = 0;
    ++passes_;
  }
  return next_++;
}

Visit ReplayTraffic::TakeLocked(int64_t i) {
  Visit v = visits_[i];
  v.new_user = first_visit_[i] != 0 && passes_ == 0;
  ++in_flight_[v.slot];
  return v;
}

Visit ReplayTraffic::Next() {
  std::lock_guard<std::mutex> lock(mu_);
  if (overlapping_) return TakeLocked(NextLineLocked());
  // A waiting line whose user is free goes first: it is older than any line still in the file.
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (in_flight_[visits_[*it].slot] == 0) {
      const int64_t i = *it;
      held_.erase(it);
      return TakeLocked(i);
    }
  }
  // Every waiting line's user is busy, so a free user in the file has no line waiting: its line
  // keeps its user's order.
  for (int64_t scanned = 0; scanned < lines() && held_.size() < kMaxHeld; ++scanned) {
    const int64_t i = NextLineLocked();
    if (in_flight_[visits_[i].slot] == 0) return TakeLocked(i);
    held_.push_back(i);
  }
  if (held_.empty()) return TakeLocked(NextLineLocked());
  const int64_t i = held_.front();  // every user in reach is busy: the oldest line goes anyway
  held_.pop_front();
  return TakeLocked(i);
}

void ReplayTraffic::Done(const Visit& visit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (visit.slot >= 0 && visit.slot < users()) --in_flight_[visit.slot];
}

}  // namespace hstu::loadgen
