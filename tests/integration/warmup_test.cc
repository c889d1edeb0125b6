// The start-up's warm-up (server/ranking_server.cc, engine/warmup.h): the warm-up request and, on a
// GPU, the eager steps' batches, none of which may leave anything cached.
#include "engine/warmup.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "engine/model_file.h"
#include "kernels/row_classes.h"
#include "server/ranking_server.h"
#include "tests/integration/server_fixture.h"
#include "tests/util/faulty_backend.h"

namespace hstu::server {
namespace {

using fixture::ServerTest;

// The GPU start-up's eager batches: one a GEMM row class, each of the class's bound in rows, up
// to the most rows the scheduler puts in one batch; requests of distinct users within the limits.
TEST(EagerWarmupBatches, OneBatchOfMissesForEachRowClassUpToTheLargestBatch) {
  // The base model: 4352 rows a full-history miss, 8 of them at most (34816 rows, class 49152).
  const std::vector<EagerWarmupBatch> batches = EagerWarmupBatches(4096, 256, 8, 65536);
  ASSERT_EQ(batches.size(), 16u);
  int64_t bound = row_classes::kFirst;
  for (size_t i = 0; i < batches.size(); ++i, bound = row_classes::Next(bound)) {
    const EagerWarmupBatch& b = batches[i];
    EXPECT_EQ(b.num_rows(), std::min<int64_t>(bound, 34816)) << i;
    EXPECT_EQ(row_classes::Of(b.num_rows()), bound) << i;
    EXPECT_LE(b.users.size(), 8u);
    const std::vector<RankRequest> requests = b.Requests();
    std::set<uint64_t> users;
    for (const RankRequest& r : requests) {
      EXPECT_GE(r.history_item_ids.size(), 1u);
      EXPECT_LE(r.history_item_ids.size(), 2048u);
      EXPECT_EQ(r.history_actions.size(), r.history_item_ids.size());
      EXPECT_GE(r.candidate_item_ids.size(), 1u);
      EXPECT_LE(r.candidate_item_ids.size(), 256u);
      EXPECT_NE(r.user_id, ~uint64_t{0});  // the warm-up request's
      users.insert(r.user_id);
    }
    EXPECT_EQ(users.size(), requests.size());
  }
  EXPECT_EQ(batches.back().users.size(), 8u);
  // A token budget of 20000 rows: the classes up to 16384, then a batch of 20000.
  const auto budget = EagerWarmupBatches(4096, 256, 8, 20000);
  ASSERT_EQ(budget.size(), 14u);
  EXPECT_EQ(budget.back().num_rows(), 20000);
  // One user always runs, whatever the budget: up to its 4352 rows.
  const auto one = EagerWarmupBatches(4096, 256, 8, 100);
  ASSERT_EQ(one.size(), 10u);
  EXPECT_EQ(one.back().num_rows(), 4352);
  // random:tiny's shape (256 tokens, 64 candidates) at 2 users: 256, 384, 512, then 640.
  const auto tiny = EagerWarmupBatches(256, 64, 2, 65536);
  ASSERT_EQ(tiny.size(), 4u);
  EXPECT_EQ(tiny.back().num_rows(), 640);
}

TEST_F(ServerTest, TheWarmUpLeavesNothingInTheCache) {
  // Before: the warm-up request (user 2^64 - 1, items 1-4, candidates 5-6) left its entry, so a
  // client's user with that id reused 8 tokens on a first visit, or counted a hash mismatch.
  StartServer();
  hstu::v1::RankRequest req;
  req.set_user_id(~uint64_t{0});
  for (int64_t item : {1, 2, 3, 4}) {
    req.add_history_item_ids(item);
    req.add_history_actions(0);
  }
  req.add_candidate_item_ids(5);
  req.add_candidate_item_ids(6);
  grpc::ClientContext ctx;
  hstu::v1::RankResponse resp;
  ASSERT_TRUE(stub_->Rank(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.reused_tokens(), 0u);
  EXPECT_EQ(resp.computed_tokens(), 8u);
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_kv_lookups_total", {{"result", "miss"}}), 1);
}

// The GPU start-up's eager warm-up, run on the CPU backend under a GPU's name: one forward a row
// class, within the server's --max_candidates (below the model's 64 a forward: before, the
// warm-up's requests failed its check and the server did not start), nothing left cached.
TEST_F(ServerTest, TheEagerWarmUpRunsEveryClassAndLeavesNothingCached) {
  auto faults = std::make_shared<testing::Faults>();
  faults->name = "cuda:0 (test: the CPU backend)";
  ServerOptions o;
  o.engine.wrap_backend = testing::WrapWithFaults(faults);
  o.engine.limits.max_candidates = 16;
  o.scheduler.max_batch_size = 4;
  ASSERT_NO_FATAL_FAILURE(StartServer(o));
  const auto c = *PresetConfig("tiny");
  const auto batches =
      EagerWarmupBatches(c.max_history_tokens, 16, 4, o.scheduler.max_batch_tokens);
  ASSERT_GE(batches.size(), 4u);
  // The warm-up request, then at least one forward a batch (a batch too large for the pool runs
  // in several).
  EXPECT_GE(faults->forwards.load(), 1 + static_cast<int>(batches.size()));
  const auto m = Scrape();
  EXPECT_EQ(m.Sum("hstu_kv_pages", {{"tier", "gpu"}, {"state", "used"}}), 0);
  // A warm-up user's id is a miss like any other.
  hstu::v1::RankRequest req = fixture::MakeRequest(~uint64_t{0} - 1, 10, 3, 1);
  hstu::v1::RankResponse resp;
  ASSERT_TRUE(Rank(req, &resp).ok());
  EXPECT_EQ(resp.cache_result(), "miss");
}

}  // namespace
}  // namespace hstu::server
