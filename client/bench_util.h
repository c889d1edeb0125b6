// Helpers shared by the hstu_bench modes: CUDA error check, random device data, event timing.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/ops.h"

// A benchmark cannot report a number after a failed CUDA call: print where and exit.
#define HSTU_BENCH_CHECK_CUDA(expr)                                                        \
  do {                                                                                     \
    const cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,                   \
                   cudaGetErrorString(e_));                                                \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

// Nor after a failed cuBLAS(Lt) call: print where and exit.
#define HSTU_BENCH_CHECK_LT(expr)                                                      \
  do {                                                                                 \
    const cublasStatus_t st_ = (expr);                                                 \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #expr, \
                   static_cast<int>(st_));                                             \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

namespace hstu::bench {

inline float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.f : v[v.size() / 2];
}

inline std::string GpuName() {
  cudaDeviceProp p{};
  HSTU_BENCH_CHECK_CUDA(cudaGetDeviceProperties(&p, 0));
  return p.name;
}

// Fills a device bf16 buffer with uniform(-1, 1) values generated on the host in slices.
inline void FillRandom(cuda::bf16* dst, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const size_t kSlice = size_t{1} << 22;
  std::vector<cuda::bf16> tmp(std::min(n, kSlice));
  for (size_t off = 0; off < n; off += kSlice) {
    const size_t m = std::min(kSlice, n - off);
    for (size_t i = 0; i < m; ++i) tmp[i] = __float2bfloat16_rn(u(rng));
    HSTU_BENCH_CHECK_CUDA(
        cudaMemcpy(dst + off, tmp.data(), m * sizeof(cuda::bf16), cudaMemcpyHostToDevice));
  }
}

// Times `fn` (which enqueues `per_call` units of work on `s`): 3 warm-ups, then the median over
// `reps` of milliseconds per unit, measured with CUDA events.
template <typename Fn>
float TimeMs(cudaStream_t s, int reps, int per_call, Fn fn) {
  cuda::Event start, stop;
  HSTU_BENCH_CHECK_CUDA(start.Create());
  HSTU_BENCH_CHECK_CUDA(stop.Create());
  for (int i = 0; i < 3; ++i) fn();
  HSTU_BENCH_CHECK_CUDA(cudaStreamSynchronize(s));
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    HSTU_BENCH_CHECK_CUDA(cudaEventRecord(start.get(), s));
    fn();
    HSTU_BENCH_CHECK_CUDA(cudaEventRecord(stop.get(), s));
    HSTU_BENCH_CHECK_CUDA(cudaEventSynchronize(stop.get()));
    float t = 0;
    HSTU_BENCH_CHECK_CUDA(cudaEventElapsedTime(&t, start.get(), stop.get()));
    ms.push_back(t / per_call);
  }
  return Median(ms);
}

template <typename Fn>
float TimeMs(cudaStream_t s, int reps, Fn fn) {
  return TimeMs(s, reps, 1, fn);
}

}  // namespace hstu::bench
