// The CUDA backend against the CPU backend on the same ForwardBatch (final hidden rows and scores),
// a cached step against a full recompute on the GPU, and the KV pages read back from both.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
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

ModelConfig GpuTestConfig(int head_dim, int window, bool position_encoding) {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 2;
  c.hidden_dim = 256;
  c.num_heads = 2;
  c.head_dim = head_dim;
  c.max_history_tokens = 512;
  c.max_candidates = 64;
  c.attention_norm_len = 512 + 64;
  c.max_attn_len = window;
  c.position_encoding = position_encoding;
  c.position_rows = position_encoding ? 512 : 0;
  c.item_rows = 1000;
  c.action_rows = 8;
  c.num_tasks = 3;
  c.head_dims = {256, 64, 3};
  return c;
}

// Builds batches of users whose histories grow between steps; pages are handed out from a shuffled
// free list so every user's pages are scattered.
class BatchBuilder {
 public:
  BatchBuilder(int page_size, int num_pages, uint64_t seed) : page_size_(page_size), rng_(seed) {
    free_.resize(num_pages);
    std::iota(free_.begin(), free_.end(), 0);
    std::shuffle(free_.begin(), free_.end(), rng_);
  }
  struct User {
    std::vector<int64_t> tokens;  // history token ids (item, action alternating)
    int cached = 0;               // tokens already in its pages
    std::vector<int32_t> pages;
  };
  // One forward: each user grows by new_tokens[b] history tokens and sends cand[b] candidates.
  // cached=false drops the user's cache first (a full recompute into fresh pages).
  std::vector<std::vector<int64_t>> Candidates(const std::vector<int>& counts) {
    std::vector<std::vector<int64_t>> c(counts.size());
    for (size_t b = 0; b < counts.size(); ++b)
      for (int i = 0; i < counts[b]; ++i) c[b].push_back(rng_() % 1000);
    return c;
  }
  ForwardBatch Step(std::vector<User>* users, const std::vector<int>& new_tokens,
                    const std::vector<std::vector<int64_t>>& cand, bool cached) {
    ForwardBatch fb;
    fb.num_users = static_cast<int32_t>(users->size());
    fb.row_offsets = {0};
    fb.page_indptr = {0};
    for (size_t b = 0; b < users->size(); ++b) {
      User& u = (*users)[b];
      if (!cached) {
        u.cached = 0;
        u.pages.clear();
      }
      for (int i = 0; i < new_tokens[b]; ++i) u.tokens.push_back(rng_() % 1000);
      const int hist = static_cast<int>(u.tokens.size());
      while (static_cast<int>(u.pages.size()) * page_size_ < hist) {
        u.pages.push_back(free_.back());
        free_.pop_back();
      }
      const int nnew = hist - u.cached;
      for (int t = u.cached; t < hist; ++t) {
        const bool action = t % 2 == 1;
        fb.token_ids.push_back(action ? u.tokens[t] % 8 : u.tokens[t]);
        fb.token_types.push_back(action ? kActionToken : kItemToken);
        fb.positions.push_back(t);
      }
      for (int64_t id : cand[b]) {
        fb.token_ids.push_back(id);
        fb.token_types.push_back(kItemToken);
        fb.positions.push_back(hist);
      }
      fb.num_new.push_back(nnew);
      fb.num_tokens.push_back(hist);
      fb.row_offsets.push_back(fb.row_offsets.back() + nnew + static_cast<int32_t>(cand[b].size()));
      fb.page_ids.insert(fb.page_ids.end(), u.pages.begin(), u.pages.end());
      fb.page_indptr.push_back(static_cast<int32_t>(fb.page_ids.size()));
      u.cached = hist;
    }
    return fb;
  }

 private:
  int page_size_;
  std::mt19937 rng_;
  std::vector<int32_t> free_;
};

// The weights exactly as the CUDA backend stores them (embeddings and GEMM weights in bf16; norms,
// biases and the head stay fp32). With these the oracle sees the GPU's weights, so the comparison
// measures the bf16 computation alone: on small random models the rounding of the weights by
// itself can move a score by more than 2e-3 (the end-to-end fp32-weights check is in
// engine_test.cc).
ModelWeights RoundedToBf16(ModelWeights w) {
  auto round = [](std::vector<float>& v) { v = test::RoundBf16(v); };
  round(w.item_embedding);
  round(w.action_embedding);
  round(w.position_embedding);
  for (LayerWeights& l : w.layers) {
    round(l.uvqk_w);
    round(l.output_w);
  }
  return w;
}

void ExpectClose(const ForwardOutput& gpu, const ForwardOutput& cpu, const std::string& what,
                 double score_tol) {
  ASSERT_EQ(gpu.scores.size(), cpu.scores.size()) << what;
  ASSERT_TRUE(test::AllFinite(gpu.scores)) << what;
  ASSERT_TRUE(test::AllFinite(gpu.hidden)) << what;
  std::printf("  %s: hidden rel L2 %.2e, scores max abs %.2e\n", what.c_str(),
              test::RelL2(gpu.hidden, cpu.hidden), test::MaxAbsDiff(gpu.scores, cpu.scores));
  EXPECT_LT(test::MaxAbsDiff(gpu.scores, cpu.scores), score_tol) << what;
  EXPECT_LT(test::RelL2(gpu.hidden, cpu.hidden), test::kBf16RelL2) << what;
}

struct BackendCase {
  int head_dim, window, page_size;
  bool pe;
  bool fused_gemm = false;  // the UVQK step on the fused CUTLASS GEMM (HSTU_GEMM_FUSED=force)
};

class CudaBackendParity : public ::testing::TestWithParam<BackendCase> {};

TEST_P(CudaBackendParity, MatchesCpuBackendCachedAndUncached) {
  HSTU_SKIP_WITHOUT_GPU();
  const BackendCase p = GetParam();
  const double score_tol = p.pe ? test::kBf16ScoreAbs : test::kBf16ScoreAbsNoPositionEncoding;
  const ModelConfig config = GpuTestConfig(p.head_dim, p.window, p.pe);
  const ModelWeights weights = RandomModel(config, 11);
  const int num_pages = 600;
  auto cpu = CreateCpuBackend(RoundedToBf16(weights), p.page_size, num_pages);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  if (p.fused_gemm) {
    if (!cuda::GemmBiasSiluAvailable()) GTEST_SKIP() << "no fused GEMM in this build or on this GPU";
    setenv("HSTU_GEMM_FUSED", "force", 1);  // read when the backend's GEMM tuner is created
  }
  auto gpu = CreateCudaBackendExt(weights, p.page_size, num_pages, 0);
  unsetenv("HSTU_GEMM_FUSED");
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE((*gpu)->SetDebugPoison(true).ok());
  // The kernel it reports: the TMA kernel exactly where that kernel applies, else why not.
  const std::string kernel = (*gpu)->attention_kernel();
  if (p.head_dim == 256 && p.page_size % 8 == 0) {
    EXPECT_EQ(kernel.rfind("warp-specialised TMA kernel", 0), 0u) << kernel;
  } else {
    EXPECT_NE(kernel.find("2-warpgroup cp.async kernel ("), std::string::npos) << kernel;
  }

  // Users: long, empty history (candidates only), one candidate, many candidates, ...
  const int B = 6;
  std::vector<BatchBuilder::User> users(B);
  BatchBuilder builder(p.page_size, num_pages, 5);
  const std::vector<int> first_new = {300, 0, 37, 1, 130, 64};
  const std::vector<int> first_cand = {20, 3, 1, 64, 7, 1};
  ForwardBatch fb = builder.Step(&users, first_new, builder.Candidates(first_cand), true);
  ForwardOutput c1, g1;
  ASSERT_TRUE((*cpu)->Forward(fb, true, &c1).ok());
  auto st = (*gpu)->Forward(fb, true, &g1);
  ASSERT_TRUE(st.ok()) << st;
  ExpectClose(g1, c1, "step 1 (no cache)", score_tol);
  // The route the step took is reported (start-up logs): the forced fused route by name, else at
  // least the row class it was chosen for.
  const std::string routes = (*gpu)->gemm_routes();
  if (p.fused_gemm) {
    EXPECT_NE(routes.find("rows: fused (128x128 ping-pong)"), std::string::npos) << routes;
  } else if (cuda::GemmBiasSiluAvailable()) {
    EXPECT_NE(routes.find(" rows: "), std::string::npos) << routes;
  }

  // Step 2: every user returns with a few more events; the cached prefix is reused.
  const std::vector<int> more = {12, 40, 0, 2, 66, 9};
  const std::vector<int> cand2 = {5, 1, 9, 1, 30, 2};
  const auto cand2_ids = builder.Candidates(cand2);
  ForwardBatch fb2 = builder.Step(&users, more, cand2_ids, /*cached=*/true);
  ForwardOutput c2, g2;
  ASSERT_TRUE((*cpu)->Forward(fb2, true, &c2).ok());
  st = (*gpu)->Forward(fb2, true, &g2);
  ASSERT_TRUE(st.ok()) << st;
  ExpectClose(g2, c2, "step 2 (cached)", score_tol);

  // KV pages as stored by both backends (user 5's cached prefix, 64 tokens, is one whole key
  // block: where the TMA kernel runs on the fused route its new K/V went through the rows).
  std::vector<float> kv_cpu, kv_gpu;
  for (int b = 0; b < B; ++b) {
    ASSERT_TRUE((*cpu)->ReadKv(users[b].pages, users[b].cached, &kv_cpu).ok());
    ASSERT_TRUE((*gpu)->ReadKv(users[b].pages, users[b].cached, &kv_gpu).ok());
    ASSERT_TRUE(test::AllFinite(kv_gpu)) << "user " << b;
    EXPECT_LT(test::RelL2(kv_gpu, kv_cpu), test::kBf16RelL2) << "user " << b << " after step 2";
  }

  // The same step recomputed from scratch on the GPU (fresh pages, nothing cached) must give
  // the cached step's scores.
  std::vector<BatchBuilder::User> fresh = users;
  for (auto& u : fresh) u.pages.clear();
  const ForwardBatch full = builder.Step(&fresh, std::vector<int>(B, 0), cand2_ids, /*cached=*/false);
  ForwardOutput g_full, c_full;
  auto read_pages = [&](const std::vector<BatchBuilder::User>& us,
                        std::vector<std::vector<float>>* kv) {
    kv->resize(us.size());
    for (size_t b = 0; b < us.size(); ++b) {
      ASSERT_TRUE((*gpu)->ReadKv(us[b].pages, us[b].cached, &(*kv)[b]).ok());
    }
  };
  std::vector<std::vector<float>> pages_before, pages_after;
  read_pages(fresh, &pages_before);
  st = (*gpu)->Forward(full, true, &g_full);
  ASSERT_TRUE(st.ok()) << st;
  read_pages(fresh, &pages_after);
  for (int b = 0; b < B; ++b) {
    if (fresh[b].cached > 0) {
      EXPECT_FALSE(test::BitEqual(pages_after[b], pages_before[b])) << "user " << b << ": no page written";
    }
  }
  // The same users in other fresh pages, with the pages not kept (the engine's cache off): the
  // same outputs bit for bit, and where the attention reads fresh K/V from the rows (the TMA
  // kernel) not one page written.
  std::vector<BatchBuilder::User> fresh2 = users;
  ForwardBatch not_kept =
      builder.Step(&fresh2, std::vector<int>(B, 0), cand2_ids, /*cached=*/false);
  not_kept.keep_kv = false;
  read_pages(fresh2, &pages_before);
  ForwardOutput g_not_kept;
  st = (*gpu)->Forward(not_kept, true, &g_not_kept);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(test::BitEqual(g_not_kept.scores, g_full.scores)) << "keep_kv off changed the scores";
  EXPECT_TRUE(test::BitEqual(g_not_kept.hidden, g_full.hidden)) << "keep_kv off changed the hidden rows";
  read_pages(fresh2, &pages_after);
  const bool rows_kernel = kernel.rfind("warp-specialised TMA kernel", 0) == 0;
  for (int b = 0; rows_kernel && b < B; ++b) {
    EXPECT_TRUE(test::BitEqual(pages_after[b], pages_before[b]))
        << "user " << b << ": a page written with keep_kv off";
  }
  ASSERT_TRUE((*cpu)->Forward(full, true, &c_full).ok());
  EXPECT_LT(test::MaxAbsDiff(c_full.scores, c2.scores), test::kF32Abs * 10) << "CPU cached != full";
  ExpectClose(g_full, c_full, "step 2 from scratch", score_tol);
  // Two bf16 computations of one fp32 result (other plans, splits and GEMM row classes, so other
  // roundings), each within score_tol of it: they agree to twice that. Without position encoding
  // each side measured up to 2.8e-3 (H100, 8eafbbb), and the two differed by 4.05e-3.
  EXPECT_LT(test::MaxAbsDiff(g_full.scores, g2.scores), 2 * score_tol) << "GPU cached != full";
  EXPECT_LT(test::RelL2(g_full.hidden, g2.hidden), test::kBf16RelL2) << "GPU cached != full";

  // Step 3: users with new events and no candidates (the last layer's attention has no tile of
  // theirs, yet their K/V reach every layer's pages), then a step without any candidate.
  const std::vector<int> more3 = {3, 0, 5, 2, 0, 1};
  const std::vector<int> cand3 = {0, 4, 0, 0, 2, 0};
  ForwardBatch fb3 = builder.Step(&users, more3, builder.Candidates(cand3), /*cached=*/true);
  ForwardOutput c3, g3;
  ASSERT_TRUE((*cpu)->Forward(fb3, true, &c3).ok());
  st = (*gpu)->Forward(fb3, true, &g3);
  ASSERT_TRUE(st.ok()) << st;
  ExpectClose(g3, c3, "step 3 (some users without candidates)", score_tol);
  const std::vector<int> more4 = {2, 1, 0, 4, 1, 0};
  ForwardBatch fb4 = builder.Step(&users, more4, builder.Candidates(std::vector<int>(B, 0)),
                                  /*cached=*/true);
  ForwardOutput c4, g4;
  ASSERT_TRUE((*cpu)->Forward(fb4, true, &c4).ok());
  st = (*gpu)->Forward(fb4, true, &g4);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(g4.scores.empty() && g4.hidden.empty()) << "step 4 (no candidates)";
  for (int b : {0, 2, 3, 4}) {
    ASSERT_TRUE((*cpu)->ReadKv(users[b].pages, users[b].cached, &kv_cpu).ok());
    ASSERT_TRUE((*gpu)->ReadKv(users[b].pages, users[b].cached, &kv_gpu).ok());
    ASSERT_TRUE(test::AllFinite(kv_gpu)) << "user " << b;
    EXPECT_LT(test::RelL2(kv_gpu, kv_cpu), test::kBf16RelL2) << "user " << b << " after step 4";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackendParity,
                         ::testing::Values(BackendCase{128, 0, 16, true},
                                           BackendCase{64, 0, 32, false},
                                           BackendCase{256, 48, 64, true},
                                           BackendCase{128, 0, 17, false},
                                           BackendCase{256, 0, 32, false},  // the TMA kernel
                                           BackendCase{128, 0, 16, true, true},
                                           BackendCase{256, 0, 32, false, true}),
                         [](const ::testing::TestParamInfo<BackendCase>& info) {
                           const BackendCase& c = info.param;
                           return absl::StrCat("D", c.head_dim, "_W", c.window, "_page",
                                               c.page_size, c.pe ? "_pos" : "_nopos",
                                               c.fused_gemm ? "_fusedgemm" : "");
                         });

TEST(CudaBackend, RejectsUnsupportedHeadDim) {
  HSTU_SKIP_WITHOUT_GPU();
  ModelConfig c = GpuTestConfig(128, 0, false);
  c.head_dim = 32;
  auto gpu = CreateCudaBackend(RandomModel(c, 1), 16, 8, 0);
  ASSERT_FALSE(gpu.ok());
  EXPECT_NE(gpu.status().message().find("64, 128, 256"), std::string::npos) << gpu.status();
}

TEST(CudaBackend, AutoReportsAGpuThatFailsToStartInsteadOfFallingBackToTheCpu) {
  // Before: --device=auto ran any model the GPU backend refused (here a head dim it has no
  // kernel for; as well a pool it could not allocate, a capture that failed) on the CPU reference,
  // with a warning. Only a machine with no usable GPU (UNAVAILABLE) falls back now.
  HSTU_SKIP_WITHOUT_GPU();
  ModelConfig c = GpuTestConfig(128, 0, false);
  c.head_dim = 32;
  auto b = CreateBackend("auto", RandomModel(c, 1), 16, 8);
  ASSERT_FALSE(b.ok()) << "ran on " << (*b)->name();
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EngineOptions o;
  o.device = "auto";
  o.page_size = 16;
  o.cache_pages = 64;
  auto e = Engine::Create(o, RandomModel(c, 1));
  ASSERT_FALSE(e.ok()) << "ran on " << (*e)->device_name();
  EXPECT_NE(e.status().message().find("64, 128, 256"), std::string::npos) << e.status();
  // It says how to run the model anyway (random:tiny, the server's default, is such a model).
  EXPECT_NE(e.status().message().find("--device=cpu runs it"), std::string::npos) << e.status();
  EXPECT_FALSE(CudaRunsModel(c).ok());
  EXPECT_TRUE(CudaRunsModel(GpuTestConfig(128, 0, false)).ok());
}

TEST(CudaBackend, RejectsAPoolPastWhatTheAttentionAddresses) {
  // Before: accepted, and TMA read the pages past 2^23 as zeros (and dropped their stores).
  HSTU_SKIP_WITHOUT_GPU();
  auto gpu = CreateCudaBackend(RandomModel(GpuTestConfig(128, 0, false), 1), 16,
                               cuda::kMaxKvPoolPages + 1, 0);
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(gpu.status().message().find("at most 8388608 pages"), std::string::npos) << gpu.status();
}

TEST(CudaBackend, RejectsPageAndRowArraysThatDoNotStartAtZeroOrEndAtTheirCount) {
  // Consistent per user, but page_indptr ends past page_ids: the kernels would have read page ids
  // from the metadata buffer's padding and written K/V into whatever page they name.
  HSTU_SKIP_WITHOUT_GPU();
  const ModelConfig c = GpuTestConfig(128, 0, false);
  auto gpu = CreateCudaBackend(RandomModel(c, 1), 32, 16, 0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ForwardBatch b;
  b.num_users = 1;
  b.row_offsets = {0, 2};
  b.num_new = {1};
  b.num_tokens = {70};
  b.page_indptr = {0, 3};
  b.page_ids = {7};
  b.token_ids = {5, 6};
  b.token_types = {kItemToken, kItemToken};  // a new history item, then a candidate
  b.positions = {69, 70};
  ForwardOutput out;
  absl::Status s = (*gpu)->Forward(b, false, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  b.page_ids = {7, 8, 9};  // now whole: the same batch runs
  s = (*gpu)->Forward(b, false, &out);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(out.scores.size(), static_cast<size_t>(c.num_tasks));
}

TEST(CudaBackend, UnavailableWithoutGpu) {
  if (test::HasGpu()) GTEST_SKIP() << "a GPU is present; this checks the no-GPU error";
  auto gpu = CreateCudaBackend(RandomModel(GpuTestConfig(128, 0, false), 1), 16, 8, 0);
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace hstu
