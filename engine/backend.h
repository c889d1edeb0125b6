// The backend interface: one planned forward pass over a batch's new rows (DESIGN §2.2–2.3).
// CPU (fp32 reference) and CUDA (bf16) implement it; both own their weights and the KV page pool
// memory, while kvcache/ owns which page belongs to whom.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model.h"

namespace hstu {

// Host-side plan of one forward pass. Rows are user-major: user b owns rows
// [row_offsets[b], row_offsets[b+1]), first num_new[b] new history tokens, then its candidates.
struct ForwardBatch {
  int32_t num_users = 0;
  std::vector<int32_t> row_offsets;   // [B + 1]
  std::vector<int32_t> num_new;       // [B]
  std::vector<int32_t> num_tokens;    // [B] history tokens in the pages after this pass's append
  std::vector<int32_t> page_indptr;   // [B + 1]
  std::vector<int32_t> page_ids;      // [page_indptr[B]]
  std::vector<int64_t> token_ids;     // [rows]
  std::vector<int32_t> token_types;   // [rows], TokenType
  std::vector<int32_t> positions;     // [rows]
  // false: nothing reads this pass's pages afterwards (the engine's cache is off), so a backend
  // may leave the new K/V out of them. The CUDA backend then skips the page writes of an eager
  // step whose users all have no cached tokens; the CPU backend writes them anyway.
  bool keep_kv = true;

  int32_t num_rows() const { return row_offsets.empty() ? 0 : row_offsets.back(); }
  int32_t num_candidates(int b) const { return row_offsets[b + 1] - row_offsets[b] - num_new[b]; }
};

struct ForwardOutput {
  std::vector<float> scores;  // [candidate rows in row order, num_tasks]
  std::vector<float> hidden;  // [candidate rows, d] (only when requested)
  // The device's time on the step, from its first enqueued operation to the score read-back
  // (CUDA events; 0 on the CPU backend). The rest of the forward's wall time is host work.
  double device_seconds = 0;
  // Whether the step waited for host → GPU KV copies (onloads or prefetches), and the device time
  // its compute stream spent stalled on them: the sum over layers of the time from the layer's
  // wait being reached to the copies it waits for being done (CUDA events; CPU backend: never).
  bool waited_for_onloads = false;
  double onload_wait_seconds = 0;
};

enum class CopyKind { kDeviceToHost, kHostToDevice };

// One completed host → GPU transfer: its bytes and the time the copy engine spent on it (from its
// first copy starting to its last one ending, waits before it excluded).
struct CopyTiming {
  int64_t bytes = 0;
  double seconds = 0;
};

// CUDA graphs of the decode step (DESIGN §7): one graph per bucket, used for a batch of at most
// max_users users and max_rows rows (new history tokens + candidates over all users).
struct GraphBucket {
  int32_t max_users = 0;
  int32_t max_rows = 0;
};
// Bounds on a bucket (a captured graph holds static buffers for max_rows rows and max_users
// users' pages; beyond these the sizes' int32 arithmetic would overflow long before memory ran
// out).
inline constexpr int32_t kMaxGraphBucketUsers = 4096;
inline constexpr int32_t kMaxGraphBucketRows = 1 << 20;
struct GraphOptions {
  bool enable = false;               // backends without graphs ignore it
  std::vector<GraphBucket> buckets;  // empty: the backend's defaults
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu" or "cuda:0 (NVIDIA H100 ...)"
  // The GPU's PCI bus id (as cudaDeviceGetPCIBusId writes it), for its telemetry
  // (engine/gpu_telemetry.h); empty on the CPU.
  virtual std::string pci_bus_id() const { return {}; }
  // The attention implementation in use, and why when it is not the fastest one (start-up logs).
  virtual std::string attention_kernel() const { return "CPU reference"; }
  // The UVQK projection's route per row class (fused GEMM or GEMM + pass), for the same logs.
  virtual std::string gemm_routes() const { return "CPU reference"; }
  virtual int64_t num_pages() const = 0;
  virtual int64_t kv_pool_bytes() const = 0;
  virtual int64_t device_memory_bytes() const = 0;
  // Of those, the model's weights on the device (0 on the CPU).
  virtual int64_t device_weight_bytes() const { return 0; }
  // Appends the new history K/V to the pages and scores the candidate rows.
  virtual absl::Status Forward(const ForwardBatch& batch, bool keep_hidden, ForwardOutput* out) = 0;
  // Copies every layer's K and V of `num_tokens` tokens stored in `page_ids` into `out`
  // ([layers, 2, num_tokens, H, D] as fp32) — tests compare caches through it.
  virtual absl::Status ReadKv(const std::vector<int32_t>& page_ids, int32_t num_tokens,
                              std::vector<float>* out) = 0;

  // Host tier: a second pool of `num_pages` pages with the same layout in host memory (pinned on a
  // GPU). Backends without one return UNIMPLEMENTED and the engine runs without the tier.
  virtual absl::Status CreateHostPool(int64_t num_pages) {
    return absl::UnimplementedError(name() + " backend has no host KV tier");
  }
  // Copies whole pages (every layer, K and V) between the tiers, src[i] → dst[i]. May run
  // asynchronously, but is ordered before any later Forward; complete once WaitCopies() returns.
  virtual absl::Status CopyPages(CopyKind kind, const std::vector<int32_t>& src,
                                 const std::vector<int32_t>& dst) {
    return absl::UnimplementedError(name() + " backend has no host KV tier");
  }
  virtual absl::Status WaitCopies() { return absl::OkStatus(); }
  // Non-blocking: have all copies issued so far completed? (The default waits for them.)
  virtual bool CopiesDone() { return WaitCopies().ok(); }
  // Prefetch: host → GPU copies started before the batch that reads them is formed (a queued
  // request's onload). Unlike CopyPages they hold up no Forward until MakePrefetchVisible(), which
  // orders the next Forward after every prefetch issued so far. WaitCopies() waits for them too.
  // The defaults treat a prefetch as an ordinary onload (the CPU backend copies synchronously).
  virtual absl::Status PrefetchPages(const std::vector<int32_t>& src,
                                     const std::vector<int32_t>& dst) {
    return CopyPages(CopyKind::kHostToDevice, src, dst);
  }
  virtual absl::Status MakePrefetchVisible() { return absl::OkStatus(); }
  virtual bool PrefetchesDone() { return true; }
  // Non-blocking: the timing of the latest onload (the CopyPages host → GPU copies issued for one
  // Forward) if it has completed and was not taken yet; nothing while it runs, or when the backend
  // cannot time copies. The engine measures the onload bandwidth from it (engine/onload_policy.h).
  virtual std::optional<CopyTiming> TakeOnloadTiming() { return std::nullopt; }
  // Forward passes run by replaying a CUDA graph (0 on backends without graphs). Thread-safe.
  virtual uint64_t graph_replays() const { return 0; }
  // Forward passes that fit a captured bucket's size but not its capture (the attention plan's
  // kind or capacity) and ran eagerly. Thread-safe.
  virtual uint64_t graph_fallbacks() const { return 0; }
  // Bytes of one page over all layers (K and V).
  virtual int64_t page_bytes() const { return num_pages() > 0 ? kv_pool_bytes() / num_pages() : 0; }
  // OK while the device can still run work. Once an error has left it unusable for the rest of the
  // process (a sticky CUDA error: a kernel fault or an uncorrectable ECC error, after which every
  // CUDA call in the process fails), that error as UNAVAILABLE. The engine asks after a call
  // failed; it does not block.
  virtual absl::Status DeviceStatus() { return absl::OkStatus(); }
};

// What the CPU backend computes in. kFp32 is the reference of DESIGN §2.2–2.3. kBf16 rounds where
// the CUDA backend stores bf16 (DESIGN §2.4, docs/cuda_kernels.md "Numerics"): embedding tables and
// layer GEMM weights, LayerNorm outputs, the UVQK GEMM's output and its bias + SiLU (so u, v, q and
// the K/V pages), P before P·V, the attention's output and LayerNorm · u; the residual stream,
// statistics and accumulations stay fp32, and the head's hidden layers take TF32 inputs. It is the
// "straightforward bf16 computation" that DESIGN §2.4 measures a GPU result against: a GPU is as
// close to kFp32 as it should be when it is about as close as kBf16 is.
enum class CpuNumerics { kFp32, kBf16 };

// CPU reference backend (name "cpu", or "cpu-bf16" with CpuNumerics::kBf16).
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(
    const ModelWeights& weights, int32_t page_size, int64_t num_pages,
    CpuNumerics numerics = CpuNumerics::kFp32);
// OK when the CUDA backend's kernels run the model's shapes (head dim 64, 128 or 256; hidden dim a
// multiple of 8), whether or not a GPU is present; INVALID_ARGUMENT naming the shape otherwise, and
// UNAVAILABLE in a build without CUDA. On a GPU, --device=auto refuses such a model too (it does
// not move it to the CPU); the error says how to run it there.
absl::Status CudaRunsModel(const ModelConfig& config);

// Whether `device` names a device CreateBackend knows (not whether it is present):
// INVALID_ARGUMENT naming the accepted forms otherwise.
absl::Status CheckDeviceName(const std::string& device);
// "cpu", "cpu-bf16" (the CPU backend with CpuNumerics::kBf16), "cuda:N" or "auto" (cuda:0 when a
// GPU is present, else cpu).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& device,
                                                       const ModelWeights& weights,
                                                       int32_t page_size, int64_t num_pages,
                                                       const GraphOptions& graphs = GraphOptions());

}  // namespace hstu
