// Small device helpers shared by the CUDA kernels: bf16 packing, 16-byte vectors, cp.async, mma.sync.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace hstu::cuda {

using bf16 = __nv_bfloat16;

// Programmatic dependent launch (sm_90+; no-ops before). A kernel launched by LaunchDependent may
// start while the kernel before it on the stream is still running: it must call
// WaitForPredecessor before it reads anything earlier work wrote (or writes anything earlier work
// reads), and it lets the kernel after it start early with AllowDependents (whose blocks then wait
// in their own WaitForPredecessor until this grid has finished and its writes are visible). A
// block that returns without reading what earlier kernels wrote and without writing may skip the
// wait: the wait of a kernel after it still covers every earlier grid (tests/gpu/pdl_test.cu
// checks it on the device), which the split reduction relies on.
__device__ __forceinline__ void WaitForPredecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void AllowDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches `kernel` with programmatic stream serialization: it may begin while the previous kernel
// on `stream` runs (see WaitForPredecessor). Every kernel launched this way must wait first thing.
// cluster_x > 0 launches it in thread block clusters of (cluster_x, 1, 1) (grid.x a multiple).
template <typename... Params, typename... Args>
cudaError_t LaunchDependentCluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                   unsigned cluster_x, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster_x;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = cluster_x > 0 ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, Args&&... args) {
  return LaunchDependentCluster(kernel, grid, block, smem, 0, stream, std::forward<Args>(args)...);
}

// 8 bf16 values moved as one 16-byte access. The copies are spelled out: __nv_bfloat162's own
// copy made a Bf16x8 load or store from global memory four 4-byte accesses (on an H200 the output
// LayerNorm · u moved 2.7 TB/s where the LayerNorm of the same bytes moved 3.8; round 34).
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];

  Bf16x8() = default;
  __host__ __device__ __forceinline__ Bf16x8(const Bf16x8& o) { Copy(o); }
  __host__ __device__ __forceinline__ Bf16x8& operator=(const Bf16x8& o) {
    Copy(o);
    return *this;
  }

 private:
  __host__ __device__ __forceinline__ void Copy(const Bf16x8& o) {
    *reinterpret_cast<uint4*>(h) = *reinterpret_cast<const uint4*>(o.h);
  }
};

__device__ __forceinline__ void Unpack8(const Bf16x8& v, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(v.h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// 8 bf16 values of read-only data (16-byte aligned) through the non-coherent cache, kept packed.
__device__ __forceinline__ Bf16x8 Ldg8(const bf16* p) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  Bf16x8 v;
  memcpy(&v, &u, sizeof(v));
  return v;
}

// acc + a·b over 8 bf16 pairs in fp32, element 2i + 1 then 2i of each pair.
__device__ __forceinline__ float Dot8(const Bf16x8& a, const Bf16x8& b, float acc) {
  float fa[8], fb[8];
  Unpack8(a, fa);
  Unpack8(b, fb);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc = fmaf(fa[2 * i], fb[2 * i], fmaf(fa[2 * i + 1], fb[2 * i + 1], acc));
  return acc;
}

__device__ __forceinline__ Bf16x8 Pack8(const float (&f)[8]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// 8 consecutive elements (16-byte aligned) to fp32 registers, and 8 fp32 back to memory.
__device__ __forceinline__ void Load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void Load8(const bf16* p, float (&v)[8]) {
  Unpack8(*reinterpret_cast<const Bf16x8*>(p), v);
}
__device__ __forceinline__ void Store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 16-byte alignment, which every vectorised kernel needs of its row pointers (launchers check it).
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__device__ __forceinline__ float Silu(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// Sum over the 32 lanes of a warp (butterfly: every lane gets the same total). Call from all lanes.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024). `scratch` holds 32 floats.
// Every thread gets the total. Contains __syncthreads: call from all threads.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  v = WarpSum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x >> 5;
  v = lane < num_warps ? scratch[lane] : 0.f;
  return WarpSum(v);
}

// ---- Asynchronous copies (sm_80+) ------------------------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes global → shared, or writes 16 zero bytes when `valid` is false (src is not read).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- Tensor cores: mma.sync m16n8k16, bf16 inputs, fp32 accumulators --------------------------------

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}

// c[16x8] += a[16x16] · b[16x8]; fragment layouts as in the PTX ISA (mma.m16n8k16 .row.col).
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace hstu::cuda
