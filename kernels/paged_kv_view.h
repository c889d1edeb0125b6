// The one paged-KV contract that CPU and CUDA code both walk (DESIGN §5, §6).
//
// A pool of one layer is `num_pages` pages, each page laid out as [2 (K, V), page_size, H, D] in the
// element type T (float on the CPU backend, bf16 on CUDA). Page `p` starts at
// `base + p * page_stride` elements; its K block comes first, its V block `kv_stride` elements later.
//
// Per user b of a batch, `page_ids[indptr[b] .. indptr[b+1])` lists its pages in token order; token t
// of user b lives in page `page_ids[indptr[b] + t / page_size]`, slot `t % page_size`.
// `num_tokens[b]` is how many history tokens of user b are valid in the pages (cached + appended);
// slots past them hold no token (a kernel may write them while the user owns the page).
//
// The view holds pointers only while a batch runs; KV metadata in kvcache/ never does.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HSTU_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HSTU_HOST_DEVICE inline
#endif

namespace hstu {

template <typename T>
struct PagedKvView {
  T* base = nullptr;              // pool of one layer: [num_pages, 2, page_size, H, D]
  int64_t page_stride = 0;        // elements between consecutive pages (= 2 * page_size * H * D)
  int64_t kv_stride = 0;          // elements from a page's K block to its V block (= page_size * H * D)
  int32_t page_size = 0;          // tokens per page, a power of two is not required here
  int32_t num_heads = 0;          // H
  int32_t head_dim = 0;           // D
  int32_t batch_size = 0;         // B
  const int32_t* indptr = nullptr;      // [B + 1], CSR offsets into page_ids
  const int32_t* page_ids = nullptr;    // [indptr[B]]
  const int32_t* num_tokens = nullptr;  // [B], valid history tokens per user

  // Element offset of (page slot of token `t` of user `b`, head `h`) in the K block; V is + kv_stride.
  HSTU_HOST_DEVICE int64_t TokenOffset(int b, int t, int h) const {
    return SlotOffset(page_ids[indptr[b] + t / page_size], t, h);
  }
  // The same from the page id already looked up (page_ids[indptr[b] + t / page_size]).
  HSTU_HOST_DEVICE int64_t SlotOffset(int32_t page, int t, int h) const {
    const int32_t slot = t % page_size;
    return page * page_stride + (static_cast<int64_t>(slot) * num_heads + h) * head_dim;
  }
  HSTU_HOST_DEVICE T* K(int b, int t, int h) const { return base + TokenOffset(b, t, h); }
  HSTU_HOST_DEVICE T* V(int b, int t, int h) const { return base + TokenOffset(b, t, h) + kv_stride; }
};

// The view of a pool of one layer in the standard layout [num_pages, 2, page_size, H, D] over a
// batch's page table (every backend, test and benchmark builds its views through this).
template <typename T>
inline PagedKvView<T> MakePagedKvView(T* base, int32_t page_size, int32_t num_heads,
                                      int32_t head_dim, int32_t batch_size, const int32_t* indptr,
                                      const int32_t* page_ids, const int32_t* num_tokens) {
  PagedKvView<T> v;
  v.base = base;
  v.kv_stride = static_cast<int64_t>(page_size) * num_heads * head_dim;
  v.page_stride = 2 * v.kv_stride;
  v.page_size = page_size;
  v.num_heads = num_heads;
  v.head_dim = head_dim;
  v.batch_size = batch_size;
  v.indptr = indptr;
  v.page_ids = page_ids;
  v.num_tokens = num_tokens;
  return v;
}

}  // namespace hstu
