// The programmatic-launch rule the step relies on (kernels/cuda/common.cuh): a dependent kernel
// that returns without touching memory may skip its WaitForPredecessor, and the kernel after it
// still sees every earlier grid's writes after its own wait. The split reduction does this for
// every item that is not a split tile (cluster plans, unsplit plans): its blocks return at once,
// and LayerNorm · u, launched after it, reads the attention's output.
//
// A writes a flag after a spin of ~50 µs; B, launched dependent on A, returns at once; C,
// dependent on B, waits and reads the flag. A control C without the wait shows that C's blocks do
// run while A is still spinning, i.e. the check can fail.
#include <cuda_runtime.h>

#include "kernels/cuda/common.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace hstu {
namespace {

__device__ volatile int g_flag;

__global__ void SpinThenWriteFlag(int value, long long cycles) {
  cuda::WaitForPredecessor();
  cuda::AllowDependents();
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  if (threadIdx.x == 0 && blockIdx.x == gridDim.x - 1) g_flag = value;
}

__global__ void ReturnAtOnce() { cuda::AllowDependents(); }

__global__ void CountStaleFlags(int value, bool wait, int* stale) {
  cuda::AllowDependents();
  if (wait) cuda::WaitForPredecessor();
  if (threadIdx.x == 0 && g_flag != value) atomicAdd(stale, 1);
}

// Enqueues chains A → B → C for flag values 1..rounds on `stream` (eagerly or into a capture).
void LaunchChains(cudaStream_t stream, int rounds, bool wait, int* stale) {
  for (int i = 1; i <= rounds; ++i) {
    EXPECT_EQ(cuda::LaunchDependent(SpinThenWriteFlag, dim3(64), dim3(128), 0, stream, i,
                                    100000LL),
              cudaSuccess);
    EXPECT_EQ(cuda::LaunchDependent(ReturnAtOnce, dim3(64), dim3(128), 0, stream), cudaSuccess);
    EXPECT_EQ(cuda::LaunchDependent(CountStaleFlags, dim3(264), dim3(128), 0, stream, i, wait,
                                    stale),
              cudaSuccess);
  }
}

// Runs `rounds` chains on `stream` and returns C's stale reads.
int StaleReads(cudaStream_t stream, int rounds, bool wait, int* stale) {
  EXPECT_EQ(cudaMemsetAsync(stale, 0, sizeof(int), stream), cudaSuccess);
  LaunchChains(stream, rounds, wait, stale);
  int h = -1;
  EXPECT_EQ(cudaMemcpyAsync(&h, stale, sizeof(int), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return h;
}

TEST(ProgrammaticLaunch, WaitCoversGridsBeforeAKernelThatReturnedWithoutWaiting) {
  HSTU_SKIP_WITHOUT_GPU();
  int major = 0;
  HSTU_ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) GTEST_SKIP() << "programmatic dependent launch needs compute capability 9.0";
  cudaStream_t stream = nullptr;
  HSTU_ASSERT_CUDA(cudaStreamCreate(&stream));
  test::DeviceArray<int> stale(1);
  constexpr int kRounds = 500;
  // The control first: without its wait C overtakes A, else the check below proves nothing. A
  // tool that serialises kernels (compute-sanitizer does) leaves nothing to overtake: skip there.
  if (StaleReads(stream, kRounds, /*wait=*/false, stale.get()) == 0) {
    cudaStreamDestroy(stream);
    GTEST_SKIP() << "no dependent kernel overtook its predecessor (kernels serialised, e.g. under "
                    "compute-sanitizer): the wait cannot be checked here";
  }
  EXPECT_EQ(StaleReads(stream, kRounds, /*wait=*/true, stale.get()), 0);

  // The same chains captured in a graph, as the decode step replays them.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  HSTU_ASSERT_CUDA(cudaMemsetAsync(stale.get(), 0, sizeof(int), stream));
  HSTU_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  LaunchChains(stream, 50, /*wait=*/true, stale.get());
  HSTU_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  HSTU_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 10; ++r) HSTU_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  int h = -1;
  HSTU_ASSERT_CUDA(cudaMemcpyAsync(&h, stale.get(), sizeof(int), cudaMemcpyDeviceToHost, stream));
  HSTU_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(h, 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace hstu
