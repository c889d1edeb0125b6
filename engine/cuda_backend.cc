// CUDA backend: the forward of DESIGN §2.2–2.3 on the GPU (see engine/cuda_backend.h).
//
// Per layer: LayerNorm (fp32 x → bf16) → UVQK GEMM (cuBLAS, bf16 out) → bias + SiLU → append the new
// history K/V into the pages → paged HSTU attention → LayerNorm · u → output GEMM added to the fp32
// residual stream (beta = 1). Then for candidate rows: gather + L2-normalise → MLP head in fp32
// (tiny; keeps the scores well inside 2e-3) → sigmoid.
#include "engine/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/copy_pages.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/ops.h"

namespace hstu {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;

constexpr float kLayerNormEps = 1e-5f;

absl::Status CudaStatus(cudaError_t err, const char* what) {
  return absl::InternalError(
      absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}
absl::Status CublasStatus(cublasStatus_t st, const char* what) {
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
absl::Status UploadBf16(const std::vector<float>& src, DeviceBuffer* dst, int64_t* total_bytes) {
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

absl::Status UploadF32(const std::vector<float>& src, DeviceBuffer* dst, int64_t* total_bytes) {
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
      cand_rows, items, token_ids, total;
};

size_t Align(size_t x) { return (x + 255) & ~size_t{255}; }

// Places the metadata arrays for B users, `rows` rows, `pages` page ids, `cands` candidate slots
// and `items` attention work items.
MetaLayout PlaceMeta(size_t B, size_t rows, size_t pages, size_t cands, size_t items) {
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
  L.token_ids = place(8 * rows);
  L.total = off;
  return L;
}

// Per-batch device buffers (grown, never shrunk). The eager path and the graphs have one each: the
// graphs' buffers are sized once at creation, so the pointers baked into the graphs stay valid.
struct Workspace {
  DeviceBuffer x, n, uvqk, a, y, meta, partials, counters, cand_raw, cand_norm, head_a, head_b;
  size_t counters_ready = 0;  // bytes of counters known to be zero
  size_t bytes() const {
    return x.bytes() + n.bytes() + uvqk.bytes() + a.bytes() + y.bytes() + meta.bytes() +
           partials.bytes() + counters.bytes() + cand_raw.bytes() + cand_norm.bytes() +
           head_a.bytes() + head_b.bytes();
  }
  std::vector<DeviceBuffer*> activations() {
    return {&x, &n, &uvqk, &a, &y, &partials, &cand_raw, &cand_norm, &head_a, &head_b};
  }
};

// The shapes the kernels of the staged step are launched with.
struct Step {
  Workspace* ws = nullptr;
  MetaLayout layout{};
  int32_t num_users = 0;  // users in the metadata (real + padding): the page-table batch size
  int32_t num_rows = 0;   // rows the row-wise kernels and GEMMs run on (real + padding)
  int32_t num_cand = 0;   // candidate slots the head runs on (real + padding)
  int32_t real_cand = 0;  // real candidate rows: the first real_cand slots
  int32_t num_items = 0;  // attention work items
  int slot = -1;          // graph bucket, -1 = eager
  bool keep_hidden = false;
};

// One captured bucket.
struct GraphSlot {
  GraphBucket bucket;
  int32_t page_cap = 0, item_cap = 0, partial_cap = 0, tile_cap = 0;
  MetaLayout layout{};
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<cudaGraphNode_t> attention_nodes;
  std::vector<cudaKernelNodeParams> attention_params;
  int32_t grid_items = 0;  // gridDim.x of the attention nodes in `exec` now
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
    cudaStreamSynchronize(offload_stream_.get());
    cudaStreamSynchronize(stream_.get());
    for (GraphSlot& g : slots_) {
      if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
      if (g.graph != nullptr) cudaGraphDestroy(g.graph);
    }
    for (cudaEvent_t e : layer_ready_) cudaEventDestroy(e);
    if (compute_done_ != nullptr) cudaEventDestroy(compute_done_);
    if (host_pool_ != nullptr) cudaFreeHost(host_pool_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
  }

  absl::Status Init(const ModelWeights& w);

  std::string name() const override { return absl::StrCat("cuda:", device_, " (", gpu_name_, ")"); }
  std::string gpu_name() const override { return gpu_name_; }
  int64_t num_pages() const override { return num_pages_; }
  int64_t kv_pool_bytes() const override { return static_cast<int64_t>(pool_.bytes()); }
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
  bool CopiesDone() override;

  absl::Status Forward(const ForwardBatch& batch, bool keep_hidden, ForwardOutput* out) override;
  absl::Status ReadKv(const std::vector<int32_t>& page_ids, int32_t num_tokens,
                      std::vector<float>* out) override;

  absl::Status Stage(const ForwardBatch& batch) override;
  absl::Status EnqueueLayerStack() override;
  absl::Status EnqueueAttention(int layer) override;
  absl::StatusOr<std::vector<float>> Time(const std::function<absl::Status()>& fn, int warmup,
                                          int reps) override;
  int attention_items() const override { return static_cast<int>(plan_.items.size()); }
  int attention_chunk_blocks() const override { return plan_.chunk_blocks; }
  absl::Status SetDebugPoison(bool on) override {
    HSTU_CUDA_RETURN(cudaSetDevice(device_));
    poison_ = on;
    if (on) HSTU_CUDA_RETURN(cudaMemset(pool_.get(), 0xFF, pool_.bytes()));
    return absl::OkStatus();
  }
  absl::StatusOr<bool> StageStep(const ForwardBatch& batch, bool use_graph) override;
  absl::Status EnqueueStep() override;
  void SetGraphReplay(bool on) override { replay_ = on; }
  int num_graphs() const override { return static_cast<int>(slots_.size()); }
  uint64_t graph_fallbacks() const override { return graph_fallbacks_; }
  void SetCopyMethod(CopyMethod m) override {
    copy_method_ = m == CopyMethod::kBatch ? cuda::PageCopyMethod::kMemcpyBatch
                                           : cuda::PageCopyMethod::kMemcpyPerRun;
  }

 private:
  PagedKvView<bf16> View(int layer) const;
  absl::Status EnqueueHead(bool keep_hidden);
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
  // Issues the queued onloads, layer-major, on the copy stream; records layer_ready_[l].
  absl::Status FlushOnloads();
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
  int concurrent_ctas_ = 0;

  cuda::Stream stream_;
  cublasHandle_t cublas_ = nullptr;
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
  cuda::AttentionPlan plan_;
  Step step_;
  bool staged_ = false;
  bool poison_ = false;

  // CUDA graphs.
  const GraphOptions graph_options_;
  std::vector<GraphSlot> slots_;
  bool capturing_ = false;
  std::vector<cudaGraphNode_t> captured_attention_;
  bool replay_ = true;
  std::atomic<uint64_t> graph_replays_{0};
  uint64_t graph_fallbacks_ = 0;

  // Host tier.
  cuda::Stream onload_stream_;   // host → GPU
  cuda::Stream offload_stream_;  // GPU → host: its own copy engine, so onloads never queue behind
                                 // the write-behind backlog
  uint8_t* host_pool_ = nullptr;  // pinned bf16 [layers, host_num_pages_, 2, page_size, H, D]
  int64_t host_num_pages_ = 0;
  std::vector<cudaEvent_t> layer_ready_;  // [layers] last onload copy of the layer, copy stream
  cudaEvent_t compute_done_ = nullptr;    // compute stream, before copies that touch its pages
  std::vector<int32_t> pending_src_, pending_dst_;  // queued onloads (host page → GPU page)
  bool onload_waits_ = false;  // an eager forward must wait for layer_ready_
  cuda::PageCopyMethod copy_method_ = cuda::PageCopyMethod::kMemcpyBatch;
  cuda::PageCopyScratch copy_scratch_;
};

absl::Status CudaBackendImpl::Init(const ModelWeights& w) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  HSTU_CUDA_RETURN(cudaGetDeviceProperties(&prop, device_));
  gpu_name_ = prop.name;
  int ctas_per_sm = 0;
  HSTU_CUDA_RETURN(cuda::HstuAttentionCtasPerSm(config_.head_dim, &ctas_per_sm));
  concurrent_ctas_ = prop.multiProcessorCount * std::max(ctas_per_sm, 1);
  HSTU_CUDA_RETURN(stream_.Create());
  HSTU_CUBLAS_RETURN(cublasCreate(&cublas_));
  HSTU_CUBLAS_RETURN(cublasSetStream(cublas_, stream_.get()));

  HSTU_RETURN_IF_ERROR(UploadBf16(w.item_embedding, &item_, &weight_bytes_));
  HSTU_RETURN_IF_ERROR(UploadBf16(w.action_embedding, &action_, &weight_bytes_));
  if (config_.position_encoding) {
    HSTU_RETURN_IF_ERROR(UploadBf16(w.position_embedding, &position_, &weight_bytes_));
  }
  layers_.resize(config_.num_layers);
  for (int l = 0; l < config_.num_layers; ++l) {
    const LayerWeights& src = w.layers[l];
    LayerBuffers& dst = layers_[l];
    HSTU_RETURN_IF_ERROR(UploadF32(src.input_norm_w, &dst.in_w, &weight_bytes_));
    HSTU_RETURN_IF_ERROR(UploadF32(src.input_norm_b, &dst.in_b, &weight_bytes_));
    HSTU_RETURN_IF_ERROR(UploadBf16(src.uvqk_w, &dst.uvqk_w, &weight_bytes_));
    HSTU_RETURN_IF_ERROR(UploadF32(src.uvqk_b, &dst.uvqk_b, &weight_bytes_));
    HSTU_RETURN_IF_ERROR(UploadF32(src.output_norm_w, &dst.out_norm_w, &weight_bytes_));
    HSTU_RETURN_IF_ERROR(UploadF32(src.output_norm_b, &dst.out_norm_b, &weight_bytes_));
    HSTU_RETURN_IF_ERROR(UploadBf16(src.output_w, &dst.out_w, &weight_bytes_));
  }
  head_.resize(w.head.size());
  for (size_t j = 0; j < w.head.size(); ++j) {
    head_[j].in = w.head[j].in;
    head_[j].out = w.head[j].out;
    HSTU_RETURN_IF_ERROR(UploadF32(w.head[j].w, &head_[j].w, &weight_bytes_));
    HSTU_RETURN_IF_ERROR(UploadF32(w.head[j].b, &head_[j].b, &weight_bytes_));
  }
  page_elems_ = 2LL * page_size_ * config_.hd();
  const size_t pool_bytes = static_cast<size_t>(page_elems_) * num_pages_ * config_.num_layers * sizeof(bf16);
  const cudaError_t err = pool_.Reserve(pool_bytes);
  if (err != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate the KV pool of ", pool_bytes,
                                                     " bytes on cuda:", device_, ": ",
                                                     cudaGetErrorString(err)));
  }
  // 32 MiB: what cuBLAS recommends on Hopper; an explicit workspace keeps graph capture free of
  // allocations and gives eager and captured GEMMs the same algorithms.
  HSTU_CUDA_RETURN(cublas_ws_.Reserve(32u << 20));
  HSTU_CUBLAS_RETURN(cublasSetWorkspace(cublas_, cublas_ws_.get(), cublas_ws_.bytes()));
  HSTU_CUDA_RETURN(onload_stream_.Create());
  HSTU_CUDA_RETURN(offload_stream_.Create());
  layer_ready_.assign(config_.num_layers, nullptr);
  for (cudaEvent_t& e : layer_ready_) {
    HSTU_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    HSTU_CUDA_RETURN(cudaEventRecord(e, onload_stream_.get()));
  }
  HSTU_CUDA_RETURN(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
  if (graph_options_.enable) HSTU_RETURN_IF_ERROR(CaptureGraphs());
  return absl::OkStatus();
}

PagedKvView<bf16> CudaBackendImpl::View(int layer) const {
  const uint8_t* base = step_.ws->meta.as<uint8_t>();
  PagedKvView<bf16> v;
  v.base = pool_.as<bf16>() + static_cast<int64_t>(layer) * num_pages_ * page_elems_;
  v.page_stride = page_elems_;
  v.kv_stride = page_elems_ / 2;
  v.page_size = page_size_;
  v.num_heads = config_.num_heads;
  v.head_dim = config_.head_dim;
  v.batch_size = step_.num_users;
  v.indptr = reinterpret_cast<const int32_t*>(base + step_.layout.page_indptr);
  v.page_ids = reinterpret_cast<const int32_t*>(base + step_.layout.page_ids);
  v.num_tokens = reinterpret_cast<const int32_t*>(base + step_.layout.num_tokens);
  return v;
}

absl::Status CudaBackendImpl::Validate(const ForwardBatch& batch,
                                       std::vector<int32_t>* cand_rows) const {
  const int32_t B = batch.num_users;
  const int32_t rows = batch.num_rows();
  if (B < 0 || static_cast<int32_t>(batch.row_offsets.size()) != B + 1 ||
      static_cast<int32_t>(batch.num_new.size()) != B ||
      static_cast<int32_t>(batch.num_tokens.size()) != B ||
      static_cast<int32_t>(batch.page_indptr.size()) != B + 1 ||
      static_cast<int32_t>(batch.token_ids.size()) != rows ||
      static_cast<int32_t>(batch.token_types.size()) != rows ||
      static_cast<int32_t>(batch.positions.size()) != rows) {
    return absl::InvalidArgumentError("ForwardBatch arrays have inconsistent sizes");
  }
  for (int32_t id : batch.page_ids) {
    if (id < 0 || id >= num_pages_) {
      return absl::InternalError(absl::StrCat("page id ", id, " outside the pool of ", num_pages_));
    }
  }
  cand_rows->clear();
  for (int32_t b = 0; b < B; ++b) {
    const int32_t pages = batch.page_indptr[b + 1] - batch.page_indptr[b];
    if (batch.num_new[b] < 0 || batch.num_new[b] > batch.num_tokens[b] ||
        static_cast<int64_t>(pages) * page_size_ < batch.num_tokens[b] ||
        batch.row_offsets[b + 1] - batch.row_offsets[b] < batch.num_new[b]) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardBatch user ", b, " is inconsistent"));
    }
    for (int32_t r = batch.row_offsets[b] + batch.num_new[b]; r < batch.row_offsets[b + 1]; ++r) {
      cand_rows->push_back(r);
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::UploadMeta(const ForwardBatch& batch,
                                         const std::vector<int32_t>& cand_rows,
                                         const MetaLayout& L, int32_t users, int32_t rows,
                                         int32_t cands, Workspace* ws) {
  const int32_t B = batch.num_users, R = batch.num_rows();
  const int32_t C = static_cast<int32_t>(cand_rows.size());
  HSTU_CUDA_RETURN(meta_host_.Reserve(L.total));
  // The previous batch's upload must be finished before its staging memory is overwritten.
  HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  uint8_t* h = meta_host_.as<uint8_t>();
  auto put = [&](size_t at, const void* src, size_t bytes) { if (bytes) std::memcpy(h + at, src, bytes); };
  // Padding: users with no rows, tokens or pages; rows past row_offsets[B] (no user's new rows,
  // so never appended) gathering item 0 at position 0; candidate slots reading row 0.
  auto pad = [&](size_t at, int32_t from, int32_t to, int32_t value) {
    for (int32_t i = from; i < to; ++i) std::memcpy(h + at + 4 * i, &value, 4);
  };
  put(L.row_offsets, batch.row_offsets.data(), 4 * (B + 1));
  pad(L.row_offsets, B + 1, users + 1, R);
  put(L.num_new, batch.num_new.data(), 4 * B);
  pad(L.num_new, B, users, 0);
  put(L.num_tokens, batch.num_tokens.data(), 4 * B);
  pad(L.num_tokens, B, users, 0);
  put(L.page_indptr, batch.page_indptr.data(), 4 * (B + 1));
  pad(L.page_indptr, B + 1, users + 1, static_cast<int32_t>(batch.page_ids.size()));
  put(L.page_ids, batch.page_ids.data(), 4 * batch.page_ids.size());
  put(L.token_types, batch.token_types.data(), 4 * R);
  pad(L.token_types, R, rows, kItemToken);
  put(L.positions, batch.positions.data(), 4 * R);
  pad(L.positions, R, rows, 0);
  put(L.cand_rows, cand_rows.data(), 4 * C);
  pad(L.cand_rows, C, cands, 0);
  put(L.items, plan_.items.data(), sizeof(cuda::AttentionWorkItem) * plan_.items.size());
  put(L.token_ids, batch.token_ids.data(), 8 * R);
  if (rows > R) std::memset(h + L.token_ids + 8 * R, 0, 8 * static_cast<size_t>(rows - R));
  HSTU_CUDA_RETURN(ws->meta.Reserve(L.total));
  HSTU_CUDA_RETURN(cudaMemcpyAsync(ws->meta.get(), h, L.total, cudaMemcpyHostToDevice, stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::Stage(const ForwardBatch& batch) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  staged_ = false;
  std::vector<int32_t> cand_rows;
  HSTU_RETURN_IF_ERROR(Validate(batch, &cand_rows));
  const int32_t B = batch.num_users;
  const int32_t rows = batch.num_rows();
  plan_ = cuda::PlanHstuAttention(batch.row_offsets.data(), batch.num_new.data(),
                                  batch.num_tokens.data(), B, config_.max_attn_len,
                                  config_.num_heads, concurrent_ctas_);
  Workspace* ws = &eager_ws_;
  const MetaLayout L = PlaceMeta(B, rows, batch.page_ids.size(), cand_rows.size(), plan_.items.size());
  HSTU_RETURN_IF_ERROR(UploadMeta(batch, cand_rows, L, B, rows, static_cast<int32_t>(cand_rows.size()), ws));

  const int64_t d = config_.hidden_dim, hd = config_.hd();
  const size_t R = std::max(rows, 1);
  HSTU_CUDA_RETURN(ws->x.Reserve(R * d * sizeof(float)));
  HSTU_CUDA_RETURN(ws->n.Reserve(R * d * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws->uvqk.Reserve(R * 4 * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws->a.Reserve(R * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws->y.Reserve(R * hd * sizeof(bf16)));
  const size_t partial_floats = static_cast<size_t>(plan_.num_partials) * config_.num_heads *
                                cuda::kAttnBlockM * config_.head_dim;
  HSTU_CUDA_RETURN(ws->partials.Reserve(std::max<size_t>(partial_floats, 1) * sizeof(float)));
  const size_t counter_bytes = std::max<size_t>(plan_.num_split_tiles * config_.num_heads, 1) * 4;
  if (counter_bytes > ws->counters_ready) {
    HSTU_CUDA_RETURN(ws->counters.Reserve(counter_bytes));
    HSTU_CUDA_RETURN(cudaMemsetAsync(ws->counters.get(), 0, ws->counters.bytes(), stream_.get()));
    ws->counters_ready = ws->counters.bytes();
  }
  const size_t C = std::max<size_t>(cand_rows.size(), 1);
  int32_t widest = 1;
  for (const HeadBuffers& hb : head_) widest = std::max({widest, hb.in, hb.out});
  HSTU_CUDA_RETURN(ws->cand_raw.Reserve(C * d * sizeof(float)));
  HSTU_CUDA_RETURN(ws->cand_norm.Reserve(C * d * sizeof(float)));
  HSTU_CUDA_RETURN(ws->head_a.Reserve(C * widest * sizeof(float)));
  HSTU_CUDA_RETURN(ws->head_b.Reserve(C * widest * sizeof(float)));
  if (poison_) {
    for (DeviceBuffer* buf : ws->activations()) {
      HSTU_CUDA_RETURN(cudaMemsetAsync(buf->get(), 0xFF, buf->bytes(), stream_.get()));
    }
  }
  step_ = Step{};
  step_.ws = ws;
  step_.layout = L;
  step_.num_users = B;
  step_.num_rows = rows;
  step_.num_cand = static_cast<int32_t>(cand_rows.size());
  step_.real_cand = step_.num_cand;
  step_.num_items = static_cast<int32_t>(plan_.items.size());
  staged_ = true;
  return absl::OkStatus();
}

std::vector<GraphBucket> DefaultGraphBuckets() {
  std::vector<GraphBucket> b;
  for (int32_t users : {1, 4, 16, 64}) {
    for (int32_t rows : {256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192}) {
      b.push_back({users, rows});
    }
  }
  return b;
}

absl::Status CudaBackendImpl::SizeGraphWorkspace() {
  const int64_t d = config_.hidden_dim, hd = config_.hd();
  const int32_t pages_per_user = (config_.max_history_tokens + page_size_ - 1) / page_size_ + 1;
  // Split-K adds work items only until the CTAs fill a few waves of the GPU (the plan's cost
  // model); a plan beyond these capacities runs eagerly (graph_fallbacks).
  const int32_t ctas_per_head = (concurrent_ctas_ + config_.num_heads - 1) / config_.num_heads;
  size_t rows = 1, meta = 1, partials = 1, tiles = 1;
  for (GraphSlot& g : slots_) {
    const int32_t U = g.bucket.max_users, R = g.bucket.max_rows;
    g.tile_cap = (R + cuda::kAttnBlockM - 1) / cuda::kAttnBlockM + U;
    g.item_cap = g.tile_cap + 8 * ctas_per_head;
    g.partial_cap = g.item_cap;
    g.page_cap = U * pages_per_user;
    g.layout = PlaceMeta(U, R, g.page_cap, R, g.item_cap);
    rows = std::max<size_t>(rows, R);
    meta = std::max(meta, g.layout.total);
    partials = std::max<size_t>(partials, g.partial_cap);
    tiles = std::max<size_t>(tiles, g.tile_cap);
  }
  int32_t widest = 1;
  for (const HeadBuffers& hb : head_) widest = std::max({widest, hb.in, hb.out});
  Workspace& ws = graph_ws_;
  HSTU_CUDA_RETURN(ws.x.Reserve(rows * d * sizeof(float)));
  HSTU_CUDA_RETURN(ws.n.Reserve(rows * d * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws.uvqk.Reserve(rows * 4 * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws.a.Reserve(rows * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws.y.Reserve(rows * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws.meta.Reserve(meta));
  HSTU_CUDA_RETURN(ws.partials.Reserve(partials * config_.num_heads * cuda::kAttnBlockM *
                                       config_.head_dim * sizeof(float)));
  HSTU_CUDA_RETURN(ws.counters.Reserve(tiles * config_.num_heads * 4));
  HSTU_CUDA_RETURN(cudaMemsetAsync(ws.counters.get(), 0, ws.counters.bytes(), stream_.get()));
  ws.counters_ready = ws.counters.bytes();
  HSTU_CUDA_RETURN(ws.cand_raw.Reserve(rows * d * sizeof(float)));
  HSTU_CUDA_RETURN(ws.cand_norm.Reserve(rows * d * sizeof(float)));
  HSTU_CUDA_RETURN(ws.head_a.Reserve(rows * widest * sizeof(float)));
  HSTU_CUDA_RETURN(ws.head_b.Reserve(rows * widest * sizeof(float)));
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::StageGraph(const ForwardBatch& batch, int slot,
                                         std::vector<int32_t> cand_rows) {
  GraphSlot& g = slots_[slot];
  Workspace* ws = &graph_ws_;
  HSTU_RETURN_IF_ERROR(UploadMeta(batch, cand_rows, g.layout, g.bucket.max_users,
                                  g.bucket.max_rows, g.bucket.max_rows, ws));
  if (poison_) {
    for (DeviceBuffer* buf : ws->activations()) {
      HSTU_CUDA_RETURN(cudaMemsetAsync(buf->get(), 0xFF, buf->bytes(), stream_.get()));
    }
  }
  step_ = Step{};
  step_.ws = ws;
  step_.layout = g.layout;
  step_.num_users = g.bucket.max_users;
  step_.num_rows = g.bucket.max_rows;
  step_.num_cand = g.bucket.max_rows;
  step_.real_cand = static_cast<int32_t>(cand_rows.size());
  step_.num_items = static_cast<int32_t>(plan_.items.size());
  step_.slot = slot;
  step_.keep_hidden = true;  // the graphs always gather the raw hidden rows
  staged_ = true;
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaBackendImpl::StageStep(const ForwardBatch& batch, bool use_graph) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  int best = -1;
  if (use_graph && !slots_.empty()) {
    const int32_t B = batch.num_users, R = batch.num_rows();
    for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
      const GraphBucket& b = slots_[i].bucket;
      if (b.max_users < B || b.max_rows < R) continue;
      if (best < 0 || b.max_rows < slots_[best].bucket.max_rows ||
          (b.max_rows == slots_[best].bucket.max_rows && b.max_users < slots_[best].bucket.max_users)) {
        best = i;
      }
    }
  }
  if (best >= 0) {
    staged_ = false;
    std::vector<int32_t> cand_rows;
    HSTU_RETURN_IF_ERROR(Validate(batch, &cand_rows));
    plan_ = cuda::PlanHstuAttention(batch.row_offsets.data(), batch.num_new.data(),
                                    batch.num_tokens.data(), batch.num_users, config_.max_attn_len,
                                    config_.num_heads, concurrent_ctas_);
    const GraphSlot& g = slots_[best];
    const int32_t items = static_cast<int32_t>(plan_.items.size());
    if (items > 0 && items <= g.item_cap && plan_.num_partials <= g.partial_cap &&
        plan_.num_split_tiles <= g.tile_cap &&
        static_cast<int64_t>(batch.page_ids.size()) <= g.page_cap) {
      HSTU_RETURN_IF_ERROR(StageGraph(batch, best, std::move(cand_rows)));
      return true;
    }
    ++graph_fallbacks_;
  }
  HSTU_RETURN_IF_ERROR(Stage(batch));
  return false;
}

absl::Status CudaBackendImpl::EnqueueStep() {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  if (step_.slot >= 0 && replay_ && !capturing_) {
    GraphSlot& g = slots_[step_.slot];
    if (g.grid_items != step_.num_items) {
      for (size_t i = 0; i < g.attention_nodes.size(); ++i) {
        cudaKernelNodeParams p = g.attention_params[i];
        p.gridDim.x = static_cast<unsigned>(step_.num_items);
        HSTU_CUDA_RETURN(cudaGraphExecKernelNodeSetParams(g.exec, g.attention_nodes[i], &p));
      }
      g.grid_items = step_.num_items;
    }
    HSTU_CUDA_RETURN(cudaGraphLaunch(g.exec, stream_.get()));
    graph_replays_.fetch_add(1, std::memory_order_relaxed);
    onload_waits_ = false;  // the graph's wait nodes covered them; later work is ordered after it
    return absl::OkStatus();
  }
  HSTU_RETURN_IF_ERROR(EnqueueLayerStack());
  return EnqueueHead(step_.keep_hidden);
}

absl::Status CudaBackendImpl::CaptureGraphs() {
  slots_.clear();
  for (const GraphBucket& b : graph_options_.buckets.empty() ? DefaultGraphBuckets()
                                                             : graph_options_.buckets) {
    if (b.max_users <= 0 || b.max_rows <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("graph bucket (", b.max_users, " users, ",
                                                     b.max_rows, " rows) must be positive"));
    }
    GraphSlot g;
    g.bucket = b;
    slots_.push_back(std::move(g));
  }
  HSTU_RETURN_IF_ERROR(SizeGraphWorkspace());
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    GraphSlot& g = slots_[i];
    // Warm-up batch of the bucket's row count: one user with one new token (written to page 0,
    // which no user owns yet) and max_rows - 1 candidates.
    const int32_t R = g.bucket.max_rows;
    ForwardBatch fb;
    fb.num_users = 1;
    fb.row_offsets = {0, R};
    fb.num_new = {1};
    fb.num_tokens = {1};
    fb.page_indptr = {0, 1};
    fb.page_ids = {0};
    fb.token_ids.assign(R, 0);
    fb.token_types.assign(R, kItemToken);
    fb.positions.assign(R, config_.position_rows > 1 ? 1 : 0);
    fb.positions[0] = 0;
    std::vector<int32_t> cand_rows;
    HSTU_RETURN_IF_ERROR(Validate(fb, &cand_rows));
    plan_ = cuda::PlanHstuAttention(fb.row_offsets.data(), fb.num_new.data(), fb.num_tokens.data(),
                                    1, config_.max_attn_len, config_.num_heads, concurrent_ctas_);
    HSTU_RETURN_IF_ERROR(StageGraph(fb, i, std::move(cand_rows)));
    // Warm-up: loads every kernel module and lets cuBLAS pick its algorithms outside the capture.
    HSTU_RETURN_IF_ERROR(EnqueueLayerStack());
    HSTU_RETURN_IF_ERROR(EnqueueHead(true));
    HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));

    captured_attention_.clear();
    HSTU_CUDA_RETURN(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    absl::Status st = EnqueueLayerStack();
    if (st.ok()) st = EnqueueHead(true);
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream_.get(), &graph);
    if (!st.ok()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      return st;
    }
    HSTU_CUDA_RETURN(end);
    g.graph = graph;
    HSTU_CUDA_RETURN(cudaGraphInstantiate(&g.exec, g.graph, 0));
    g.attention_nodes = captured_attention_;
    if (static_cast<int>(g.attention_nodes.size()) < config_.num_layers) {
      return absl::InternalError("graph capture: attention nodes not found");
    }
    for (cudaGraphNode_t n : g.attention_nodes) {
      cudaGraphNodeType type;
      HSTU_CUDA_RETURN(cudaGraphNodeGetType(n, &type));
      cudaKernelNodeParams p{};
      if (type == cudaGraphNodeTypeKernel) HSTU_CUDA_RETURN(cudaGraphKernelNodeGetParams(n, &p));
      if (type != cudaGraphNodeTypeKernel || p.gridDim.x != static_cast<unsigned>(step_.num_items)) {
        return absl::InternalError(
            "graph capture: an attention launch node is not a kernel with one block column per "
            "work item; CUDA graphs cannot resize it (disable graphs or update the backend)");
      }
      g.attention_params.push_back(p);
    }
    g.grid_items = step_.num_items;
  }
  staged_ = false;
  HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::LastCapturedNode(cudaGraphNode_t* node) {
  cudaStreamCaptureStatus status;
  const cudaGraphNode_t* deps = nullptr;
  size_t num_deps = 0;
  HSTU_CUDA_RETURN(cudaStreamGetCaptureInfo(stream_.get(), &status, nullptr, nullptr, &deps,
                                            nullptr, &num_deps));
  if (num_deps > 1) return absl::InternalError("graph capture: the stream is not a chain");
  *node = num_deps == 1 ? deps[0] : nullptr;
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueAttention(int layer) {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  const int64_t hd = config_.hd();
  const uint8_t* m = step_.ws->meta.as<uint8_t>();
  AttentionParams<bf16> att;
  att.uvqk = step_.ws->uvqk.as<bf16>();
  att.uvqk_row_stride = 4 * hd;
  att.out = step_.ws->a.as<bf16>();
  att.num_rows = step_.num_rows;
  att.row_offsets = reinterpret_cast<const int32_t*>(m + step_.layout.row_offsets);
  att.num_new = reinterpret_cast<const int32_t*>(m + step_.layout.num_new);
  att.kv = View(layer);
  att.alpha = 1.f / std::sqrt(static_cast<float>(config_.head_dim));
  att.inv_norm = 1.f / static_cast<float>(config_.attention_norm_len);
  att.max_attn_len = config_.max_attn_len;
  // While capturing, the nodes this launch adds (the attention kernel and, as of now, its split
  // reduction) get the batch's work-item count as gridDim.x before each replay: every kernel of
  // LaunchHstuAttention has one block column per work item (checked after the capture).
  cudaGraphNode_t before = nullptr;
  if (capturing_) HSTU_RETURN_IF_ERROR(LastCapturedNode(&before));
  HSTU_CUDA_RETURN(cuda::LaunchHstuAttention(
      att, reinterpret_cast<const cuda::AttentionWorkItem*>(m + step_.layout.items),
      step_.num_items, step_.ws->partials.as<float>(), step_.ws->counters.as<int32_t>(),
      stream_.get()));
  if (capturing_) {
    cudaGraphNode_t node = nullptr;
    HSTU_RETURN_IF_ERROR(LastCapturedNode(&node));
    // Walk the (linear) chain back to the node before the launch.
    while (node != nullptr && node != before) {
      captured_attention_.push_back(node);
      size_t n = 0;
      HSTU_CUDA_RETURN(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
      if (n != 1) return absl::InternalError("graph capture: the attention launch is not a chain");
      HSTU_CUDA_RETURN(cudaGraphNodeGetDependencies(node, &node, nullptr, &n));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::WaitForLayer(int layer) {
  if (capturing_) {
    // An external event-wait node: each replay waits for the event's latest record (a no-op once
    // the copies it stands for are done).
    HSTU_CUDA_RETURN(cudaStreamWaitEvent(stream_.get(), layer_ready_[layer], cudaEventWaitExternal));
  } else if (onload_waits_) {
    HSTU_CUDA_RETURN(cudaStreamWaitEvent(stream_.get(), layer_ready_[layer], 0));
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueLayerStack() {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  const int64_t rows = step_.num_rows, d = config_.hidden_dim, hd = config_.hd();
  Workspace& ws = *step_.ws;
  const uint8_t* m = ws.meta.as<uint8_t>();
  cudaStream_t s = stream_.get();
  EmbeddingParams<bf16> ep;
  ep.item_table = item_.as<bf16>();
  ep.action_table = action_.as<bf16>();
  ep.position_table = config_.position_encoding ? position_.as<bf16>() : nullptr;
  ep.item_rows = config_.item_rows;
  ep.action_rows = config_.action_rows;
  ep.position_rows = config_.position_rows;
  ep.hidden_dim = config_.hidden_dim;
  ep.num_rows = step_.num_rows;
  ep.token_ids = reinterpret_cast<const int64_t*>(m + step_.layout.token_ids);
  ep.token_types = reinterpret_cast<const int32_t*>(m + step_.layout.token_types);
  ep.positions = reinterpret_cast<const int32_t*>(m + step_.layout.positions);
  HSTU_CUDA_RETURN(cuda::LaunchEmbeddingGather(ep, ws.x.as<float>(), s));

  for (int l = 0; l < config_.num_layers; ++l) {
    const LayerBuffers& w = layers_[l];
    HSTU_CUDA_RETURN(cuda::LaunchLayerNorm(ws.x.as<float>(), rows, d, w.in_w.as<float>(),
                                           w.in_b.as<float>(), kLayerNormEps, ws.n.as<bf16>(), s));
    HSTU_CUBLAS_RETURN(cuda::GemmBf16(cublas_, ws.n.as<bf16>(), w.uvqk_w.as<bf16>(), ws.uvqk.get(),
                                      /*c_is_f32=*/false, rows, 4 * hd, d, 0.f));
    HSTU_CUDA_RETURN(cuda::LaunchBiasSilu(ws.uvqk.as<bf16>(), rows, 4 * hd, w.uvqk_b.as<float>(), s));
    // Layer l's onloaded pages are needed from here on (append, then attention).
    HSTU_RETURN_IF_ERROR(WaitForLayer(l));
    AppendKvParams<bf16> ap;
    ap.uvqk = ws.uvqk.as<bf16>();
    ap.uvqk_row_stride = 4 * hd;
    ap.row_offsets = reinterpret_cast<const int32_t*>(m + step_.layout.row_offsets);
    ap.num_new = reinterpret_cast<const int32_t*>(m + step_.layout.num_new);
    ap.kv = View(l);
    HSTU_CUDA_RETURN(cuda::LaunchAppendKv(ap, step_.num_rows, s));
    HSTU_RETURN_IF_ERROR(EnqueueAttention(l));
    HSTU_CUDA_RETURN(cuda::LaunchNormMulU(ws.a.as<bf16>(), ws.uvqk.as<bf16>() + kU * hd, 4 * hd, rows, hd,
                                          w.out_norm_w.as<float>(), w.out_norm_b.as<float>(),
                                          kLayerNormEps, ws.y.as<bf16>(), s));
    HSTU_CUBLAS_RETURN(cuda::GemmBf16(cublas_, ws.y.as<bf16>(), w.out_w.as<bf16>(), ws.x.get(),
                                      /*c_is_f32=*/true, rows, d, hd, 1.f));
  }
  if (!capturing_) onload_waits_ = false;  // later forwards are ordered after this one
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueHead(bool keep_hidden) {
  const int64_t d = config_.hidden_dim;
  cudaStream_t s = stream_.get();
  Workspace& ws = *step_.ws;
  const uint8_t* m = ws.meta.as<uint8_t>();
  const int32_t C = step_.num_cand;
  HSTU_CUDA_RETURN(cuda::LaunchGatherL2Normalize(
      ws.x.as<float>(), reinterpret_cast<const int32_t*>(m + step_.layout.cand_rows), C, d,
      keep_hidden ? ws.cand_raw.as<float>() : nullptr, ws.cand_norm.as<float>(), s));
  const float* act = ws.cand_norm.as<float>();
  for (size_t j = 0; j < head_.size(); ++j) {
    float* next = (j % 2 == 0 ? ws.head_a : ws.head_b).as<float>();
    HSTU_CUBLAS_RETURN(cuda::GemmF32(cublas_, act, head_[j].w.as<float>(), next, C,
                                     head_[j].out, head_[j].in, 0.f));
    const bool last = j + 1 == head_.size();
    HSTU_CUDA_RETURN(cuda::LaunchBiasActivation(
        next, C, head_[j].out, head_[j].b.as<float>(),
        last ? cuda::Activation::kSigmoid : cuda::Activation::kRelu, s));
    act = next;
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::Forward(const ForwardBatch& batch, bool keep_hidden,
                                      ForwardOutput* out) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  // Queued onloads start now, so they overlap the staging below and the layers before theirs.
  HSTU_RETURN_IF_ERROR(FlushOnloads());
  auto graphed = StageStep(batch, /*use_graph=*/true);
  if (!graphed.ok()) return graphed.status();
  if (!*graphed) step_.keep_hidden = keep_hidden;
  HSTU_RETURN_IF_ERROR(EnqueueStep());
  const int64_t d = config_.hidden_dim;
  const int32_t tasks = head_.empty() ? 0 : head_.back().out;
  const int32_t C = step_.real_cand;
  const size_t score_bytes = static_cast<size_t>(C) * tasks * sizeof(float);
  const size_t hidden_bytes = keep_hidden ? static_cast<size_t>(C) * d * sizeof(float) : 0;
  HSTU_CUDA_RETURN(scores_host_.Reserve(std::max<size_t>(score_bytes, 4)));
  HSTU_CUDA_RETURN(hidden_host_.Reserve(std::max<size_t>(hidden_bytes, 4)));
  const float* scores_dev = (head_.size() % 2 == 1 ? step_.ws->head_a : step_.ws->head_b).as<float>();
  cudaStream_t s = stream_.get();
  if (score_bytes > 0) {
    HSTU_CUDA_RETURN(cudaMemcpyAsync(scores_host_.as<float>(), scores_dev, score_bytes,
                                     cudaMemcpyDeviceToHost, s));
  }
  if (hidden_bytes > 0) {
    HSTU_CUDA_RETURN(cudaMemcpyAsync(hidden_host_.as<float>(), step_.ws->cand_raw.get(), hidden_bytes,
                                     cudaMemcpyDeviceToHost, s));
  }
  HSTU_CUDA_RETURN(cudaStreamSynchronize(s));
  out->scores.assign(scores_host_.as<float>(), scores_host_.as<float>() + score_bytes / 4);
  if (keep_hidden) {
    out->hidden.assign(hidden_host_.as<float>(), hidden_host_.as<float>() + hidden_bytes / 4);
  }
  return absl::OkStatus();
}

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
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  // The destination pages may have been read by work still queued on the compute stream.
  HSTU_CUDA_RETURN(cudaEventRecord(compute_done_, stream_.get()));
  HSTU_CUDA_RETURN(cudaStreamWaitEvent(onload_stream_.get(), compute_done_, 0));
  const std::vector<cuda::PageRun> runs =
      cuda::MergePageRuns(pending_src_.data(), pending_dst_.data(), pending_src_.size());
  pending_src_.clear();
  pending_dst_.clear();
  for (int l = 0; l < config_.num_layers; ++l) {
    HSTU_CUDA_RETURN(cuda::EnqueuePageRuns(runs, HostPoolRef(), GpuPoolRef(), l, copy_method_,
                                           onload_stream_.get(), &copy_scratch_));
    HSTU_CUDA_RETURN(cudaEventRecord(layer_ready_[l], onload_stream_.get()));
  }
  onload_waits_ = true;
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::WaitCopies() {
  HSTU_RETURN_IF_ERROR(FlushOnloads());
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  HSTU_CUDA_RETURN(cudaStreamSynchronize(onload_stream_.get()));
  HSTU_CUDA_RETURN(cudaStreamSynchronize(offload_stream_.get()));
  return absl::OkStatus();
}

bool CudaBackendImpl::CopiesDone() {
  if (!FlushOnloads().ok() || cudaSetDevice(device_) != cudaSuccess) return false;
  // cudaErrorNotReady means still running; any other error is reported by the next WaitCopies.
  return cudaStreamQuery(onload_stream_.get()) == cudaSuccess &&
         cudaStreamQuery(offload_stream_.get()) == cudaSuccess;
}

absl::Status CudaBackendImpl::ReadKv(const std::vector<int32_t>& page_ids, int32_t num_tokens,
                                     std::vector<float>* out) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  const int64_t hd = config_.hd();
  if (num_tokens < 0 || static_cast<int64_t>(page_ids.size()) * page_size_ < num_tokens) {
    return absl::InvalidArgumentError("ReadKv: too few pages for the token count");
  }
  for (int32_t id : page_ids) {
    if (id < 0 || id >= num_pages_) return absl::InvalidArgumentError("ReadKv: page id out of range");
  }
  HSTU_RETURN_IF_ERROR(WaitCopies());
  HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  out->assign(static_cast<size_t>(config_.num_layers) * 2 * num_tokens * hd, 0.f);
  std::vector<bf16> page(page_elems_);
  for (int l = 0; l < config_.num_layers; ++l) {
    for (size_t pi = 0; pi * page_size_ < static_cast<size_t>(num_tokens); ++pi) {
      const bf16* src = pool_.as<bf16>() + (static_cast<int64_t>(l) * num_pages_ + page_ids[pi]) * page_elems_;
      HSTU_CUDA_RETURN(cudaMemcpy(page.data(), src, page_elems_ * sizeof(bf16), cudaMemcpyDeviceToHost));
      for (int kv = 0; kv < 2; ++kv) {
        for (int32_t slot = 0; slot < page_size_; ++slot) {
          const int64_t t = static_cast<int64_t>(pi) * page_size_ + slot;
          if (t >= num_tokens) break;
          const bf16* row = page.data() + kv * (page_elems_ / 2) + slot * hd;
          float* dst = out->data() + ((static_cast<int64_t>(l) * 2 + kv) * num_tokens + t) * hd;
          for (int64_t c = 0; c < hd; ++c) dst[c] = __bfloat162float(row[c]);
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> CudaBackendImpl::Time(const std::function<absl::Status()>& fn,
                                                         int warmup, int reps) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  for (int i = 0; i < warmup; ++i) HSTU_RETURN_IF_ERROR(fn());
  cuda::Event start, stop;
  HSTU_CUDA_RETURN(start.Create());
  HSTU_CUDA_RETURN(stop.Create());
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    HSTU_CUDA_RETURN(cudaEventRecord(start.get(), stream_.get()));
    HSTU_RETURN_IF_ERROR(fn());
    HSTU_CUDA_RETURN(cudaEventRecord(stop.get(), stream_.get()));
    HSTU_CUDA_RETURN(cudaEventSynchronize(stop.get()));
    float t = 0.f;
    HSTU_CUDA_RETURN(cudaEventElapsedTime(&t, start.get(), stop.get()));
    ms.push_back(t);
  }
  return ms;
}

}  // namespace

bool CudaDeviceAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackendExt(const ModelWeights& weights,
                                                                  int32_t page_size,
                                                                  int64_t num_pages,
                                                                  int device_index,
                                                                  const GraphOptions& graphs) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device is available (cudaGetDeviceCount: ",
        err != cudaSuccess ? cudaGetErrorString(err) : "0 devices", "); use --device=cpu"));
  }
  if (device_index < 0 || device_index >= count) {
    return absl::UnavailableError(absl::StrCat("cuda:", device_index, " does not exist (", count,
                                               " CUDA device(s) present)"));
  }
  const ModelConfig& c = weights.config;
  if (!cuda::HeadDimSupported(c.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("the CUDA backend supports head dims ",
                                                   cuda::kSupportedHeadDimsText, ", not ", c.head_dim));
  }
  if (c.hidden_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend needs hidden_dim % 8 == 0, got ", c.hidden_dim));
  }
  if (page_size <= 0) return absl::InvalidArgumentError("page_size must be > 0");
  if (num_pages <= 0) return absl::InvalidArgumentError("the KV pool needs at least one page");
  auto backend = std::make_unique<CudaBackendImpl>(weights, page_size, num_pages, device_index, graphs);
  HSTU_RETURN_IF_ERROR(backend->Init(weights));
  return std::unique_ptr<CudaBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const ModelWeights& weights,
                                                           int32_t page_size, int64_t num_pages,
                                                           int device_index,
                                                           const GraphOptions& graphs) {
  auto b = CreateCudaBackendExt(weights, page_size, num_pages, device_index, graphs);
  if (!b.ok()) return b.status();
  return std::unique_ptr<Backend>(std::move(*b));
}

}  // namespace hstu
