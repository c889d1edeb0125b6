// Free list over page ids [0, num_pages). Holds no memory: the backend's pool maps ids to bytes.
// Not thread-safe; owned by CacheManager.
#pragma once

#include <cstdint>
#include <vector>

namespace hstu {

class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);
  int64_t num_pages() const { return num_pages_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  // Appends `n` page ids to `out`; returns false (and takes nothing) when fewer than n are free.
  bool Allocate(int64_t n, std::vector<int32_t>* out);
  // Returns pages; a double free or an id out of range aborts (a broken invariant).
  void Free(const int32_t* ids, int64_t n);
  // Takes back pages that are free (an undo of Free; a page freed last is found at once, taken in
  // the reverse of Free's order); an id in use or out of range aborts.
  void Retake(const int32_t* ids, int64_t n);

 private:
  int64_t num_pages_;
  std::vector<int32_t> free_;
  std::vector<uint8_t> in_use_;
};

}  // namespace hstu
