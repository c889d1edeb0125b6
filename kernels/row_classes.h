// The GEMM tuner's row classes (kernels/cuda/gemm_tuner.h), without CUDA: a GEMM of m rows is
// tuned once for its class, the smallest bound >= m of 256, 384, 512, 768, 1024, ... (alternately
// x1.5 and x4/3). The server's start-up warms each class up (server/ranking_server.h).
#pragma once

#include <cstdint>

namespace hstu::row_classes {

inline constexpr int64_t kFirst = 256;

// The bound after `bound` (a bound of this sequence).
constexpr int64_t Next(int64_t bound) {
  return (bound & (bound - 1)) == 0 ? bound + bound / 2 : bound / 3 * 4;
}

// The class of m rows: its bound.
constexpr int64_t Of(int64_t m) {
  int64_t bound = kFirst;
  while (bound < m) bound = Next(bound);
  return bound;
}

}  // namespace hstu::row_classes
