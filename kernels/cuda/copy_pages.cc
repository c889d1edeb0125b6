#include "kernels/cuda/copy_pages.h"

namespace hstu::cuda {

std::vector<PageRun> MergePageRuns(const int32_t* src, const int32_t* dst, size_t n) {
  std::vector<PageRun> runs;
  for (size_t i = 0; i < n; ++i) {
    if (!runs.empty()) {
      PageRun& r = runs.back();
      if (src[i] == r.src_page + r.count && dst[i] == r.dst_page + r.count) {
        ++r.count;
        continue;
      }
    }
    runs.push_back({src[i], dst[i], 1});
  }
  return runs;
}

cudaError_t EnqueuePageRuns(const std::vector<PageRun>& runs, const PagePoolRef& src,
                            const PagePoolRef& dst, int layer, PageCopyMethod method,
                            cudaStream_t stream, PageCopyScratch* scratch) {
  if (runs.empty()) return cudaSuccess;
  if (src.page_bytes != dst.page_bytes) return cudaErrorInvalidValue;
  const uint8_t* src_layer = src.base + layer * src.num_pages * src.page_bytes;
  uint8_t* dst_layer = dst.base + layer * dst.num_pages * dst.page_bytes;
  if (method == PageCopyMethod::kMemcpyPerRun || runs.size() == 1) {
    for (const PageRun& r : runs) {
      const cudaError_t err = cudaMemcpyAsync(dst_layer + r.dst_page * dst.page_bytes,
                                              src_layer + r.src_page * src.page_bytes,
                                              r.count * src.page_bytes, cudaMemcpyDefault, stream);
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }
  scratch->dsts.clear();
  scratch->srcs.clear();
  scratch->sizes.clear();
  for (const PageRun& r : runs) {
    scratch->dsts.push_back(dst_layer + r.dst_page * dst.page_bytes);
    scratch->srcs.push_back(src_layer + r.src_page * src.page_bytes);
    scratch->sizes.push_back(r.count * src.page_bytes);
  }
  // Stream order for the sources: the copies may read only after the work before them in the
  // stream (the forward that wrote the pages, or the event waits in front of them).
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
  const cudaError_t err = cudaMemcpyBatchAsync(scratch->dsts.data(), scratch->srcs.data(),
                                               scratch->sizes.data(), runs.size(), &attr, &attr_idx,
                                               1, stream);
  if (err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver) {
    // Drivers before CUDA 12.8 have no batched copies: one copy per run instead (half the rate
    // for scattered pages, docs/benchmarks.md). The error is not sticky; clear it.
    cudaGetLastError();
    return EnqueuePageRuns(runs, src, dst, layer, PageCopyMethod::kMemcpyPerRun, stream, scratch);
  }
  return err;
}

}  // namespace hstu::cuda
