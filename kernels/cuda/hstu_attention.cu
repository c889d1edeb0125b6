// Launcher of the paged HSTU attention: argument checks and head-dim dispatch over an explicit list.
#include "kernels/cuda/hstu_attention.h"

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "kernels/cuda/hstu_attention_kernel.cuh"
#include "kernels/cuda/hstu_attention_ws.cuh"
#include "kernels/cuda/ops.h"

namespace hstu::cuda {
namespace {

// ---- The K/V tensor map of the warp-specialised kernel (D = 256) ----
// The pool [num_pages, 2, page_size, H, D] bf16 is viewed as the packed 4-D tensor, fastest first,
// {64 columns, H*D/64 slabs of 128 bytes, page_size rows, 2*num_pages K|V halves}; a box
// {64, 1, box_rows, 1} is box_rows rows of one 64-column slab of one head of one page, which the
// 128-byte swizzle writes in exactly the layout of the kernel's tiles. The pool size is not known
// here, so the last dimension gets a bound past any pool (the kernel only asks for pages of the page
// table). The kernel takes its maps by value, as __grid_constant__ parameters: a launch, or the
// node a stream capture records, carries its own copy, so no map lives in device memory.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

bool WsEnabled() {  // HSTU_ATTN_WS=0 selects the 2-warpgroup cp.async kernel at D = 256 (A/B timing)
  static const bool on = [] {
    const char* e = std::getenv("HSTU_ATTN_WS");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on;
}

EncodeTiledFn GetEncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiledFn>(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// Rows of a TMA box: the largest of 64, 32, 16, 8 that divides the page size (0: none does).
int KvBoxRows(int page_size) {
  for (int r = 64; r >= 8; r /= 2) {
    if (page_size % r == 0) return r;
  }
  return 0;
}

// A 4-D bf16 tensor map with the 128-byte swizzle over `base` (dims and box fastest first, byte
// strides of dims 1..3), encoded on the host into *map. Encoded maps are kept per (base, geometry)
// — a backend has a few: its pool and each uvqk buffer — so a step's launches do not encode again;
// the cache holds at most kMaxCachedMaps (the oldest goes first). Host memory only, so a stream
// may be capturing. false with *why set when the driver cannot encode it.
bool EncodeTensorMap(const void* base, const cuuint64_t (&dims)[4], const cuuint64_t (&strides)[3],
                     const cuuint32_t (&box)[4], CUtensorMap* map, const char** why) {
  struct Entry {
    const void* base;
    std::array<cuuint64_t, 7> shape;  // dims, strides
    std::array<cuuint32_t, 4> box;
    CUtensorMap map;
  };
  constexpr size_t kMaxCachedMaps = 64;
  const std::array<cuuint64_t, 7> shape = {dims[0], dims[1], dims[2], dims[3],
                                           strides[0], strides[1], strides[2]};
  const std::array<cuuint32_t, 4> box_key = {box[0], box[1], box[2], box[3]};
  static std::mutex mu;
  static std::deque<Entry>* cache = new std::deque<Entry>();  // never destroyed: no exit order
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : *cache) {
    if (e.base == base && e.shape == shape && e.box == box_key) {
      *map = e.map;
      return true;
    }
  }
  const EncodeTiledFn encode = GetEncodeTiled();
  if (encode == nullptr) {
    *why = "the driver has no cuTensorMapEncodeTiled";
    return false;
  }
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  if (encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims, strides,
             box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    *why = "cuTensorMapEncodeTiled refused the layout";
    return false;
  }
  if (cache->size() == kMaxCachedMaps) cache->pop_front();
  cache->push_back(Entry{base, shape, box_key, *map});
  return true;
}

// p's K/V tensor map into *map; false when the warp-specialised kernel does not apply (*why, when
// given, then says why). The pool is viewed as {64 columns, H·D/64 slabs, page_size rows,
// 2·num_pages K|V halves}, the last dimension bounded at 2·kMaxKvPoolPages (the pool's size is not
// known here; the backends refuse larger pools, whose pages past the bound TMA would read as zeros
// and not store).
bool KvTensorMap(const AttentionParams<bf16>& p, CUtensorMap* map, const char** why = nullptr) {
  const auto& kv = p.kv;
  const int64_t hd = static_cast<int64_t>(kv.num_heads) * kv.head_dim;
  const char* ignored = nullptr;
  if (why == nullptr) why = &ignored;
  auto fail = [why](const char* reason) {
    *why = reason;
    return false;
  };
  if (kv.head_dim != 256) return fail("head dim is not 256");
  if (!WsEnabled()) return fail("HSTU_ATTN_WS=0");
  if (KvBoxRows(kv.page_size) == 0) return fail("page size is not a multiple of 8");
  if (kv.page_size > (1 << 20) || kv.kv_stride != kv.page_size * hd ||
      kv.page_stride != 2 * kv.kv_stride || reinterpret_cast<uintptr_t>(kv.base) % 16 != 0) {
    return fail("pool layout is not packed K|V pages");
  }
  const cuuint64_t dims[4] = {64, static_cast<cuuint64_t>(hd / 64),
                              static_cast<cuuint64_t>(kv.page_size),
                              static_cast<cuuint64_t>(2 * kMaxKvPoolPages)};
  const cuuint64_t strides[3] = {128, static_cast<cuuint64_t>(hd * 2),
                                 static_cast<cuuint64_t>(kv.kv_stride * 2)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(KvBoxRows(kv.page_size)), 1};
  return EncodeTensorMap(kv.base, dims, strides, box, map, why);
}

// The tensor map of p's uvqk rows for the new K/V read there (new_kv_from_rows): the rows
// [uvqk_rows, 4·H·D] bf16 viewed as {64 columns, 4·H·D/64 slabs of 128 bytes, uvqk_rows rows, 1},
// box {64, 1, 64, 1} — a 64-key block of one slab in the swizzled layout of the pool map's boxes.
// Rows past the allocation read as zeros. false when it cannot be had (*why says why).
bool RowsTensorMap(const AttentionParams<bf16>& p, CUtensorMap* map, const char** why) {
  const int64_t cols = 4LL * p.kv.num_heads * p.kv.head_dim;
  if (p.uvqk_rows < p.num_rows || p.uvqk_rows <= 0 || p.uvqk_rows > INT32_MAX ||
      p.uvqk_row_stride != cols || reinterpret_cast<uintptr_t>(p.uvqk) % 16 != 0) {
    *why = "uvqk rows are not packed, or uvqk_rows < num_rows";
    return false;
  }
  const cuuint64_t dims[4] = {64, static_cast<cuuint64_t>(cols / 64),
                              static_cast<cuuint64_t>(p.uvqk_rows), 1};
  const cuuint64_t strides[3] = {128, static_cast<cuuint64_t>(cols * 2),
                                 static_cast<cuuint64_t>(p.uvqk_rows * cols * 2)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(kAttnBlockN), 1};
  return EncodeTensorMap(p.uvqk, dims, strides, box, map, why);
}

template <int kD>
cudaError_t Launch(const AttentionParams<bf16>& p, const AttentionWorkItem* items, int32_t num_items,
                   int32_t num_split_tiles, float* partials, cudaStream_t stream, int32_t cluster) {
  const dim3 grid(num_items * p.kv.num_heads);  // x = item * H + head
  cudaError_t err = cudaSuccess;
  CUtensorMap kv_map{}, rows_map{};  // rows_map stays zero unless p.new_kv_from_rows
  const bool ws = kD == 256 && KvTensorMap(p, &kv_map);
  if (cluster > 0 && !ws) return cudaErrorInvalidValue;  // the WS kernel only
  // The rows' users' new K/V are in no page yet: only the WS kernel reads them from the rows.
  const char* why = "";
  if (p.new_kv_from_rows && !(ws && RowsTensorMap(p, &rows_map, &why))) {
    return cudaErrorInvalidValue;
  }
  if (ws) {
    constexpr int kSmem = AttnWsTraits::kSmemBytes;
    // Not a stream operation, so it is allowed while a stream is being captured.
    err = cudaFuncSetAttribute(HstuAttentionWsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kSmem);
    if (err != cudaSuccess) return err;
    if (cluster > 0) {
      // x = chunk (the CTA's rank in its cluster), y = tile * H + head.
      const dim3 cgrid(cluster, num_items / cluster * p.kv.num_heads);
      err = LaunchDependentCluster(HstuAttentionWsKernel, cgrid, dim3(AttnWsTraits::kThreads),
                                   kSmem, cluster, stream, p, items, partials, kv_map, rows_map,
                                   KvBoxRows(p.kv.page_size), static_cast<int>(cluster));
    } else {
      err = LaunchDependent(HstuAttentionWsKernel, grid, dim3(AttnWsTraits::kThreads), kSmem,
                            stream, p, items, partials, kv_map, rows_map,
                            KvBoxRows(p.kv.page_size), 0);
    }
    if (err != cudaSuccess) return err;
  } else {
    constexpr int kSmem = AttnTraits<kD>::kSmemBytes;
    err = cudaFuncSetAttribute(HstuAttentionKernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kSmem);
    if (err != cudaSuccess) return err;
    err = LaunchDependent(HstuAttentionKernel<kD>, grid, dim3(AttnTraits<kD>::kThreads), kSmem,
                          stream, p, items, partials);
    if (err != cudaSuccess) return err;
  }
  if (partials == nullptr) return cudaSuccess;
  const dim3 reduce_grid(HstuAttentionReduceGridX(num_split_tiles, p.kv.num_heads), 1,
                         kAttnBlockM / kReduceRows);
  return LaunchDependent(HstuAttentionReduceKernel<kD>, reduce_grid, dim3(256), 0, stream, items,
                         partials, p);
}

template <int kD>
cudaError_t CtasPerSm(int* n) {
  constexpr int kSmem = AttnTraits<kD>::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(HstuAttentionKernel<kD>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, HstuAttentionKernel<kD>,
                                                       AttnTraits<kD>::kThreads, kSmem);
}

}  // namespace

cudaError_t HstuAttentionCtasPerSm(int head_dim, int* ctas_per_sm) {
  // The kernel is wgmma (sm_90a) only: refuse other GPUs here, where the backend sets up.
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  if (major != 9 || minor != 0) return cudaErrorInvalidDeviceFunction;
  switch (head_dim) {
    case 64: return CtasPerSm<64>(ctas_per_sm);
    case 128: return CtasPerSm<128>(ctas_per_sm);
    case 256: return CtasPerSm<256>(ctas_per_sm);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t HstuAttentionMaxClusters(int32_t cluster, int* max_clusters) {
  *max_clusters = 0;
  if (cluster < 2 || cluster > kMaxAttnCluster || kAttnBlockM % cluster != 0) {
    return cudaErrorInvalidValue;
  }
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  if (major != 9) return cudaErrorInvalidDeviceFunction;
  constexpr int kSmem = AttnWsTraits::kSmemBytes;
  err = cudaFuncSetAttribute(HstuAttentionWsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kSmem);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster, 64);
  config.blockDim = dim3(AttnWsTraits::kThreads);
  config.dynamicSmemBytes = kSmem;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(max_clusters, HstuAttentionWsKernel, &config);
}

std::string HstuAttentionKernelName(const AttentionParams<bf16>& p) {
  if (!HeadDimSupported(p.kv.head_dim)) return "none (unsupported head dim)";
  const char* why = "";
  CUtensorMap map;
  if (KvTensorMap(p, &map, &why)) return "warp-specialised TMA kernel";
  return std::string("2-warpgroup cp.async kernel (") + why + ")";
}

bool HstuAttentionKvFromRowsEnabled() {
  static const bool on = [] {
    const char* e = std::getenv("HSTU_ATTN_FRESH_ROWS");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on;
}

cudaError_t ReadHstuAttentionTrace(std::vector<uint64_t>* out) {
#if defined(HSTU_ATTN_TRACE)
  out->assign(static_cast<size_t>(kAttnTraceCtas) * kAttnTraceFields, 0);
  const size_t bytes = out->size() * sizeof(uint64_t);
  if (cudaError_t e = cudaMemcpyFromSymbol(out->data(), g_attn_trace, bytes); e != cudaSuccess) {
    return e;
  }
  void* dev = nullptr;
  if (cudaError_t e = cudaGetSymbolAddress(&dev, g_attn_trace); e != cudaSuccess) return e;
  return cudaMemset(dev, 0, bytes);
#else
  (void)out;
  return cudaErrorNotSupported;
#endif
}

cudaError_t LaunchHstuAttention(const AttentionParams<bf16>& p, const AttentionWorkItem* items,
                                int32_t num_items, int32_t num_split_tiles, float* partials,
                                cudaStream_t stream, int32_t cluster) {
  const auto& kv = p.kv;
  const int64_t hd = static_cast<int64_t>(kv.num_heads) * kv.head_dim;
  if (num_items < 0 || kv.num_heads <= 0 || kv.num_heads > 65535 || p.uvqk == nullptr ||
      p.out == nullptr || !Aligned16(p.uvqk) || !Aligned16(p.out) || !Aligned16(kv.base) ||
      (num_items > 0 && (kv.base == nullptr || p.row_offsets == nullptr || p.num_new == nullptr ||
                         kv.indptr == nullptr || kv.page_ids == nullptr ||
                         kv.num_tokens == nullptr)) ||
      p.uvqk_row_stride < 4 * hd || p.uvqk_row_stride % 8 != 0 ||
      kv.page_size <= 0 || kv.page_stride % 8 != 0 || kv.kv_stride % 8 != 0 ||
      (num_items > 0 && items == nullptr) || num_split_tiles < 0 ||
      num_split_tiles > num_items || (num_split_tiles > 0 && partials == nullptr) ||
      static_cast<int64_t>(num_items) * kv.num_heads > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (cluster != 0 && (cluster < 2 || cluster > kMaxAttnCluster || kAttnBlockM % cluster != 0 ||
                       num_items % cluster != 0 ||
                       num_split_tiles != 0 || kv.head_dim != 256 ||
                       static_cast<int64_t>(num_items) / cluster * kv.num_heads > 65535)) {
    return cudaErrorInvalidValue;
  }
  if (!HeadDimSupported(kv.head_dim)) return cudaErrorInvalidValue;  // allowed: 64, 128, 256
  if (num_items == 0) return cudaSuccess;
  switch (kv.head_dim) {
    case 64: return Launch<64>(p, items, num_items, num_split_tiles, partials, stream, cluster);
    case 128: return Launch<128>(p, items, num_items, num_split_tiles, partials, stream, cluster);
    case 256: return Launch<256>(p, items, num_items, num_split_tiles, partials, stream, cluster);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace hstu::cuda
