// CUDA-graph decode steps of the CUDA backend (DESIGN §7): buckets, static buffers, capture after
// a warm-up, padded staging and replay with the attention grid resized to the batch's work items.
#include "engine/cuda_backend_impl.h"

#include <algorithm>
#include <limits>

namespace hstu {

std::vector<GraphBucket> DefaultGraphBuckets() {
  std::vector<GraphBucket> b;
  for (int32_t users : {1, 4, 16, 64}) {
    for (int32_t rows : {256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192}) {
      b.push_back({users, rows});
    }
  }
  return b;
}

namespace cuda_backend_internal {

absl::Status CudaBackendImpl::SizeGraphWorkspace() {
  const int64_t d = config_.hidden_dim, hd = config_.hd();
  const int64_t pages_per_user =
      (int64_t{config_.max_history_tokens} + page_size_ - 1) / page_size_ + 1;
  // Split-K adds work items only until the CTAs fill a few waves of the GPU (the plan's cost
  // model); a plan beyond these capacities runs eagerly (graph_fallbacks).
  const int32_t ctas_per_head = (concurrent_ctas_ + config_.num_heads - 1) / config_.num_heads;
  size_t rows = 1, meta = 1, partials = 1;
  for (GraphSlot& g : slots_) {
    const int32_t U = g.bucket.max_users, R = g.bucket.max_rows;
    const int32_t tiles = (R + cuda::kAttnBlockM - 1) / cuda::kAttnBlockM + U;
    g.item_cap = tiles + 8 * ctas_per_head;
    g.partial_cap = g.item_cap;
    // A batch's page ids are pool pages, each user's its own: no batch lists more than the pool
    // holds, however long the model's histories may be (before: U × pages a user in int32, which
    // wrapped at 4096 users of 2^22 tokens in pages of 8, and start-up failed on a ~2^64-byte
    // allocation). A batch past the capacity would run eagerly.
    g.page_cap = static_cast<int32_t>(
        std::min<int64_t>({U * pages_per_user, num_pages_, std::numeric_limits<int32_t>::max()}));
    g.layout = PlaceMeta(U, R, g.page_cap, R, g.item_cap, g.item_cap);
    rows = std::max<size_t>(rows, R);
    meta = std::max(meta, g.layout.total);
    partials = std::max<size_t>(partials, g.partial_cap);
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
  // The head runs after the graph, eagerly, on the real candidate rows only (cuBLAS bakes its row
  // count into a captured GEMM, so a captured head would run on every padding row too).
  step_.num_cand = static_cast<int32_t>(cand_rows.size());
  step_.real_cand = step_.num_cand;
  SetStepPlans();
  step_.append_idle = AppendIdle(batch);
  step_.slot = slot;
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
    const GraphSlot& g = slots_[best];
    // A captured attention node keeps its kind (cluster plan or not); the grid follows the plan.
    // A bucket captured without clusters replays a batch that could take them with a plan
    // without (a split plan: ~3 µs a layer slower at batch 1 than the cluster plan, against the
    // ~40 µs of launches a replay saves a step); one captured with clusters cannot replay a plan
    // without them, which runs eagerly (counted in graph_fallbacks).
    PlanAttention(batch, /*clusters=*/g.plain.grid[kAllRows].cluster > 0);
    auto fits = [&](const cuda::AttentionPlan& plan, AttentionPlanKind kind) {
      const int32_t items = static_cast<int32_t>(plan.items.size());
      return items > 0 && items <= g.item_cap && plan.num_partials <= g.partial_cap &&
             plan.cluster == g.plain.grid[kind].cluster;
    };
    if (fits(plan_, kAllRows) && fits(last_plan_, kCandidateRows) &&
        static_cast<int64_t>(batch.page_ids.size()) <= g.page_cap) {
      HSTU_RETURN_IF_ERROR(StageGraph(batch, best, std::move(cand_rows)));
      return true;
    }
    graph_fallbacks_.fetch_add(1, std::memory_order_relaxed);
  }
  HSTU_RETURN_IF_ERROR(Stage(batch));
  return false;
}

absl::Status CudaBackendImpl::EnqueueStep() {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  if (step_.slot >= 0 && replay_ && !capturing_) {
    // Without onloads or prefetches issued since the last step, every layer_ready_ event is
    // already complete for this stream's order, and the graph without wait nodes is equivalent.
    const bool waits = onload_waits_ || always_wait_nodes_;
    CapturedStep& g = waits ? slots_[step_.slot].with_waits : slots_[step_.slot].plain;
    for (AttentionPlanKind kind : {kAllRows, kCandidateRows}) {
      AttentionLaunch& sized = g.grid[kind];
      const AttentionLaunch& want = step_.attn[kind];
      if (sized.items == want.items && sized.split_tiles == want.split_tiles) continue;
      // Unknown until every node is updated: a failure part-way must not leave it claiming the
      // old or the new size.
      sized.items = -1;
      for (size_t i = 0; i < g.attention_nodes.size(); ++i) {
        if (g.attention_nodes[i].plan != kind) continue;
        cudaKernelNodeParams p = g.attention_params[i];
        const auto [x, y] = AttentionGrid(g.attention_nodes[i].reduce, kind);
        p.gridDim.x = static_cast<unsigned>(x);
        p.gridDim.y = static_cast<unsigned>(y);
        HSTU_CUDA_RETURN(cudaGraphExecKernelNodeSetParams(g.exec, g.attention_nodes[i].node, &p));
      }
      sized.items = want.items;
      sized.split_tiles = want.split_tiles;
    }
    if (g.append_shrunk != static_cast<int8_t>(step_.append_idle)) {
      g.append_shrunk = -1;
      for (size_t i = 0; i < g.append_nodes.size(); ++i) {
        cudaKernelNodeParams p = g.append_params[i];
        if (step_.append_idle) p.gridDim = dim3(1, 1, 1);
        HSTU_CUDA_RETURN(cudaGraphExecKernelNodeSetParams(g.exec, g.append_nodes[i], &p));
      }
      g.append_shrunk = static_cast<int8_t>(step_.append_idle);
    }
    HSTU_CUDA_RETURN(cudaGraphLaunch(g.exec, stream_.get()));
    if (onload_waits_) {
      step_waits_ = true;  // the waiting variant's event-record nodes time every layer's wait
      wait_timed_.assign(wait_timed_.size(), true);
    }
    onload_waits_ = false;  // the graph's wait nodes covered them; later work is ordered after it
    // The last layer's tail and the head run eagerly on the real candidate rows (cuBLAS bakes a
    // GEMM's row count into a capture).
    HSTU_RETURN_IF_ERROR(EnqueueLastLayerTail());
    HSTU_RETURN_IF_ERROR(EnqueueHead());
    // Counted once the whole pass is enqueued: a pass that failed was not a replayed one.
    graph_replays_.fetch_add(1, std::memory_order_relaxed);
    if (waits) graph_wait_replays_.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  HSTU_RETURN_IF_ERROR(EnqueueLayerStack());
  return EnqueueHead();
}

absl::Status CudaBackendImpl::CaptureGraphs() {
  slots_.clear();
  for (const GraphBucket& b : graph_options_.buckets.empty() ? DefaultGraphBuckets()
                                                             : graph_options_.buckets) {
    if (b.max_users <= 0 || b.max_rows <= 0 || b.max_users > kMaxGraphBucketUsers ||
        b.max_rows > kMaxGraphBucketRows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "graph bucket (", b.max_users, " users, ", b.max_rows, " rows) must have users in [1, ",
          kMaxGraphBucketUsers, "] and rows in [1, ", kMaxGraphBucketRows, "]"));
    }
    GraphSlot g;
    g.bucket = b;
    slots_.push_back(std::move(g));
  }
  HSTU_RETURN_IF_ERROR(SizeGraphWorkspace());
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    GraphSlot& g = slots_[i];
    // Warm-up batch of the bucket's row count: one user with one new token (written to page 0,
    // which no user owns yet) and max_rows - 1 candidates; a one-row bucket gets a candidate and
    // no history, so that the last layer's plan (candidate rows) has a tile to capture too.
    const int32_t R = g.bucket.max_rows;
    const int32_t warm_new = R > 1 ? 1 : 0;
    ForwardBatch fb;
    fb.num_users = 1;
    fb.row_offsets = {0, R};
    fb.num_new = {warm_new};
    fb.num_tokens = {warm_new};
    fb.page_indptr = {0, 1};
    fb.page_ids = {0};
    fb.token_ids.assign(R, 0);
    fb.token_types.assign(R, kItemToken);
    fb.positions.assign(R, config_.position_rows > 1 ? 1 : 0);
    fb.positions[0] = 0;
    std::vector<int32_t> cand_rows;
    HSTU_RETURN_IF_ERROR(Validate(fb, &cand_rows));
    // Warm-up: loads every kernel module and lets cuBLAS pick its algorithms outside the capture.
    // A GPU that refuses the cluster launch it reported room for (EnqueueAttention turns clusters
    // off) gets the bucket warmed up again without them, instead of failing the start-up.
    absl::Status warmed;
    for (int attempt = 0; attempt < 2; ++attempt) {
      PlanAttention(fb);
      HSTU_RETURN_IF_ERROR(StageGraph(fb, i, cand_rows));
      warmed = EnqueueLayerStack();
      if (warmed.ok()) warmed = EnqueueHead();
      if (warmed.ok() || plan_.cluster == 0 || attn_cluster_ > 0) break;
      cudaGetLastError();  // the refused launch's (non-sticky) error
      HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
    }
    HSTU_RETURN_IF_ERROR(warmed);
    HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));

    HSTU_RETURN_IF_ERROR(CaptureStep(/*waits=*/true, &g.with_waits));
    HSTU_RETURN_IF_ERROR(CaptureStep(/*waits=*/false, &g.plain));
  }
  staged_ = false;
  HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::CaptureStep(bool waits, CapturedStep* c) {
  captured_attention_.clear();
  captured_append_.clear();
  HSTU_CUDA_RETURN(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
  capture_waits_ = waits;
  // The last layer's tail and the head stay out of the graph (StageGraph, EnqueueStep).
  const absl::Status st = EnqueueTrunk();
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_.get(), &graph);
  if (!st.ok()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return st;
  }
  HSTU_CUDA_RETURN(end);
  c->graph = graph;
  HSTU_CUDA_RETURN(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &c->edges));
  std::vector<cudaGraphNode_t> from(c->edges), to(c->edges);
  std::vector<cudaGraphEdgeData> data(c->edges);
  HSTU_CUDA_RETURN(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &c->edges));
  c->programmatic_edges = static_cast<size_t>(std::count_if(
      data.begin(), data.end(),
      [](const cudaGraphEdgeData& e) { return e.type == cudaGraphDependencyTypeProgrammatic; }));
  HSTU_CUDA_RETURN(cudaGraphInstantiate(&c->exec, c->graph, 0));
  c->attention_nodes = captured_attention_;
  if (static_cast<int>(c->attention_nodes.size()) < config_.num_layers) {
    return absl::InternalError("graph capture: attention nodes not found");
  }
  for (const CapturedAttentionNode& n : c->attention_nodes) {
    cudaGraphNodeType type;
    HSTU_CUDA_RETURN(cudaGraphNodeGetType(n.node, &type));
    cudaKernelNodeParams p{};
    if (type == cudaGraphNodeTypeKernel) HSTU_CUDA_RETURN(cudaGraphKernelNodeGetParams(n.node, &p));
    const auto [x, y] = AttentionGrid(n.reduce, n.plan);
    if (type != cudaGraphNodeTypeKernel || p.gridDim.x != static_cast<unsigned>(x) ||
        p.gridDim.y != static_cast<unsigned>(y)) {
      return absl::InternalError(
          "graph capture: an attention launch node is not a kernel with the grid of its plan; "
          "CUDA graphs cannot resize it (disable graphs or update the backend)");
    }
    c->attention_params.push_back(p);
  }
  c->append_nodes = captured_append_;
  for (cudaGraphNode_t node : c->append_nodes) {
    cudaGraphNodeType type;
    HSTU_CUDA_RETURN(cudaGraphNodeGetType(node, &type));
    cudaKernelNodeParams p{};
    if (type == cudaGraphNodeTypeKernel) HSTU_CUDA_RETURN(cudaGraphKernelNodeGetParams(node, &p));
    if (type != cudaGraphNodeTypeKernel || p.gridDim.x == 0) {
      return absl::InternalError("graph capture: an append launch node is not a kernel");
    }
    c->append_params.push_back(p);
  }
  c->grid[kAllRows] = step_.attn[kAllRows];
  c->grid[kCandidateRows] = step_.attn[kCandidateRows];
  return absl::OkStatus();
}

std::string CudaBackendImpl::graph_summary() const {
  size_t edges[2] = {0, 0}, programmatic[2] = {0, 0};
  for (const GraphSlot& g : slots_) {
    edges[0] += g.plain.edges;
    programmatic[0] += g.plain.programmatic_edges;
    edges[1] += g.with_waits.edges;
    programmatic[1] += g.with_waits.programmatic_edges;
  }
  return absl::StrCat(slots_.size(), " buckets; edges without / with onload waits: ", edges[0],
                      " / ", edges[1], ", of which programmatic ", programmatic[0], " / ",
                      programmatic[1]);
}

absl::Status CudaBackendImpl::LastCapturedNode(cudaGraphNode_t* node) {
  cudaStreamCaptureStatus status;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;  // programmatic edges: the query must take them
  size_t num_deps = 0;
  HSTU_CUDA_RETURN(cudaStreamGetCaptureInfo(stream_.get(), &status, nullptr, nullptr, &deps,
                                            &edges, &num_deps));
  if (num_deps > 1) return absl::InternalError("graph capture: the stream is not a chain");
  *node = num_deps == 1 ? deps[0] : nullptr;
  return absl::OkStatus();
}

}  // namespace cuda_backend_internal
}  // namespace hstu
