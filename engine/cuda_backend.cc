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
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
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

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(const ModelWeights& w, int32_t page_size, int64_t num_pages, int device)
      : config_(w.config), page_size_(page_size), num_pages_(num_pages), device_(device) {}
  ~CudaBackendImpl() override {
    if (cublas_ != nullptr) {
      cudaSetDevice(device_);
      cublasDestroy(cublas_);
    }
  }

  absl::Status Init(const ModelWeights& w);

  std::string name() const override { return absl::StrCat("cuda:", device_, " (", gpu_name_, ")"); }
  std::string gpu_name() const override { return gpu_name_; }
  int64_t num_pages() const override { return num_pages_; }
  int64_t kv_pool_bytes() const override { return static_cast<int64_t>(pool_.bytes()); }
  int64_t device_memory_bytes() const override {
    return weight_bytes_ + static_cast<int64_t>(pool_.bytes() + x_.bytes() + n_.bytes() + uvqk_.bytes() +
                                                a_.bytes() + y_.bytes() + meta_.bytes() +
                                                partials_.bytes() + counters_.bytes() + cand_raw_.bytes() +
                                                cand_norm_.bytes() + head_a_.bytes() + head_b_.bytes());
  }

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

 private:
  PagedKvView<bf16> View(int layer) const;
  absl::Status EnqueueHead(bool keep_hidden);

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

  // Per-batch state (grown, never shrunk).
  DeviceBuffer x_, n_, uvqk_, a_, y_, meta_, partials_, counters_, cand_raw_, cand_norm_, head_a_,
      head_b_;
  size_t counters_ready_ = 0;  // bytes of counters_ known to be zero
  cuda::PinnedBuffer meta_host_, scores_host_, hidden_host_;
  MetaLayout layout_{};
  cuda::AttentionPlan plan_;
  int32_t num_users_ = 0, num_rows_ = 0, num_cand_ = 0;
  bool staged_ = false;
  bool poison_ = false;
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
  return absl::OkStatus();
}

PagedKvView<bf16> CudaBackendImpl::View(int layer) const {
  const uint8_t* base = meta_.as<uint8_t>();
  PagedKvView<bf16> v;
  v.base = pool_.as<bf16>() + static_cast<int64_t>(layer) * num_pages_ * page_elems_;
  v.page_stride = page_elems_;
  v.kv_stride = page_elems_ / 2;
  v.page_size = page_size_;
  v.num_heads = config_.num_heads;
  v.head_dim = config_.head_dim;
  v.batch_size = num_users_;
  v.indptr = reinterpret_cast<const int32_t*>(base + layout_.page_indptr);
  v.page_ids = reinterpret_cast<const int32_t*>(base + layout_.page_ids);
  v.num_tokens = reinterpret_cast<const int32_t*>(base + layout_.num_tokens);
  return v;
}

absl::Status CudaBackendImpl::Stage(const ForwardBatch& batch) {
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  staged_ = false;
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
  std::vector<int32_t> cand_rows;
  for (int32_t b = 0; b < B; ++b) {
    const int32_t pages = batch.page_indptr[b + 1] - batch.page_indptr[b];
    if (batch.num_new[b] < 0 || batch.num_new[b] > batch.num_tokens[b] ||
        static_cast<int64_t>(pages) * page_size_ < batch.num_tokens[b] ||
        batch.row_offsets[b + 1] - batch.row_offsets[b] < batch.num_new[b]) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardBatch user ", b, " is inconsistent"));
    }
    for (int32_t r = batch.row_offsets[b] + batch.num_new[b]; r < batch.row_offsets[b + 1]; ++r) {
      cand_rows.push_back(r);
    }
  }
  plan_ = cuda::PlanHstuAttention(batch.row_offsets.data(), batch.num_new.data(),
                                  batch.num_tokens.data(), B, config_.max_attn_len,
                                  config_.num_heads, concurrent_ctas_);

  MetaLayout& L = layout_;
  size_t off = 0;
  auto place = [&](size_t bytes) { const size_t at = off; off = Align(off + bytes); return at; };
  L.row_offsets = place(4 * (B + 1));
  L.num_new = place(4 * B);
  L.num_tokens = place(4 * B);
  L.page_indptr = place(4 * (B + 1));
  L.page_ids = place(4 * batch.page_ids.size());
  L.token_types = place(4 * rows);
  L.positions = place(4 * rows);
  L.cand_rows = place(4 * cand_rows.size());
  L.items = place(sizeof(cuda::AttentionWorkItem) * plan_.items.size());
  L.token_ids = place(8 * rows);
  L.total = off;
  HSTU_CUDA_RETURN(meta_host_.Reserve(L.total));
  // The previous batch's upload must be finished before its staging memory is overwritten.
  HSTU_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  uint8_t* h = meta_host_.as<uint8_t>();
  auto put = [&](size_t at, const void* src, size_t bytes) { if (bytes) std::memcpy(h + at, src, bytes); };
  put(L.row_offsets, batch.row_offsets.data(), 4 * (B + 1));
  put(L.num_new, batch.num_new.data(), 4 * B);
  put(L.num_tokens, batch.num_tokens.data(), 4 * B);
  put(L.page_indptr, batch.page_indptr.data(), 4 * (B + 1));
  put(L.page_ids, batch.page_ids.data(), 4 * batch.page_ids.size());
  put(L.token_types, batch.token_types.data(), 4 * rows);
  put(L.positions, batch.positions.data(), 4 * rows);
  put(L.cand_rows, cand_rows.data(), 4 * cand_rows.size());
  put(L.items, plan_.items.data(), sizeof(cuda::AttentionWorkItem) * plan_.items.size());
  put(L.token_ids, batch.token_ids.data(), 8 * rows);
  HSTU_CUDA_RETURN(meta_.Reserve(L.total));
  HSTU_CUDA_RETURN(cudaMemcpyAsync(meta_.get(), h, L.total, cudaMemcpyHostToDevice, stream_.get()));

  const int64_t d = config_.hidden_dim, hd = config_.hd();
  const size_t R = std::max(rows, 1);
  HSTU_CUDA_RETURN(x_.Reserve(R * d * sizeof(float)));
  HSTU_CUDA_RETURN(n_.Reserve(R * d * sizeof(bf16)));
  HSTU_CUDA_RETURN(uvqk_.Reserve(R * 4 * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(a_.Reserve(R * hd * sizeof(bf16)));
  HSTU_CUDA_RETURN(y_.Reserve(R * hd * sizeof(bf16)));
  const size_t partial_floats = static_cast<size_t>(plan_.num_partials) * config_.num_heads *
                                cuda::kAttnBlockM * config_.head_dim;
  HSTU_CUDA_RETURN(partials_.Reserve(std::max<size_t>(partial_floats, 1) * sizeof(float)));
  const size_t counter_bytes = std::max<size_t>(plan_.num_split_tiles * config_.num_heads, 1) * 4;
  if (counter_bytes > counters_ready_) {
    HSTU_CUDA_RETURN(counters_.Reserve(counter_bytes));
    HSTU_CUDA_RETURN(cudaMemsetAsync(counters_.get(), 0, counters_.bytes(), stream_.get()));
    counters_ready_ = counters_.bytes();
  }
  const size_t C = std::max<size_t>(cand_rows.size(), 1);
  int32_t widest = 1;
  for (const HeadBuffers& hb : head_) widest = std::max({widest, hb.in, hb.out});
  HSTU_CUDA_RETURN(cand_raw_.Reserve(C * d * sizeof(float)));
  HSTU_CUDA_RETURN(cand_norm_.Reserve(C * d * sizeof(float)));
  HSTU_CUDA_RETURN(head_a_.Reserve(C * widest * sizeof(float)));
  HSTU_CUDA_RETURN(head_b_.Reserve(C * widest * sizeof(float)));
  if (poison_) {
    for (DeviceBuffer* buf : {&x_, &n_, &uvqk_, &a_, &y_, &partials_, &cand_raw_, &cand_norm_,
                              &head_a_, &head_b_}) {
      HSTU_CUDA_RETURN(cudaMemsetAsync(buf->get(), 0xFF, buf->bytes(), stream_.get()));
    }
  }
  num_users_ = B;
  num_rows_ = rows;
  num_cand_ = static_cast<int32_t>(cand_rows.size());
  staged_ = true;
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueAttention(int layer) {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  const int64_t hd = config_.hd();
  const uint8_t* m = meta_.as<uint8_t>();
  AttentionParams<bf16> att;
  att.uvqk = uvqk_.as<bf16>();
  att.uvqk_row_stride = 4 * hd;
  att.out = a_.as<bf16>();
  att.num_rows = num_rows_;
  att.row_offsets = reinterpret_cast<const int32_t*>(m + layout_.row_offsets);
  att.num_new = reinterpret_cast<const int32_t*>(m + layout_.num_new);
  att.kv = View(layer);
  att.alpha = 1.f / std::sqrt(static_cast<float>(config_.head_dim));
  att.inv_norm = 1.f / static_cast<float>(config_.attention_norm_len);
  att.max_attn_len = config_.max_attn_len;
  HSTU_CUDA_RETURN(cuda::LaunchHstuAttention(
      att, reinterpret_cast<const cuda::AttentionWorkItem*>(m + layout_.items),
      static_cast<int32_t>(plan_.items.size()), partials_.as<float>(), counters_.as<int32_t>(),
      stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueLayerStack() {
  if (!staged_) return absl::FailedPreconditionError("no staged batch");
  HSTU_CUDA_RETURN(cudaSetDevice(device_));
  const int64_t rows = num_rows_, d = config_.hidden_dim, hd = config_.hd();
  const uint8_t* m = meta_.as<uint8_t>();
  cudaStream_t s = stream_.get();
  EmbeddingParams<bf16> ep;
  ep.item_table = item_.as<bf16>();
  ep.action_table = action_.as<bf16>();
  ep.position_table = config_.position_encoding ? position_.as<bf16>() : nullptr;
  ep.item_rows = config_.item_rows;
  ep.action_rows = config_.action_rows;
  ep.position_rows = config_.position_rows;
  ep.hidden_dim = config_.hidden_dim;
  ep.num_rows = num_rows_;
  ep.token_ids = reinterpret_cast<const int64_t*>(m + layout_.token_ids);
  ep.token_types = reinterpret_cast<const int32_t*>(m + layout_.token_types);
  ep.positions = reinterpret_cast<const int32_t*>(m + layout_.positions);
  HSTU_CUDA_RETURN(cuda::LaunchEmbeddingGather(ep, x_.as<float>(), s));

  for (int l = 0; l < config_.num_layers; ++l) {
    const LayerBuffers& w = layers_[l];
    HSTU_CUDA_RETURN(cuda::LaunchLayerNorm(x_.as<float>(), rows, d, w.in_w.as<float>(),
                                           w.in_b.as<float>(), kLayerNormEps, n_.as<bf16>(), s));
    HSTU_CUBLAS_RETURN(cuda::GemmBf16(cublas_, n_.as<bf16>(), w.uvqk_w.as<bf16>(), uvqk_.get(),
                                      /*c_is_f32=*/false, rows, 4 * hd, d, 0.f));
    HSTU_CUDA_RETURN(cuda::LaunchBiasSilu(uvqk_.as<bf16>(), rows, 4 * hd, w.uvqk_b.as<float>(), s));
    AppendKvParams<bf16> ap;
    ap.uvqk = uvqk_.as<bf16>();
    ap.uvqk_row_stride = 4 * hd;
    ap.row_offsets = reinterpret_cast<const int32_t*>(m + layout_.row_offsets);
    ap.num_new = reinterpret_cast<const int32_t*>(m + layout_.num_new);
    ap.kv = View(l);
    HSTU_CUDA_RETURN(cuda::LaunchAppendKv(ap, num_rows_, s));
    HSTU_RETURN_IF_ERROR(EnqueueAttention(l));
    HSTU_CUDA_RETURN(cuda::LaunchNormMulU(a_.as<bf16>(), uvqk_.as<bf16>() + kU * hd, 4 * hd, rows, hd,
                                          w.out_norm_w.as<float>(), w.out_norm_b.as<float>(),
                                          kLayerNormEps, y_.as<bf16>(), s));
    HSTU_CUBLAS_RETURN(cuda::GemmBf16(cublas_, y_.as<bf16>(), w.out_w.as<bf16>(), x_.get(),
                                      /*c_is_f32=*/true, rows, d, hd, 1.f));
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::EnqueueHead(bool keep_hidden) {
  const int64_t d = config_.hidden_dim;
  cudaStream_t s = stream_.get();
  const uint8_t* m = meta_.as<uint8_t>();
  HSTU_CUDA_RETURN(cuda::LaunchGatherL2Normalize(
      x_.as<float>(), reinterpret_cast<const int32_t*>(m + layout_.cand_rows), num_cand_, d,
      keep_hidden ? cand_raw_.as<float>() : nullptr, cand_norm_.as<float>(), s));
  const float* act = cand_norm_.as<float>();
  for (size_t j = 0; j < head_.size(); ++j) {
    float* next = (j % 2 == 0 ? head_a_ : head_b_).as<float>();
    HSTU_CUBLAS_RETURN(cuda::GemmF32(cublas_, act, head_[j].w.as<float>(), next, num_cand_,
                                     head_[j].out, head_[j].in, 0.f));
    const bool last = j + 1 == head_.size();
    HSTU_CUDA_RETURN(cuda::LaunchBiasActivation(
        next, num_cand_, head_[j].out, head_[j].b.as<float>(),
        last ? cuda::Activation::kSigmoid : cuda::Activation::kRelu, s));
    act = next;
  }
  return absl::OkStatus();
}

absl::Status CudaBackendImpl::Forward(const ForwardBatch& batch, bool keep_hidden,
                                      ForwardOutput* out) {
  HSTU_RETURN_IF_ERROR(Stage(batch));
  HSTU_RETURN_IF_ERROR(EnqueueLayerStack());
  HSTU_RETURN_IF_ERROR(EnqueueHead(keep_hidden));
  const int64_t d = config_.hidden_dim;
  const int32_t tasks = head_.empty() ? 0 : head_.back().out;
  const size_t score_bytes = static_cast<size_t>(num_cand_) * tasks * sizeof(float);
  const size_t hidden_bytes = keep_hidden ? static_cast<size_t>(num_cand_) * d * sizeof(float) : 0;
  HSTU_CUDA_RETURN(scores_host_.Reserve(std::max<size_t>(score_bytes, 4)));
  HSTU_CUDA_RETURN(hidden_host_.Reserve(std::max<size_t>(hidden_bytes, 4)));
  const float* scores_dev = (head_.size() % 2 == 1 ? head_a_ : head_b_).as<float>();
  cudaStream_t s = stream_.get();
  if (score_bytes > 0) {
    HSTU_CUDA_RETURN(cudaMemcpyAsync(scores_host_.as<float>(), scores_dev, score_bytes,
                                     cudaMemcpyDeviceToHost, s));
  }
  if (hidden_bytes > 0) {
    HSTU_CUDA_RETURN(cudaMemcpyAsync(hidden_host_.as<float>(), cand_raw_.get(), hidden_bytes,
                                     cudaMemcpyDeviceToHost, s));
  }
  HSTU_CUDA_RETURN(cudaStreamSynchronize(s));
  out->scores.assign(scores_host_.as<float>(), scores_host_.as<float>() + score_bytes / 4);
  if (keep_hidden) {
    out->hidden.assign(hidden_host_.as<float>(), hidden_host_.as<float>() + hidden_bytes / 4);
  }
  return absl::OkStatus();
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
                                                                  int device_index) {
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
  auto backend = std::make_unique<CudaBackendImpl>(weights, page_size, num_pages, device_index);
  HSTU_RETURN_IF_ERROR(backend->Init(weights));
  return std::unique_ptr<CudaBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const ModelWeights& weights,
                                                           int32_t page_size, int64_t num_pages,
                                                           int device_index) {
  auto b = CreateCudaBackendExt(weights, page_size, num_pages, device_index);
  if (!b.ok()) return b.status();
  return std::unique_ptr<Backend>(std::move(*b));
}

}  // namespace hstu
