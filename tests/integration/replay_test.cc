// hstu_loadgen --replay's visit source (client/replay.h): the file's order, a busy user's line
// waiting without reordering that user's visits, the overlapping mode, passes, and load errors
// that name the file and line.
#include "client/replay.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace hstu::loadgen {
namespace {

// A line of user `user` with `events` events (item ids 100 + i) and one candidate.
std::string Line(uint64_t user, int events) {
  std::string items, actions;
  for (int i = 0; i < events; ++i) {
    absl::StrAppend(&items, i > 0 ? "," : "", 100 + i);
    absl::StrAppend(&actions, i > 0 ? "," : "", i % 3);
  }
  return absl::StrCat("{\"user_id\":", user, ",\"history_item_ids\":[", items,
                      "],\"history_actions\":[", actions, "],\"candidate_item_ids\":[7]}");
}

std::unique_ptr<ReplayTraffic> FromLines(const std::vector<std::string>& lines,
                                         bool overlapping = false) {
  auto r = ReplayTraffic::FromLines(lines, "f.jsonl", overlapping);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

// Next() from a thread of its own: it must still be waiting after 300 ms, and return once `busy`
// is answered.
Visit NextOnceAnswered(ReplayTraffic& r, const Visit& busy) {
  std::promise<Visit> next;
  std::future<Visit> got = next.get_future();
  std::thread caller([&] { next.set_value(r.Next()); });
  EXPECT_EQ(got.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  r.Done(busy);
  EXPECT_EQ(got.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  caller.join();  // a Next() that never returns fails the test by its time limit
  return got.get();
}

TEST(ReplayTest, SendsTheLinesInTheFilesOrderAndStartsAgainAtItsEnd) {
  auto r = FromLines({Line(1, 2), "", Line(2, 3), "  ", Line(3, 1)});
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->num_lines(), 3);
  EXPECT_EQ(r->num_users(), 3);
  std::vector<uint64_t> users;
  for (int i = 0; i < 7; ++i) {
    const Visit v = r->Next();
    users.push_back(v.user_id);
    EXPECT_EQ(v.new_user, i < 3) << i;  // each user's first line, on the first pass
    r->Done(v);
  }
  EXPECT_EQ(users, (std::vector<uint64_t>{1, 2, 3, 1, 2, 3, 1}));
  EXPECT_EQ(r->passes(), 2);
  const Visit v = r->Next();
  EXPECT_EQ(v.history_item_ids, (std::vector<int64_t>{100, 101, 102}));
  EXPECT_EQ(v.history_actions, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(v.candidate_item_ids, (std::vector<int64_t>{7}));
}

// User 1's second line waits while its first is in flight; user 2's lines go ahead; once user 1
// is answered its waiting line goes before any later line of the file.
TEST(ReplayTest, ABusyUsersLineWaitsAndKeepsItsUsersOrder) {
  auto r = FromLines({Line(1, 2), Line(1, 4), Line(2, 2), Line(1, 6), Line(2, 4), Line(3, 1)});
  ASSERT_NE(r, nullptr);
  const Visit a = r->Next();
  EXPECT_EQ(a.user_id, 1u);
  EXPECT_EQ(a.history_item_ids.size(), 2u);
  const Visit b = r->Next();  // line 2 (user 1) waits
  EXPECT_EQ(b.user_id, 2u);
  const Visit c = r->Next();  // line 4 (user 1) waits too; line 5 is user 2's, busy; then user 3
  EXPECT_EQ(c.user_id, 3u);
  r->Done(a);
  const Visit d = r->Next();
  EXPECT_EQ(d.user_id, 1u);
  EXPECT_EQ(d.history_item_ids.size(), 4u);  // its older waiting line, not the 6-event one
  r->Done(b);
  const Visit e = r->Next();  // user 2's waiting line
  EXPECT_EQ(e.user_id, 2u);
  EXPECT_EQ(e.history_item_ids.size(), 4u);
  r->Done(d);
  const Visit f = r->Next();
  EXPECT_EQ(f.user_id, 1u);
  EXPECT_EQ(f.history_item_ids.size(), 6u);
}

// With every user busy, Next() waits for an answer rather than send a user's second visit.
TEST(ReplayTest, WhenEveryUserIsBusyNextWaitsForAnAnswer) {
  auto r = FromLines({Line(1, 2), Line(1, 4)});
  ASSERT_NE(r, nullptr);
  const Visit a = r->Next();
  const Visit b = NextOnceAnswered(*r, a);
  EXPECT_EQ(b.user_id, 1u);
  EXPECT_EQ(b.history_item_ids.size(), 4u);
}

// A stop ends a wait without a visit (a stop signal while every user is busy), and a second
// Done() of one visit changes nothing.
TEST(ReplayTest, AStopEndsTheWaitAndARepeatedDoneIsIgnored) {
  auto r = FromLines({Line(1, 2), Line(1, 4)});
  ASSERT_NE(r, nullptr);
  const Visit a = r->Next();
  std::atomic<bool> stop{false};
  std::promise<std::optional<Visit>> next;
  std::future<std::optional<Visit>> got = next.get_future();
  std::thread caller([&] { next.set_value(r->NextUnless([&] { return stop.load(); })); });
  EXPECT_EQ(got.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  stop = true;
  ASSERT_EQ(got.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  caller.join();
  EXPECT_FALSE(got.get().has_value());
  r->Done(a);
  r->Done(a);  // ignored: user 1 has nothing in flight
  const Visit b = r->Next();
  EXPECT_EQ(b.history_item_ids.size(), 4u);
  // User 1 is busy again: had the second Done() counted, a third visit would go at once.
  EXPECT_FALSE(r->NextUnless([] { return true; }).has_value());
}

// A waiting line of this pass goes before any line of the next, and the pass count is that of
// the lines sent (not of how far the file was read).
TEST(ReplayTest, NoLineOfTheNextPassOvertakesAWaitingOne) {
  auto r = FromLines({Line(1, 2), Line(1, 4), Line(2, 2)});
  ASSERT_NE(r, nullptr);
  const Visit a = r->Next();  // line 1
  const Visit b = r->Next();  // line 2 waits (user 1 busy): line 3
  EXPECT_EQ(b.user_id, 2u);
  r->Done(b);
  // User 2 is free, but its next line is of pass 1, and line 2 of pass 0 still waits.
  const Visit c = NextOnceAnswered(*r, a);
  EXPECT_EQ(c.user_id, 1u);
  EXPECT_EQ(c.history_item_ids.size(), 4u);
  EXPECT_EQ(r->passes(), 0);
  r->Done(c);
  const Visit d = r->Next();  // line 1 of pass 1
  EXPECT_EQ(d.user_id, 1u);
  EXPECT_EQ(d.history_item_ids.size(), 2u);
  EXPECT_FALSE(d.new_user);
  EXPECT_EQ(r->passes(), 1);

  auto two = FromLines({Line(1, 2), Line(2, 2)});
  ASSERT_NE(two, nullptr);
  std::vector<Visit> out;
  for (int i = 0; i < 23; ++i) {
    out.push_back(two->Next());
    if (out.size() == 2) {  // two callers
      two->Done(out.front());
      out.erase(out.begin());
    }
  }
  EXPECT_EQ(two->passes(), 11);  // 23 lines of a 2-line file: passes 0..11
}

TEST(ReplayTest, OverlappingSendsEveryLineInOrderAtOnce) {
  auto r = FromLines({Line(1, 2), Line(1, 4), Line(2, 2)}, /*overlapping=*/true);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->Next().history_item_ids.size(), 2u);
  const Visit b = r->Next();
  EXPECT_EQ(b.user_id, 1u);
  EXPECT_EQ(b.history_item_ids.size(), 4u);
  EXPECT_EQ(r->Next().user_id, 2u);
}

TEST(ReplayTest, RecordedLinesLoadAndTheirScoresAreCounted) {
  const std::string recorded =
      "{\"user_id\":9,\"history_item_ids\":[1],\"history_actions\":[0],\"candidate_item_ids\":[4,"
      "5],\"expected_scores\":[[0.5],[0.25]],\"cache_result\":\"miss\"}";
  auto r = FromLines({recorded, Line(9, 1)});
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->num_lines_with_scores(), 1);
  EXPECT_EQ(r->Next().candidate_item_ids, (std::vector<int64_t>{4, 5}));
}

TEST(ReplayTest, LoadErrorsNameTheFileAndLine) {
  auto bad = ReplayTraffic::FromLines({Line(1, 1), "", "{\"user_id\":1,\"history_items\":[1]}"},
                                      "f.jsonl", false);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StartsWith(bad.status().message(), "f.jsonl:3: unknown field 'history_items'"))
      << bad.status();
  auto empty = ReplayTraffic::FromLines({"", " "}, "f.jsonl", false);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().message(), "f.jsonl: no request line to replay");
  auto missing = ReplayTraffic::Load("/nonexistent/replay.jsonl", false);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "/nonexistent/replay.jsonl"));

  const std::string path = ::testing::TempDir() + "/replay_test.jsonl";
  {
    std::ofstream out(path);
    out << Line(5, 3) << "\n\n" << Line(6, 1) << "\n";
  }
  auto loaded = ReplayTraffic::Load(path, false);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->num_lines(), 2);
  EXPECT_EQ((*loaded)->Next().user_id, 5u);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace hstu::loadgen
