// CUDA backend: the forward of DESIGN §2.2–2.3 on the GPU (see engine/cuda_backend.h).
//
// Per layer: LayerNorm (fp32 x → bf16; layer 0's fused into the embedding gather) → UVQK GEMM
// (cuBLAS, bf16 out) → bias + SiLU fused with the append of the new history K/V into the pages →
// paged HSTU attention → LayerNorm · u → output GEMM added to the fp32 residual stream (beta = 1).
// Then for candidate rows: gather + L2-normalise → MLP head in fp32 (tiny; keeps the scores well
// inside 2e-3) → sigmoid. The host tier's copies are in engine/cuda_host_tier.cc, the CUDA-graph
// capture and replay in engine/graph_runner.cc.
#include "engine/cuda_backend.h"

#include "engine/cuda_backend_impl.h"
#include "kernels/cuda/gemm_bias_silu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "spdlog/spdlog.h"

namespace hstu {
namespace cuda_backend_internal {

absl::Status CudaBackendImpl::Init(const ModelWeights& w) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  HSTU_CUDA_RETURN(cudaGetDeviceProperties(&prop, device_));
  gpu_name_ = prop.name;
  char bus_id[32] = {};
  HSTU_CUDA_RETURN(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_));
  pci_bus_id_ = bus_id;
  if (prop.unifiedAddressing == 0) {
    // The step's metadata and scores move between pinned host memory and the GPU by kernels that
    // dereference cudaMallocHost pointers (cuda::LaunchSmCopy).
    return absl::FailedPreconditionError(absl::StrCat(
        "device ", device_, " (", gpu_name_, ") has no unified addressing, which the CUDA backend "
        "needs to read and write pinned host memory from its kernels"));
  }
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
  // A cudaMemcpy from pageable memory may return before its DMA lands, and the compute stream is
  // non-blocking (not ordered after the legacy stream the copies ran on).
  HSTU_CUDA_RETURN(cudaDeviceSynchronize());
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
  HSTU_CUBLAS_RETURN(gemm_.Init(cublas_, cublas_ws_.get(), cublas_ws_.bytes()));
  HSTU_CUDA_RETURN(onload_stream_.Create());
  HSTU_CUDA_RETURN(offload_stream_.Create());
  layer_ready_.assign(config_.num_layers, nullptr);
  for (cudaEvent_t& e : layer_ready_) {
    HSTU_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    HSTU_CUDA_RETURN(cudaEventRecord(e, onload_stream_.get()));
  }
  wait_begin_.assign(config_.num_layers, nullptr);
  wait_end_.assign(config_.num_layers, nullptr);
  wait_timed_.assign(config_.num_layers, false);
  for (int l = 0; l < config_.num_layers; ++l) {
    HSTU_CUDA_RETURN(cudaEventCreate(&wait_begin_[l]));
    HSTU_CUDA_RETURN(cudaEventCreate(&wait_end_[l]));
  }
  HSTU_CUDA_RETURN(prefetch_stream_.Create());
  prefetch_ready_.assign(config_.num_layers, nullptr);
  for (cudaEvent_t& e : prefetch_ready_) {
    HSTU_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    HSTU_CUDA_RETURN(cudaEventRecord(e, prefetch_stream_.get()));
  }
  HSTU_CUDA_RETURN(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
  HSTU_CUDA_RETURN(cudaEventCreate(&onload_start_));
  HSTU_CUDA_RETURN(cudaEventCreate(&onload_end_));
  HSTU_CUDA_RETURN(cudaEventCreate(&step_start_));
  HSTU_CUDA_RETURN(cudaEventCreate(&step_end_));
  // Layer 0's pool (every layer has the same layout); only the base, shape and strides are read.
  AttentionParams<bf16> probe;
  probe.kv = MakePagedKvView(pool_.as<bf16>(), page_size_, config_.num_heads, config_.head_dim, 0,
                             nullptr, nullptr, nullptr);
  probe.max_attn_len = config_.max_attn_len;
  attention_kernel_ = cuda::HstuAttentionKernelName(probe);
  kv_from_rows_ = attention_kernel_ == "warp-specialised TMA kernel" &&
                  cuda::HstuAttentionKvFromRowsEnabled();
  const char* drop = std::getenv("HSTU_DROP_KV");  // 0: write the pages anyway (A/B timing)
  drop_kv_ok_ = kv_from_rows_ && (drop == nullptr || std::string(drop) != "0");
  if (const char* v = std::getenv("HSTU_ATTN_CLUSTER"); (v == nullptr || std::string(v) != "0") &&
      attention_kernel_ == "warp-specialised TMA kernel") {
    // Cluster plans only speed up one-wave steps: a GPU that cannot say how many clusters fit
    // (a partitioned one, say) runs without them rather than not at all.
    int max_clusters = 0;
    if (const cudaError_t cerr = cuda::HstuAttentionMaxClusters(cuda::kMaxAttnCluster, &max_clusters);
        cerr != cudaSuccess) {
      cudaGetLastError();
      spdlog::warn("attention without cluster plans: the cluster occupancy query failed ({})",
                   cudaGetErrorString(cerr));
      max_clusters = 0;
    }
    if (max_clusters > 0) {
      attn_cluster_ = cuda::kMaxAttnCluster;
      attn_max_clusters_ = max_clusters;
      attention_kernel_ += ", cluster reduction for one-wave steps (" +
                           std::to_string(max_clusters) + " clusters of " +
                           std::to_string(attn_cluster_) + ")";
    }
  }
  if (const char* v = std::getenv("HSTU_GRAPH_WAIT_NODES"); v != nullptr && std::string(v) == "1") {
    always_wait_nodes_ = true;  // A/B of the graphs without onload wait nodes
  }
  if (graph_options_.enable) HSTU_RETURN_IF_ERROR(CaptureGraphs());
  return absl::OkStatus();
}

PagedKvView<bf16> CudaBackendImpl::View(int layer) const {
  const uint8_t* base = step_.ws->meta.as<uint8_t>();
  return MakePagedKvView(pool_.as<bf16>() + static_cast<int64_t>(layer) * num_pages_ * page_elems_,
                         page_size_, config_.num_heads, config_.head_dim, step_.num_users,
                         reinterpret_cast<const int32_t*>(base + step_.layout.page_indptr),
                         reinterpret_cast<const int32_t*>(base + step_.layout.page_ids),
                         reinterpret_cast<const int32_t*>(base + step_.layout.num_tokens));
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
  if (batch.row_offsets[0] != 0 || batch.page_indptr[0] != 0 ||
      batch.page_indptr[B] != static_cast<int32_t>(batch.page_ids.size())) {
    return absl::InvalidArgumentError(
        "ForwardBatch row_offsets and page_indptr must start at 0, and page_indptr end at the page count");
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
  // The previous batch's upload must be finished before its staging memory is overwritten, or
  // freed by a Reserve that grows it.
  HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  HSTU_CUDA_RETURN(meta_host_.Reserve(L.total));
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
  put(L.last_items, last_plan_.items.data(),
      sizeof(cuda::AttentionWorkItem) * last_plan_.items.size());
  put(L.token_ids, batch.token_ids.data(), 8 * R);
  if (rows > R) std::memset(h + L.token_ids + 8 * R, 0, 8 * static_cast<size_t>(rows - R));
  HSTU_CUDA_RETURN(ws->meta.Reserve(L.total));
  // By the SMs, not a copy engine: a memcpy would queue behind the KV onloads and prefetches in
  // flight (LaunchSmCopy). The step's first kernel is launched normally, so every later kernel,
  // even one that reads the metadata before its griddepcontrol.wait, starts after this one ends.
  HSTU_CUDA_RETURN(cuda::LaunchSmCopy(ws->meta.get(), h, L.total, stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::Stage(const ForwardBatch& batch) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  staged_ = false;
  std::vector<int32_t> cand_rows;
  HSTU_RETURN_IF_ERROR(Validate(batch, &cand_rows));
  const int32_t B = batch.num_users;
  const int32_t rows = batch.num_rows();
  PlanAttention(batch);
  Workspace* ws = &eager_ws_;
  const MetaLayout L = PlaceMeta(B, rows, batch.page_ids.size(), cand_rows.size(),
                                 plan_.items.size(), last_plan_.items.size());
  HSTU_RETURN_IF_ERROR(UploadMeta(batch, cand_rows, L, B, rows, static_cast<int32_t>(cand_rows.size()), ws));

  const int64_t d = config_.hidden_dim, hd = config_.hd();
  const size_t R = std::max(rows, 1);
  HSTU_CUDA_RETURN(ws->x.Reserve(R * d * sizeof(float)));
  HSTU_CUDA_RETURN(ws->n.Reserve(R * d * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws->uvqk.Reserve(R * 4 * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws->a.Reserve(R * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(ws->y.Reserve(R * hd * sizeof(bf16)));
  const size_t partial_floats =
      static_cast<size_t>(std::max(plan_.num_partials, last_plan_.num_partials)) *
      config_.num_heads * cuda::kAttnBlockM * config_.head_dim;
  HSTU_CUDA_RETURN(ws->partials.Reserve(std::max<size_t>(partial_floats, 1) * sizeof(float)));
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
  SetStepPlans();
  step_.all_fresh = true;
  for (int32_t b = 0; b < B; ++b) step_.all_fresh &= batch.num_tokens[b] == batch.num_new[b];
  step_.append_idle = AppendIdle(batch);
  step_.drop_kv = step_.all_fresh && !batch.keep_kv && drop_kv_ok_;
  staged_ = true;
  return absl::OkStatus();
}

bool CudaBackendImpl::AppendIdle(const ForwardBatch& batch) const {
  for (int32_t b = 0; b < batch.num_users; ++b) {
    if (batch.num_new[b] > 0 &&
        !NewKvFromRows(kv_from_rows_, /*returning=*/true, batch.num_tokens[b], batch.num_new[b])) {
      return false;
    }
  }
  return true;
}

absl::Status CudaBackendImpl::EnqueueAttention(int layer) {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("no layer ", layer, " in a model of ",
                                                   config_.num_layers, " layers"));
  }
  // The last layer's queries are the candidate rows only: its history rows' outputs feed nothing
  // (their K/V, appended before, are all the cache keeps of them).
  const AttentionPlanKind kind = layer + 1 == config_.num_layers ? kCandidateRows : kAllRows;
  const AttentionLaunch& launch = step_.attn[kind];
  const int64_t hd = config_.hd();
  const uint8_t* m = step_.ws->meta.as<uint8_t>();
  AttentionParams<bf16> att;
  att.uvqk = step_.ws->uvqk.as<bf16>();
  att.uvqk_row_stride = 4 * hd;
  att.uvqk_rows = static_cast<int64_t>(step_.ws->uvqk.bytes() / (4 * hd * sizeof(bf16)));
  // Not in the last layer (unless no page is written): the append has put every user's K/V in
  // the pages there, and the cuBLAS route's pass left the rows of appended keys unactivated.
  att.new_kv_from_rows = kv_from_rows_ && (kind == kAllRows || step_.drop_kv);
  att.returning_kv_from_rows = returning_kv_from_rows_;
  att.store_new_kv = !step_.drop_kv;
  att.out = step_.ws->a.as<bf16>();
  att.num_rows = step_.num_rows;
  att.row_offsets = reinterpret_cast<const int32_t*>(m + step_.layout.row_offsets);
  att.num_new = reinterpret_cast<const int32_t*>(m + step_.layout.num_new);
  att.kv = View(layer);
  att.alpha = 1.f / std::sqrt(static_cast<float>(config_.head_dim));
  att.inv_norm = 1.f / static_cast<float>(config_.attention_norm_len);
  att.max_attn_len = config_.max_attn_len;
  // While capturing, the nodes this launch adds (the attention kernel, then the split reduction)
  // are recorded: each replay resizes their grids to its plan (checked after capture).
  cudaGraphNode_t before = nullptr;
  if (capturing_) HSTU_RETURN_IF_ERROR(LastCapturedNode(&before));
  // Without split tiles an eager step skips the split reduction (partials = nullptr): its grid of
  // items × H × 8 blocks would only exit (8704 of them in the no-cache block at batch 8). A graph
  // bucket's steps (warm-up, capture, eager runs of a staged bucket) keep it, since a replay's plan
  // may split, unless the plan is a cluster plan: a captured cluster node only replays cluster
  // plans (StageStep), which have no split tiles.
  const bool graph_step = step_.slot >= 0 || capturing_;
  float* partials = launch.split_tiles > 0 || (graph_step && launch.cluster == 0)
                        ? step_.ws->partials.as<float>()
                        : nullptr;
  const size_t items = kind == kCandidateRows ? step_.layout.last_items : step_.layout.items;
  if (const cudaError_t err = cuda::LaunchHstuAttention(
          att, reinterpret_cast<const cuda::AttentionWorkItem*>(m + items), launch.items,
          launch.split_tiles, partials, stream_.get(), launch.cluster);
      err != cudaSuccess) {
    const bool cluster_refused = err == cudaErrorInvalidClusterSize ||
                                 err == cudaErrorLaunchOutOfResources ||
                                 err == cudaErrorNotSupported;
    if (launch.cluster > 0 && cluster_refused && !capturing_ && attn_cluster_ > 0) {
      // A GPU that reported room for clusters and then refused the launch (an MPS or MIG
      // partition, say) would fail every one-wave step the same way: this batch fails, and the
      // next ones are planned without clusters (graph buckets captured with them run eagerly).
      spdlog::warn("attention cluster launch failed ({}); planning without clusters from now on",
                   cudaGetErrorString(err));
      attn_cluster_ = 0;
      attn_max_clusters_ = 0;
    }
    return CudaStatus(err, "cuda::LaunchHstuAttention");
  }
  if (capturing_) {
    cudaGraphNode_t node = nullptr;
    HSTU_RETURN_IF_ERROR(LastCapturedNode(&node));
    // Walk the (linear) chain back to the node before the launch: the split reduction (launched
    // last, when partials are given), then the attention kernel.
    const size_t first = captured_attention_.size();
    while (node != nullptr && node != before) {
      captured_attention_.push_back({node, false, kind});
      size_t n = 0;
      HSTU_CUDA_RETURN(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
      if (n != 1) return absl::InternalError("graph capture: the attention launch is not a chain");
      // Edge data too: the kernels launch as programmatic dependents, and a query without the
      // edge data would be lossy (cudaErrorLossyQuery).
      cudaGraphEdgeData edge{};
      HSTU_CUDA_RETURN(cudaGraphNodeGetDependencies(node, &node, &edge, &n));
    }
    if (captured_attention_.size() - first != (partials != nullptr ? 2u : 1u)) {
      return absl::InternalError(
          "graph capture: expected the attention kernel and, for a split plan, its reduction");
    }
    captured_attention_[first].reduce = partials != nullptr;
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::WaitForLayer(int layer) {
  cudaStream_t s = stream_.get();
  if (capturing_) {
    // An external event-wait node in the waiting variant of the graph: each replay waits for the
    // event's latest record (a no-op once the copies it stands for are done). The stall is timed
    // by external event-record nodes around it.
    if (capture_waits_) {
      HSTU_CUDA_RETURN(cudaEventRecordWithFlags(wait_begin_[layer], s, cudaEventRecordExternal));
      HSTU_CUDA_RETURN(cudaStreamWaitEvent(s, layer_ready_[layer], cudaEventWaitExternal));
      HSTU_CUDA_RETURN(cudaEventRecordWithFlags(wait_end_[layer], s, cudaEventRecordExternal));
    }
  } else if (onload_waits_) {
    // A layer may be waited for twice in a step (a GEMM route's first timing); the first wait
    // holds the stall.
    const bool time = !wait_timed_[layer];
    if (time) HSTU_CUDA_RETURN(cudaEventRecord(wait_begin_[layer], s));
    HSTU_CUDA_RETURN(cudaStreamWaitEvent(s, layer_ready_[layer], 0));
    if (time) HSTU_CUDA_RETURN(cudaEventRecord(wait_end_[layer], s));
    wait_timed_[layer] = true;
    step_waits_ = true;
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueLayerStack() {
  HSTU_RETURN_IF_ERROR(EnqueueTrunk());
  return EnqueueLastLayerTail();
}

absl::Status CudaBackendImpl::EnqueueTrunk() {
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
  // Layer 0's input LayerNorm is fused into the gather (x is not read back: 4·rows·d bytes less).
  const bool fuse_norm = config_.num_layers > 0;
  HSTU_CUDA_RETURN(cuda::LaunchEmbeddingGather(
      ep, ws.x.as<float>(), fuse_norm ? layers_[0].in_w.as<float>() : nullptr,
      fuse_norm ? layers_[0].in_b.as<float>() : nullptr, kLayerNormEps,
      fuse_norm ? ws.n.as<bf16>() : nullptr, s));

  for (int l = 0; l < config_.num_layers; ++l) {
    const LayerBuffers& w = layers_[l];
    const bool last = l + 1 == config_.num_layers;
    if (l > 0) {
      HSTU_CUDA_RETURN(cuda::LaunchLayerNorm(ws.x.as<float>(), rows, d, w.in_w.as<float>(),
                                             w.in_b.as<float>(), kLayerNormEps, ws.n.as<bf16>(), s));
    }
    // UVQK projection, then bias + SiLU and the append of the new history rows' K/V: either the
    // fused GEMM (bias + SiLU in its epilogue) and the append alone, or cuBLAS and one pass for
    // both — whichever the tuner timed faster for this row class (gemm_tuner.h).
    bf16* uvqk = ws.uvqk.as<bf16>();
    AppendKvParams<bf16> ap;
    ap.uvqk = uvqk;
    ap.uvqk_row_stride = 4 * hd;
    ap.row_offsets = reinterpret_cast<const int32_t*>(m + step_.layout.row_offsets);
    ap.num_new = reinterpret_cast<const int32_t*>(m + step_.layout.num_new);
    ap.kv = View(l);
    // The last layer's attention runs no tile of history rows, so none stores a user's new K/V
    // to the pages: the append does it there, for every user — unless the pages are not kept,
    // when the pass activates the rows the attention reads them from.
    ap.new_kv_from_rows = kv_from_rows_ && (!last || step_.drop_kv);
    // The route's first call of a row class times both routes, appends included, so layer l's
    // onloaded pages must be there first; otherwise they are needed from the append on.
    if (!gemm_.HasBiasSiluRoute(rows, 4 * hd, d)) HSTU_RETURN_IF_ERROR(WaitForLayer(l));
    // Timed as this step would run it: without the fused route's append when the attention
    // stores every user's new K/V (the graph buckets' warm-up batches, and the decode steps).
    const bool append_runs = !(ap.new_kv_from_rows && step_.append_idle);
    const int route = gemm_.BiasSiluRoute(ws.n.as<bf16>(), w.uvqk_w.as<bf16>(),
                                          w.uvqk_b.as<float>(), ap, rows, 4 * hd, d, s,
                                          append_runs);
    // Returning users' new K/V go through the rows only where a separate append would copy them
    // to the pages (the fused GEMM's route): the cuBLAS route's pass writes them there at no cost
    // beyond writing them back to the rows, while the attention's stores of them would lengthen
    // its history tiles (batch 1: +8 µs a step, docs/kernel_rounds.md, round 27).
    ap.returning_kv_from_rows = route >= 0;
    returning_kv_from_rows_ = ap.returning_kv_from_rows;
    if (route >= 0) {
      HSTU_CUDA_RETURN(cuda::LaunchGemmBiasSilu(ws.n.as<bf16>(), w.uvqk_w.as<bf16>(),
                                                w.uvqk_b.as<float>(), uvqk, rows, 4 * hd, d,
                                                route, s));
    } else {
      HSTU_CUBLAS_RETURN(gemm_.Run(ws.n.as<bf16>(), w.uvqk_w.as<bf16>(), uvqk,
                                   /*c_is_f32=*/false, rows, 4 * hd, d, 0.f, s));
    }
    HSTU_RETURN_IF_ERROR(WaitForLayer(l));
    if (route >= 0) {
      // Nothing to append when the attention stores every user's new K/V. A captured step keeps
      // the node, whose replays may have users whose cached prefix is not whole key blocks; a
      // replay without any shrinks its grid to one block (EnqueueStep).
      if (!(ap.new_kv_from_rows && step_.append_idle && !capturing_)) {
        cudaGraphNode_t before = nullptr, node = nullptr;
        if (capturing_) HSTU_RETURN_IF_ERROR(LastCapturedNode(&before));
        HSTU_CUDA_RETURN(cuda::LaunchAppendKvFromRows(rows, ap, s));
        if (capturing_ && ap.new_kv_from_rows) {
          HSTU_RETURN_IF_ERROR(LastCapturedNode(&node));
          if (node == nullptr || node == before) {
            return absl::InternalError("graph capture: the append added no node");
          }
          captured_append_.push_back(node);
        }
      }
    } else {
      HSTU_CUDA_RETURN(
          cuda::LaunchBiasSiluAppendKv(uvqk, rows, 4 * hd, w.uvqk_b.as<float>(), ap, s));
    }
    HSTU_RETURN_IF_ERROR(EnqueueAttention(l));
    if (last) break;  // the rest of it on the candidate rows: EnqueueLastLayerTail
    HSTU_CUDA_RETURN(cuda::LaunchNormMulU(ws.a.as<bf16>(), ws.uvqk.as<bf16>() + kU * hd, 4 * hd, rows, hd,
                                          w.out_norm_w.as<float>(), w.out_norm_b.as<float>(),
                                          kLayerNormEps, ws.y.as<bf16>(), s));
    HSTU_CUBLAS_RETURN(gemm_.Run(ws.y.as<bf16>(), w.out_w.as<bf16>(), ws.x.get(),
                                 /*c_is_f32=*/true, rows, d, hd, 1.f, s));
  }
  if (!capturing_) onload_waits_ = false;  // later forwards are ordered after this one
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueLastLayerTail() {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  const int64_t d = config_.hidden_dim, hd = config_.hd();
  cudaStream_t s = stream_.get();
  Workspace& ws = *step_.ws;
  const int32_t* cand_rows =
      reinterpret_cast<const int32_t*>(ws.meta.as<uint8_t>() + step_.layout.cand_rows);
  const int32_t C = step_.num_cand;
  if (config_.num_layers == 0) {  // the embeddings are the final rows
    HSTU_CUDA_RETURN(cuda::LaunchGatherL2Normalize(ws.x.as<float>(), cand_rows, C, d,
                                                   ws.cand_raw.as<float>(),
                                                   ws.cand_norm.as<float>(), s));
    return absl::OkStatus();
  }
  // Candidate i's attention row, u and residual row are rows cand_rows[i]; the compact rows
  // then take the output projection as every layer's rows do (y · W_o + x).
  const LayerBuffers& w = layers_.back();
  HSTU_CUDA_RETURN(cuda::LaunchNormMulUGather(
      ws.a.as<bf16>(), ws.uvqk.as<bf16>() + kU * hd, 4 * hd, cand_rows, C, hd,
      w.out_norm_w.as<float>(), w.out_norm_b.as<float>(), kLayerNormEps, ws.y.as<bf16>(),
      ws.x.as<float>(), d, ws.cand_raw.as<float>(), s));
  HSTU_CUBLAS_RETURN(gemm_.Run(ws.y.as<bf16>(), w.out_w.as<bf16>(), ws.cand_raw.get(),
                               /*c_is_f32=*/true, C, d, hd, 1.f, s));
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueHead() {
  const int64_t d = config_.hidden_dim;
  cudaStream_t s = stream_.get();
  Workspace& ws = *step_.ws;
  const int32_t C = step_.num_cand;
  const size_t L = head_.size();
  // The last layer, when narrow, is one kernel that also applies the previous layer's bias and
  // ReLU (cuBLAS would run it split-K: a GEMM, a reduction and a bias pass). With at most one
  // GEMM before it, that kernel also applies the L2 normalisation ((x/|x|)·W = (x·W)/|x|): the
  // GEMM reads the raw rows.
  const bool fused_out = L > 0 && cuda::HeadOutputFits(head_.back().in, head_.back().out);
  const bool fold_norm = fused_out && L <= 2;
  if (!fold_norm) {
    HSTU_CUDA_RETURN(cuda::LaunchGatherL2Normalize(ws.cand_raw.as<float>(), nullptr, C, d,
                                                   nullptr, ws.cand_norm.as<float>(), s));
  }
  const float* act = (fold_norm ? ws.cand_raw : ws.cand_norm).as<float>();
  const float* pending_bias = nullptr;  // the previous layer's, left to the fused last layer
  for (size_t j = 0; j < L; ++j) {
    float* next = (j % 2 == 0 ? ws.head_a : ws.head_b).as<float>();
    const bool last = j + 1 == L;
    if (last && fused_out) {
      HSTU_CUDA_RETURN(cuda::LaunchHeadOutput(
          act, C, head_[j].in, pending_bias, fold_norm ? ws.cand_raw.as<float>() : nullptr, d,
          head_[j].w.as<float>(), head_[j].b.as<float>(), head_[j].out,
          cuda::Activation::kSigmoid, next, s));
      break;
    }
    // TF32 tensor cores (fp32 accumulation): the base head's first layer at 2048 candidate rows
    // takes 24 µs instead of 60 in plain fp32 (H200), and its inputs keep 10 mantissa bits where
    // the layers before it carry bf16's 7.
    HSTU_CUBLAS_RETURN(cuda::GemmF32(cublas_, act, head_[j].w.as<float>(), next, C,
                                     head_[j].out, head_[j].in, 0.f, /*tf32=*/true));
    if (j + 2 == L && fused_out) {
      pending_bias = head_[j].b.as<float>();
    } else {
      HSTU_CUDA_RETURN(cuda::LaunchBiasActivation(
          next, C, head_[j].out, head_[j].b.as<float>(),
          last ? cuda::Activation::kSigmoid : cuda::Activation::kRelu, s));
    }
    act = next;
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::Forward(const ForwardBatch& batch, bool keep_hidden,
                                      ForwardOutput* out) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  // An ordinary error left by a call that was already reported (or by another user of the
  // context) must not fail this step's first launch; a sticky one comes back at once.
  cudaGetLastError();
  // Queued onloads start now, so they overlap the staging below and the layers before theirs.
  if (absl::Status flushed = FlushOnloads(); !flushed.ok()) {
    onload_failed_ = false;  // this batch, whose onloads they were, fails here: not the next one
    return flushed;
  }
  if (std::exchange(onload_failed_, false)) {
    return absl::InternalError("a KV onload for this batch could not be issued");
  }
  auto graphed = StageStep(batch, /*use_graph=*/true);
  if (!graphed.ok()) return graphed.status();
  cudaStream_t s = stream_.get();
  // After the metadata upload: the device time below is the layers', the head's and the read-back.
  HSTU_CUDA_RETURN(cudaEventRecord(step_start_, s));
  step_waits_ = false;
  wait_timed_.assign(wait_timed_.size(), false);
  HSTU_RETURN_IF_ERROR(EnqueueStep());
  const int64_t d = config_.hidden_dim;
  const int32_t tasks = head_.empty() ? 0 : head_.back().out;
  const int32_t C = step_.real_cand;
  const size_t score_bytes = static_cast<size_t>(C) * tasks * sizeof(float);
  const size_t hidden_bytes = keep_hidden ? static_cast<size_t>(C) * d * sizeof(float) : 0;
  HSTU_CUDA_RETURN(scores_host_.Reserve(std::max<size_t>(score_bytes, 4)));
  HSTU_CUDA_RETURN(hidden_host_.Reserve(std::max<size_t>(hidden_bytes, 4)));
  const float* scores_dev = (head_.size() % 2 == 1 ? step_.ws->head_a : step_.ws->head_b).as<float>();
  // Read back by the SMs: a memcpy would queue behind the write-behind offloads in flight (up to
  // the offload backlog, ~2.4 ms of PCIe at 128 MiB; LaunchSmCopy).
  HSTU_CUDA_RETURN(cuda::LaunchSmCopy(scores_host_.get(), scores_dev, score_bytes, s));
  HSTU_CUDA_RETURN(
      cuda::LaunchSmCopy(hidden_host_.get(), step_.ws->cand_raw.get(), hidden_bytes, s));
  HSTU_CUDA_RETURN(cudaEventRecord(step_end_, s));
  HSTU_CUDA_RETURN(cudaStreamSynchronize(s));
  float device_ms = 0;
  HSTU_CUDA_RETURN(cudaEventElapsedTime(&device_ms, step_start_, step_end_));
  out->device_seconds = 1e-3 * device_ms;
  out->waited_for_onloads = false;
  out->onload_wait_seconds = 0;
  if (step_waits_) {
    double wait_ms = 0;
    bool timed = true;
    for (size_t l = 0; l < wait_timed_.size() && timed; ++l) {
      float ms = 0;
      if (!wait_timed_[l]) continue;
      timed = cudaEventElapsedTime(&ms, wait_begin_[l], wait_end_[l]) == cudaSuccess;
      wait_ms += ms;
    }
    if (timed) {
      out->waited_for_onloads = true;
      out->onload_wait_seconds = 1e-3 * wait_ms;
    } else {
      cudaGetLastError();  // a stall that could not be timed is not reported; the step is fine
    }
  }
  out->scores.assign(scores_host_.as<float>(), scores_host_.as<float>() + score_bytes / 4);
  if (keep_hidden) {
    out->hidden.assign(hidden_host_.as<float>(), hidden_host_.as<float>() + hidden_bytes / 4);
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::DeviceStatus() {
  // A sticky error comes back from every CUDA call after it, so two queries failing alike say the
  // context is lost; an ordinary error is cleared once returned and does not repeat.
  cudaError_t first = cudaSetDevice(device_);
  if (first == cudaSuccess) first = cudaStreamQuery(stream_.get());
  if (first == cudaSuccess || first == cudaErrorNotReady) return absl::OkStatus();
  if (cudaStreamQuery(stream_.get()) != first) {
    cudaGetLastError();
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "the GPU (", name(), ") can run no more work in this process: ", cudaGetErrorName(first),
      " (", cudaGetErrorString(first), "); the process must restart to use it again"));
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

}  // namespace cuda_backend_internal

using cuda_backend_internal::CudaBackendImpl;

absl::Status CudaBackendRunsModel(const ModelConfig& c) {
  // Also under --device=auto, which does not move a model off a present GPU: say how to run it.
  constexpr const char* kOnTheCpu = "; --device=cpu runs it on the CPU reference backend";
  if (!cuda::HeadDimSupported(c.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("the CUDA backend supports head dims ",
                                                   cuda::kSupportedHeadDimsText, ", not ",
                                                   c.head_dim, kOnTheCpu));
  }
  if (c.hidden_dim % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA backend needs hidden_dim % 8 == 0, got ", c.hidden_dim, kOnTheCpu));
  }
  return absl::OkStatus();
}

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
  // The attention kernels are sm_90a code (wgmma, TMA, clusters): no other GPU runs them. Such a
  // GPU is "no usable GPU" (UNAVAILABLE), so --device=auto falls back to the CPU.
  cudaDeviceProp prop{};
  if (const cudaError_t perr = cudaGetDeviceProperties(&prop, device_index); perr != cudaSuccess) {
    return cuda_backend_internal::CudaStatus(perr, "cudaGetDeviceProperties");
  }
  if (prop.major != 9 || prop.minor != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cuda:", device_index, " (", prop.name, ") has compute capability ", prop.major, ".",
        prop.minor, "; the CUDA backend's kernels run on 9.0 (H100, H200) only; use --device=cpu"));
  }
  if (absl::Status runs = CudaBackendRunsModel(weights.config); !runs.ok()) return runs;
  if (page_size <= 0) return absl::InvalidArgumentError("page_size must be > 0");
  if (num_pages <= 0) return absl::InvalidArgumentError("the KV pool needs at least one page");
  if (num_pages > cuda::kMaxKvPoolPages) {
    return absl::InvalidArgumentError(absl::StrCat("the KV pool holds at most ", cuda::kMaxKvPoolPages,
                                                   " pages on the GPU, got ", num_pages));
  }
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
