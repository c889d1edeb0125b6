// RAII owners of device memory, pinned host memory, a stream and events. Move-only; not
// thread-safe. Allocation failures are returned (cudaError_t), never thrown.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace hstu::cuda {

// Memory that only grows (Reserve), so per-batch buffers stop allocating once warm; Alloc says
// where it lives (DeviceAlloc, PinnedAlloc).
template <typename Alloc>
class GrowingBuffer {
 public:
  GrowingBuffer() = default;
  ~GrowingBuffer() { Free(); }
  GrowingBuffer(GrowingBuffer&& o) noexcept { *this = std::move(o); }
  GrowingBuffer& operator=(GrowingBuffer&& o) noexcept {
    if (this != &o) {
      Free();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  GrowingBuffer(const GrowingBuffer&) = delete;
  GrowingBuffer& operator=(const GrowingBuffer&) = delete;

  // Ensures at least `bytes`; old contents are dropped when it reallocates.
  cudaError_t Reserve(size_t bytes) {
    if (bytes <= bytes_) return cudaSuccess;
    Free();
    void* p = nullptr;
    const cudaError_t err = Alloc::Allocate(&p, bytes);
    if (err != cudaSuccess) return err;
    ptr_ = p;
    bytes_ = bytes;
    return cudaSuccess;
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void Free() {
    if (ptr_ != nullptr) Alloc::Release(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct DeviceAlloc {
  static cudaError_t Allocate(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
  static void Release(void* p) { cudaFree(p); }
};
// Page-locked host memory (asynchronous copies need it).
struct PinnedAlloc {
  static cudaError_t Allocate(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
  static void Release(void* p) { cudaFreeHost(p); }
};

using DeviceBuffer = GrowingBuffer<DeviceAlloc>;
using PinnedBuffer = GrowingBuffer<PinnedAlloc>;

class Stream {
 public:
  Stream() = default;
  ~Stream() {
    if (s_ != nullptr) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaError_t Create() { return cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() = default;
  ~Event() {
    if (e_ != nullptr) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaError_t Create() { return cudaEventCreate(&e_); }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace hstu::cuda
