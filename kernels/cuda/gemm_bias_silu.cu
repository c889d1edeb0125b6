// CUTLASS 3 GEMM with bias + SiLU in the epilogue (see gemm_bias_silu.h).
//
// Mainloop: the collective builder's TMA + wgmma warp-specialised pipeline (a producer warp loads
// A and B tiles into a shared-memory ring, two consumer warpgroups run wgmma). Epilogue: an
// epilogue-visitor tree, activation(alpha · acc + bias[col]) with our SiLU as the activation, written
// through shared memory by TMA. a is K-major (row-major [m, k]); b is the layer weight as stored,
// row-major [k, n], i.e. N-major, which TMA + wgmma take directly for 16-bit types.
#include "kernels/cuda/gemm_bias_silu.h"

#include <map>
#include <mutex>
#include <tuple>

#if defined(HSTU_HAVE_CUTLASS)
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#endif

namespace hstu::cuda {

#if defined(HSTU_HAVE_CUTLASS)
namespace {

// SiLU as the bias + SiLU pass computes it (common.cuh: x / (1 + e^−x) with the fast exp and
// divide), so the fused and unfused paths differ only by the pass's extra bf16 rounding of the GEMM
// output. The epilogue applies it to fragments (Array<float, N>).
template <class T>
struct SiluActivation {
  CUTLASS_DEVICE T operator()(T const& x) const { return __fdividef(x, 1.f + __expf(-x)); }
};

template <class T, int N>
struct SiluActivation<cutlass::Array<T, N>> {
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x) const {
    cutlass::Array<T, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = __fdividef(x[i], 1.f + __expf(-x[i]));
    return y;
  }
};

using namespace cute;

// Epilogue-visitor node that passes its child's output (the activated bf16 fragment) through and
// also stores the v and k columns of appended rows into their page slots (PageStoreArgs): the
// K/V append of the decode step, done from the registers instead of a pass over the rows. A
// fragment's elements are addressed by their coordinates (the epilogue's thread-partitioned
// coordinate tensor, relative to the thread's first element, whose absolute position is
// (M, N) − residue).
struct Sm90PageStore {
  struct SharedStorage {};
  using Arguments = PageStoreArgs;
  using Params = PageStoreArgs;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return args.pool == nullptr ||
           (args.row_slot != nullptr && args.hd > 0 && get<1>(problem_shape) == 4 * args.hd);
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90PageStore() {}
  CUTLASS_HOST_DEVICE Sm90PageStore(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(
      cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor tc, Residue residue, int first_m,
                                          int first_n, Params const& params)
        : tCcD(tc), residue(residue), first_m(first_m), first_n(first_n), params(params) {
      // The wgmma accumulator layout: the 4 lanes of a quad hold the same rows, lane q the column
      // pair 2q, 2q + 1 of each 8-column group. Checked here (and per fragment in visit), so that
      // another layout takes the element-wise path instead of storing wrong values.
      const int lane = threadIdx.x & 31, q = lane & 3;
      const int m0 = __shfl_sync(0xffffffffu, first_m, lane & ~3);
      const int n0 = __shfl_sync(0xffffffffu, first_n, lane & ~3);
      quad_layout = __all_sync(0xffffffffu, first_m == m0 && first_n == n0 + 2 * q);
      quad_n0 = n0;
    }
    CoordTensor tCcD;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): coordinates relative to the first
    Residue residue;   // (M, N) − the first element's coordinates
    int first_m, first_n;
    Params const& params;
    bool quad_layout = false;  // warp-uniform
    int quad_n0 = 0;           // the first column of lane 0 of this lane's quad

    // Element-wise: a 2-byte store per v/k element of an appended row (any layout).
    template <class CTensor, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE void StoreElements(CTensor const& c, int epi_v,
                                      cutlass::Array<ElementInput, FragmentSize> const& frg) {
      const int hd = static_cast<int>(params.hd);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const auto rel = c(epi_v * FragmentSize + i);
        if (!elem_less(rel, residue)) continue;
        const int n = first_n + static_cast<int>(get<1>(rel));
        const bool is_v = n >= hd && n < 2 * hd;
        if (!is_v && n < 3 * hd) continue;  // u and q: nothing to append
        const int64_t slot = params.row_slot[first_m + static_cast<int>(get<0>(rel))];
        if (slot < 0) continue;  // not a new history row
        reinterpret_cast<ElementInput*>(
            params.pool)[slot + (is_v ? params.kv_stride + (n - hd) : n - 3 * hd)] = frg[i];
      }
    }

    // By quads: pair p (elements 2p, 2p + 1) of the 4 lanes of a quad is one row's 8 consecutive
    // columns. A transpose across the quad (3 xor-shuffle rounds) gives lane q the whole 8 columns
    // of the pairs p ≡ q (mod 4), stored as one 16-byte vector.
    template <class CTensor, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE void StoreQuads(CTensor const& c, int epi_v,
                                   cutlass::Array<ElementInput, FragmentSize> const& frg) {
      constexpr int kPairs = FragmentSize / 2;
      const int lane = threadIdx.x & 31, q = lane & 3;
      const int hd = static_cast<int>(params.hd);
      uint32_t w[kPairs];
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) w[p] = reinterpret_cast<const uint32_t*>(frg.data())[p];
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < kPairs / 4; ++h) {
        uint32_t v[4];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) v[j] = 0;
        CUTLASS_PRAGMA_UNROLL
        for (int x = 0; x < 4; ++x) {
          // This lane sends pair (lane ^ x) & 3 of group h, and receives its own pair q of group
          // h from lane q ^ x, which is column pair q ^ x of the vector.
          const int send = (q ^ x) & 3;
          uint32_t out = w[4 * h];
          CUTLASS_PRAGMA_UNROLL
          for (int j = 1; j < 4; ++j) out = send == j ? w[4 * h + j] : out;
          const uint32_t in = x == 0 ? out : __shfl_xor_sync(0xffffffffu, out, x);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 4; ++j) v[j] = (q ^ x) == j ? in : v[j];
        }
        // The vector is pair p = 4h + q: its row and its first column (lane 0 of the quad's).
        int row_rel = 0, col_rel = 0;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          const auto rel = c(epi_v * FragmentSize + 2 * (4 * h + j));
          if (j == q) {
            row_rel = static_cast<int>(get<0>(rel));
            col_rel = static_cast<int>(get<1>(rel));
          }
        }
        if (row_rel >= static_cast<int>(get<0>(residue))) continue;  // a row past M
        const int n = quad_n0 + col_rel;
        if (n >= 4 * hd) continue;  // a column past N (the last tile's padding)
        const bool is_v = n >= hd && n < 2 * hd;
        if (!is_v && n < 3 * hd) continue;
        const int64_t slot = params.row_slot[first_m + row_rel];
        if (slot < 0) continue;
        *reinterpret_cast<uint4*>(reinterpret_cast<ElementInput*>(params.pool) + slot +
                                  (is_v ? params.kv_stride + (n - hd) : n - 3 * hd)) =
            make_uint4(v[0], v[1], v[2], v[3]);
      }
    }

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, FragmentSize> const& frg) {
      if (params.pool == nullptr) return frg;
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      if constexpr (FragmentSize % 8 == 0 && sizeof(ElementInput) == 2) {
        // The pairs must be adjacent columns of one row, starting at a multiple of 8 on lane 0, and
        // an 8-column vector must not straddle two blocks (H·D % 8 == 0, true for every head dim
        // the attention takes).
        bool pairs = quad_layout && params.hd % 8 == 0;
        CUTLASS_PRAGMA_UNROLL
        for (int p = 0; p < FragmentSize / 2; ++p) {
          const auto a = c(epi_v * FragmentSize + 2 * p), b = c(epi_v * FragmentSize + 2 * p + 1);
          pairs = pairs && get<0>(a) == get<0>(b) && get<1>(b) == get<1>(a) + 1 &&
                  (quad_n0 + static_cast<int>(get<1>(a))) % 8 == 0;
        }
        if (__all_sync(0xffffffffu, pairs)) {
          StoreQuads(c, epi_v, frg);
          return frg;
        }
      }
      StoreElements(c, epi_v, frg);
      return frg;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    const auto [M, N, K, L] = args.problem_shape_mnkl;
    const int first_m = static_cast<int>(M) - static_cast<int>(get<0>(args.residue_tCcD));
    const int first_n = static_cast<int>(N) - static_cast<int>(get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        args.tCcD, args.residue_tCcD, first_m, first_n, params);
  }
};

// The epilogue: D = SiLU(acc + bias[col]) in bf16, with the appended rows' v and k also stored to
// their pages.
template <class CtaTileShapeMNK>
using BiasSiluPageStore = cutlass::epilogue::fusion::Sm90EVT<
    Sm90PageStore,
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<SiluActivation, cutlass::bfloat16_t, float,
                                               cutlass::FloatRoundStyle::round_to_nearest>,
        cutlass::epilogue::fusion::Sm90EVT<
            cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, float, float,
                                                   cutlass::FloatRoundStyle::round_to_nearest>,
            cutlass::epilogue::fusion::Sm90AccFetch,
            cutlass::epilogue::fusion::Sm90RowBroadcast<0, CtaTileShapeMNK, float, float,
                                                        Stride<_0, _1, int64_t>, 4>>>>;

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct FusedGemm {
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // [m, k], k contiguous
  using LayoutB = cutlass::layout::RowMajor;     // [k, n], n contiguous (N-major B)
  using LayoutD = cutlass::layout::RowMajor;     // [m, n]
  static constexpr int kAlign = 8;               // 16 bytes of bf16
  using FusionOp = BiasSiluPageStore<TileShape>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, /*C*/ void, LayoutD, kAlign,
      Element, LayoutD, kAlign, EpilogueSchedule, FusionOp>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Params = typename Kernel::Params;

  static typename Gemm::Arguments MakeArguments(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                                const float* bias, __nv_bfloat16* c, int m, int n,
                                                int k, const PageStoreArgs& pages, int device,
                                                int sm_count) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    const StrideA sa = make_stride(int64_t{k}, Int<1>{}, int64_t{0});
    const StrideB sb = make_stride(Int<1>{}, int64_t{n}, int64_t{0});
    const StrideD sd = make_stride(int64_t{n}, Int<1>{}, int64_t{0});
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {reinterpret_cast<const Element*>(a), sa, reinterpret_cast<const Element*>(b), sb},
        {{}, nullptr, sd, reinterpret_cast<Element*>(c), sd}};
    // {silu{plus{acc, bias}}, pages}: children first, then the node's own arguments.
    args.epilogue.thread = {
        {{{}, {bias, 0.f, {_0{}, _1{}, int64_t{0}}}, {}}, {}},
        pages};
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    return args;
  }
};

using Cooperative128x256 =
    FusedGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>,
              cutlass::gemm::KernelTmaWarpSpecializedCooperative,
              cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Pingpong128x128 =
    FusedGemm<Shape<_128, _128, _64>, Shape<_2, _1, _1>,
              cutlass::gemm::KernelTmaWarpSpecializedPingpong,
              cutlass::epilogue::TmaWarpSpecialized>;

// Launch parameters (with their TMA descriptors) per call shape and device: building them costs
// several host microseconds, and a forward repeats the same eight layer calls.
using Key = std::tuple<int, int, const void*, const void*, const void*, void*, int64_t, int64_t,
                       int64_t, const void*, const void*, int64_t, int64_t>;

template <class G>
cudaError_t Run(const Key& key, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* bias,
                __nv_bfloat16* c, int m, int n, int k, const PageStoreArgs& pages, int device,
                cudaStream_t stream) {
  static std::mutex mu;
  static std::map<Key, typename G::Params> cache;
  static std::map<int, int> sm_counts;  // devices whose kernel attribute is set → SM count
  typename G::Params params;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto sm = sm_counts.find(device);
    if (sm == sm_counts.end()) {
      int count = 0;
      if (cudaError_t e = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
          e != cudaSuccess) {
        return e;
      }
      const int smem = static_cast<int>(G::Kernel::SharedStorageSize);
      if (cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<typename G::Kernel>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          e != cudaSuccess) {
        return e;
      }
      sm = sm_counts.emplace(device, count).first;
    }
    auto it = cache.find(key);
    if (it == cache.end()) {
      const auto args = G::MakeArguments(a, b, bias, c, m, n, k, pages, device, sm->second);
      if (G::Gemm::can_implement(args) != cutlass::Status::kSuccess ||
          G::Gemm::get_workspace_size(args) != 0) {
        return cudaErrorInvalidValue;
      }
      if (cache.size() >= 1024) cache.clear();  // bounded: shapes come from a few buckets
      it = cache.emplace(key, G::Kernel::to_underlying_arguments(args, nullptr)).first;
    }
    params = it->second;
  }
  if (G::Gemm::run(params, stream) != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    return e != cudaSuccess ? e : cudaErrorLaunchFailure;
  }
  return cudaPeekAtLastError();
}

}  // namespace

bool GemmBiasSiluAvailable() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // The sm_90a image is in the build only when 90a is among the architectures; other images of
  // this kernel are empty (CUTLASS guards the sm90 code by __CUDA_ARCH_FEAT_SM90_ALL).
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, cutlass::device_kernel<Cooperative128x256::Kernel>) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0 && attr.binaryVersion == 90;
}

cudaError_t LaunchGemmBiasSilu(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* bias,
                               __nv_bfloat16* c, int64_t m, int64_t n, int64_t k, int config,
                               const PageStoreArgs& pages, cudaStream_t stream) {
  constexpr int64_t kMax = 0x7fffffff;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (a == nullptr || b == nullptr || bias == nullptr || c == nullptr || m < 0 || n <= 0 ||
      k <= 0 || m > kMax || n > kMax || k > kMax || n % 8 != 0 || k % 8 != 0 || !aligned(a) ||
      !aligned(b) || !aligned(bias) || !aligned(c) || config < 0 ||
      config >= kGemmBiasSiluConfigs ||
      (pages.pool != nullptr &&
       (pages.row_slot == nullptr || pages.hd <= 0 || n != 4 * pages.hd || pages.kv_stride < 0))) {
    return cudaErrorInvalidValue;
  }
  if (m == 0) return cudaSuccess;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const Key key{config, device, a, b, bias, c, m, n, k, pages.pool, pages.row_slot,
                pages.kv_stride, pages.hd};
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  return config == 0
             ? Run<Cooperative128x256>(key, a, b, bias, c, mi, ni, ki, pages, device, stream)
             : Run<Pingpong128x128>(key, a, b, bias, c, mi, ni, ki, pages, device, stream);
}

#else  // no CUTLASS headers at build time

bool GemmBiasSiluAvailable() { return false; }

cudaError_t LaunchGemmBiasSilu(const __nv_bfloat16*, const __nv_bfloat16*, const float*,
                               __nv_bfloat16*, int64_t, int64_t, int64_t, int,
                               const PageStoreArgs&, cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace hstu::cuda
