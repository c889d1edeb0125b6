// CPU reference backend: the forward of DESIGN §2.2–2.3 in fp32, composed of kernels/cpu ops; or,
// with CpuNumerics::kBf16, the same forward rounded where the CUDA backend stores bf16.
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "kernels/cpu/ops.h"

namespace hstu {
namespace {

// Past 1 TiB no machine we run on has the memory, and the pool's byte count stays in range.
absl::Status CheckPoolSize(const char* what, int64_t num_pages, int64_t page_floats) {
  if (num_pages > (int64_t{1} << 40) / std::max<int64_t>(1, page_floats * 4)) {
    return absl::ResourceExhaustedError(absl::StrCat("a ", what, " of ", num_pages, " pages of ",
                                                     page_floats * 4,
                                                     " bytes is too large (over 1 TiB)"));
  }
  return absl::OkStatus();
}

constexpr float kLayerNormEps = 1e-5f;

class CpuBackend final : public Backend {
 public:
  CpuBackend(const ModelWeights& weights, int32_t page_size, int64_t num_pages,
             CpuNumerics numerics)
      : w_(weights), bf16_(numerics == CpuNumerics::kBf16), page_size_(page_size),
        num_pages_(num_pages) {
    const ModelConfig& c = w_.config;
    if (bf16_) {
      // The tensors the CUDA backend keeps in bf16; norms, biases and the head stay fp32.
      for (std::vector<float>* t :
           {&w_.item_embedding, &w_.action_embedding, &w_.position_embedding}) {
        Round(t);
      }
      for (LayerWeights& l : w_.layers) {
        Round(&l.uvqk_w);
        Round(&l.output_w);
      }
      // The head's hidden layers run on the TF32 tensor cores; the last, narrow one in fp32.
      for (size_t j = 0; j + 1 < w_.head.size(); ++j) {
        cpu::RoundToTf32InPlace(w_.head[j].w.data(), static_cast<int64_t>(w_.head[j].w.size()));
      }
    }
    page_elems_ = 2LL * page_size_ * c.hd();
    layer_elems_ = page_elems_ * num_pages_;
    // Left uninitialised on purpose: pages are always written (append) before they are read, and a
    // large pool should not be touched up front.
    pool_.reset(new (std::nothrow) float[static_cast<size_t>(layer_elems_ * c.num_layers)]);
  }
  // False when the pool could not be allocated (CreateCpuBackend reports it).
  bool allocated() const { return pool_ != nullptr; }

  std::string name() const override { return bf16_ ? "cpu-bf16" : "cpu"; }
  int64_t num_pages() const override { return num_pages_; }
  int64_t kv_pool_bytes() const override { return layer_elems_ * w_.config.num_layers * 4; }
  int64_t device_memory_bytes() const override { return 0; }

  absl::Status Forward(const ForwardBatch& batch, bool keep_hidden, ForwardOutput* out) override;
  absl::Status ReadKv(const std::vector<int32_t>& page_ids, int32_t num_tokens,
                      std::vector<float>* out) override;

  absl::Status CreateHostPool(int64_t num_pages) override {
    if (absl::Status s = CheckPoolSize("host KV tier", num_pages, page_elems_ * w_.config.num_layers);
        !s.ok()) {
      return s;
    }
    const size_t floats = static_cast<size_t>(page_elems_) * static_cast<size_t>(num_pages) *
                          static_cast<size_t>(w_.config.num_layers);
    host_pool_.reset(new (std::nothrow) float[floats]);
    if (host_pool_ == nullptr) {
      host_num_pages_ = 0;
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate the host KV tier of ", num_pages, " pages (", floats * sizeof(float),
          " bytes)"));
    }
    host_num_pages_ = num_pages;
    return absl::OkStatus();
  }
  // On the CPU a host copy is a memcpy per page and layer; it is complete on return.
  absl::Status CopyPages(CopyKind kind, const std::vector<int32_t>& src,
                         const std::vector<int32_t>& dst) override {
    if (host_pool_ == nullptr) return absl::FailedPreconditionError("no host pool");
    if (src.size() != dst.size()) return absl::InvalidArgumentError("CopyPages: src/dst sizes differ");
    const bool to_host = kind == CopyKind::kDeviceToHost;
    const int64_t src_pages = to_host ? num_pages_ : host_num_pages_;
    const int64_t dst_pages = to_host ? host_num_pages_ : num_pages_;
    float* from = to_host ? pool_.get() : host_pool_.get();
    float* to = to_host ? host_pool_.get() : pool_.get();
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] < 0 || src[i] >= src_pages || dst[i] < 0 || dst[i] >= dst_pages) {
        return absl::InvalidArgumentError(absl::StrCat("CopyPages: page ", src[i], " -> ", dst[i],
                                                       " out of range"));
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < src.size(); ++i) {
      for (int l = 0; l < w_.config.num_layers; ++l) {
        std::memcpy(to + l * dst_pages * page_elems_ + dst[i] * page_elems_,
                    from + l * src_pages * page_elems_ + src[i] * page_elems_,
                    sizeof(float) * page_elems_);
      }
    }
    if (!to_host && !src.empty()) {
      // Onloads of one wave add up until the engine takes them (after the wave's forward).
      onload_timing_.bytes += static_cast<int64_t>(src.size()) * page_bytes();
      onload_timing_.seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    return absl::OkStatus();
  }
  std::optional<CopyTiming> TakeOnloadTiming() override {
    if (onload_timing_.bytes == 0) return std::nullopt;
    const CopyTiming t = onload_timing_;
    onload_timing_ = CopyTiming();
    return t;
  }

 private:
  PagedKvView<float> View(int layer, const ForwardBatch& batch) const {
    const ModelConfig& c = w_.config;
    return MakePagedKvView(pool_.get() + layer * layer_elems_, page_size_, c.num_heads, c.head_dim,
                           batch.num_users, batch.page_indptr.data(), batch.page_ids.data(),
                           batch.num_tokens.data());
  }

  // Rounds to bf16 in the kBf16 numerics, where the CUDA backend stores bf16; else a no-op.
  void Round(std::vector<float>* x) const {
    if (bf16_) cpu::RoundToBf16InPlace(x->data(), static_cast<int64_t>(x->size()));
  }

  ModelWeights w_;  // own copy (rounded in kBf16): the engine drops its host weights after start-up
  const bool bf16_;
  int32_t page_size_;
  int64_t num_pages_;
  int64_t page_elems_ = 0;
  int64_t layer_elems_ = 0;
  std::unique_ptr<float[]> pool_;       // [layers, num_pages, 2, page_size, H, D]
  int64_t host_num_pages_ = 0;
  std::unique_ptr<float[]> host_pool_;  // [layers, host_num_pages, 2, page_size, H, D]
  CopyTiming onload_timing_;            // host → "device" memcpys not yet taken
};

absl::Status CpuBackend::Forward(const ForwardBatch& batch, bool keep_hidden, ForwardOutput* out) {
  const ModelConfig& c = w_.config;
  const int64_t rows = batch.num_rows();
  const int64_t d = c.hidden_dim, hd = c.hd();
  for (int32_t id : batch.page_ids) {
    if (id < 0 || id >= num_pages_) {
      return absl::InternalError(absl::StrCat("page id ", id, " outside the pool of ", num_pages_));
    }
  }
  std::vector<float> x(rows * d), n(rows * d), uvqk(rows * 4 * hd), a(rows * hd), y(rows * hd);

  EmbeddingParams<float> ep;
  ep.item_table = w_.item_embedding.data();
  ep.action_table = w_.action_embedding.data();
  ep.position_table = c.position_encoding ? w_.position_embedding.data() : nullptr;
  ep.item_rows = c.item_rows;
  ep.action_rows = c.action_rows;
  ep.position_rows = c.position_rows;
  ep.hidden_dim = c.hidden_dim;
  ep.num_rows = static_cast<int32_t>(rows);
  ep.token_ids = batch.token_ids.data();
  ep.token_types = batch.token_types.data();
  ep.positions = batch.positions.data();
  ep.out = x.data();
  cpu::EmbeddingGather(ep);

  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& l = w_.layers[layer];
    cpu::LayerNorm(x.data(), rows, d, l.input_norm_w.data(), l.input_norm_b.data(), kLayerNormEps,
                   n.data());
    Round(&n);
    if (bf16_) {
      // As the cuBLAS route: the GEMM's bf16 output, then bias + SiLU rounded once more.
      cpu::Gemm(n.data(), l.uvqk_w.data(), nullptr, rows, 4 * hd, d, 0.f, uvqk.data());
      Round(&uvqk);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < 4 * hd; ++j) uvqk[r * 4 * hd + j] += l.uvqk_b[j];
      }
    } else {
      cpu::Gemm(n.data(), l.uvqk_w.data(), l.uvqk_b.data(), rows, 4 * hd, d, 0.f, uvqk.data());
    }
    cpu::SiluInPlace(uvqk.data(), rows * 4 * hd);
    Round(&uvqk);

    const PagedKvView<float> kv = View(layer, batch);
    AppendKvParams<float> ap;
    ap.uvqk = uvqk.data();
    ap.uvqk_row_stride = 4 * hd;
    ap.row_offsets = batch.row_offsets.data();
    ap.num_new = batch.num_new.data();
    ap.kv = kv;
    cpu::AppendKv(ap);

    AttentionParams<float> att;
    att.uvqk = uvqk.data();
    att.uvqk_row_stride = 4 * hd;
    att.out = a.data();
    att.num_rows = static_cast<int32_t>(rows);
    att.row_offsets = batch.row_offsets.data();
    att.num_new = batch.num_new.data();
    att.kv = kv;
    att.alpha = 1.f / std::sqrt(static_cast<float>(c.head_dim));
    att.inv_norm = 1.f / static_cast<float>(c.attention_norm_len);
    att.max_attn_len = c.max_attn_len;
    cpu::HstuAttention(att, /*round_p_to_bf16=*/bf16_);
    Round(&a);

    cpu::NormMulU(a.data(), uvqk.data() + kU * hd, 4 * hd, rows, hd, l.output_norm_w.data(),
                  l.output_norm_b.data(), kLayerNormEps, y.data());
    Round(&y);
    cpu::Gemm(y.data(), l.output_w.data(), nullptr, rows, d, hd, 1.f, x.data());
  }

  // Candidate rows, user-major, in request order.
  std::vector<float> h;
  int64_t num_cand = 0;
  for (int b = 0; b < batch.num_users; ++b) {
    const int64_t first = batch.row_offsets[b] + batch.num_new[b];
    const int64_t count = batch.row_offsets[b + 1] - first;
    h.insert(h.end(), x.begin() + first * d, x.begin() + (first + count) * d);
    num_cand += count;
  }
  if (keep_hidden) out->hidden = h;
  cpu::L2NormalizeRows(h.data(), num_cand, d);
  std::vector<float> act = std::move(h);
  for (size_t j = 0; j < w_.head.size(); ++j) {
    const HeadLayerWeights& hl = w_.head[j];
    std::vector<float> next(num_cand * hl.out);
    if (bf16_ && j + 1 < w_.head.size()) {
      // TF32 inputs, as the weights were rounded at construction.
      cpu::RoundToTf32InPlace(act.data(), static_cast<int64_t>(act.size()));
    }
    cpu::Gemm(act.data(), hl.w.data(), hl.b.data(), num_cand, hl.out, hl.in, 0.f, next.data());
    if (j + 1 < w_.head.size()) cpu::ReluInPlace(next.data(), static_cast<int64_t>(next.size()));
    act = std::move(next);
  }
  cpu::SigmoidInPlace(act.data(), static_cast<int64_t>(act.size()));
  out->scores = std::move(act);
  return absl::OkStatus();
}

absl::Status CpuBackend::ReadKv(const std::vector<int32_t>& page_ids, int32_t num_tokens,
                                std::vector<float>* out) {
  const ModelConfig& c = w_.config;
  const int64_t hd = c.hd();
  if (static_cast<int64_t>(page_ids.size()) * page_size_ < num_tokens) {
    return absl::InvalidArgumentError("ReadKv: too few pages for the token count");
  }
  out->assign(static_cast<size_t>(c.num_layers) * 2 * num_tokens * hd, 0.f);
  for (int l = 0; l < c.num_layers; ++l) {
    const float* base = pool_.get() + l * layer_elems_;
    for (int kv = 0; kv < 2; ++kv) {
      for (int32_t t = 0; t < num_tokens; ++t) {
        const float* src = base + page_ids[t / page_size_] * page_elems_ + kv * (page_elems_ / 2) +
                           static_cast<int64_t>(t % page_size_) * hd;
        std::memcpy(out->data() + ((static_cast<int64_t>(l) * 2 + kv) * num_tokens + t) * hd, src,
                    sizeof(float) * hd);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const ModelWeights& weights,
                                                          int32_t page_size, int64_t num_pages,
                                                          CpuNumerics numerics) {
  if (page_size <= 0) return absl::InvalidArgumentError("page_size must be > 0");
  if (num_pages <= 0) return absl::InvalidArgumentError("the KV pool needs at least one page");
  const int64_t page_floats = 2LL * page_size * weights.config.hd() * weights.config.num_layers;
  if (absl::Status s = CheckPoolSize("KV pool", num_pages, page_floats); !s.ok()) return s;
  auto backend = std::make_unique<CpuBackend>(weights, page_size, num_pages, numerics);
  if (!backend->allocated()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the KV pool: ", num_pages, " pages of ", page_floats * 4, " bytes (",
        num_pages * page_floats * 4, " bytes); lower --cache_pages"));
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace hstu
