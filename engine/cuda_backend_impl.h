// Internals of the CUDA backend shared by engine/cuda_backend.cc (forward, host tier) and
// engine/graph_runner.cc (CUDA-graph capture and replay). Not part of any public interface.
#pragma once

#include "engine/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/copy_pages.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_tuner.h"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/ops.h"

namespace hstu::cuda_backend_internal {

using cuda::bf16;
using cuda::DeviceBuffer;

inline constexpr float kLayerNormEps = 1e-5f;

inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  // Reported here, so cleared: an ordinary error (an allocation that failed) would otherwise stay
  // the thread's last error, and every later launcher's cudaPeekAtLastError would return it. A
  // sticky error cannot be cleared and comes back from the next call anyway.
  cudaGetLastError();
  return absl::InternalError(
      absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}
inline absl::Status CublasStatus(cublasStatus_t st, const char* what) {
  return absl::InternalError(absl::StrCat("cuBLAS error in ", what, ": ", cublasGetStatusName(st),
                                          " (", cublasGetStatusString(st), ")"));
}

#define HSTU_CUDA_RETURN(expr)                                    \
  do {                                                            \
    const cudaError_t hstu_err_ = (expr);                         \
    if (hstu_err_ != cudaSuccess) return CudaStatus(hstu_err_, #expr); \
  } while (0)
#define HSTU_CUBLAS_RETURN(expr)                                           \
  do {                                                                     \
    const cublasStatus_t hstu_st_ = (expr);                                \
    if (hstu_st_ != CUBLAS_STATUS_SUCCESS) return CublasStatus(hstu_st_, #expr); \
  } while (0)
#define HSTU_RETURN_IF_ERROR(expr)        \
  do {                                    \
    const absl::Status hstu_s_ = (expr);  \
    if (!hstu_s_.ok()) return hstu_s_;    \
  } while (0)

// Converts on the host in slices (the item table of the base model is 1 GiB in bf16).
inline absl::Status UploadBf16(const std::vector<float>& src, DeviceBuffer* dst, int64_t* total_bytes) {
  HSTU_CUDA_RETURN(dst->Reserve(std::max<size_t>(src.size(), 1) * sizeof(bf16)));
  *total_bytes += static_cast<int64_t>(dst->bytes());
  constexpr size_t kSlice = size_t{1} << 24;
  std::vector<bf16> tmp(std::min(src.size(), kSlice));
  for (size_t off = 0; off < src.size(); off += kSlice) {
    const size_t n = std::min(kSlice, src.size() - off);
    for (size_t i = 0; i < n; ++i) tmp[i] = __float2bfloat16_rn(src[off + i]);
    HSTU_CUDA_RETURN(cudaMemcpy(dst->as<bf16>() + off, tmp.data(), n * sizeof(bf16),
                                cudaMemcpyHostToDevice));
  }
  return absl::OkStatus();
}

inline absl::Status UploadF32(const std::vector<float>& src, DeviceBuffer* dst, int64_t* total_bytes) {
  HSTU_CUDA_RETURN(dst->Reserve(std::max<size_t>(src.size(), 1) * sizeof(float)));
  *total_bytes += static_cast<int64_t>(dst->bytes());
  HSTU_CUDA_RETURN(cudaMemcpy(dst->get(), src.data(), src.size() * sizeof(float),
                              cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

struct LayerBuffers {
  DeviceBuffer in_w, in_b;    // [d] fp32
  DeviceBuffer uvqk_w;        // [d, 4·H·D] bf16
  DeviceBuffer uvqk_b;        // [4·H·D] fp32
  DeviceBuffer out_norm_w, out_norm_b;  // [H·D] fp32
  DeviceBuffer out_w;         // [H·D, d] bf16
};
struct HeadBuffers {
  int32_t in = 0, out = 0;
  DeviceBuffer w, b;  // fp32 [in, out], [out]
};

// Byte layout of the per-batch metadata, uploaded with one copy.
struct MetaLayout {
  size_t row_offsets, num_new, num_tokens, page_indptr, page_ids, token_types, positions,
      cand_rows, items, last_items, token_ids, total;
};

inline size_t Align(size_t x) { return (x + 255) & ~size_t{255}; }

// Places the metadata arrays for B users, `rows` rows, `pages` page ids, `cands` candidate slots,
// `items` attention work items of the layers before the last and `last_items` of the last layer.
inline MetaLayout PlaceMeta(size_t B, size_t rows, size_t pages, size_t cands, size_t items,
                            size_t last_items) {
  MetaLayout L{};
  size_t off = 0;
  auto place = [&](size_t bytes) { const size_t at = off; off = Align(off + bytes); return at; };
  L.row_offsets = place(4 * (B + 1));
  L.num_new = place(4 * B);
  L.num_tokens = place(4 * B);
  L.page_indptr = place(4 * (B + 1));
  L.page_ids = place(4 * pages);
  L.token_types = place(4 * rows);
  L.positions = place(4 * rows);
  L.cand_rows = place(4 * cands);
  L.items = place(sizeof(cuda::AttentionWorkItem) * items);
  L.last_items = place(sizeof(cuda::AttentionWorkItem) * last_items);
  L.token_ids = place(8 * rows);
  L.total = off;
  return L;
}

// Per-batch device buffers (grown, never shrunk). The eager path and the graphs have one each: the
// graphs' buffers are sized once at creation, so the pointers baked into the graphs stay valid.
struct Workspace {
  DeviceBuffer x, n, uvqk, a, y, meta, partials, cand_raw, cand_norm, head_a, head_b;
  size_t bytes() const {
    return x.bytes() + n.bytes() + uvqk.bytes() + a.bytes() + y.bytes() + meta.bytes() +
           partials.bytes() + cand_raw.bytes() + cand_norm.bytes() +
           head_a.bytes() + head_b.bytes();
  }
  std::vector<DeviceBuffer*> activations() {
    return {&x, &n, &uvqk, &a, &y, &partials, &cand_raw, &cand_norm, &head_a, &head_b};
  }
};

// An attention plan as launched: work items, split tiles, cluster size.
struct AttentionLaunch {
  int32_t items = 0;        // attention work items
  int32_t split_tiles = 0;  // tiles cut into chunks (the split reduction's work)
  int32_t cluster = 0;      // > 0: a cluster plan (cuda::AttentionPlan::cluster)
};

// Which attention plan a layer runs: every query row, or (the last layer) the candidate rows only.
enum AttentionPlanKind : int { kAllRows = 0, kCandidateRows = 1 };

// The shapes the kernels of the staged step are launched with.
struct Step {
  Workspace* ws = nullptr;
  MetaLayout layout{};
  int32_t num_users = 0;  // users in the metadata (real + padding): the page-table batch size
  int32_t num_rows = 0;   // rows the row-wise kernels and GEMMs run on (real + padding)
  int32_t num_cand = 0;   // candidate slots the head runs on (real + padding)
  int32_t real_cand = 0;  // real candidate rows: the first real_cand slots
  // The attention plans: [kAllRows] for the layers before the last, [kCandidateRows] for the
  // last, whose history rows feed nothing (DESIGN §2.3 reads the candidate rows only).
  AttentionLaunch attn[2];
  int slot = -1;          // graph bucket, -1 = eager
  bool all_fresh = false;  // eager step whose users all have no cached tokens
  // Eager step whose users' new K/V all go through the rows (NewKvFromRows) or who have none: the
  // append of the layers before the last has nothing to do.
  bool append_idle = false;
  // All fresh, pages not kept (ForwardBatch::keep_kv false) and the attention reads K/V from the
  // rows: no layer writes a page, the last one reads its keys from the rows too.
  bool drop_kv = false;
};

// A kernel node of a captured attention launch.
struct CapturedAttentionNode {
  cudaGraphNode_t node = nullptr;
  bool reduce = false;  // the split reduction (else the attention kernel)
  AttentionPlanKind plan = kAllRows;
};

// One capture of a bucket's step.
struct CapturedStep {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  // The attention launches' kernel nodes, whose grids follow the batch's plan on each replay:
  // the attention kernel (items × H) and the split reduction (HstuAttentionReduceGridX).
  std::vector<CapturedAttentionNode> attention_nodes;
  std::vector<cudaKernelNodeParams> attention_params;
  // The append kernel's nodes (fused UVQK route, layers before the last) with their captured
  // launch; a replay whose users all go through the rows (Step::append_idle) runs them on one
  // block, which finds nothing to copy, instead of one warp per row and v/k segment.
  std::vector<cudaGraphNode_t> append_nodes;
  std::vector<cudaKernelNodeParams> append_params;
  // Whether they run on one block now: 0 no, 1 yes, -1 unknown (an update failed part-way).
  int8_t append_shrunk = 0;
  // The plans the nodes in `exec` are sized for (items = -1: not yet set), per AttentionPlanKind;
  // the captured cluster sizes: replays need plans of the same kind.
  AttentionLaunch grid[2] = {{-1, -1, 0}, {-1, -1, 0}};
  size_t edges = 0, programmatic_edges = 0;  // of the captured graph (reports)
};

// One captured bucket, twice: with an external event-wait node per layer on that layer's onload
// (replayed while onloads or prefetches may be in flight), and without (every other replay: the
// wait nodes cost time even when their copies are long done, and they sit between the UVQK GEMM
// and the activation pass, which otherwise launches as a programmatic dependent).
struct GraphSlot {
  GraphBucket bucket;
  int32_t page_cap = 0, item_cap = 0, partial_cap = 0;
  MetaLayout layout{};
  CapturedStep with_waits, plain;
};

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(const ModelWeights& w, int32_t page_size, int64_t num_pages, int device,
                  const GraphOptions& graphs)
      : config_(w.config), page_size_(page_size), num_pages_(num_pages), device_(device),
        graph_options_(graphs) {}
  ~CudaBackendImpl() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(onload_stream_.get());
    cudaStreamSynchronize(prefetch_stream_.get());
    cudaStreamSynchronize(offload_stream_.get());
    cudaStreamSynchronize(stream_.get());
    for (GraphSlot& g : slots_) {
      for (CapturedStep* c : {&g.with_waits, &g.plain}) {
        if (c->exec != nullptr) cudaGraphExecDestroy(c->exec);
        if (c->graph != nullptr) cudaGraphDestroy(c->graph);
      }
    }
    for (cudaEvent_t e : layer_ready_) cudaEventDestroy(e);
    for (cudaEvent_t e : wait_begin_) cudaEventDestroy(e);
    for (cudaEvent_t e : wait_end_) cudaEventDestroy(e);
    for (cudaEvent_t e : prefetch_ready_) cudaEventDestroy(e);
    if (compute_done_ != nullptr) cudaEventDestroy(compute_done_);
    if (onload_start_ != nullptr) cudaEventDestroy(onload_start_);
    if (onload_end_ != nullptr) cudaEventDestroy(onload_end_);
    if (step_start_ != nullptr) cudaEventDestroy(step_start_);
    if (step_end_ != nullptr) cudaEventDestroy(step_end_);
    if (host_pool_ != nullptr) cudaFreeHost(host_pool_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
  }

  absl::Status Init(const ModelWeights& w);

  std::string name() const override { return absl::StrCat("cuda:", device_, " (", gpu_name_, ")"); }
  std::string gpu_name() const override { return gpu_name_; }
  std::string pci_bus_id() const override { return pci_bus_id_; }
  std::string attention_kernel() const override { return attention_kernel_; }
  std::string gemm_routes() const override { return gemm_.BiasSiluRoutes(); }
  int64_t num_pages() const override { return num_pages_; }
  int64_t kv_pool_bytes() const override { return static_cast<int64_t>(pool_.bytes()); }
  int64_t device_weight_bytes() const override { return weight_bytes_; }
  int64_t device_memory_bytes() const override {
    return weight_bytes_ + static_cast<int64_t>(pool_.bytes() + eager_ws_.bytes() +
                                                graph_ws_.bytes() + cublas_ws_.bytes());
  }
  int64_t page_bytes() const override { return page_elems_ * config_.num_layers * 2; }
  uint64_t graph_replays() const override { return graph_replays_.load(std::memory_order_relaxed); }

  absl::Status CreateHostPool(int64_t num_pages) override;
  absl::Status CopyPages(CopyKind kind, const std::vector<int32_t>& src,
                         const std::vector<int32_t>& dst) override;
  absl::Status WaitCopies() override;
  absl::Status DeviceStatus() override;
  bool CopiesDone() override;
  absl::Status PrefetchPages(const std::vector<int32_t>& src,
                             const std::vector<int32_t>& dst) override;
  absl::Status MakePrefetchVisible() override;
  bool PrefetchesDone() override;
  std::optional<CopyTiming> TakeOnloadTiming() override;

  absl::Status Forward(const ForwardBatch& batch, bool keep_hidden, ForwardOutput* out) override;
  absl::Status ReadKv(const std::vector<int32_t>& page_ids, int32_t num_tokens,
                      std::vector<float>* out) override;

  absl::Status Stage(const ForwardBatch& batch) override;
  absl::Status EnqueueLayerStack() override;
  absl::Status EnqueueAttention(int layer) override;
  // Whether every user of the batch with new history rows has them go through the rows
  // (NewKvFromRows with returning users): the fused route's append has nothing to do.
  bool AppendIdle(const ForwardBatch& batch) const;
  absl::StatusOr<std::vector<float>> Time(const std::function<absl::Status()>& fn, int warmup,
                                          int reps) override;
  int attention_items() const override { return static_cast<int>(plan_.items.size()); }
  int attention_chunk_blocks() const override { return plan_.chunk_blocks; }
  int attention_cluster() const override { return plan_.cluster; }
  // Grid x and y of the staged step's attention kernel, or of its split reduction (see
  // cuda::LaunchHstuAttention).
  std::pair<int32_t, int32_t> AttentionGrid(bool reduce, AttentionPlanKind kind) const {
    const AttentionLaunch& a = step_.attn[kind];
    if (reduce) return {cuda::HstuAttentionReduceGridX(a.split_tiles, config_.num_heads), 1};
    if (a.cluster > 0) return {a.cluster, a.items / a.cluster * config_.num_heads};
    return {a.items * config_.num_heads, 1};
  }
  // The attention plans of a batch, for this GPU (cluster plans where they apply): every query
  // row (plan_), and the candidate rows only (last_plan_, the last layer's).
  // The last layer's plan is never a cluster plan: its few candidate tiles split over more CTAs
  // than a cluster holds, and a CUDA graph's captured node keeps its kind (a cluster plan of the
  // warm-up batch could not serve the decode steps).
  // `clusters` false plans without clusters even where they apply (a graph bucket captured
  // without them replays the batch).
  void PlanAttention(const ForwardBatch& batch, bool clusters = true) {
    plan_ = cuda::PlanHstuAttention(batch.row_offsets.data(), batch.num_new.data(),
                                    batch.num_tokens.data(), batch.num_users,
                                    config_.max_attn_len, config_.num_heads, concurrent_ctas_,
                                    /*max_split=*/64, clusters ? attn_cluster_ : 0,
                                    clusters ? attn_max_clusters_ : 0);
    last_plan_ = cuda::PlanHstuAttention(
        batch.row_offsets.data(), batch.num_new.data(), batch.num_tokens.data(), batch.num_users,
        config_.max_attn_len, config_.num_heads, concurrent_ctas_, /*max_split=*/64,
        /*cluster=*/0, /*max_clusters=*/0, /*candidates_only=*/true);
  }
  // The staged plans as launched.
  void SetStepPlans() {
    step_.attn[kAllRows] = {static_cast<int32_t>(plan_.items.size()), plan_.num_split_tiles,
                            plan_.cluster};
    step_.attn[kCandidateRows] = {static_cast<int32_t>(last_plan_.items.size()),
                                  last_plan_.num_split_tiles, last_plan_.cluster};
  }
  absl::Status SetDebugPoison(bool on) override {
    HSTU_CUDA_RETURN(cudaSetDevice(device_));
    poison_ = on;
    if (on) {
      // On the compute stream and finished here: a memset on the legacy stream is not ordered
      // before the non-blocking streams' next appends.
      HSTU_CUDA_RETURN(cudaMemsetAsync(pool_.get(), 0xFF, pool_.bytes(), stream_.get()));
      HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<bool> StageStep(const ForwardBatch& batch, bool use_graph) override;
  absl::Status EnqueueStep() override;
  void SetGraphReplay(bool on) override { replay_ = on; }
  int num_graphs() const override { return static_cast<int>(slots_.size()); }
  std::string graph_summary() const override;
  uint64_t graph_wait_replays() const override {
    return graph_wait_replays_.load(std::memory_order_relaxed);
  }
  uint64_t graph_fallbacks() const override {
    return graph_fallbacks_.load(std::memory_order_relaxed);
  }
  void SetCopyMethod(CopyMethod m) override {
    copy_method_ = m == CopyMethod::kBatch ? cuda::PageCopyMethod::kMemcpyBatch
                                           : cuda::PageCopyMethod::kMemcpyPerRun;
  }

 private:
  PagedKvView<bf16> View(int layer) const;
  // Embedding gather and every layer, the last one up to its attention (on the candidate rows):
  // what a graph captures.
  absl::Status EnqueueTrunk();
  // The rest of the last layer, on the candidate rows only, compacted: LayerNorm · u of their
  // attention rows, and their residual rows plus the output projection into ws.cand_raw.
  absl::Status EnqueueLastLayerTail();
  // L2 normalisation and the MLP head on ws.cand_raw (the final candidate rows).
  absl::Status EnqueueHead();
  // Checks the batch and lists its candidate rows.
  absl::Status Validate(const ForwardBatch& batch, std::vector<int32_t>* cand_rows) const;
  // Writes the metadata of `batch` into the host staging buffer at `L`, padded to `users` users,
  // `rows` rows and `cands` candidate slots, and uploads it to ws->meta on the compute stream.
  absl::Status UploadMeta(const ForwardBatch& batch, const std::vector<int32_t>& cand_rows,
                          const MetaLayout& L, int32_t users, int32_t rows, int32_t cands,
                          Workspace* ws);
  absl::Status StageGraph(const ForwardBatch& batch, int slot, std::vector<int32_t> cand_rows);
  absl::Status SizeGraphWorkspace();
  absl::Status CaptureGraphs();
  // Captures the staged bucket's step (gather → layers → head) into *c; `waits`: with the
  // per-layer onload wait nodes.
  absl::Status CaptureStep(bool waits, CapturedStep* c);
  // Issues the queued onloads, layer-major, on the copy stream; records layer_ready_[l].
  absl::Status FlushOnloads();
  absl::Status IssueOnloads();  // FlushOnloads' copies and events, from pending_src_/pending_dst_
  // Moves the timed onload into onload_timing_ once its end event has completed (non-blocking).
  void PollOnloadTiming();
  absl::Status WaitForLayer(int layer);
  absl::Status LastCapturedNode(cudaGraphNode_t* node);
  cuda::PagePoolRef GpuPoolRef() const {
    return {pool_.as<uint8_t>(), num_pages_, page_elems_ * static_cast<int64_t>(sizeof(bf16))};
  }
  cuda::PagePoolRef HostPoolRef() const {
    return {host_pool_, host_num_pages_, page_elems_ * static_cast<int64_t>(sizeof(bf16))};
  }

  const ModelConfig config_;
  const int32_t page_size_;
  const int64_t num_pages_;
  const int device_;
  std::string gpu_name_;
  std::string pci_bus_id_;
  std::string attention_kernel_;  // cuda::HstuAttentionKernelName of the pool, found at Init
  // New K/V of fresh users and of those whose cached prefix is whole key blocks go from their rows
  // straight into the attention, which stores them to the pages (AttentionParams::
  // new_kv_from_rows): the warp-specialised kernel runs, and HSTU_ATTN_FRESH_ROWS is not 0.
  bool kv_from_rows_ = false;
  // Eager steps whose pages are not kept (ForwardBatch::keep_kv false) write none: kv_from_rows_,
  // and HSTU_DROP_KV is not 0.
  bool drop_kv_ok_ = false;
  int concurrent_ctas_ = 0;
  // Cluster plans (cuda::PlanHstuAttention): the cluster size, 0 = off (not the warp-specialised
  // kernel, no cluster fits, or HSTU_ATTN_CLUSTER=0), and how many clusters the GPU runs at once.
  int32_t attn_cluster_ = 0, attn_max_clusters_ = 0;

  cuda::Stream stream_;
  cublasHandle_t cublas_ = nullptr;
  cuda::GemmTuner gemm_;  // the layer GEMMs, algorithm measured per row class (uses cublas_)
  int64_t weight_bytes_ = 0;
  DeviceBuffer item_, action_, position_;  // bf16 tables
  std::vector<LayerBuffers> layers_;
  std::vector<HeadBuffers> head_;
  DeviceBuffer pool_;  // bf16 [layers, num_pages, 2, page_size, H, D]
  int64_t page_elems_ = 0;

  DeviceBuffer cublas_ws_;  // cuBLAS workspace set explicitly, so capture never allocates

  // Per-batch state.
  Workspace eager_ws_, graph_ws_;
  cuda::PinnedBuffer meta_host_, scores_host_, hidden_host_;
  cuda::AttentionPlan plan_, last_plan_;  // see PlanAttention
  Step step_;
  bool staged_ = false;
  bool poison_ = false;

  // CUDA graphs.
  const GraphOptions graph_options_;
  std::vector<GraphSlot> slots_;
  bool capturing_ = false;
  bool capture_waits_ = false;  // the capture in progress records the per-layer onload waits
  bool always_wait_nodes_ = false;  // HSTU_GRAPH_WAIT_NODES=1: replay the waiting graphs only (A/B)
  std::atomic<uint64_t> graph_wait_replays_{0};
  std::vector<CapturedAttentionNode> captured_attention_;
  std::vector<cudaGraphNode_t> captured_append_;  // the append nodes a capture added (layers
                                                  // before the last, fused GEMM route)
  // The current layer's AppendKvParams / AttentionParams::returning_kv_from_rows (its UVQK route).
  bool returning_kv_from_rows_ = false;
  bool replay_ = true;
  std::atomic<uint64_t> graph_replays_{0};
  std::atomic<uint64_t> graph_fallbacks_{0};

  // Host tier.
  cuda::Stream onload_stream_;   // host → GPU
  cuda::Stream offload_stream_;  // GPU → host: its own copy engine, so onloads never queue behind
                                 // the write-behind backlog
  uint8_t* host_pool_ = nullptr;  // pinned bf16 [layers, host_num_pages_, 2, page_size, H, D]
  int64_t host_num_pages_ = 0;
  std::vector<cudaEvent_t> layer_ready_;  // [layers] last onload copy of the layer, copy stream
  // [layers] recorded on the compute stream around the wait for layer_ready_ (timing events; in
  // the waiting graph variant as external event-record nodes): the stall, ForwardOutput.
  std::vector<cudaEvent_t> wait_begin_, wait_end_;
  std::vector<bool> wait_timed_;  // this step has recorded layer l's pair
  bool step_waits_ = false;       // this step waits for onloads (eager waits or the waiting graph)
  cuda::Stream prefetch_stream_;            // host → GPU copies of queued requests (Prefetch)
  std::vector<cudaEvent_t> prefetch_ready_; // [layers] last prefetch copy of the layer
  cudaEvent_t compute_done_ = nullptr;    // compute stream, before copies that touch its pages
  std::vector<int32_t> pending_src_, pending_dst_;  // queued onloads (host page → GPU page)
  bool onload_waits_ = false;  // an eager forward must wait for layer_ready_
  // A FlushOnloads failed after taking the queued onloads: the next Forward (the batch those
  // pages were for) fails instead of reading pages that were never copied.
  bool onload_failed_ = false;
  // Timing events around the latest flush of onloads on the onload stream (after its waits).
  cudaEvent_t onload_start_ = nullptr, onload_end_ = nullptr;
  cudaEvent_t step_start_ = nullptr, step_end_ = nullptr;  // around a forward's device work
  int64_t timed_onload_bytes_ = 0;  // bytes of the flush between them; 0 = nothing to time
  std::optional<CopyTiming> onload_timing_;  // completed, not yet taken
  cuda::PageCopyMethod copy_method_ = cuda::PageCopyMethod::kMemcpyBatch;
  cuda::PageCopyScratch copy_scratch_;
};

}  // namespace hstu::cuda_backend_internal
