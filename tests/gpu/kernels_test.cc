// Every CUDA kernel against its CPU twin (kernels/cpu/ops.h) on random inputs with odd sizes; the
// attention and the K/V append are in attention_test.cc.
// Inputs are rounded to bf16 first so both sides see the same values; outputs are poisoned (NaN)
// before each launch and checked for NaN/Inf.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

using test::AllFinite;
using test::bf16;
using test::DeviceArray;
using test::RandomVector;
using test::RoundBf16;
using test::ToBf16;
using test::ToF32;

// The gather alone and fused with the first layer's LayerNorm: x against cpu::EmbeddingGather,
// the normalised rows against cpu::LayerNorm of it and bit for bit against LaunchLayerNorm of the
// GPU's own x. d = 136 and 1024 run the warp-per-row kernel (136: a partly masked lane group),
// 4104 the block-per-row gather followed by the LayerNorm fallback.
TEST(CudaKernels, EmbeddingGatherAndFusedLayerNormMatchCpu) {
  HSTU_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1);
  for (int d : {136, 1024, 4104}) {
    for (bool pe : {false, true}) {
      const int rows = 17, item_rows = 29, action_rows = 5, pos_rows = 11;
      const std::string what = "d=" + std::to_string(d) + " pe=" + std::to_string(pe);
      auto items = RoundBf16(RandomVector(rng, item_rows * d));
      auto actions = RoundBf16(RandomVector(rng, action_rows * d));
      auto pos = RoundBf16(RandomVector(rng, pos_rows * d));
      auto w = RandomVector(rng, d, 0.5f, 1.5f), b = RandomVector(rng, d);
      std::vector<int64_t> ids(rows);
      std::vector<int32_t> types(rows), positions(rows);
      for (int r = 0; r < rows; ++r) {
        types[r] = r % 3 == 1 ? kActionToken : kItemToken;
        ids[r] = types[r] == kItemToken ? rng() % 1000 : rng() % action_rows;
        positions[r] = rng() % 20;  // some beyond pos_rows: clamped
      }
      EmbeddingParams<float> cp;
      cp.item_table = items.data();
      cp.action_table = actions.data();
      cp.position_table = pe ? pos.data() : nullptr;
      cp.item_rows = item_rows;
      cp.action_rows = action_rows;
      cp.position_rows = pos_rows;
      cp.hidden_dim = d;
      cp.num_rows = rows;
      cp.token_ids = ids.data();
      cp.token_types = types.data();
      cp.positions = positions.data();
      std::vector<float> want(rows * d), want_n(rows * d);
      cp.out = want.data();
      cpu::EmbeddingGather(cp);
      cpu::LayerNorm(want.data(), rows, d, w.data(), b.data(), 1e-5f, want_n.data());

      DeviceArray<bf16> d_items(ToBf16(items)), d_actions(ToBf16(actions)), d_pos(ToBf16(pos));
      DeviceArray<int64_t> d_ids(ids);
      DeviceArray<int32_t> d_types(types), d_positions(positions);
      DeviceArray<float> d_x(rows * d), d_x_only(rows * d), d_w(w), d_b(b);
      DeviceArray<bf16> d_n(rows * d), d_n_ref(rows * d);
      d_x.Poison();
      d_x_only.Poison();
      d_n.Poison();
      d_n_ref.Poison();
      EmbeddingParams<bf16> gp;
      gp.item_table = d_items.get();
      gp.action_table = d_actions.get();
      gp.position_table = pe ? d_pos.get() : nullptr;
      gp.item_rows = item_rows;
      gp.action_rows = action_rows;
      gp.position_rows = pos_rows;
      gp.hidden_dim = d;
      gp.num_rows = rows;
      gp.token_ids = d_ids.get();
      gp.token_types = d_types.get();
      gp.positions = d_positions.get();
      HSTU_ASSERT_CUDA(cuda::LaunchEmbeddingGather(gp, d_x_only.get(), nullptr, nullptr, 1e-5f,
                                                   nullptr, nullptr));
      HSTU_ASSERT_CUDA(cuda::LaunchEmbeddingGather(gp, d_x.get(), d_w.get(), d_b.get(), 1e-5f,
                                                   d_n.get(), nullptr));
      HSTU_ASSERT_CUDA(cuda::LaunchLayerNorm(d_x.get(), rows, d, d_w.get(), d_b.get(), 1e-5f,
                                             d_n_ref.get(), nullptr));
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      const auto got = d_x.Download(), got_only = d_x_only.Download();
      const auto got_n = ToF32(d_n.Download()), ref_n = ToF32(d_n_ref.Download());
      ASSERT_TRUE(AllFinite(got) && AllFinite(got_n)) << what;
      EXPECT_LT(test::RelL2(got, want), test::kF32RelL2) << what;
      EXPECT_EQ(std::memcmp(got.data(), got_only.data(), got.size() * sizeof(float)), 0)
          << what << ": the gather alone and the fused kernel differ";
      EXPECT_LT(test::RelL2(got_n, want_n), test::kBf16RoundRelL2) << what;
      EXPECT_EQ(std::memcmp(got_n.data(), ref_n.data(), got_n.size() * sizeof(float)), 0)
          << what << ": fused LayerNorm differs from LaunchLayerNorm";
      // Rejected with nothing launched: a missing id, type or position array, no action rows.
      for (int bad = 0; bad < 4; ++bad) {
        EmbeddingParams<bf16> q = gp;
        if (bad == 0) q.token_ids = nullptr;
        if (bad == 1) q.token_types = nullptr;
        if (bad == 2) q.action_rows = 0;
        if (bad == 3) {
          q.position_table = d_pos.get();
          q.positions = nullptr;
        }
        EXPECT_EQ(cuda::LaunchEmbeddingGather(q, d_x.get(), nullptr, nullptr, 1e-5f, nullptr, nullptr),
                  cudaErrorInvalidValue)
            << what << ": case " << bad;
      }
    }
  }
}

// Widths 136 … 2048 run one warp per row (520 and 136 with a partly masked lane group), 4360 the
// block-per-row fallback; odd row counts leave the last block of 4 rows partly empty.
TEST(CudaKernels, LayerNormAndNormMulUMatchCpu) {
  HSTU_SKIP_WITHOUT_GPU();
  std::mt19937 rng(2);
  // 8200 rows: from 8192 on, LayerNorm · u loads w and b after the statistics (layer_norm.cu).
  for (int cols : {1024, 512, 2048, 520, 136, 4360}) {
    for (int rows : {1, 3, 5, 7, 9, 11, 13, 15, 17, 8200}) {
      if (rows > 17 && cols != 1024 && cols != 520) continue;
      const std::string what = std::to_string(rows) + "x" + std::to_string(cols);
      auto x = RandomVector(rng, rows * cols, -3.f, 5.f);
      auto w = RandomVector(rng, cols, 0.5f, 1.5f), b = RandomVector(rng, cols);
      std::vector<float> want(rows * cols);
      cpu::LayerNorm(x.data(), rows, cols, w.data(), b.data(), 1e-5f, want.data());
      DeviceArray<float> d_x(x), d_w(w), d_b(b);
      DeviceArray<bf16> d_out(rows * cols);
      d_out.Poison();
      HSTU_ASSERT_CUDA(cuda::LaunchLayerNorm(d_x.get(), rows, cols, d_w.get(), d_b.get(), 1e-5f,
                                             d_out.get(), nullptr));
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      const auto got = ToF32(d_out.Download());
      ASSERT_TRUE(AllFinite(got)) << what;
      EXPECT_LT(test::RelL2(got, want), test::kBf16RoundRelL2) << what;

      // NormMulU: a [rows, cols] bf16, u a strided column block (as the u block of uvqk rows).
      const int stride = cols * 3;
      auto a = RoundBf16(RandomVector(rng, rows * cols, -2.f, 2.f));
      auto u = RoundBf16(RandomVector(rng, rows * stride));
      std::vector<float> want_y(rows * cols);
      cpu::NormMulU(a.data(), u.data() + cols, stride, rows, cols, w.data(), b.data(), 1e-5f,
                    want_y.data());
      DeviceArray<bf16> d_a(ToBf16(a)), d_u(ToBf16(u)), d_y(rows * cols);
      d_y.Poison();
      HSTU_ASSERT_CUDA(cuda::LaunchNormMulU(d_a.get(), d_u.get() + cols, stride, rows, cols,
                                            d_w.get(), d_b.get(), 1e-5f, d_y.get(), nullptr));
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      const auto got_y = ToF32(d_y.Download());
      ASSERT_TRUE(AllFinite(got_y)) << what;
      EXPECT_LT(test::RelL2(got_y, want_y), test::kBf16RoundRelL2) << what;

      // The gathered form (the last layer's candidate rows): rows picked in any order, some
      // twice, give the same bits as the rows above, and x's picked rows are copied alongside.
      std::vector<int32_t> pick;
      for (int i = 0; i < rows + 2; ++i) pick.push_back(static_cast<int32_t>(rng() % rows));
      const int n = static_cast<int>(pick.size());
      DeviceArray<int32_t> d_pick(pick);
      DeviceArray<bf16> d_yg(n * cols);
      DeviceArray<float> d_xg(n * cols);
      d_yg.Poison();
      d_xg.Poison();
      HSTU_ASSERT_CUDA(cuda::LaunchNormMulUGather(d_a.get(), d_u.get() + cols, stride,
                                                  d_pick.get(), n, cols, d_w.get(), d_b.get(),
                                                  1e-5f, d_yg.get(), d_x.get(), cols, d_xg.get(),
                                                  nullptr));
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      const auto got_yg = ToF32(d_yg.Download());
      const auto got_xg = d_xg.Download();
      for (int i = 0; i < n; ++i) {
        for (int c = 0; c < cols; ++c) {
          ASSERT_EQ(got_yg[i * cols + c], got_y[pick[i] * cols + c]) << what << " gathered row " << i;
          ASSERT_EQ(got_xg[i * cols + c], x[pick[i] * cols + c]) << what << " gathered x row " << i;
        }
      }
    }
  }
  // Rejected with nothing launched: a width that is not a multiple of 8, a misaligned row.
  DeviceArray<float> d_x(64), d_w(64);
  DeviceArray<bf16> d_o(64);
  EXPECT_EQ(cuda::LaunchLayerNorm(d_x.get(), 1, 60, d_w.get(), d_w.get(), 1e-5f, d_o.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchLayerNorm(d_x.get() + 1, 1, 8, d_w.get(), d_w.get(), 1e-5f, d_o.get(),
                                  nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchNormMulU(d_o.get(), d_o.get() + 4, 8, 1, 8, d_w.get(), d_w.get(), 1e-5f,
                                 d_o.get(), nullptr),
            cudaErrorInvalidValue);
  DeviceArray<int32_t> d_rows(std::vector<int32_t>{0});
  EXPECT_EQ(cuda::LaunchNormMulUGather(d_o.get(), d_o.get(), 8, nullptr, 1, 8, d_w.get(),
                                       d_w.get(), 1e-5f, d_o.get(), d_x.get(), 8, d_x.get(),
                                       nullptr),
            cudaErrorInvalidValue);  // no row list
  EXPECT_EQ(cuda::LaunchNormMulUGather(d_o.get(), d_o.get(), 8, d_rows.get(), 1, 8, d_w.get(),
                                       d_w.get(), 1e-5f, d_o.get(), d_x.get(), 12, d_x.get(),
                                       nullptr),
            cudaErrorInvalidValue);  // x width not a multiple of 8
}

TEST(CudaKernels, BiasSiluHeadOpsMatchCpu) {
  HSTU_SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  const int rows = 11, cols = 264;
  auto x = RoundBf16(RandomVector(rng, rows * cols, -4.f, 4.f));
  auto bias = RandomVector(rng, cols);
  std::vector<float> want = x;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) want[r * cols + c] += bias[c];
  cpu::SiluInPlace(want.data(), want.size());
  DeviceArray<bf16> d_x(ToBf16(x));
  DeviceArray<float> d_bias(bias);
  HSTU_ASSERT_CUDA(cuda::LaunchBiasSilu(d_x.get(), rows, cols, d_bias.get(), nullptr));
  HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
  const auto got = ToF32(d_x.Download());
  ASSERT_TRUE(AllFinite(got));
  EXPECT_LT(test::RelL2(got, want), test::kBf16RoundRelL2);
  EXPECT_LE(test::MaxRelDiff(got, want), test::kBf16RoundRelElement);

  // Gather + L2 normalise of candidate rows, then bias + ReLU / sigmoid (fp32).
  const int d = 40;
  auto h = RandomVector(rng, rows * d, -2.f, 2.f);
  std::vector<int32_t> pick = {10, 0, 3, 7};
  std::vector<float> want_raw, want_norm;
  for (int r : pick) want_raw.insert(want_raw.end(), h.begin() + r * d, h.begin() + (r + 1) * d);
  want_norm = want_raw;
  cpu::L2NormalizeRows(want_norm.data(), pick.size(), d);
  DeviceArray<float> d_h(h), d_raw(pick.size() * d), d_norm(pick.size() * d);
  DeviceArray<int32_t> d_pick(pick);
  d_raw.Poison();
  d_norm.Poison();
  HSTU_ASSERT_CUDA(cuda::LaunchGatherL2Normalize(d_h.get(), d_pick.get(), pick.size(), d,
                                                 d_raw.get(), d_norm.get(), nullptr));
  std::vector<float> act = RandomVector(rng, pick.size() * d, -3.f, 3.f);
  auto hb = RandomVector(rng, d);
  std::vector<float> want_relu = act, want_sig = act;
  for (size_t i = 0; i < act.size(); ++i) {
    want_relu[i] += hb[i % d];
    want_sig[i] += hb[i % d];
  }
  cpu::ReluInPlace(want_relu.data(), want_relu.size());
  cpu::SigmoidInPlace(want_sig.data(), want_sig.size());
  DeviceArray<float> d_relu(act), d_sig(act), d_hb(hb);
  HSTU_ASSERT_CUDA(cuda::LaunchBiasActivation(d_relu.get(), pick.size(), d, d_hb.get(),
                                              cuda::Activation::kRelu, nullptr));
  HSTU_ASSERT_CUDA(cuda::LaunchBiasActivation(d_sig.get(), pick.size(), d, d_hb.get(),
                                              cuda::Activation::kSigmoid, nullptr));
  HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_LT(test::RelL2(d_raw.Download(), want_raw), test::kF32RelL2);
  EXPECT_LT(test::RelL2(d_norm.Download(), want_norm), test::kF32RelL2);
  // Without a row list: the rows of x themselves (the compacted candidate rows).
  DeviceArray<float> d_norm2(pick.size() * d);
  d_norm2.Poison();
  HSTU_ASSERT_CUDA(cuda::LaunchGatherL2Normalize(d_raw.get(), nullptr, pick.size(), d, nullptr,
                                                 d_norm2.get(), nullptr));
  HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(d_norm2.Download(), d_norm.Download());
  EXPECT_LT(test::RelL2(d_relu.Download(), want_relu), test::kF32RelL2);
  EXPECT_LT(test::MaxAbsDiff(d_sig.Download(), want_sig), test::kF32Abs);
}

// The head's fused last layer (the previous layer's bias + ReLU applied on load, the input's L2
// normalisation folded in) against a double-precision loop, over odd shapes: rows not a multiple
// of the block's 8 warps, widths not a multiple of the warp, 1 to 16 outputs, each activation.
TEST(CudaKernels, HeadOutputMatchesCpu) {
  HSTU_SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  // norm: 0, or the width of the rows whose L2 norm scales the input (without in_bias: the input
  // itself, so norm == in).
  struct Shape { int rows, in, out; bool in_bias; int norm; cuda::Activation act; };
  const Shape shapes[] = {{1, 5, 1, false, 0, cuda::Activation::kSigmoid},
                          {7, 40, 3, true, 0, cuda::Activation::kSigmoid},
                          {33, 512, 4, true, 1024, cuda::Activation::kSigmoid},
                          {300, 129, 16, true, 1100, cuda::Activation::kRelu},
                          {17, 64, 8, false, 64, cuda::Activation::kNone},
                          {9, 1030, 4, false, 1030, cuda::Activation::kSigmoid},
                          {9000, 32, 2, true, 0, cuda::Activation::kSigmoid}};
  for (const Shape& sh : shapes) {
    SCOPED_TRACE(testing::Message() << sh.rows << " rows, " << sh.in << " -> " << sh.out
                                    << ", norm " << sh.norm);
    const auto x = RandomVector(rng, static_cast<size_t>(sh.rows) * sh.in, -2.f, 2.f);
    const auto in_bias = RandomVector(rng, sh.in, -0.5f, 0.5f);
    const auto w = RandomVector(rng, static_cast<size_t>(sh.in) * sh.out, -0.3f, 0.3f);
    const auto bias = RandomVector(rng, sh.out);
    const bool own_norm = sh.norm > 0 && !sh.in_bias;  // the input's own rows
    const auto norm_rows =
        own_norm ? x : RandomVector(rng, static_cast<size_t>(sh.rows) * sh.norm, -3.f, 3.f);
    std::vector<float> want(static_cast<size_t>(sh.rows) * sh.out);
    for (int r = 0; r < sh.rows; ++r) {
      double ss = 0;
      for (int i = 0; i < sh.norm; ++i) {
        const double v = norm_rows[static_cast<size_t>(r) * sh.norm + i];
        ss += v * v;
      }
      const double scale = sh.norm > 0 ? 1.0 / std::max(std::sqrt(ss), 1e-6) : 1.0;
      for (int o = 0; o < sh.out; ++o) {
        double acc = 0;
        for (int i = 0; i < sh.in; ++i) {
          double h = x[static_cast<size_t>(r) * sh.in + i] * scale;
          if (sh.in_bias) h = std::max(h + in_bias[i], 0.0);
          acc += h * w[static_cast<size_t>(i) * sh.out + o];
        }
        acc += bias[o];
        if (sh.act == cuda::Activation::kRelu) acc = std::max(acc, 0.0);
        if (sh.act == cuda::Activation::kSigmoid) acc = 1.0 / (1.0 + std::exp(-acc));
        want[static_cast<size_t>(r) * sh.out + o] = static_cast<float>(acc);
      }
    }
    DeviceArray<float> d_x(x), d_in_bias(in_bias), d_norm(norm_rows), d_w(w), d_bias(bias),
        d_out(want.size());
    d_out.Poison();
    ASSERT_TRUE(cuda::HeadOutputFits(sh.in, sh.out));
    HSTU_ASSERT_CUDA(cuda::LaunchHeadOutput(
        d_x.get(), sh.rows, sh.in, sh.in_bias ? d_in_bias.get() : nullptr,
        sh.norm > 0 ? (own_norm ? d_x.get() : d_norm.get()) : nullptr, sh.norm, d_w.get(),
        d_bias.get(), sh.out, sh.act, d_out.get(), nullptr));
    HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto got = d_out.Download();
    ASSERT_TRUE(AllFinite(got));
    EXPECT_LT(test::MaxAbsDiff(got, want), 1e-5);
  }
  // Saturated logits: scores stay inside (0, 1), as the CPU's (ScoreFromLogit), through both
  // kernels that apply the sigmoid.
  {
    const std::vector<float> logits = {200.f, -200.f, 17.f, -104.f, 0.5f, -0.5f};
    std::vector<float> want = logits;
    cpu::SigmoidInPlace(want.data(), static_cast<int64_t>(want.size()));
    EXPECT_EQ(want[0], kMaxScore);
    EXPECT_EQ(want[1], kMinScore);
    DeviceArray<float> d_act(logits);
    HSTU_ASSERT_CUDA(cuda::LaunchBiasActivation(d_act.get(), 3, 2, nullptr,
                                                cuda::Activation::kSigmoid, nullptr));
    // The head's last layer with zero weights: the logits are its biases.
    DeviceArray<float> d_x(std::vector<float>(4, 1.f)), d_w(std::vector<float>(2 * 6, 0.f)),
        d_bias(logits), d_out(2 * 6);
    d_out.Poison();
    HSTU_ASSERT_CUDA(cuda::LaunchHeadOutput(d_x.get(), 2, 2, nullptr, nullptr, 0, d_w.get(),
                                            d_bias.get(), 6, cuda::Activation::kSigmoid,
                                            d_out.get(), nullptr));
    HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto got = d_act.Download();
    const auto head = d_out.Download();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-7) << "logit " << logits[i];
      EXPECT_NEAR(head[i], want[i], 1e-7) << "logit " << logits[i];
      EXPECT_NEAR(head[6 + i], want[i], 1e-7) << "logit " << logits[i];
    }
    EXPECT_EQ(got[0], kMaxScore);
    EXPECT_EQ(got[1], kMinScore);
    EXPECT_EQ(head[0], kMaxScore);
    EXPECT_EQ(head[1], kMinScore);
    EXPECT_EQ(head[3], kMinScore);  // -104: e^104 overflows a float
  }
  // Shapes it does not take: too many outputs, weights beyond its shared memory, no rows' input,
  // rows to normalise without a width.
  DeviceArray<float> d_buf(64);
  EXPECT_FALSE(cuda::HeadOutputFits(64, cuda::kHeadOutMaxCols + 1));
  EXPECT_FALSE(cuda::HeadOutputFits(cuda::kHeadOutMaxSharedFloats, 4));
  EXPECT_FALSE(cuda::HeadOutputFits(0, 4));
  EXPECT_EQ(cuda::LaunchHeadOutput(d_buf.get(), 2, 8, nullptr, nullptr, 0, d_buf.get(), nullptr,
                                   cuda::kHeadOutMaxCols + 1, cuda::Activation::kNone,
                                   d_buf.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchHeadOutput(nullptr, 2, 8, nullptr, nullptr, 0, d_buf.get(), nullptr, 4,
                                   cuda::Activation::kNone, d_buf.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchHeadOutput(d_buf.get(), 2, 8, nullptr, d_buf.get(), 0, d_buf.get(),
                                   nullptr, 4, cuda::Activation::kNone, d_buf.get(), nullptr),
            cudaErrorInvalidValue);
}

// Bias + SiLU fused with the append, and the append alone from activated rows. The rows of a batch of no users (nothing appended) against
// the CPU's fp32 SiLU (one bf16 rounding, per element); the rows with users equal those bit for
// bit except the appended rows' v and k, which keep the GEMM output; the pages bit for bit
// against cpu::AppendKv over the activated rows, which also proves every other slot untouched.
// The new tokens' slots are poisoned (NaN) first. Every 4th user's new rows are turned into
// candidates (cached history, nothing to append); padding rows past row_offsets[B] get bias +
// SiLU only.
TEST(CudaKernels, SmCopyMovesBytesBetweenPinnedHostAndDevice) {
  HSTU_SKIP_WITHOUT_GPU();
  cuda::Stream stream;
  HSTU_ASSERT_CUDA(stream.Create());
  std::mt19937 rng(23);
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17},
                             size_t{4096 + 3}, size_t{(1 << 20) + 5}, size_t{(9 << 20) + 8}}) {
    SCOPED_TRACE(testing::Message() << bytes << " bytes");
    cuda::PinnedBuffer host_in, host_out;
    cuda::DeviceBuffer dev;
    HSTU_ASSERT_CUDA(host_in.Reserve(bytes + 16));
    HSTU_ASSERT_CUDA(host_out.Reserve(bytes + 16));
    HSTU_ASSERT_CUDA(dev.Reserve(bytes + 16));
    auto* in = host_in.as<unsigned char>();
    auto* out = host_out.as<unsigned char>();
    for (size_t i = 0; i < bytes + 16; ++i) in[i] = static_cast<unsigned char>(rng());
    std::memset(out, 0xAB, bytes + 16);
    HSTU_ASSERT_CUDA(cudaMemset(dev.get(), 0xCD, bytes + 16));
    // Host → device → host, both by the SMs; the bytes past `bytes` must stay as they were.
    HSTU_ASSERT_CUDA(cuda::LaunchSmCopy(dev.get(), in, bytes, stream.get()));
    HSTU_ASSERT_CUDA(cuda::LaunchSmCopy(out, dev.get(), bytes, stream.get()));
    HSTU_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    EXPECT_EQ(std::memcmp(in, out, bytes), 0);
    for (size_t i = bytes; i < bytes + 16; ++i) ASSERT_EQ(out[i], 0xAB) << "byte " << i;
    std::vector<unsigned char> dev_tail(16);
    HSTU_ASSERT_CUDA(cudaMemcpy(dev_tail.data(), dev.as<unsigned char>() + bytes, 16,
                                cudaMemcpyDeviceToHost));
    for (const unsigned char c : dev_tail) ASSERT_EQ(c, 0xCD);
  }
  cuda::DeviceBuffer a;
  HSTU_ASSERT_CUDA(a.Reserve(256));
  auto* p = a.as<unsigned char>();
  EXPECT_EQ(cuda::LaunchSmCopy(nullptr, p, 16, stream.get()), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchSmCopy(p, nullptr, 16, stream.get()), cudaErrorInvalidValue);
  // Misaligned, overlapping, adjacent.
  EXPECT_EQ(cuda::LaunchSmCopy(p + 8, p + 64, 16, stream.get()), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchSmCopy(p + 16, p, 32, stream.get()), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchSmCopy(p + 32, p, 32, stream.get()), cudaSuccess);
  HSTU_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
}

}  // namespace
}  // namespace hstu
