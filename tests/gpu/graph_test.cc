// CUDA graphs of the decode step: replay equals eager execution on the same (padded) inputs bit
// for bit, across batches of one bucket with different attention plans (grid updates) and odd
// sizes, with and without the onload wait nodes; the unpadded eager step agrees within bf16
// tolerance; batches beyond every bucket run
// eagerly; an engine with graphs matches the CPU engine and counts its replays.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include "engine/cuda_backend.h"
#include "engine/engine.h"
#include "engine/model_file.h"
#include "kernels/cuda/gemm_bias_silu.h"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/params.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

ModelConfig GraphConfig(int head_dim) {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 3;
  c.hidden_dim = 128;
  c.num_heads = 2;
  c.head_dim = head_dim;
  c.max_history_tokens = 512;
  c.max_candidates = 64;
  c.attention_norm_len = 512 + 64;
  c.position_encoding = true;
  c.position_rows = 512;
  c.item_rows = 700;
  c.action_rows = 6;
  c.num_tasks = 3;
  c.head_dims = {128, 32, 3};
  return c;
}

// Head dim 256 (the warp-specialised attention kernel) and decode-length histories.
ModelConfig WsGraphConfig(int heads) {
  ModelConfig c = GraphConfig(256);
  c.hidden_dim = 256;
  c.num_heads = heads;
  c.max_history_tokens = 4096;
  c.max_candidates = 256;
  c.attention_norm_len = 4096 + 256;
  c.position_rows = 4096;
  c.head_dims = {256, 32, 3};
  return c;
}

struct User {
  std::vector<int64_t> tokens;
  std::vector<int32_t> pages;
  int cached = 0;
};

// Users grow by new_tokens[b] and send cand[b] candidates; pages come from a shuffled free list.
ForwardBatch Step(std::vector<User>* users, const std::vector<int>& new_tokens,
                  const std::vector<int>& cand, int page_size, std::vector<int32_t>* free_pages,
                  std::mt19937* rng) {
  ForwardBatch fb;
  fb.num_users = static_cast<int32_t>(users->size());
  fb.row_offsets = {0};
  fb.page_indptr = {0};
  for (size_t b = 0; b < users->size(); ++b) {
    User& u = (*users)[b];
    for (int i = 0; i < new_tokens[b]; ++i) u.tokens.push_back((*rng)() % 700);
    const int hist = static_cast<int>(u.tokens.size());
    while (static_cast<int>(u.pages.size()) * page_size < hist) {
      u.pages.push_back(free_pages->back());
      free_pages->pop_back();
    }
    for (int t = u.cached; t < hist; ++t) {
      fb.token_ids.push_back(t % 2 ? u.tokens[t] % 6 : u.tokens[t]);
      fb.token_types.push_back(t % 2 ? kActionToken : kItemToken);
      fb.positions.push_back(t);
    }
    for (int c = 0; c < cand[b]; ++c) {
      fb.token_ids.push_back((*rng)() % 700);
      fb.token_types.push_back(kItemToken);
      fb.positions.push_back(hist);
    }
    fb.num_new.push_back(hist - u.cached);
    fb.num_tokens.push_back(hist);
    fb.row_offsets.push_back(fb.row_offsets.back() + hist - u.cached + cand[b]);
    fb.page_ids.insert(fb.page_ids.end(), u.pages.begin(), u.pages.end());
    fb.page_indptr.push_back(static_cast<int32_t>(fb.page_ids.size()));
    u.cached = hist;
  }
  return fb;
}

// Step for the users at indices `who` of *users only (new_tokens and cand per listed user); their
// entries in *users grow with it.
ForwardBatch StepUsers(std::vector<User>* users, const std::vector<int>& who,
                       const std::vector<int>& new_tokens, const std::vector<int>& cand,
                       int page_size, std::vector<int32_t>* free_pages, std::mt19937* rng) {
  std::vector<User> sub;
  for (int u : who) sub.push_back((*users)[u]);
  ForwardBatch fb = Step(&sub, new_tokens, cand, page_size, free_pages, rng);
  for (size_t i = 0; i < who.size(); ++i) (*users)[who[i]] = sub[i];
  return fb;
}

// Runs `fb` with graph replay on, then eagerly on the same padded inputs: the first run replays a
// graph exactly when `replay` (else it falls back to eager execution), and both give the same
// bits, finite. Leaves replay off. Returns the replayed run's output.
ForwardOutput ReplayThenEager(CudaBackend& g, const ForwardBatch& fb, bool replay,
                              const std::string& what) {
  ForwardOutput replayed, eager;
  g.SetGraphReplay(true);
  const uint64_t r0 = g.graph_replays(), f0 = g.graph_fallbacks();
  EXPECT_TRUE(g.Forward(fb, true, &replayed).ok()) << what;
  EXPECT_EQ(g.graph_replays() - r0, replay ? 1u : 0u) << what;
  EXPECT_EQ(g.graph_fallbacks() - f0, replay ? 0u : 1u) << what;
  g.SetGraphReplay(false);
  EXPECT_TRUE(g.Forward(fb, true, &eager).ok()) << what;
  EXPECT_TRUE(test::AllFinite(replayed.scores) && test::AllFinite(replayed.hidden)) << what;
  EXPECT_TRUE(test::BitEqual(replayed.scores, eager.scores)) << what;
  EXPECT_TRUE(test::BitEqual(replayed.hidden, eager.hidden)) << what;
  return replayed;
}

// The last layer's attention has its own plan (candidate rows only): a one-row bucket still
// captures it (its warm-up is one candidate without history), a batch whose users send no
// candidates at all runs eagerly, and users without candidates beside users with some replay.
TEST(CudaGraphs, LastLayerCandidatePlanInTinyBucketsAndWithoutCandidates) {
  HSTU_SKIP_WITHOUT_GPU();
  const ModelWeights w = RandomModel(GraphConfig(128), 17);
  const int page_size = 16, num_pages = 64;
  GraphOptions go;
  go.enable = true;
  go.buckets = {{1, 1}, {2, 40}};
  auto graphed = CreateCudaBackendExt(w, page_size, num_pages, 0, go);
  ASSERT_TRUE(graphed.ok()) << graphed.status();
  CudaBackend& g = **graphed;
  EXPECT_EQ(g.num_graphs(), 2);
  ASSERT_TRUE(g.SetDebugPoison(true).ok());
  std::mt19937 rng(5);
  std::vector<User> users(2);
  std::vector<int32_t> free_pages(num_pages);
  std::iota(free_pages.begin(), free_pages.end(), 0);
  struct Visit { std::vector<int> who, more, cand; bool replay; };
  const Visit visits[] = {
      {{0}, {0}, {1}, true},             // one row: a candidate without history
      {{0, 1}, {10, 20}, {3, 0}, true},  // user 1 sends no candidate
      {{1}, {1}, {0}, false},            // no candidate at all: the last plan is empty, eager
  };
  for (size_t v = 0; v < std::size(visits); ++v) {
    const Visit& vis = visits[v];
    const ForwardBatch fb =
        StepUsers(&users, vis.who, vis.more, vis.cand, page_size, &free_pages, &rng);
    const std::string what = "visit " + std::to_string(v);
    const ForwardOutput replay = ReplayThenEager(g, fb, vis.replay, what);
    int cands = 0;
    for (int c : vis.cand) cands += c;
    EXPECT_EQ(replay.scores.size(), static_cast<size_t>(cands) * 3) << what;
  }
}

// A bucket's page table holds what the pool can: a model of 2^22-token histories in pages of 8
// with a 4096-user bucket (before: 4096 × 524,289 page ids in int32 wrapped, and the backend
// failed to start on a ~2^64-byte allocation), and its batches still replay.
TEST(CudaGraphs, ABucketsPageTableIsBoundedByThePool) {
  HSTU_SKIP_WITHOUT_GPU();
  ModelConfig c = GraphConfig(64);
  c.max_history_tokens = 1 << 22;
  c.attention_norm_len = (1 << 22) + c.max_candidates;
  c.position_encoding = false;
  c.position_rows = 0;
  const ModelWeights w = RandomModel(c, 41);
  const int page_size = 8, num_pages = 256;
  GraphOptions go;
  go.enable = true;
  go.buckets = {{kMaxGraphBucketUsers, 64}};
  auto graphed = CreateCudaBackendExt(w, page_size, num_pages, 0, go);
  ASSERT_TRUE(graphed.ok()) << graphed.status();
  CudaBackend& g = **graphed;
  EXPECT_EQ(g.num_graphs(), 1);
  std::mt19937 rng(9);
  std::vector<User> users(3);
  std::vector<int32_t> free_pages(num_pages);
  std::iota(free_pages.begin(), free_pages.end(), 0);
  const ForwardBatch fb = Step(&users, {20, 9, 1}, {4, 2, 1}, page_size, &free_pages, &rng);
  ReplayThenEager(g, fb, /*replay=*/true, "3 users in the 4096-user bucket");
}

TEST(CudaGraphs, ReplayEqualsEagerBitForBit) {
  HSTU_SKIP_WITHOUT_GPU();
  for (int head_dim : {64, 128}) {
    const ModelWeights w = RandomModel(GraphConfig(head_dim), 31 + head_dim);
    const int page_size = 16, num_pages = 512;
    GraphOptions go;
    go.enable = true;
    go.buckets = {{2, 64}, {4, 256}, {8, 640}};
    // One page more than the users draw from: odd steps onload a host page into it first, so
    // those replays run the graph variant with the per-layer wait nodes.
    auto graphed = CreateCudaBackendExt(w, page_size, num_pages + 1, 0, go);
    auto plain = CreateCudaBackendExt(w, page_size, num_pages, 0);
    ASSERT_TRUE(graphed.ok() && plain.ok()) << graphed.status() << plain.status();
    CudaBackend& g = **graphed;
    CudaBackend& e = **plain;
    ASSERT_TRUE(g.CreateHostPool(1).ok());
    EXPECT_EQ(g.num_graphs(), 3);
    EXPECT_EQ(e.num_graphs(), 0);
    ASSERT_TRUE(g.SetDebugPoison(true).ok() && e.SetDebugPoison(true).ok());
    std::mt19937 rng(3);
    // 7 users; prefixes of 30..400 tokens computed eagerly (rows beyond every bucket).
    std::vector<User> users(7);
    std::vector<int32_t> free_pages(num_pages);
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
    std::vector<int> prefix(users.size()), no_cand(users.size(), 0);
    for (int& p : prefix) p = 30 + static_cast<int>(rng() % 370);
    std::mt19937 rng_e = rng;
    std::vector<User> users_e = users;
    std::vector<int32_t> free_e = free_pages;
    const ForwardBatch pre = Step(&users, prefix, no_cand, page_size, &free_pages, &rng);
    const ForwardBatch pre_e = Step(&users_e, prefix, no_cand, page_size, &free_e, &rng_e);
    ForwardOutput og, oe;
    ASSERT_TRUE(g.Forward(pre, false, &og).ok() && e.Forward(pre_e, false, &oe).ok());
    EXPECT_EQ(g.graph_replays(), 0u);

    uint64_t replays = 0, wait_replays = 0;
    double worst = 0;
    int bit_exact_plain = 0, steps = 0;
    for (int step = 0; step < 12; ++step) {
      const int B = 1 + static_cast<int>(rng() % 7);
      std::vector<User> sub(users.begin(), users.begin() + B);
      std::vector<int> nn(B), cand(B);
      for (int b = 0; b < B; ++b) {
        nn[b] = static_cast<int>(rng() % (step % 3 == 0 ? 60 : 9));
        cand[b] = 1 + static_cast<int>(rng() % 40);
      }
      std::mt19937 r2 = rng;
      std::vector<int32_t> fp2 = free_pages;
      std::vector<User> sub2 = sub;
      const ForwardBatch fb = Step(&sub, nn, cand, page_size, &free_pages, &rng);
      const ForwardBatch fb2 = Step(&sub2, nn, cand, page_size, &fp2, &r2);
      std::copy(sub.begin(), sub.end(), users.begin());
      ASSERT_EQ(fb.page_ids, fb2.page_ids);
      const bool fits = fb.num_users <= 8 && fb.num_rows() <= 640;
      ForwardOutput replay, eager_padded, eager_plain;
      g.SetGraphReplay(true);
      const uint64_t r0 = g.graph_replays(), f0 = g.graph_fallbacks(), w0 = g.graph_wait_replays();
      const bool onload = step % 2 == 1;
      if (onload) {
        ASSERT_TRUE(g.CopyPages(CopyKind::kHostToDevice, {0}, {num_pages}).ok());
      }
      ASSERT_TRUE(g.Forward(fb, true, &replay).ok());
      // A batch that fits a bucket replays, unless its plan exceeds the static capacity; with an
      // onload issued before it, the graph with the wait nodes.
      EXPECT_EQ(g.graph_replays() - r0 + g.graph_fallbacks() - f0, fits ? 1u : 0u) << "step " << step;
      EXPECT_EQ(g.graph_wait_replays() - w0, onload ? g.graph_replays() - r0 : 0u) << "step " << step;
      replays += g.graph_replays() - r0;
      wait_replays += g.graph_wait_replays() - w0;
      g.SetGraphReplay(false);
      ASSERT_TRUE(g.Forward(fb, true, &eager_padded).ok());
      ASSERT_TRUE(e.Forward(fb2, true, &eager_plain).ok());
      const std::string what = "head dim " + std::to_string(head_dim) + " step " +
                               std::to_string(step) + " (" + std::to_string(fb.num_users) +
                               " users, " + std::to_string(fb.num_rows()) + " rows)";
      ASSERT_TRUE(test::AllFinite(replay.scores) && test::AllFinite(replay.hidden)) << what;
      EXPECT_TRUE(test::BitEqual(replay.scores, eager_padded.scores)) << what;
      EXPECT_TRUE(test::BitEqual(replay.hidden, eager_padded.hidden)) << what;
      EXPECT_LT(test::MaxAbsDiff(replay.scores, eager_plain.scores), test::kBf16ScoreAbs) << what;
      EXPECT_LT(test::RelL2(replay.hidden, eager_plain.hidden), test::kBf16RelL2) << what;
      worst = std::max(worst, test::MaxAbsDiff(replay.scores, eager_plain.scores));
      bit_exact_plain += test::BitEqual(replay.scores, eager_plain.scores) ? 1 : 0;
      ++steps;
    }
    g.SetGraphReplay(true);
    EXPECT_GT(replays - wait_replays, 0u);
    EXPECT_GT(wait_replays, 0u);
    std::printf("  head dim %d: %llu replays (%llu with onload waits), %llu fallbacks; graph vs "
                "unpadded eager: %d of %d steps bit-exact, worst score abs %.2e\n",
                head_dim, static_cast<unsigned long long>(g.graph_replays()),
                static_cast<unsigned long long>(wait_replays),
                static_cast<unsigned long long>(g.graph_fallbacks()), bit_exact_plain, steps, worst);
  }
}

// Cluster plans (D = 256, one wave of clusters, as in the batch-1 decode step) in a graph: the
// captured attention node keeps its cluster launch when a replay resizes it to fewer tiles,
// replays equal the padded eager step bit for bit, and a batch whose plan is of the other kind
// (too few tiles to fill two thirds of the GPU) runs eagerly. 2 heads, so that several tile counts
// make cluster plans: from lo = ceil(2·SMs / (3 · 2 heads · 8)) to hi = clusters at once / 2.
TEST(CudaGraphs, ClusterPlansReplayEqualEager) {
  HSTU_SKIP_WITHOUT_GPU();
  int max_clusters = 0, device = 0, sms = 0;
  ASSERT_EQ(cuda::HstuAttentionMaxClusters(8, &max_clusters), cudaSuccess);
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  const int heads = 2, lo = (2 * sms + 3 * heads * 8 - 1) / (3 * heads * 8),
            hi = max_clusters / heads;
  if (hi < lo + 1) GTEST_SKIP() << max_clusters << " clusters of 8 on " << sms << " SMs";
  const ModelConfig c = WsGraphConfig(heads);
  const ModelWeights w = RandomModel(c, 77);
  const int page_size = 32, num_pages = 400;
  GraphOptions go;
  go.enable = true;
  go.buckets = {{2, hi * cuda::kAttnBlockM}};  // captured with hi tiles: a cluster plan
  auto graphed = CreateCudaBackendExt(w, page_size, num_pages, 0, go);
  ASSERT_TRUE(graphed.ok()) << graphed.status();
  CudaBackend& g = **graphed;
  ASSERT_NE(g.attention_kernel().find("cluster reduction"), std::string::npos)
      << g.attention_kernel();
  ASSERT_TRUE(g.SetDebugPoison(true).ok());
  std::mt19937 rng(9);
  std::vector<User> users(2);
  std::vector<int32_t> free_pages(num_pages);
  std::iota(free_pages.begin(), free_pages.end(), 0);
  std::shuffle(free_pages.begin(), free_pages.end(), rng);
  ForwardOutput out;
  const ForwardBatch pre = Step(&users, {300, 500}, {0, 0}, page_size, &free_pages, &rng);
  ASSERT_TRUE(g.Forward(pre, false, &out).ok());
  // Rows of a user that make `tiles` query tiles: 256 candidates (fewer below 2 tiles), the rest
  // new history.
  auto rows_of = [](int tiles) { return tiles * cuda::kAttnBlockM - 30; };
  struct Visit { std::vector<int> who, tiles; bool cluster; };
  const Visit visits[] = {
      {{0}, {hi}, true},                    // the captured grid
      {{0}, {lo}, true},                    // fewer tiles: the cluster node resized
      {{1}, {lo - 1}, false},               // too few CTAs: the other kind, eager
      {{0, 1}, {hi / 2, hi - hi / 2}, true},  // two users
  };
  int cluster_replays = 0;
  for (size_t v = 0; v < std::size(visits); ++v) {
    const Visit& vis = visits[v];
    std::vector<int> nn, cand;
    for (size_t i = 0; i < vis.who.size(); ++i) {
      const int rows = rows_of(vis.tiles[i]);
      cand.push_back(std::min(256, rows - 1));
      nn.push_back(rows - cand.back());
    }
    const ForwardBatch fb = StepUsers(&users, vis.who, nn, cand, page_size, &free_pages, &rng);
    const std::string what = "visit " + std::to_string(v);
    const uint64_t r0 = g.graph_replays();
    ReplayThenEager(g, fb, vis.cluster, what);
    EXPECT_EQ(g.attention_cluster(), vis.cluster ? 8 : 0) << what;  // the same batch's plan
    cluster_replays += g.graph_replays() > r0 && g.attention_cluster() > 0;
  }
  EXPECT_EQ(cluster_replays, 3);
  std::printf("  %d clusters of 8 at once on %d SMs: cluster plans of %d..%d tiles (2 heads)\n",
              max_clusters, sms, lo, hi);
  g.SetGraphReplay(true);

  // A bucket captured without clusters (lo - 1 tiles) replays a batch that would take them (two
  // users of 2·128 + 1 rows: lo tiles in fewer rows) with a plan without them. Before, it ran
  // eagerly (a graph fallback).
  go.buckets = {{2, (lo - 1) * cuda::kAttnBlockM}};
  auto plain = CreateCudaBackendExt(w, page_size, num_pages, 0, go);
  ASSERT_TRUE(plain.ok()) << plain.status();
  CudaBackend& p = **plain;
  ASSERT_TRUE(p.SetDebugPoison(true).ok());
  std::vector<User> fresh(2);
  ASSERT_TRUE(p.Forward(Step(&fresh, {300, 500}, {0, 0}, page_size, &free_pages, &rng), false,
                        &out).ok());
  const int a = (lo - 2) / 2, b = lo - 2 - a;  // lo tiles: (a + 1) + (b + 1)
  const std::vector<int> rows = {a * cuda::kAttnBlockM + 1, b * cuda::kAttnBlockM + 1};
  std::vector<int> nn, cand;
  for (int r : rows) {
    cand.push_back(std::min(256, r - 1));
    nn.push_back(r - cand.back());
  }
  const ForwardBatch two = Step(&fresh, nn, cand, page_size, &free_pages, &rng);
  ASSERT_LE(two.num_rows(), (lo - 1) * cuda::kAttnBlockM);
  // The premise: planned with clusters (one CTA an SM, as the backend plans), it takes them.
  ASSERT_GT(cuda::PlanHstuAttention(two.row_offsets.data(), two.num_new.data(),
                                    two.num_tokens.data(), two.num_users, c.max_attn_len, heads,
                                    sms, /*max_split=*/64, /*cluster=*/8, max_clusters)
                .cluster,
            0);
  ReplayThenEager(p, two, /*replay=*/true, "a cluster-sized batch in a bucket without clusters");
  EXPECT_EQ(p.attention_cluster(), 0);
  p.SetGraphReplay(true);
}

// Returning users whose cached prefix is whole 64-key blocks have their new K/V read from the rows
// and stored to the pages by the attention (the warp-specialised kernel, D = 256, on the fused
// UVQK route): a replay whose users all do runs the append nodes on one block, one with a user
// whose prefix is not whole blocks runs them whole again. Each replay equals the padded eager
// step bit for bit; the outputs and every visited user's pages follow a backend on the cuBLAS
// route (every returning user's K/V appended to the pages) within bf16 tolerance.
TEST(CudaGraphs, AppendNodesFollowTheUsersReadFromTheRows) {
  HSTU_SKIP_WITHOUT_GPU();
  if (!cuda::GemmBiasSiluAvailable()) GTEST_SKIP() << "no fused GEMM in this build or on this GPU";
  const ModelConfig c = WsGraphConfig(/*heads=*/2);
  const ModelWeights w = RandomModel(c, 78);
  const int page_size = 32, num_pages = 400;
  GraphOptions go;
  go.enable = true;
  go.buckets = {{4, 1024}};
  setenv("HSTU_GEMM_FUSED", "force", 1);  // read when a backend's GEMM tuner is created
  auto graphed = CreateCudaBackendExt(w, page_size, num_pages, 0, go);
  setenv("HSTU_GEMM_FUSED", "0", 1);
  auto appended = CreateCudaBackendExt(w, page_size, num_pages, 0);
  unsetenv("HSTU_GEMM_FUSED");
  ASSERT_TRUE(graphed.ok() && appended.ok()) << graphed.status() << appended.status();
  CudaBackend& g = **graphed;
  CudaBackend& e = **appended;
  ASSERT_EQ(g.attention_kernel().rfind("warp-specialised TMA kernel", 0), 0u)
      << g.attention_kernel();
  ASSERT_TRUE(g.SetDebugPoison(true).ok() && e.SetDebugPoison(true).ok());
  std::mt19937 rng(12);
  std::vector<User> users(4);
  std::vector<int32_t> free_pages(num_pages);
  std::iota(free_pages.begin(), free_pages.end(), 0);
  std::shuffle(free_pages.begin(), free_pages.end(), rng);
  ForwardOutput out;
  const ForwardBatch pre =
      Step(&users, {192, 320, 64, 128}, {0, 0, 0, 0}, page_size, &free_pages, &rng);
  ASSERT_TRUE(g.Forward(pre, false, &out).ok() && e.Forward(pre, false, &out).ok());
  struct Visit { std::vector<int> who, nn, cand; };
  const Visit visits[] = {
      {{0, 1, 2, 3}, {64, 128, 64, 0}, {20, 5, 1, 30}},  // prefixes 192, 320, 64, 128: all whole
      {{0, 1, 2, 3}, {10, 64, 0, 64}, {3, 40, 7, 2}},    // 256, 448, 128, 128: whole
      {{0, 1, 2, 3}, {5, 3, 7, 64}, {9, 1, 4, 16}},      // 266: user 0 through the append
      {{3}, {40}, {25}},                                  // 256: whole again
      {{0, 2}, {1, 2}, {6, 6}},                           // 271 and 135: both appended
  };
  for (size_t v = 0; v < std::size(visits); ++v) {
    const Visit& vis = visits[v];
    const ForwardBatch fb =
        StepUsers(&users, vis.who, vis.nn, vis.cand, page_size, &free_pages, &rng);
    const std::string what = "visit " + std::to_string(v);
    const ForwardOutput replayed = ReplayThenEager(g, fb, /*replay=*/true, what);
    ForwardOutput ref;
    ASSERT_TRUE(e.Forward(fb, true, &ref).ok()) << what;
    EXPECT_LT(test::MaxAbsDiff(replayed.scores, ref.scores), test::kBf16ScoreAbs) << what;
    EXPECT_LT(test::RelL2(replayed.hidden, ref.hidden), test::kBf16RelL2) << what;
    for (int who : vis.who) {
      const User& u = users[who];
      std::vector<float> kv_g, kv_e;
      ASSERT_TRUE(g.ReadKv(u.pages, u.cached, &kv_g).ok());
      ASSERT_TRUE(e.ReadKv(u.pages, u.cached, &kv_e).ok());
      ASSERT_TRUE(test::AllFinite(kv_g)) << what;
      EXPECT_LT(test::RelL2(kv_g, kv_e), test::kBf16RelL2) << what << ", pages of a user";
    }
  }
  EXPECT_NE(g.gemm_routes().find("fused"), std::string::npos) << g.gemm_routes();
  EXPECT_EQ(e.gemm_routes().find("rows: fused"), std::string::npos) << e.gemm_routes();
  g.SetGraphReplay(true);
}

TEST(CudaGraphs, EngineWithGraphsMatchesCpuEngine) {
  HSTU_SKIP_WITHOUT_GPU();
  const ModelWeights w = RandomModel(GraphConfig(64), 77);
  EngineOptions o;
  o.page_size = 16;
  o.device = "cpu";
  auto cpu = Engine::Create(o, w);
  o.device = "cuda:0";
  o.graph_buckets = {{4, 128}, {8, 1024}};
  o.wrap_backend = test::PoisonedKv;
  auto gpu = Engine::Create(o, w);
  o.use_cuda_graphs = false;
  auto eager = Engine::Create(o, w);
  ASSERT_TRUE(cpu.ok() && gpu.ok() && eager.ok());
  std::mt19937 rng(8);
  std::vector<RankRequest> users(6);
  for (size_t u = 0; u < users.size(); ++u) users[u].user_id = 70 + u;
  for (int visit = 0; visit < 4; ++visit) {
    for (auto& r : users) {
      for (int i = 0, n = visit == 0 ? 50 : 3; i < n; ++i) {
        r.history_item_ids.push_back(rng() % 700);
        r.history_actions.push_back(rng() % 6);
      }
      r.candidate_item_ids.assign(1 + rng() % 30, 0);
      for (auto& id : r.candidate_item_ids) id = rng() % 700;
    }
    auto rc = (*cpu)->Rank(users);
    auto rg = (*gpu)->Rank(users);
    auto re = (*eager)->Rank(users);
    for (size_t i = 0; i < users.size(); ++i) {
      ASSERT_TRUE(rc[i].ok() && rg[i].ok() && re[i].ok());
      EXPECT_LT(test::MaxAbsDiff(rg[i]->scores, rc[i]->scores), test::kBf16ScoreAbs);
      EXPECT_LT(test::MaxAbsDiff(rg[i]->scores, re[i]->scores), test::kBf16ScoreAbs);
    }
  }
  EXPECT_GT((*gpu)->Stats().graph_replays, 0u);
  EXPECT_EQ((*eager)->Stats().graph_replays, 0u);
}

}  // namespace
}  // namespace hstu
