// Page copies between the GPU KV pool and the pinned host pool (DESIGN §6). Both pools share one
// layout, bf16 [layers, num_pages, 2, page_size, H, D], so page p of layer l is one contiguous
// block of page_bytes at base + (l · num_pages + p) · page_bytes, and pages with consecutive ids in
// both pools form one contiguous copy. Host-only code (no kernels); not thread-safe.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace hstu::cuda {

// How a layer's page runs are handed to the copy engines.
enum class PageCopyMethod {
  kMemcpyPerRun,  // one cudaMemcpyAsync per run of consecutive pages
  kMemcpyBatch,   // one cudaMemcpyBatchAsync per layer (CUDA 12.8+): one call, many copies
};

struct PagePoolRef {
  uint8_t* base = nullptr;  // layer 0, page 0
  int64_t num_pages = 0;    // pages per layer
  int64_t page_bytes = 0;   // one page of one layer (K and V)
};

// `count` pages from src_page onwards go to dst_page onwards.
struct PageRun {
  int32_t src_page = 0;
  int32_t dst_page = 0;
  int32_t count = 0;
};

// Merges src[i] → dst[i] into runs where both ids advance by one. src and dst: [n].
std::vector<PageRun> MergePageRuns(const int32_t* src, const int32_t* dst, size_t n);

// Reused host arrays of the batched call (the API reads them during the call).
struct PageCopyScratch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

// Enqueues one layer's runs on `stream`. Asynchronous with pinned host memory.
cudaError_t EnqueuePageRuns(const std::vector<PageRun>& runs, const PagePoolRef& src,
                            const PagePoolRef& dst, int layer, PageCopyMethod method,
                            cudaStream_t stream, PageCopyScratch* scratch);

}  // namespace hstu::cuda
