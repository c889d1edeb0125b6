// A sticky CUDA error (here a kernel's illegal write) leaves the process's GPU unusable: every
// later CUDA call fails. The engine must notice after the batch that hit it fails (INTERNAL), then
// answer UNAVAILABLE without touching the device (engine/engine.h, Engine::health). The scenario
// runs in a child process (a death test re-executing this binary), so that the error does not
// poison the other GPU tests.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "engine/engine.h"
#include "engine/model_file.h"
#include "tests/gpu/gpu_test_util.h"

namespace hstu {
namespace {

__global__ void WriteToAnInvalidAddress(int* p) { *p = 1; }

[[noreturn]] void Fail(int code, const char* what) {
  std::fprintf(stderr, "device loss scenario failed: %s\n", what);
  std::fflush(stderr);
  std::_Exit(code);
}

// Exits 0 with a message when every step behaves; destructors are skipped (the context is dead).
[[noreturn]] void RunDeviceLossScenario() {
  EngineOptions o;
  o.device = "cuda:0";
  o.page_size = 16;
  auto e = Engine::Create(o, RandomModel(test::SmallGpuModelConfig(), 3));
  if (!e.ok()) Fail(2, "engine creation failed");
  RankRequest r{7, {1, 2, 3, 4}, {0, 1, 2, 3}, {10, 11, 12}};
  if (!(*e)->Rank({&r, 1})[0].ok()) Fail(3, "the first request failed");
  WriteToAnInvalidAddress<<<1, 1>>>(reinterpret_cast<int*>(64));
  if (cudaDeviceSynchronize() == cudaSuccess) Fail(4, "the faulting kernel did not fault");
  r.history_item_ids.push_back(5);
  r.history_actions.push_back(4);
  const auto failed = (*e)->Rank({&r, 1});
  if (failed[0].status().code() != absl::StatusCode::kInternal) {
    Fail(5, "the batch after the fault did not fail with INTERNAL");
  }
  const absl::Status health = (*e)->health();
  std::fprintf(stderr, "health: %s\n", health.ToString().c_str());
  if (health.code() != absl::StatusCode::kUnavailable) Fail(6, "health is not UNAVAILABLE");
  const auto later = (*e)->Rank({&r, 1});
  if (later[0].status().code() != absl::StatusCode::kUnavailable) {
    Fail(7, "a later request was not answered UNAVAILABLE");
  }
  std::fprintf(stderr, "device loss scenario passed\n");
  std::fflush(stderr);
  std::_Exit(0);
}

TEST(CudaEngineDeviceLoss, StickyErrorMakesTheEngineUnavailable) {
  HSTU_SKIP_WITHOUT_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process, not a fork of this one
  EXPECT_EXIT(RunDeviceLossScenario(), ::testing::ExitedWithCode(0),
              "device loss scenario passed");
}

}  // namespace
}  // namespace hstu
