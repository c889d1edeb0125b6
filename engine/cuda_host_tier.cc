// The CUDA backend's host KV tier (DESIGN §6): the pinned host pool, the onloads (host → GPU, on
// their own stream, each layer's pages behind an event that the layer's compute waits for), the
// prefetches of queued requests, the write-behind offloads (GPU → host) and their completion.
#include "engine/cuda_backend_impl.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace hstu {
namespace cuda_backend_internal {

absl::Status CudaBackendImpl::CreateHostPool(int64_t num_pages) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  if (num_pages <= 0) return absl::InvalidArgumentError("the host pool needs at least one page");
  if (host_pool_ != nullptr) return absl::FailedPreconditionError("the host pool exists already");
  const size_t bytes = static_cast<size_t>(page_elems_) * sizeof(bf16) * num_pages * config_.num_layers;
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot pin ", bytes, " bytes for the host KV pool: ",
                                                     cudaGetErrorString(err)));
  }
  host_pool_ = static_cast<uint8_t*>(p);
  host_num_pages_ = num_pages;
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::CopyPages(CopyKind kind, const std::vector<int32_t>& src,
                                        const std::vector<int32_t>& dst) {
  if (host_pool_ == nullptr) return absl::FailedPreconditionError("no host pool");
  if (src.size() != dst.size()) return absl::InvalidArgumentError("CopyPages: src/dst sizes differ");
  const bool to_host = kind == CopyKind::kDeviceToHost;
  const int64_t src_pages = to_host ? num_pages_ : host_num_pages_;
  const int64_t dst_pages = to_host ? host_num_pages_ : num_pages_;
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] < 0 || src[i] >= src_pages || dst[i] < 0 || dst[i] >= dst_pages) {
      return absl::InvalidArgumentError(absl::StrCat("CopyPages: page ", src[i], " -> ", dst[i],
                                                     " out of range"));
    }
  }
  if (src.empty()) return absl::OkStatus();
  if (!to_host) {
    pending_src_.insert(pending_src_.end(), src.begin(), src.end());
    pending_dst_.insert(pending_dst_.end(), dst.begin(), dst.end());
    return absl::OkStatus();
  }
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  // Write-behind: the copies start once the compute stream's work so far (the forward that wrote
  // these pages) is done, and never hold up later compute.
  HSTU_CUDA_RETURN(cudaEventRecord(compute_done_, stream_.get()));
  HSTU_CUDA_RETURN(cudaStreamWaitEvent(offload_stream_.get(), compute_done_, 0));
  const std::vector<cuda::PageRun> runs = cuda::MergePageRuns(src.data(), dst.data(), src.size());
  for (int l = 0; l < config_.num_layers; ++l) {
    HSTU_CUDA_RETURN(cuda::EnqueuePageRuns(runs, GpuPoolRef(), HostPoolRef(), l, copy_method_,
                                           offload_stream_.get(), &copy_scratch_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::FlushOnloads() {
  if (pending_src_.empty()) return absl::OkStatus();
  absl::Status s = IssueOnloads();
  pending_src_.clear();
  pending_dst_.clear();
  if (!s.ok()) {
    // Some layers' copies may be queued, others not. Let none land later in pages that will be
    // freed and reused, and fail the batch the pages were for.
    onload_failed_ = true;
    cudaStreamSynchronize(onload_stream_.get());
    cudaGetLastError();
  }
  return s;
}

absl::Status CudaBackendImpl::IssueOnloads() {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  // The destination pages may have been read by work still queued on the compute stream.
  HSTU_CUDA_RETURN(cudaEventRecord(compute_done_, stream_.get()));
  HSTU_CUDA_RETURN(cudaStreamWaitEvent(onload_stream_.get(), compute_done_, 0));
  const std::vector<cuda::PageRun> runs =
      cuda::MergePageRuns(pending_src_.data(), pending_dst_.data(), pending_src_.size());
  const int64_t bytes = static_cast<int64_t>(pending_src_.size()) * page_bytes();
  // The events are reused: a previous flush's timing still unread is kept if complete, else lost.
  PollOnloadTiming();
  timed_onload_bytes_ = 0;
  // Recorded behind the waits above (and behind any prefetch made visible on this stream), so
  // the interval is the copies' own time.
  HSTU_CUDA_RETURN(cudaEventRecord(onload_start_, onload_stream_.get()));
  for (int l = 0; l < config_.num_layers; ++l) {
    HSTU_CUDA_RETURN(cuda::EnqueuePageRuns(runs, HostPoolRef(), GpuPoolRef(), l, copy_method_,
                                           onload_stream_.get(), &copy_scratch_));
    HSTU_CUDA_RETURN(cudaEventRecord(layer_ready_[l], onload_stream_.get()));
  }
  HSTU_CUDA_RETURN(cudaEventRecord(onload_end_, onload_stream_.get()));
  timed_onload_bytes_ = bytes;
  onload_waits_ = true;
  return absl::OkStatus();
}

void CudaBackendImpl::PollOnloadTiming() {
  if (timed_onload_bytes_ == 0 || cudaSetDevice(device_) != cudaSuccess) return;
  const cudaError_t q = cudaEventQuery(onload_end_);
  if (q == cudaErrorNotReady) return;
  float ms = 0;
  // Any other error surfaces at the next synchronising call; this sample is dropped.
  if (q == cudaSuccess && cudaEventElapsedTime(&ms, onload_start_, onload_end_) == cudaSuccess &&
      ms > 0) {
    onload_timing_ = CopyTiming{timed_onload_bytes_, ms * 1e-3};
  }
  timed_onload_bytes_ = 0;
}

std::optional<CopyTiming> CudaBackendImpl::TakeOnloadTiming() {
  PollOnloadTiming();
  std::optional<CopyTiming> t = onload_timing_;
  onload_timing_.reset();
  return t;
}

absl::Status CudaBackendImpl::PrefetchPages(const std::vector<int32_t>& src,
                                            const std::vector<int32_t>& dst) {
  if (host_pool_ == nullptr) return absl::FailedPreconditionError("no host KV pool");
  if (src.size() != dst.size()) return absl::InvalidArgumentError("PrefetchPages: src/dst sizes differ");
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] < 0 || src[i] >= host_num_pages_ || dst[i] < 0 || dst[i] >= num_pages_) {
      return absl::InvalidArgumentError(absl::StrCat("PrefetchPages: page ", src[i], " -> ", dst[i],
                                                     " out of range"));
    }
  }
  if (src.empty()) return absl::OkStatus();
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  // Its own stream and events: forwards of other users never wait for it. The destination pages
  // are free pages, but work already queued on the compute stream may still read them.
  HSTU_CUDA_RETURN(cudaEventRecord(compute_done_, stream_.get()));
  HSTU_CUDA_RETURN(cudaStreamWaitEvent(prefetch_stream_.get(), compute_done_, 0));
  const std::vector<cuda::PageRun> runs = cuda::MergePageRuns(src.data(), dst.data(), src.size());
  for (int l = 0; l < config_.num_layers; ++l) {
    HSTU_CUDA_RETURN(cuda::EnqueuePageRuns(runs, HostPoolRef(), GpuPoolRef(), l, copy_method_,
                                           prefetch_stream_.get(), &copy_scratch_));
    HSTU_CUDA_RETURN(cudaEventRecord(prefetch_ready_[l], prefetch_stream_.get()));
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::MakePrefetchVisible() {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  // layer_ready_[l] is what forwards (eager and graph wait nodes) wait for before layer l: re-record
  // it on the onload stream behind the latest prefetch of that layer.
  for (int l = 0; l < config_.num_layers; ++l) {
    HSTU_CUDA_RETURN(cudaStreamWaitEvent(onload_stream_.get(), prefetch_ready_[l], 0));
    HSTU_CUDA_RETURN(cudaEventRecord(layer_ready_[l], onload_stream_.get()));
  }
  onload_waits_ = true;
  return absl::OkStatus();
}

bool CudaBackendImpl::PrefetchesDone() {
  if (cudaSetDevice(device_) != cudaSuccess) return false;
  return cudaStreamQuery(prefetch_stream_.get()) == cudaSuccess;
}

absl::Status CudaBackendImpl::WaitCopies() {
  // Every stream is drained even after a failure: the callers free or reuse pages next.
  absl::Status first = FlushOnloads();
  auto keep_first = [&first](cudaError_t err, const char* what) {
    if (err != cudaSuccess && first.ok()) first = CudaStatus(err, what);
  };
  keep_first(cudaSetDevice(device_), "cudaSetDevice");
  keep_first(cudaStreamSynchronize(prefetch_stream_.get()), "cudaStreamSynchronize(prefetch)");
  keep_first(cudaStreamSynchronize(onload_stream_.get()), "cudaStreamSynchronize(onload)");
  keep_first(cudaStreamSynchronize(offload_stream_.get()), "cudaStreamSynchronize(offload)");
  return first;
}

bool CudaBackendImpl::CopiesDone() {
  if (!FlushOnloads().ok() || cudaSetDevice(device_) != cudaSuccess) return false;
  // cudaErrorNotReady means still running; any other error is reported by the next WaitCopies.
  return cudaStreamQuery(onload_stream_.get()) == cudaSuccess &&
         cudaStreamQuery(offload_stream_.get()) == cudaSuccess;
}

}  // namespace cuda_backend_internal
}  // namespace hstu
