// Helpers of the GPU tests: skipping without a GPU, device arrays, bf16 rounding, random data.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/model_file.h"
#include "gtest/gtest.h"

namespace hstu::test {

inline bool HasGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define HSTU_SKIP_WITHOUT_GPU() \
  if (!::hstu::test::HasGpu()) GTEST_SKIP() << "no CUDA device present: GPU test skipped"

#define HSTU_ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

using bf16 = __nv_bfloat16;

// A device copy of a host vector; Download() reads it back.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) { Allocate(n); }
  explicit DeviceArray(const std::vector<T>& h) {
    Allocate(h.size());
    Upload(h);
  }
  ~DeviceArray() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void Allocate(size_t n) {
    n_ = n;
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  void Upload(const std::vector<T>& h) {
    EXPECT_EQ(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  // Fills every byte with 0xFF: NaN for fp32 and bf16, so unwritten outputs show up.
  void Poison() { EXPECT_EQ(cudaMemset(p_, 0xFF, std::max<size_t>(n_, 1) * sizeof(T)), cudaSuccess); }
  std::vector<T> Download() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

inline std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(v[i]);
  return out;
}
inline std::vector<float> ToF32(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}
// Rounds through bf16, so the CPU oracle sees exactly the GPU's inputs.
inline std::vector<float> RoundBf16(const std::vector<float>& v) { return ToF32(ToBf16(v)); }

inline std::vector<float> RandomVector(std::mt19937& rng, size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

inline bool AllFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// For EngineOptions::wrap_backend: a CUDA backend whose KV pool starts as NaN (bytes 0xFF), so
// that a page the engine reads before anything was written to it turns the scores non-finite (the
// engine then answers INTERNAL) instead of reading as whatever the allocation held. Other
// backends pass unchanged.
inline std::unique_ptr<Backend> PoisonedKv(std::unique_ptr<Backend> b) {
  if (auto* cuda = dynamic_cast<CudaBackend*>(b.get()); cuda != nullptr) {
    const absl::Status s = cuda->SetDebugPoison(true);
    EXPECT_TRUE(s.ok()) << s;
  }
  return b;
}

// A small model the CUDA kernels support (head dim 64), with position encoding: 3 layers, d 128,
// 2 heads x 64, 256 history tokens, 32 candidates per forward, 2 tasks.
inline ModelConfig SmallGpuModelConfig() {
  ModelConfig c = *PresetConfig("tiny");
  c.num_layers = 3;
  c.hidden_dim = 128;
  c.num_heads = 2;
  c.head_dim = 64;
  c.max_history_tokens = 256;
  c.max_candidates = 32;
  c.attention_norm_len = 256 + 32;
  c.position_encoding = true;
  c.position_rows = 256;
  c.item_rows = 500;
  c.action_rows = 6;
  c.num_tasks = 2;
  c.head_dims = {128, 32, 2};
  return c;
}

// Equal bit for bit (NaN patterns included, where == would fail): replays against eager runs,
// pages that must be left as they were.
inline bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace hstu::test
