// The measured GEMM algorithm choice (kernels/cuda/gemm_tuner.h) against cublasGemmEx on the same
// operands: same product, an accumulating call adds its product exactly once (the timing runs of
// the first call must not touch c), and a class keeps its algorithm (bit-identical repeats).
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>
#include <string>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_bias_silu.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/gemm_tuner.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

using test::bf16;
using test::DeviceArray;
using test::RandomVector;
using test::ToBf16;
using test::ToF32;

// Host-only: the row classes are the graph buckets' row counts and continue past them.
TEST(CudaGemmTuner, RowClassesFollowTheGraphBuckets) {
  EXPECT_EQ(cuda::GemmTuner::RowClass(1), 256);
  EXPECT_EQ(cuda::GemmTuner::RowClass(256), 256);
  EXPECT_EQ(cuda::GemmTuner::RowClass(257), 384);
  EXPECT_EQ(cuda::GemmTuner::RowClass(384), 384);
  EXPECT_EQ(cuda::GemmTuner::RowClass(385), 512);
  EXPECT_EQ(cuda::GemmTuner::RowClass(3000), 3072);
  EXPECT_EQ(cuda::GemmTuner::RowClass(4096), 4096);
  EXPECT_EQ(cuda::GemmTuner::RowClass(8193), 12288);
  EXPECT_EQ(cuda::GemmTuner::RowClass(34816), 49152);
}

// A stream and a cuBLAS handle bound to it with a 32 MiB workspace, as the backend sets them up.
struct BlasOnStream {
  cuda::Stream stream;
  cublasHandle_t blas = nullptr;
  cuda::DeviceBuffer ws;
  BlasOnStream() = default;
  BlasOnStream(const BlasOnStream&) = delete;
  BlasOnStream& operator=(const BlasOnStream&) = delete;
  ~BlasOnStream() {
    if (blas != nullptr) cublasDestroy(blas);
  }
  void Init() {
    HSTU_ASSERT_CUDA(stream.Create());
    ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(blas, stream.get()), CUBLAS_STATUS_SUCCESS);
    HSTU_ASSERT_CUDA(ws.Reserve(32u << 20));
    ASSERT_EQ(cublasSetWorkspace(blas, ws.get(), ws.bytes()), CUBLAS_STATUS_SUCCESS);
  }
};

TEST(CudaGemmTuner, MatchesGemmExAndAccumulatesOnce) {
  HSTU_SKIP_WITHOUT_GPU();
  BlasOnStream env;
  ASSERT_NO_FATAL_FAILURE(env.Init());
  cublasHandle_t blas = env.blas;
  cuda::Stream& stream = env.stream;
  cuda::GemmTuner tuner;
  ASSERT_EQ(tuner.Init(blas, env.ws.get(), env.ws.bytes()), CUBLAS_STATUS_SUCCESS);

  struct Shape { int64_t m, n, k; bool f32; float beta; };
  // The engine's two GEMMs at batch 1 / batch 8 / odd row counts, and a second call of a tuned
  // class at another row count (3071 after 3072, 300 after 384).
  const Shape shapes[] = {{384, 4096, 1024, false, 0.f}, {3072, 1024, 1024, true, 1.f},
                          {3071, 1024, 1024, true, 1.f}, {300, 4096, 1024, false, 0.f},
                          {1, 1024, 1024, true, 1.f},    {5000, 1024, 1024, true, 1.f},
                          {777, 4096, 1024, false, 0.f}};
  std::mt19937 rng(11);
  for (const Shape& s : shapes) {
    const std::string what = std::to_string(s.m) + "x" + std::to_string(s.n) + "x" +
                             std::to_string(s.k) + (s.f32 ? " fp32 += " : " bf16 =");
    DeviceArray<bf16> a(ToBf16(RandomVector(rng, s.m * s.k)));
    DeviceArray<bf16> b(ToBf16(RandomVector(rng, s.k * s.n, -0.05f, 0.05f)));
    const auto c0 = RandomVector(rng, s.m * s.n, -2.f, 2.f);
    std::vector<float> want, got, again;
    for (int run = 0; run < 3; ++run) {
      DeviceArray<float> cf(c0);
      DeviceArray<bf16> cb(s.m * s.n);
      if (!s.f32) cb.Poison();
      // The uploads and the poison run on the legacy stream; the GEMM on `stream` must see them.
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      void* c = s.f32 ? static_cast<void*>(cf.get()) : static_cast<void*>(cb.get());
      const cublasStatus_t st =
          run == 0 ? cuda::GemmBf16(blas, a.get(), b.get(), c, s.f32, s.m, s.n, s.k, s.beta)
                   : tuner.Run(a.get(), b.get(), c, s.f32, s.m, s.n, s.k, s.beta, stream.get());
      ASSERT_EQ(st, CUBLAS_STATUS_SUCCESS) << what << " run " << run;
      HSTU_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
      auto out = s.f32 ? cf.Download() : ToF32(cb.Download());
      (run == 0 ? want : run == 1 ? got : again) = std::move(out);
    }
    ASSERT_TRUE(test::AllFinite(got)) << what;
    // Another algorithm sums in another order: fp32 agrees to rounding, bf16 to one rounding.
    EXPECT_LT(test::RelL2(got, want), s.f32 ? test::kF32RelL2 : test::kBf16RoundRelL2) << what;
    EXPECT_EQ(got, again) << what << ": a tuned class must keep its algorithm";
  }
  if (tuner.enabled()) {
    EXPECT_EQ(tuner.num_tuned(), 5);  // 384/300 and 3072/3071 share their classes
  }
}

// c = SiLU(a·b + bias) on bf16-rounded inputs, in double.
std::vector<float> BiasSiluReference(const std::vector<float>& a, const std::vector<float>& b,
                                     const std::vector<float>& bias, int64_t m, int64_t n,
                                     int64_t k) {
  std::vector<float> c(m * n);
  std::vector<double> acc(n);
  for (int64_t r = 0; r < m; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const double x = a[r * k + j];
      for (int64_t col = 0; col < n; ++col) acc[col] += x * b[j * n + col];
    }
    for (int64_t col = 0; col < n; ++col) {
      const double v = acc[col] + bias[col];
      c[r * n + col] = static_cast<float>(v / (1.0 + std::exp(-v)));
    }
  }
  return c;
}

// The fused UVQK GEMM (CUTLASS, sm_90a) in each tile configuration against the double reference
// and against cuBLAS + the bias + SiLU pass: partial tiles in m (1, 17, 300 rows), n and k not
// multiples of the tile (264 × 136, 520 × 40), and the engine's shape at batch 1 and 8. One row
// past m is poisoned and must stay so (no write outside c).
TEST(CudaGemmBiasSilu, MatchesReferenceInEveryConfig) {
  HSTU_SKIP_WITHOUT_GPU();
  if (!cuda::GemmBiasSiluAvailable()) {
    GTEST_SKIP() << "fused GEMM not in this build or not a compute capability 9.0 GPU";
  }
  cublasHandle_t blas = nullptr;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  struct Shape { int64_t m, n, k; };
  // The last shape's bias spans ±40, so the activation sees its tails (e^−x up to 2^58).
  const Shape shapes[] = {{1, 264, 136}, {17, 520, 40}, {300, 4096, 1024}, {384, 4096, 1024},
                          {3072, 4096, 1024}, {96, 264, 64}};
  std::mt19937 rng(21);
  for (const Shape& s : shapes) {
    const std::string what =
        std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
    const auto a = test::RoundBf16(RandomVector(rng, s.m * s.k));
    const auto b = test::RoundBf16(RandomVector(rng, s.k * s.n, -0.1f, 0.1f));
    const float bias_range = &s == &shapes[std::size(shapes) - 1] ? 40.f : 1.f;
    const auto bias = RandomVector(rng, s.n, -bias_range, bias_range);
    const auto want = BiasSiluReference(a, b, bias, s.m, s.n, s.k);
    DeviceArray<bf16> da(ToBf16(a)), db(ToBf16(b));
    DeviceArray<float> dbias(bias);
    // cuBLAS + the bias + SiLU pass: the unfused route, rounded twice.
    DeviceArray<bf16> unfused(s.m * s.n);
    ASSERT_EQ(cuda::GemmBf16(blas, da.get(), db.get(), unfused.get(), false, s.m, s.n, s.k, 0.f),
              CUBLAS_STATUS_SUCCESS);
    HSTU_ASSERT_CUDA(cuda::LaunchBiasSilu(unfused.get(), s.m, s.n, dbias.get(), nullptr));
    HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto want_unfused = ToF32(unfused.Download());
    ASSERT_LT(test::RelL2(want_unfused, want), test::kBf16RoundRelL2) << what << " (cuBLAS)";
    for (int config = 0; config < cuda::kGemmBiasSiluConfigs; ++config) {
      DeviceArray<bf16> dc((s.m + 1) * s.n);
      dc.Poison();
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      HSTU_ASSERT_CUDA(cuda::LaunchGemmBiasSilu(da.get(), db.get(), dbias.get(), dc.get(), s.m,
                                                s.n, s.k, config, nullptr));
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      auto all = dc.Download();
      const std::vector<bf16> past(all.begin() + s.m * s.n, all.end());
      all.resize(s.m * s.n);
      const auto got = ToF32(all);
      const std::string at = what + " config " + std::to_string(config);
      ASSERT_TRUE(test::AllFinite(got)) << at;
      // One bf16 rounding of a value the reference has in double, in norm and element by element
      // (half a bf16 unit is 2^-9 relative; the floor covers fp32 summation near SiLU's zero).
      EXPECT_LT(test::RelL2(got, want), test::kBf16RoundRelL2) << at;
      int64_t worst = 0;
      double worst_excess = 0;
      for (int64_t i = 0; i < s.m * s.n; ++i) {
        const double excess = std::abs(got[i] - want[i]) - (std::abs(want[i]) / 256.0 + 1e-4);
        if (excess > worst_excess) worst_excess = excess, worst = i;
      }
      EXPECT_EQ(worst_excess, 0.0) << at << ": element " << worst << " is " << got[worst]
                                   << ", the reference " << want[worst];
      // The unfused route rounds the GEMM output once more: the two agree to about one bf16 unit.
      EXPECT_LT(test::RelL2(got, want_unfused), 2 * test::kBf16RoundRelL2) << at;
      const auto poison = ToF32(past);
      EXPECT_TRUE(std::all_of(poison.begin(), poison.end(), [](float v) { return std::isnan(v); }))
          << at << ": wrote past row m";
      // Deterministic: the same call again gives the same bits.
      HSTU_ASSERT_CUDA(cuda::LaunchGemmBiasSilu(da.get(), db.get(), dbias.get(), dc.get(), s.m,
                                                s.n, s.k, config, nullptr));
      HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
      auto again = dc.Download();
      again.resize(s.m * s.n);
      EXPECT_EQ(std::memcmp(again.data(), all.data(), all.size() * sizeof(bf16)), 0) << at;
    }
  }
  // Rejected with nothing launched: n or k not a multiple of 8, a misaligned operand, a config
  // that does not exist, no bias.
  DeviceArray<bf16> x(64 * 64);
  DeviceArray<float> bias(64);
  EXPECT_EQ(cuda::LaunchGemmBiasSilu(x.get(), x.get(), bias.get(), x.get(), 8, 60, 64, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchGemmBiasSilu(x.get(), x.get(), bias.get(), x.get(), 8, 64, 60, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchGemmBiasSilu(x.get() + 1, x.get(), bias.get(), x.get(), 8, 64, 64, 0,
                                     nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchGemmBiasSilu(x.get(), x.get(), bias.get(), x.get(), 8, 64, 64,
                                     cuda::kGemmBiasSiluConfigs, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchGemmBiasSilu(x.get(), x.get(), nullptr, x.get(), 8, 64, 64, 0, nullptr),
            cudaErrorInvalidValue);
  cublasDestroy(blas);
}

// The tuner's route for the UVQK step: a valid route, the same on every later call of the class,
// and −1 when the fused kernel is turned off (HSTU_GEMM_FUSED=0) or unavailable.
TEST(CudaGemmBiasSilu, TunerRouteIsStablePerClassAndCanBeTurnedOff) {
  HSTU_SKIP_WITHOUT_GPU();
  BlasOnStream env;
  ASSERT_NO_FATAL_FAILURE(env.Init());
  cublasHandle_t blas = env.blas;
  cuda::Stream& stream = env.stream;
  cuda::DeviceBuffer& ws = env.ws;
  std::mt19937 rng(23);
  const int64_t m = 384, n = 4096, k = 1024;
  DeviceArray<bf16> a(ToBf16(RandomVector(rng, m * k)));
  DeviceArray<bf16> b(ToBf16(RandomVector(rng, k * n, -0.05f, 0.05f)));
  DeviceArray<float> bias(RandomVector(rng, n));
  DeviceArray<bf16> c(m * n);
  HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
  for (bool off : {false, true}) {
    if (off) setenv("HSTU_GEMM_FUSED", "0", 1);
    cuda::GemmTuner tuner;
    ASSERT_EQ(tuner.Init(blas, ws.get(), ws.bytes()), CUBLAS_STATUS_SUCCESS);
    unsetenv("HSTU_GEMM_FUSED");
    EXPECT_EQ(tuner.fused_available(), !off && cuda::GemmBiasSiluAvailable() && tuner.enabled());
    // No users: the appends have nothing to write (the kernels still run in the timing).
    AppendKvParams<bf16> none;
    none.uvqk = c.get();
    none.uvqk_row_stride = n;
    none.kv.num_heads = 4;
    none.kv.head_dim = n / 16;
    none.kv.page_size = 16;
    none.kv.base = c.get();
    EXPECT_FALSE(tuner.HasBiasSiluRoute(m, n, k) && tuner.fused_available());
    const int route = tuner.BiasSiluRoute(a.get(), b.get(), bias.get(), none, m, n, k,
                                          stream.get());
    EXPECT_TRUE(tuner.HasBiasSiluRoute(300, n, k));
    EXPECT_GE(route, -1);
    EXPECT_LT(route, cuda::kGemmBiasSiluConfigs);
    if (off || !cuda::GemmBiasSiluAvailable() || !tuner.enabled()) {
      EXPECT_EQ(route, -1) << "off=" << off;
    }
    // Another row count of the same class (300 → 384) keeps the route without timing again.
    EXPECT_EQ(tuner.BiasSiluRoute(a.get(), b.get(), bias.get(), none, 300, n, k, stream.get()),
              route);
    std::printf("[ route ] 384 x 4096 x 1024, fused %s: %d\n", off ? "off" : "on", route);
  }
}

}  // namespace
}  // namespace hstu
