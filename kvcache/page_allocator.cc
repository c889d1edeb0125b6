#include "kvcache/page_allocator.h"

#include <cstdio>
#include <cstdlib>

namespace hstu {

PageAllocator::PageAllocator(int64_t num_pages) : num_pages_(num_pages), in_use_(num_pages, 0) {
  free_.reserve(num_pages);
  // Highest ids first so that pages are handed out in increasing order (easier to read in tests).
  for (int64_t i = num_pages - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

bool PageAllocator::Allocate(int64_t n, std::vector<int32_t>* out) {
  if (n > num_free()) return false;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = free_.back();
    free_.pop_back();
    in_use_[id] = 1;
    out->push_back(id);
  }
  return true;
}

void PageAllocator::Retake(const int32_t* ids, int64_t n) {
  for (int64_t i = n - 1; i >= 0; --i) {  // the reverse of Free's order
    const int32_t id = ids[i];
    if (id < 0 || id >= num_pages_ || in_use_[id]) {
      std::fprintf(stderr, "PageAllocator: retake of page %d that is not free\n", id);
      std::abort();
    }
    auto it = free_.end() - 1;
    while (*it != id) --it;  // found: in_use_ says it is free
    *it = free_.back();
    free_.pop_back();
    in_use_[id] = 1;
  }
}

void PageAllocator::Free(const int32_t* ids, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= num_pages_ || !in_use_[id]) {
      std::fprintf(stderr, "PageAllocator: free of page %d that is not in use\n", id);
      std::abort();
    }
    in_use_[id] = 0;
    free_.push_back(id);
  }
}

}  // namespace hstu
