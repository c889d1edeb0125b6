// The wire messages to the engine's structs and back (server/validation.*), field by field, with
// the values at the edges of their types: independent of the engine that the server tests
// compare against, which is fed through the same conversion.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "hstu/v1/ranking.pb.h"
#include "server/validation.h"

namespace hstu::server {
namespace {

TEST(ProtoConversion, FromProtoKeepsEveryFieldInOrder) {
  hstu::v1::RankRequest p;
  p.set_user_id(std::numeric_limits<uint64_t>::max());
  for (int64_t id : {int64_t{0}, int64_t{7}, std::numeric_limits<int64_t>::max(), int64_t{7}}) {
    p.add_history_item_ids(id);
  }
  for (int32_t a : {3, 0, 15, 1}) p.add_history_actions(a);
  for (int64_t id : {int64_t{9}, int64_t{9}, std::numeric_limits<int64_t>::max()}) {
    p.add_candidate_item_ids(id);
  }
  p.set_request_id("r-1");
  const RankRequest r = FromProto(p);
  EXPECT_EQ(r.user_id, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(r.history_item_ids,
            (std::vector<int64_t>{0, 7, std::numeric_limits<int64_t>::max(), 7}));
  EXPECT_EQ(r.history_actions, (std::vector<int32_t>{3, 0, 15, 1}));
  EXPECT_EQ(r.candidate_item_ids,
            (std::vector<int64_t>{9, 9, std::numeric_limits<int64_t>::max()}));

  // Unequal lengths and negative ids come through as sent: the engine's validation names them.
  hstu::v1::RankRequest odd;
  odd.add_history_item_ids(-1);
  odd.add_candidate_item_ids(-5);
  const RankRequest o = FromProto(odd);
  EXPECT_EQ(o.user_id, 0u);
  EXPECT_EQ(o.history_item_ids, (std::vector<int64_t>{-1}));
  EXPECT_TRUE(o.history_actions.empty());
  EXPECT_EQ(o.candidate_item_ids, (std::vector<int64_t>{-5}));
  EXPECT_TRUE(FromProto(hstu::v1::RankRequest()).candidate_item_ids.empty());
}

TEST(ProtoConversion, ToProtoKeepsEveryField) {
  RankResult r;
  r.num_tasks = 2;
  r.scores = {0.25f, 1e-30f, 0.999f, 0.5f};
  r.reused_tokens = 4294967295u;
  r.computed_tokens = 6;
  r.cache_result = LookupResult::kHostRecompute;
  hstu::v1::RankResponse p;
  ToProto(r, "id-\xc3\xa9", &p);
  EXPECT_EQ(p.num_tasks(), 2u);
  ASSERT_EQ(p.scores_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(p.scores(i), r.scores[i]) << i;
  EXPECT_EQ(p.request_id(), "id-\xc3\xa9");
  EXPECT_EQ(p.reused_tokens(), 4294967295u);
  EXPECT_EQ(p.computed_tokens(), 6u);
  EXPECT_EQ(p.cache_result(), "host_recompute");
}

}  // namespace
}  // namespace hstu::server
