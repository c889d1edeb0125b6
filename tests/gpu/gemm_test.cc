// The measured GEMM algorithm choice (kernels/cuda/gemm_tuner.h) against cublasGemmEx on the same
// operands: same product, an accumulating call adds its product exactly once (the timing runs of
// the first call must not touch c), and a class keeps its algorithm (bit-identical repeats).
#include <cublas_v2.h>

#include <random>
#include <string>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
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

TEST(CudaGemmTuner, MatchesGemmExAndAccumulatesOnce) {
  HSTU_SKIP_WITHOUT_GPU();
  cuda::Stream stream;
  HSTU_ASSERT_CUDA(stream.Create());
  cublasHandle_t blas = nullptr;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(blas, stream.get()), CUBLAS_STATUS_SUCCESS);
  cuda::DeviceBuffer ws;
  HSTU_ASSERT_CUDA(ws.Reserve(32u << 20));
  ASSERT_EQ(cublasSetWorkspace(blas, ws.get(), ws.bytes()), CUBLAS_STATUS_SUCCESS);
  cuda::GemmTuner tuner;
  ASSERT_EQ(tuner.Init(blas, ws.get(), ws.bytes()), CUBLAS_STATUS_SUCCESS);

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
  cublasDestroy(blas);
}

}  // namespace
}  // namespace hstu
