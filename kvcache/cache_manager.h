// Per-user KV cache entries over a page pool (DESIGN §4, §6): hash-chain reuse rules, pinning and
// LRU eviction. Holds metadata only (page ids, hashes, counts), never memory addresses.
//
// A token is identified by a 64-bit key (kind and id, see TokenKey). Each full page has a chain hash
// covering its keys and the previous page's hash; the entry also keeps the hash of its whole prefix.
// The hashes find how much of a request's history the entry holds; the entry's keys, kept beside
// them (8 bytes a token), confirm it, so a history crafted to collide with a hash is recomputed,
// not served from the other history's K/V.
//
// Host tier (host_num_pages > 0): after a commit, the entry's new full pages get host copies
// (write-behind, PageCopies returned by Commit). An entry evicted from the GPU keeps its host copy
// (its full pages; a partial last page is recomputed) and is onloaded by its next Acquire, unless
// the caller's OnloadFilter prefers recomputing those tokens (host_recompute). When the
// host tier is full, the least recently used unpinned entries lose their host copies.
// Offloads run behind compute: an entry whose offload is in flight keeps its GPU pages (no eviction,
// no truncation) until the caller reports OffloadsComplete(). Its user's next request may still
// extend it (a GPU hit: the copy reads only full pages, which the request leaves alone, and a
// failed request keeps them), but one that would reuse less of it answers UNAVAILABLE so the
// caller can wait for its copies and retry. At most `max_inflight_pages` pages are in flight;
// beyond that, new full pages stay GPU-only until a later commit of their user.
//
// Sliding window (window_tokens W > 0, the model's max_attn_len, DESIGN §2.2): a request that
// reuses a prefix of P tokens reads keys from P − W on only, which the GPU kernels round down to
// a block of kWindowKeyBlock keys. So each commit of an entry of T tokens releases, on both tiers,
// its pages wholly before T − W − WindowSlackTokens() (kWindowSlackPages pages plus one key
// block). Those are "dead": their slots in the page lists hold kDeadPage, and nothing reads
// them again. A reuse whose block-rounded P − W falls before the live pages counts as a hash
// mismatch and recomputes the user. The slack keeps a history whose last events changed
// reusable. A user then holds about W tokens + the slack + 2 pages of each tier.
//
// Thread-safe: every method takes the manager's lock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcache/page_allocator.h"

namespace hstu {

// kHostRecompute: the user's prefix was on the host tier only, and the caller chose to recompute
// it rather than onload it (see OnloadFilter); its tokens count as computed.
enum class LookupResult : int {
  kHit = 0, kHostHit, kPartial, kMiss, kMismatch, kDisabled, kHostRecompute, kNumResults
};
// "gpu_hit", "host_hit", "partial", "miss", "hash_mismatch", "disabled", "host_recompute"
const char* LookupResultName(LookupResult r);

struct CacheStats {
  uint64_t lookups[static_cast<int>(LookupResult::kNumResults)] = {};
  uint64_t tokens_reused = 0;
  uint64_t tokens_computed = 0;
  uint64_t evictions = 0;        // entries whose GPU pages were evicted to make room
  uint64_t host_evictions = 0;   // entries whose host copies were evicted to make room
  uint64_t dropped_entries = 0;  // entries gone entirely (a failed request's, or evicted with no
                                 // copy left); not a new user's failed first request
  uint64_t pages_offloaded = 0;  // GPU → host page copies planned
  uint64_t pages_onloaded = 0;   // host → GPU page copies planned
  uint64_t offloads_skipped = 0; // full pages not offloaded at commit (copy backlog at its bound)
  uint64_t pages_prefetched = 0; // host → GPU page copies started early by Prefetch()
  uint64_t window_pages_released = 0;  // GPU pages released behind the sliding window
  int64_t pages_total = 0;
  int64_t pages_free = 0;
  int64_t pages_pinned = 0;
  int64_t host_pages_total = 0;  // 0 when the host tier is disabled
  int64_t host_pages_free = 0;
  int64_t entries = 0;
  int32_t page_size = 0;
};

// Pages of `page_size` tokens that hold `tokens` tokens.
inline int64_t PagesFor(int64_t tokens, int32_t page_size) { return (tokens + page_size - 1) / page_size; }

// Key of one history token: items and actions never collide.
inline uint64_t TokenKey(bool is_action, int64_t id) {
  return (static_cast<uint64_t>(id) << 1) | (is_action ? 1u : 0u);
}

// Page copies between the tiers that the caller must carry out (same index in src and dst).
struct PageCopies {
  std::vector<int32_t> src;
  std::vector<int32_t> dst;
  bool empty() const { return src.empty(); }
};

// Asked by Acquire and Prefetch, under the manager's lock, before they plan the onload of `pages`
// host pages of a user that lives on the host only: true to onload them, false to recompute
// instead, which recomputes `tokens` tokens (pages * page_size, or more when a sliding window
// released the pages before them: those cannot be reused without the copy either). Must not call
// back into the manager. Null: always onload.
using OnloadFilter = std::function<bool(int64_t pages, int64_t tokens)>;

// A page-list slot of a page released under the sliding window (see CacheManager).
inline constexpr int32_t kDeadPage = -1;

// One request's hold on its user's pages, between Acquire and Commit/Release.
struct Reservation {
  uint64_t user_id = 0;
  bool temporary = false;        // cache disabled: pages are freed at release
  int32_t reused_tokens = 0;     // tokens valid in the pages before this request
  int32_t total_tokens = 0;      // tokens valid after this request's append
  std::vector<int32_t> page_ids; // GPU pages, cover total_tokens
  int32_t dead_pages = 0;        // page_ids[0, dead_pages) are kDeadPage: no key there is read
  int64_t pinned_pages = 0;      // the GPU pages this reservation pins (the live ones)
  LookupResult result = LookupResult::kMiss;
  PageCopies onload;             // host → GPU copies to finish before the forward reads the pages
  bool prefetched = false;       // its pages came from a Prefetch() whose copies may be in flight
  bool new_entry = false;        // the user had no entry before this request
  // The chain hashes of the request's full pages (PageChainHashes of its keys), for Commit.
  std::vector<uint64_t> page_hashes;
};

class CacheManager {
 public:
  // Pages kept past the window's edge, so that a history whose last events changed still reuses
  // its prefix.
  static constexpr int32_t kWindowSlackPages = 2;
  // Keys the attention kernels read in one block (kernels/cuda: kAttnBlockN), from the block
  // holding a query's first key.
  static constexpr int32_t kWindowKeyBlock = 64;
  // A reuse point cut back to whole pages (up to a page and the changed events before T) then
  // loses up to a key block to the kernels' rounding: the two add up. (As their maximum, with a
  // page size that does not divide the block, a failed request's cut released pages an offload
  // was still reading, and with page size 1 an edit of the last event recomputed the user.)
  int32_t WindowSlackTokens() const { return kWindowSlackPages * page_size_ + kWindowKeyBlock; }

  CacheManager(int32_t page_size, int64_t num_pages, int64_t host_num_pages = 0,
               int64_t max_inflight_pages = 0 /* 0 = no bound below the host tier's size */,
               int32_t window_tokens = 0 /* the model's max_attn_len; 0 = no window */);
  CacheManager(const CacheManager&) = delete;
  CacheManager& operator=(const CacheManager&) = delete;

  int32_t page_size() const { return page_size_; }
  int32_t window_tokens() const { return window_; }

  // Looks up `user_id`, decides how much of `keys` (the kept history, oldest first) is cached,
  // pins the entry and makes sure it has pages for all of `keys`, evicting least recently used
  // unpinned entries. RESOURCE_EXHAUSTED when the pool cannot hold the user even after evicting;
  // FAILED_PRECONDITION if the user is already pinned (two requests of one user at once).
  // A host-only user whose onload `onload_ok` declines is served as a miss of those tokens
  // (kHostRecompute, reused_tokens 0, no copies); its host copies stay, since the request
  // recomputes the very same keys into its GPU pages, and Commit offloads only pages beyond them.
  // The keys' page hashes (computed before the lock) travel in the reservation to Commit, so each
  // key is hashed once.
  absl::StatusOr<Reservation> Acquire(uint64_t user_id, absl::Span<const uint64_t> keys,
                                      const OnloadFilter& onload_ok = nullptr);
  // Pages for `num_tokens` tokens that belong to no entry (cache disabled); freed by Release.
  absl::StatusOr<Reservation> AcquireTemporary(uint64_t user_id, int32_t num_tokens);
  // The request's pages now hold K/V for all of `keys` (the keys it was acquired with): record the
  // hashes, unpin, mark recent.
  // Returns the GPU → host copies of the entry's new full pages (empty without a host tier).
  PageCopies Commit(const Reservation& r, absl::Span<const uint64_t> keys);
  // The request failed: unpin and drop what it added (and the entry, whose pages may be partial;
  // an entry with an offload in flight keeps the full pages that have host copies, which the
  // request did not write).
  void Release(const Reservation& r);

  // Starts a host-only user's onload early (a queued request, DESIGN §6): GPU pages for the host
  // pages whose chain matches `keys`. They come from free pages, or from evicting least recently
  // used entries whose every full page already has a host copy (nothing is lost, they come back
  // the same way) and that are not in `keep` (the users of the batch about to run). Returns the
  // host → GPU copies to issue, or nothing. Until PrefetchesComplete() the entry is not evicted;
  // its next Acquire reports host_hit and marks the reservation `prefetched`. Nothing either when
  // `onload_ok` declines the copies (asked before anyone is evicted for them).
  PageCopies Prefetch(uint64_t user_id, absl::Span<const uint64_t> keys,
                      absl::Span<const uint64_t> keep = {},
                      const OnloadFilter& onload_ok = nullptr);
  // Every copy returned by Prefetch so far has completed.
  void PrefetchesComplete();
  bool prefetches_pending() const;
  // A planned offload failed: the user's host copies are not valid, forget them.
  void ForgetHostCopy(uint64_t user_id);
  // A Prefetch copy for the user failed (call once no copy is in flight): its GPU pages hold
  // nothing valid, so the entry goes and the user's next visit is recomputed.
  void PrefetchFailed(uint64_t user_id);
  // Every offload returned by Commit so far has completed.
  void OffloadsComplete();
  bool offloads_in_flight() const;
  void Clear();  // drops every unpinned entry, and the host copies of the others
  // Drops one user's entry (and its host copy) unless a request or a copy still uses it; true
  // when the user has no entry now. Not counted as dropped: nothing was lost to pressure.
  bool Forget(uint64_t user_id);
  CacheStats Stats() const;
  // Number of cached tokens of a user (0 when absent); for tests and tools.
  int32_t CachedTokens(uint64_t user_id) const;
  // Whether Prefetch could start copies for the user now: an entry on the host tier only, not
  // busy. A cheap check before building the request's keys.
  bool PrefetchCandidate(uint64_t user_id) const;

 private:
  struct Entry {
    int32_t num_tokens = 0;
    std::vector<int32_t> page_ids;      // GPU pages; empty when the entry lives on the host only
    std::vector<int32_t> host_page_ids; // host copies of full pages [0, size)
    std::vector<uint64_t> page_hashes;  // one per full page
    int32_t dead_pages = 0;             // pages [0, dead_pages) released behind the window
    uint64_t prefix_hash = 0;           // over all num_tokens keys
    std::vector<uint64_t> keys;         // the num_tokens keys, which confirm every hash match
    bool pinned = false;
    int32_t inflight_pages = 0;         // pages of this entry in an offload not yet complete
    bool prefetch_pending = false;      // GPU pages being filled by a Prefetch() copy
    bool from_host = false;             // GPU pages came from the host; next Acquire is a host hit
    std::list<uint64_t>::iterator lru_it;
  };

  // On the host tier only, not pinned, no offload in flight: what Prefetch can start copies for.
  static bool HostOnlyIdle(const Entry& e);
  // Whether AllocateLocked may move `e` off the GPU to make room for `user_id`'s request.
  static bool GpuEvictable(uint64_t victim, const Entry& e, uint64_t user_id);
  bool AllocateLocked(uint64_t user_id, int64_t n, std::vector<int32_t>* out);
  bool AllocateHostLocked(uint64_t user_id, int64_t n, std::vector<int32_t>* out);
  // Frees the entry's GPU pages and cuts it to its host copy; false when nothing is left to serve
  // (the caller drops it).
  bool KeepOnlyHostCopyLocked(Entry& e);
  void EvictFromGpuLocked(uint64_t user_id);
  void DropLocked(uint64_t user_id);
  void TruncateLocked(Entry& e, size_t full_pages);
  void TouchLocked(Entry& e, uint64_t user_id);
  // Releases the pages no request can read again under the window (after a commit).
  void ReleaseBehindWindowLocked(Entry& e);
  // Whether a prefix of `pages` full pages is usable: its new queries read no dead page.
  bool WindowAllows(const Entry& e, size_t pages) const;

  mutable std::mutex mu_;
  int32_t page_size_;
  int32_t window_;
  PageAllocator allocator_;
  PageAllocator host_allocator_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::list<uint64_t> lru_;  // front = most recently used
  CacheStats stats_;
  int64_t pinned_pages_ = 0;
  int64_t max_inflight_pages_ = 0;
  int64_t inflight_pages_ = 0;            // offload pages in flight (host side)
  std::vector<uint64_t> inflight_users_;
  std::vector<uint64_t> prefetch_users_;
};

// Chain hash of keys [0, n) in pages of `page_size`: hashes[i] covers full page i and hashes[i-1].
std::vector<uint64_t> PageChainHashes(absl::Span<const uint64_t> keys, int32_t page_size);
// Hash of the whole prefix keys[0, n) (the chain extended over a partial last page).
uint64_t PrefixHash(absl::Span<const uint64_t> keys, int32_t page_size);

}  // namespace hstu
