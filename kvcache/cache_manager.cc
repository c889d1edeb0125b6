#include "kvcache/cache_manager.h"

#include <algorithm>
#include <bit>
#include <optional>

#include "absl/strings/str_cat.h"

namespace hstu {
namespace {

constexpr uint64_t kHashSeed = 0x6a09e667f3bcc908ull;

inline uint64_t Mix(uint64_t h, uint64_t v) {
  // One round of a 64-bit multiply-xorshift (wyhash-style); good enough to make accidental
  // collisions between histories of one user negligible.
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 32);
}

// One step of a hash lane: a bijection of the lane for a fixed key and of the key for a fixed
// lane, so two pages that differ in one key always leave that key's lane, and the fold, different.
inline uint64_t LaneStep(uint64_t lane, uint64_t key) {
  return std::rotl((lane ^ key) * 0x9fb21c651e98df25ull, 29);
}

// A page's hash is Mix(previous page's hash, its content hash), and the content hash does not
// depend on the previous page: the chain costs one Mix a page and the CPU overlaps the pages'
// content hashes. The content hash runs eight lanes (key i to lane i % 8, count in lane 0's seed),
// each step three instructions, so the multiplier stays busy: ~1 cycle a key, against ~2.8 for
// a Mix per key chained across pages.
uint64_t HashPage(uint64_t prev, const uint64_t* keys, int64_t count) {
  constexpr int kLanes = 8;
  uint64_t lane[kLanes];
  for (int j = 0; j < kLanes; ++j) lane[j] = 0x243f6a8885a308d3ull * (2 * j + 1);
  lane[0] ^= static_cast<uint64_t>(count);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lane[j] = LaneStep(lane[j], keys[i + j]);
  }
  for (int j = 0; i < count; ++i, ++j) lane[j] = LaneStep(lane[j], keys[i]);
  uint64_t content = lane[0];
  for (int j = 1; j < kLanes; ++j) content = LaneStep(content, lane[j]);
  return Mix(prev, content);
}

// Folds HashPage over keys from page `first_page` on, starting from h (the chain hash before that
// page; the last page may be partial), appending each full page's hash to *full_pages when given.
// Returns the hash after the last key: from the seed and page 0, PrefixHash(keys).
uint64_t ChainFrom(uint64_t h, absl::Span<const uint64_t> keys, size_t first_page,
                   int32_t page_size, std::vector<uint64_t>* full_pages) {
  for (size_t start = first_page * page_size; start < keys.size(); start += page_size) {
    const int64_t count = std::min<int64_t>(page_size, static_cast<int64_t>(keys.size() - start));
    h = HashPage(h, keys.data() + start, count);
    if (full_pages != nullptr && count == page_size) full_pages->push_back(h);
  }
  return h;
}

// How many of the first `limit` keys of `a` and `b` are equal, counted from the first: the exact
// check behind every hash match (a 64-bit hash can be collided on purpose, and a crafted history
// must not be served from another history's K/V, DESIGN §4).
size_t CommonPrefix(absl::Span<const uint64_t> a, absl::Span<const uint64_t> b, size_t limit) {
  limit = std::min({limit, a.size(), b.size()});
  return static_cast<size_t>(std::mismatch(a.begin(), a.begin() + limit, b.begin()).first -
                             a.begin());
}

// Frees the pages of ids[from, end) that are not dead.
void FreeLive(PageAllocator& a, const std::vector<int32_t>& ids, size_t from = 0) {
  for (size_t i = from; i < ids.size(); ++i) {
    if (ids[i] != kDeadPage) a.Free(&ids[i], 1);
  }
}

// Takes back the pages of ids[from, end) that are not dead: an undo of FreeLive(a, ids, from).
void RetakeLive(PageAllocator& a, const std::vector<int32_t>& ids, size_t from) {
  for (size_t i = ids.size(); i > from; --i) {  // last freed first: each is at the free list's back
    if (ids[i - 1] != kDeadPage) a.Retake(&ids[i - 1], 1);
  }
}

// Pages of a list that hold memory (its dead slots excluded).
int64_t LivePages(const std::vector<int32_t>& ids, int32_t dead_pages) {
  return static_cast<int64_t>(ids.size()) -
         std::min<int64_t>(static_cast<int64_t>(ids.size()), dead_pages);
}

}  // namespace

const char* LookupResultName(LookupResult r) {
  switch (r) {
    case LookupResult::kHit: return "gpu_hit";
    case LookupResult::kHostHit: return "host_hit";
    case LookupResult::kPartial: return "partial";
    case LookupResult::kMiss: return "miss";
    case LookupResult::kMismatch: return "hash_mismatch";
    case LookupResult::kDisabled: return "disabled";
    case LookupResult::kHostRecompute: return "host_recompute";
    default: return "unknown";
  }
}

std::vector<uint64_t> PageChainHashes(absl::Span<const uint64_t> keys, int32_t page_size) {
  std::vector<uint64_t> out;
  out.reserve(keys.size() / page_size);
  ChainFrom(kHashSeed, keys.subspan(0, keys.size() / page_size * page_size), 0, page_size, &out);
  return out;
}

uint64_t PrefixHash(absl::Span<const uint64_t> keys, int32_t page_size) {
  return ChainFrom(kHashSeed, keys, 0, page_size, nullptr);
}

CacheManager::CacheManager(int32_t page_size, int64_t num_pages, int64_t host_num_pages,
                           int64_t max_inflight_pages, int32_t window_tokens)
    : page_size_(page_size), window_(std::max(0, window_tokens)), allocator_(num_pages),
      host_allocator_(host_num_pages),
      max_inflight_pages_(max_inflight_pages > 0 ? max_inflight_pages : host_num_pages) {
  stats_.page_size = page_size;
}

void CacheManager::TouchLocked(Entry& e, uint64_t user_id) {
  lru_.erase(e.lru_it);
  lru_.push_front(user_id);
  e.lru_it = lru_.begin();
}

bool CacheManager::WindowAllows(const Entry& e, size_t pages) const {
  // The first new query is at P = pages * page_size and reads keys from the block holding P − W.
  if (e.dead_pages == 0) return true;
  const int64_t first_key = static_cast<int64_t>(pages) * page_size_ - window_;
  return first_key >= 0 && first_key / kWindowKeyBlock * kWindowKeyBlock >=
                               static_cast<int64_t>(e.dead_pages) * page_size_;
}

void CacheManager::ReleaseBehindWindowLocked(Entry& e) {
  // Not while an offload reads the entry's GPU pages or writes its host pages.
  if (window_ == 0 || e.inflight_pages > 0) return;
  const int64_t edge =
      (static_cast<int64_t>(e.num_tokens) - window_ - WindowSlackTokens()) / page_size_;
  const int32_t dead = static_cast<int32_t>(
      std::min<int64_t>(std::max<int64_t>(edge, 0), static_cast<int64_t>(e.page_ids.size())));
  for (int32_t i = e.dead_pages; i < dead; ++i) {
    if (e.page_ids[i] != kDeadPage) {
      allocator_.Free(&e.page_ids[i], 1);
      e.page_ids[i] = kDeadPage;
      ++stats_.window_pages_released;
    }
    if (static_cast<size_t>(i) < e.host_page_ids.size() && e.host_page_ids[i] != kDeadPage) {
      host_allocator_.Free(&e.host_page_ids[i], 1);
      e.host_page_ids[i] = kDeadPage;
    }
  }
  e.dead_pages = std::max(e.dead_pages, dead);
}

void CacheManager::DropLocked(uint64_t user_id) {
  auto it = entries_.find(user_id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  FreeLive(allocator_, e.page_ids);
  FreeLive(host_allocator_, e.host_page_ids);
  lru_.erase(e.lru_it);
  entries_.erase(it);
}

void CacheManager::TruncateLocked(Entry& e, size_t full_pages) {
  // A prefix whose new queries would read dead pages is no prefix at all. (Never so for an entry
  // with an offload in flight, which callers truncate to at least its host copies: those extend
  // past the dead pages by more than the window.)
  if (!WindowAllows(e, full_pages)) full_pages = 0;
  if (e.page_ids.size() > full_pages) {
    FreeLive(allocator_, e.page_ids, full_pages);
    e.page_ids.resize(full_pages);
  }
  if (e.host_page_ids.size() > full_pages) {
    FreeLive(host_allocator_, e.host_page_ids, full_pages);
    e.host_page_ids.resize(full_pages);
  }
  e.dead_pages = std::min(e.dead_pages, static_cast<int32_t>(full_pages));
  if (full_pages == 0) e.dead_pages = 0;
  e.page_hashes.resize(std::min(e.page_hashes.size(), full_pages));
  e.num_tokens = static_cast<int32_t>(e.page_hashes.size()) * page_size_;
  e.keys.resize(e.num_tokens);
  e.prefix_hash = e.page_hashes.empty() ? PrefixHash({}, page_size_) : e.page_hashes.back();
}

bool CacheManager::KeepOnlyHostCopyLocked(Entry& e) {
  if (LivePages(e.host_page_ids, e.dead_pages) == 0) return false;
  // The host copy covers the full pages; a partial last page is recomputed on the next visit.
  FreeLive(allocator_, e.page_ids);
  e.page_ids.clear();
  TruncateLocked(e, e.host_page_ids.size());
  return e.num_tokens > 0;  // else the window left nothing the host copy could serve
}

void CacheManager::EvictFromGpuLocked(uint64_t user_id) {
  ++stats_.evictions;
  if (!KeepOnlyHostCopyLocked(entries_.at(user_id))) {
    DropLocked(user_id);
    ++stats_.dropped_entries;
  }
}

bool CacheManager::GpuEvictable(uint64_t victim, const Entry& e, uint64_t user_id) {
  return !e.pinned && victim != user_id && !e.page_ids.empty() && e.inflight_pages == 0 &&
         !e.prefetch_pending;
}

bool CacheManager::AllocateLocked(uint64_t user_id, int64_t n, std::vector<int32_t>* out) {
  if (n <= allocator_.num_free()) return allocator_.Allocate(n, out);
  // Evict only when eviction can succeed, so a request that cannot fit costs nobody their cache:
  // pick the victims, least recently used first, and count what they free before evicting any.
  // (Counted, not derived from the pinned / in-flight totals, which overlap: a pinned user may
  // have an offload in flight.)
  std::vector<uint64_t> victims;
  int64_t could_free = allocator_.num_free();
  for (auto it = lru_.rbegin(); could_free < n && it != lru_.rend(); ++it) {
    const Entry& e = entries_.at(*it);
    if (!GpuEvictable(*it, e, user_id)) continue;
    victims.push_back(*it);
    could_free += LivePages(e.page_ids, e.dead_pages);
  }
  if (could_free < n) return false;
  for (const uint64_t victim : victims) EvictFromGpuLocked(victim);
  return allocator_.Allocate(n, out);
}

bool CacheManager::AllocateHostLocked(uint64_t user_id, int64_t n, std::vector<int32_t>* out) {
  if (n <= host_allocator_.num_free()) return host_allocator_.Allocate(n, out);
  int64_t evictable = 0;
  for (const auto& [user, e] : entries_) {
    if (!e.pinned && user != user_id && e.inflight_pages == 0 && !e.prefetch_pending) {
      evictable += LivePages(e.host_page_ids, e.dead_pages);
    }
  }
  if (host_allocator_.num_free() + evictable < n) return false;
  auto it = lru_.end();
  while (host_allocator_.num_free() < n && it != lru_.begin()) {
    --it;
    const uint64_t victim = *it;
    Entry& e = entries_.at(victim);
    if (e.pinned || victim == user_id || LivePages(e.host_page_ids, e.dead_pages) == 0 ||
        e.inflight_pages > 0 || e.prefetch_pending) {
      continue;  // a prefetch may still be reading these host pages
    }
    const auto after = std::next(it);
    ++stats_.host_evictions;
    if (e.page_ids.empty()) {
      DropLocked(victim);  // host-only: nothing of the entry is left
      ++stats_.dropped_entries;
    } else {
      FreeLive(host_allocator_, e.host_page_ids);
      e.host_page_ids.clear();
    }
    it = after;
  }
  return host_allocator_.Allocate(n, out);
}

absl::StatusOr<Reservation> CacheManager::Acquire(uint64_t user_id, absl::Span<const uint64_t> keys,
                                                  const OnloadFilter& onload_ok) {
  // Hashed before the lock: the only pass over the keys (Commit reuses the page hashes).
  std::vector<uint64_t> page_hashes = PageChainHashes(keys, page_size_);
  std::lock_guard<std::mutex> lock(mu_);
  Reservation r;
  r.user_id = user_id;
  r.total_tokens = static_cast<int32_t>(keys.size());
  // PrefixHash(keys[0, n)) from the page hashes: only a partial last page is hashed here.
  auto prefix_hash = [&](size_t n) {
    const size_t full = n / page_size_;
    return ChainFrom(full == 0 ? kHashSeed : page_hashes[full - 1], keys.subspan(0, n), full,
                     page_size_, nullptr);
  };
  auto [it, inserted] = entries_.try_emplace(user_id);
  Entry& e = it->second;
  std::optional<Entry> before_cut;  // a mismatched entry as it was before its stale pages went
  size_t cut_gpu_from = 0, cut_host_from = 0;  // the pages [from, end) of before_cut's lists
  const bool host_only = !inserted && e.page_ids.empty() && e.num_tokens > 0;
  const bool from_host = host_only || (!inserted && e.from_host && e.num_tokens > 0);
  r.new_entry = inserted;
  if (inserted) {
    lru_.push_front(user_id);
    e.lru_it = lru_.begin();
    e.prefix_hash = PrefixHash({}, page_size_);
    r.result = LookupResult::kMiss;
  } else if (e.pinned) {
    return absl::FailedPreconditionError(
        absl::StrCat("user ", user_id, " already has a request in flight"));
  } else {
    // Whether the request's history extends everything the entry holds: the hashes say so, and
    // the keys confirm it.
    const size_t held = static_cast<size_t>(e.num_tokens);
    const bool extends = held <= keys.size() && prefix_hash(held) == e.prefix_hash &&
                         CommonPrefix(keys, e.keys, held) == held;
    if (e.inflight_pages > 0 && !extends) {
      // Reusing less than the entry holds would free pages that the offload still reads.
      return absl::UnavailableError(absl::StrCat("user ", user_id,
                                                 " changed while its offload is in flight; retry "
                                                 "after OffloadsComplete()"));
    }
    if (e.prefetch_pending && !extends) {
      // Reusing less than was prefetched would free pages that a copy may still be writing.
      return absl::UnavailableError(
          absl::StrCat("user ", user_id, " changed while its prefetch is in flight; retry after "
                       "PrefetchesComplete()"));
    }
    if (extends) {
      r.reused_tokens = e.num_tokens;
      r.result = e.num_tokens == 0 ? LookupResult::kMiss
                 : from_host       ? LookupResult::kHostHit
                                   : LookupResult::kHit;
    } else {
      // Longest page-aligned prefix whose chain still matches; the rest of the entry is stale.
      const size_t cmp_pages = std::min(page_hashes.size(), e.page_hashes.size());
      size_t k = 0;
      while (k < cmp_pages && page_hashes[k] == e.page_hashes[k]) ++k;
      k = CommonPrefix(keys, e.keys, k * page_size_) / page_size_;  // the keys confirm the chain
      // Undone if the request cannot get its pages: the stale part may be what the user's next
      // visit (an older history resent, say) reuses.
      before_cut = e;
      TruncateLocked(e, k);  // to nothing when the window has released what k pages need
      cut_gpu_from = e.page_ids.size();
      cut_host_from = e.host_page_ids.size();
      r.reused_tokens = e.num_tokens;
      r.result = e.num_tokens == 0 ? LookupResult::kMismatch
                 : from_host       ? LookupResult::kHostHit
                                   : LookupResult::kPartial;
    }
  }
  const bool prefetch_pending = e.prefetch_pending;
  if (e.prefetch_pending) {
    r.prefetched = true;
    e.prefetch_pending = false;
  }
  e.from_host = false;
  e.pinned = true;
  TouchLocked(e, user_id);
  // A host-only entry with dead pages: onloaded, its dead slots stay dead; recomputed from token
  // 0, it needs every page, so its host copy goes (the commit offloads the recomputed pages).
  bool declined = false;
  if (host_only && e.dead_pages > 0 && r.reused_tokens > 0) {
    const int64_t live = r.reused_tokens / page_size_ - e.dead_pages;
    if (onload_ok && !onload_ok(live, r.reused_tokens)) {
      // The host copy goes once the recompute, which rewrites every page, has its pages (below):
      // a request that cannot fit costs nobody their cache, its own user included.
      r.reused_tokens = 0;
      r.result = LookupResult::kHostRecompute;
      declined = true;
    } else {
      e.page_ids.assign(e.dead_pages, kDeadPage);
    }
  }
  const int64_t pages_needed = PagesFor(static_cast<int64_t>(keys.size()), page_size_);
  const int64_t missing = pages_needed - static_cast<int64_t>(e.page_ids.size());
  // This entry's own pages are pinned now but not yet in pinned_pages_: count them for the check.
  pinned_pages_ += LivePages(e.page_ids, e.dead_pages);
  if (missing > 0 && !AllocateLocked(user_id, missing, &e.page_ids)) {
    // A request that cannot fit costs nobody their cache, its own user included.
    pinned_pages_ -= LivePages(e.page_ids, e.dead_pages);
    if (before_cut) {
      // The cut's pages are still free (AllocateLocked took and evicted nothing): take them back.
      RetakeLive(allocator_, before_cut->page_ids, cut_gpu_from);
      RetakeLive(host_allocator_, before_cut->host_page_ids, cut_host_from);
      const auto lru_it = e.lru_it;  // TouchLocked moved the user's LRU node
      e = *std::move(before_cut);     // unpinned, its flags as they were
      e.lru_it = lru_it;
    } else {
      e.pinned = false;
      e.from_host = from_host;                // the retry's lookup is still a host hit,
      e.prefetch_pending = prefetch_pending;  // and its pages may still be being copied
      if (host_only) e.page_ids.clear();      // still on the host only
      if (e.num_tokens == 0) DropLocked(user_id);
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache pool too small: user ", user_id, " needs ", pages_needed, " pages of ", page_size_,
        " tokens, the pool has ", allocator_.num_pages(), " pages and ", pinned_pages_,
        " are pinned by requests in flight"));
  }
  pinned_pages_ += std::max<int64_t>(missing, 0);
  if (declined) {
    std::vector<int32_t> fresh = std::move(e.page_ids);
    e.page_ids.clear();
    TruncateLocked(e, 0);
    e.page_ids = std::move(fresh);
  }
  if (host_only && !declined) {
    // Host-only entries hold whole pages, so the reused tokens are exactly the first pages (of
    // which the dead ones are neither copied nor read).
    const size_t n = static_cast<size_t>(r.reused_tokens / page_size_);
    const size_t first = static_cast<size_t>(e.dead_pages);
    if (first == 0 && n > 0 && onload_ok &&
        !onload_ok(static_cast<int64_t>(n), static_cast<int64_t>(n) * page_size_)) {
      // Recomputed from token 0 into the new GPU pages. The entry's metadata still describes its
      // host pages [0, n), which hold the K/V of these same keys: Commit keeps them as the host
      // copy and offloads only the pages beyond.
      r.reused_tokens = 0;
      r.result = LookupResult::kHostRecompute;
    } else {
      r.onload.src.assign(e.host_page_ids.begin() + first, e.host_page_ids.begin() + n);
      r.onload.dst.assign(e.page_ids.begin() + first, e.page_ids.begin() + n);
      stats_.pages_onloaded += n - first;
    }
  }
  ++stats_.lookups[static_cast<int>(r.result)];
  stats_.tokens_reused += r.reused_tokens;
  stats_.tokens_computed += keys.size() - r.reused_tokens;
  r.page_ids = e.page_ids;
  r.dead_pages = e.dead_pages;
  r.pinned_pages = LivePages(e.page_ids, e.dead_pages);
  r.page_hashes = std::move(page_hashes);
  return r;
}

absl::StatusOr<Reservation> CacheManager::AcquireTemporary(uint64_t user_id, int32_t num_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  Reservation r;
  r.user_id = user_id;
  r.temporary = true;
  r.total_tokens = num_tokens;
  r.result = LookupResult::kDisabled;
  const int64_t pages_needed = PagesFor(num_tokens, page_size_);
  if (!AllocateLocked(user_id, pages_needed, &r.page_ids)) {
    return absl::ResourceExhaustedError(absl::StrCat("KV page pool too small: ", num_tokens,
                                                     " tokens need ", pages_needed, " pages of ",
                                                     page_size_, ", the pool has ",
                                                     allocator_.num_pages()));
  }
  pinned_pages_ += pages_needed;
  r.pinned_pages = pages_needed;
  ++stats_.lookups[static_cast<int>(LookupResult::kDisabled)];
  stats_.tokens_computed += num_tokens;
  return r;
}

PageCopies CacheManager::Commit(const Reservation& r, absl::Span<const uint64_t> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  pinned_pages_ -= r.pinned_pages;
  PageCopies offload;
  if (r.temporary) {
    allocator_.Free(r.page_ids.data(), static_cast<int64_t>(r.page_ids.size()));
    return offload;
  }
  Entry& e = entries_.at(r.user_id);
  if (keys.empty() && e.inflight_pages == 0) {
    // Nothing to reuse (a user with no history yet): keeping the entry would only grow the map,
    // since an entry without pages is never evicted.
    DropLocked(r.user_id);
    return offload;
  }
  e.num_tokens = static_cast<int32_t>(keys.size());
  e.keys.assign(keys.begin(), keys.end());
  // Acquire hashed the request's full pages (the reused ones matched the entry's); only keys
  // other than the acquired ones are hashed again.
  e.page_hashes = r.page_hashes.size() == keys.size() / page_size_
                      ? r.page_hashes
                      : PageChainHashes(keys, page_size_);
  e.prefix_hash = ChainFrom(e.page_hashes.empty() ? kHashSeed : e.page_hashes.back(), keys,
                            e.page_hashes.size(), page_size_, nullptr);
  TouchLocked(e, r.user_id);
  ReleaseBehindWindowLocked(e);
  // Write-behind: new full pages get host copies (while still pinned, so eviction for host room
  // never picks this entry). Dead pages get none.
  if (e.host_page_ids.size() < static_cast<size_t>(e.dead_pages)) {
    e.host_page_ids.resize(e.dead_pages, kDeadPage);
  }
  const size_t full = e.page_hashes.size(), have = e.host_page_ids.size();
  const int64_t want = static_cast<int64_t>(full) - static_cast<int64_t>(have);
  if (host_allocator_.num_pages() > 0 && want > 0) {
    std::vector<int32_t> fresh;
    if (inflight_pages_ + want > max_inflight_pages_) {
      stats_.offloads_skipped += static_cast<uint64_t>(want);  // a later commit picks them up
    } else if (AllocateHostLocked(r.user_id, want, &fresh)) {
      offload.src.assign(e.page_ids.begin() + have, e.page_ids.begin() + full);
      offload.dst = fresh;
      e.host_page_ids.insert(e.host_page_ids.end(), fresh.begin(), fresh.end());
      // The entry may already have an offload in flight (its user came back before it completed).
      if (e.inflight_pages == 0) inflight_users_.push_back(r.user_id);
      e.inflight_pages += static_cast<int32_t>(want);
      inflight_pages_ += want;
      stats_.pages_offloaded += fresh.size();
    }
  }
  e.pinned = false;
  return offload;
}

void CacheManager::Release(const Reservation& r) {
  std::lock_guard<std::mutex> lock(mu_);
  pinned_pages_ -= r.pinned_pages;
  if (r.temporary) {
    allocator_.Free(r.page_ids.data(), static_cast<int64_t>(r.page_ids.size()));
    return;
  }
  auto it = entries_.find(r.user_id);
  if (it != entries_.end() && it->second.inflight_pages > 0) {
    // An offload still reads the entry's full pages with host copies; the failed request wrote
    // only beyond them. Keep those, drop the rest.
    Entry& e = it->second;
    TruncateLocked(e, e.host_page_ids.size());
    e.pinned = false;
    return;
  }
  if (it == entries_.end()) return;
  Entry& e = it->second;
  e.pinned = false;
  // The failed forward may have left the GPU pages half written (its own rows, or an onload that
  // did not complete); the host copies, whose offloads completed, it never touches: keep those,
  // as an eviction would.
  if (!e.prefetch_pending && KeepOnlyHostCopyLocked(e)) return;
  DropLocked(r.user_id);
  if (!r.new_entry) ++stats_.dropped_entries;  // a new user's failed request loses nothing
}

void CacheManager::ForgetHostCopy(uint64_t user_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user_id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  if (e.inflight_pages > 0) {
    inflight_pages_ -= e.inflight_pages;
    e.inflight_pages = 0;
  }
  FreeLive(host_allocator_, e.host_page_ids);
  e.host_page_ids.clear();
  if (e.page_ids.empty()) DropLocked(user_id);
}

void CacheManager::PrefetchFailed(uint64_t user_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user_id);
  if (it == entries_.end() || it->second.pinned) return;
  if (it->second.prefetch_pending) {
    prefetch_users_.erase(std::remove(prefetch_users_.begin(), prefetch_users_.end(), user_id),
                          prefetch_users_.end());
  }
  DropLocked(user_id);
  ++stats_.dropped_entries;
}

bool CacheManager::HostOnlyIdle(const Entry& e) {
  return !e.pinned && e.page_ids.empty() && LivePages(e.host_page_ids, e.dead_pages) > 0 &&
         e.inflight_pages == 0;
}

bool CacheManager::PrefetchCandidate(uint64_t user_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user_id);
  return it != entries_.end() && HostOnlyIdle(it->second);
}

PageCopies CacheManager::Prefetch(uint64_t user_id, absl::Span<const uint64_t> keys,
                                  absl::Span<const uint64_t> keep, const OnloadFilter& onload_ok) {
  std::lock_guard<std::mutex> lock(mu_);
  PageCopies copies;
  auto it = entries_.find(user_id);
  if (it == entries_.end()) return copies;
  Entry& e = it->second;
  if (!HostOnlyIdle(e)) return copies;  // not host-only, or busy
  const size_t cmp_tokens = std::min(keys.size(), e.page_hashes.size() * page_size_);
  const std::vector<uint64_t> req = PageChainHashes(keys.subspan(0, cmp_tokens), page_size_);
  size_t k = 0;
  while (k < req.size() && k < e.host_page_ids.size() && req[k] == e.page_hashes[k]) ++k;
  k = CommonPrefix(keys, e.keys, k * page_size_) / page_size_;
  if (k <= static_cast<size_t>(e.dead_pages) || !WindowAllows(e, k)) return copies;
  const size_t first = static_cast<size_t>(e.dead_pages);
  const int64_t live = static_cast<int64_t>(k - first);
  if (onload_ok && !onload_ok(live, static_cast<int64_t>(k) * page_size_)) return copies;
  // Make room only from entries that lose nothing but a partial last page by moving to the host,
  // and only when they make enough of it: a prefetch that cannot start evicts nobody.
  std::vector<uint64_t> victims;
  int64_t room = allocator_.num_free();
  for (auto vit = lru_.rbegin(); room < live && vit != lru_.rend(); ++vit) {
    const uint64_t victim = *vit;
    const Entry& v = entries_.at(victim);
    if (victim == user_id || v.pinned || v.page_ids.empty() || v.inflight_pages > 0 ||
        v.prefetch_pending || v.host_page_ids.size() < v.page_hashes.size() ||
        std::find(keep.begin(), keep.end(), victim) != keep.end()) {
      continue;
    }
    victims.push_back(victim);
    room += LivePages(v.page_ids, v.dead_pages);
  }
  if (room < live) return copies;
  for (uint64_t victim : victims) EvictFromGpuLocked(victim);
  if (live > allocator_.num_free()) return copies;
  TruncateLocked(e, k);
  e.page_ids.assign(first, kDeadPage);
  allocator_.Allocate(live, &e.page_ids);
  copies.src.assign(e.host_page_ids.begin() + first, e.host_page_ids.begin() + k);
  copies.dst.assign(e.page_ids.begin() + first, e.page_ids.end());
  e.prefetch_pending = true;
  e.from_host = true;
  // Its request is queued: most recently used, so that the batches before it evict others first
  // (at the LRU end, where its eviction to the host had left it, the next batch's first
  // acquisitions would take the prefetched pages back once the copy is done).
  TouchLocked(e, user_id);
  prefetch_users_.push_back(user_id);
  stats_.pages_prefetched += live;
  stats_.pages_onloaded += live;
  return copies;
}

void CacheManager::PrefetchesComplete() {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t user : prefetch_users_) {
    auto it = entries_.find(user);
    if (it != entries_.end()) it->second.prefetch_pending = false;
  }
  prefetch_users_.clear();
}

bool CacheManager::prefetches_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !prefetch_users_.empty();
}

void CacheManager::OffloadsComplete() {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t user : inflight_users_) {
    auto it = entries_.find(user);
    if (it != entries_.end()) it->second.inflight_pages = 0;
  }
  inflight_users_.clear();
  inflight_pages_ = 0;
}

bool CacheManager::offloads_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !inflight_users_.empty();
}

void CacheManager::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> victims;
  for (const auto& [user, e] : entries_) {
    if (!e.pinned && e.inflight_pages == 0 && !e.prefetch_pending) victims.push_back(user);
  }
  for (uint64_t u : victims) DropLocked(u);
  stats_.dropped_entries += victims.size();
  // The entries in use stay, but not their host copies (Clear follows a failed copy: no host page
  // can be trusted), unless a copy still writes them.
  for (auto& [user, e] : entries_) {
    if (e.inflight_pages == 0 && !e.prefetch_pending) {
      FreeLive(host_allocator_, e.host_page_ids);
      e.host_page_ids.clear();
    }
  }
}

bool CacheManager::Forget(uint64_t user_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user_id);
  if (it == entries_.end()) return true;
  const Entry& e = it->second;
  if (e.pinned || e.inflight_pages > 0 || e.prefetch_pending) return false;
  DropLocked(user_id);
  return true;
}

CacheStats CacheManager::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats s = stats_;
  s.pages_total = allocator_.num_pages();
  s.pages_free = allocator_.num_free();
  s.pages_pinned = pinned_pages_;
  s.host_pages_total = host_allocator_.num_pages();
  s.host_pages_free = host_allocator_.num_free();
  s.entries = static_cast<int64_t>(entries_.size());
  return s;
}

int32_t CacheManager::CachedTokens(uint64_t user_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user_id);
  return it == entries_.end() ? 0 : it->second.num_tokens;
}

}  // namespace hstu
