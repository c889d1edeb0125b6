#include "engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <numeric>
#include <optional>
#include <unordered_map>

#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/model_file.h"
#include "kernels/params.h"
#include "spdlog/spdlog.h"

namespace hstu {
namespace {

// The kept history of one request (DESIGN §4 truncation): tokens [start, 2n) of the full sequence
// [item_1, action_1, ..., item_n, action_n]; start is even so the kept part begins with an item.
struct KeptHistory {
  int64_t start = 0;
  int32_t length = 0;
  std::vector<uint64_t> keys;
};

KeptHistory KeepHistory(const RankRequest& r, const ModelConfig& c) {
  KeptHistory k;
  const int64_t total = 2 * static_cast<int64_t>(r.history_item_ids.size());
  const int64_t m = c.max_history_tokens, s = c.truncation_stride();
  if (total > m) k.start = (total - m + s - 1) / s * s;
  k.length = static_cast<int32_t>(total - k.start);
  k.keys.resize(k.length);
  // start is even: the kept tokens are whole (item, action) events.
  const int64_t first_event = k.start / 2;
  for (int32_t e = 0; e < k.length / 2; ++e) {
    k.keys[2 * e] = TokenKey(false, r.history_item_ids[first_event + e]);
    k.keys[2 * e + 1] = TokenKey(true, r.history_actions[first_event + e]);
  }
  return k;
}

// One user's share of one forward pass.
struct PassItem {
  size_t request_idx;
  int32_t first_new;      // first kept-history index computed in this pass
  int32_t num_new;
  int32_t first_cand;
  int32_t num_cand;
};

constexpr int64_t kDefaultCpuPoolBytes = 1LL << 30;

// The automatic host tier: only behind a GPU pool (on the CPU backend the pool already is host
// memory), twice its size, within a quarter of the memory the process may use and 32 GiB of
// pinned memory.
int64_t AutoHostPages(const Backend& backend, int64_t gpu_pages) {
  if (backend.device_memory_bytes() == 0) return 0;
  const int64_t page_bytes = std::max<int64_t>(1, backend.page_bytes());
  const int64_t cap_bytes = std::min<int64_t>(UsableMemoryBytes() / 4, int64_t{32} << 30);
  return std::min(2 * gpu_pages, cap_bytes / page_bytes);
}
constexpr int64_t kDefaultGpuPoolBytes = 16LL << 30;

// The first integer in `path`, or nullopt (no such file, or "max": no limit).
std::optional<int64_t> ReadLimit(const std::string& path) {
  std::ifstream in(path);
  int64_t v = 0;
  if (!(in >> v) || v <= 0) return std::nullopt;
  return v;
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int64_t UsableMemoryBytes(const std::string& cgroup_root) {
  int64_t bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  for (const char* file : {"/memory.max", "/memory/memory.limit_in_bytes"}) {
    // v1 says "no limit" with a huge number, which the minimum ignores.
    if (std::optional<int64_t> limit = ReadLimit(cgroup_root + file)) bytes = std::min(bytes, *limit);
  }
  return bytes;
}

Engine::Engine(const EngineOptions& options, ModelConfig config, std::unique_ptr<Backend> backend,
               std::unique_ptr<CacheManager> cache)
    : options_(options), config_(std::move(config)), backend_(std::move(backend)),
      cache_(std::move(cache)),
      onload_cost_(options.onload_bytes_per_second, options.recompute_seconds_per_token) {}

Engine::~Engine() = default;

absl::Status CheckEngineOptions(const EngineOptions& options) {
  if (options.page_size <= 0 || options.page_size > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must be in [1, 4096], got ", options.page_size));
  }
  if (options.cache_pages < 0 || options.cache_pages > kMaxPoolPages) {
    return absl::InvalidArgumentError(absl::StrCat("cache_pages must be in [0, ", kMaxPoolPages,
                                                   "], got ", options.cache_pages));
  }
  if (options.host_cache_pages < -1 || options.host_cache_pages > kMaxPoolPages) {
    return absl::InvalidArgumentError(absl::StrCat("host_cache_pages must be in [-1, ",
                                                   kMaxPoolPages, "], got ",
                                                   options.host_cache_pages));
  }
  if (options.offload_backlog_mib < 1 || options.offload_backlog_mib > kMaxOffloadBacklogMib) {
    return absl::InvalidArgumentError(absl::StrCat("offload_backlog_mib must be in [1, ",
                                                   kMaxOffloadBacklogMib, "], got ",
                                                   options.offload_backlog_mib));
  }
  if (!(options.onload_bytes_per_second >= 0) || !(options.recompute_seconds_per_token >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "onload_bytes_per_second and recompute_seconds_per_token must be >= 0 (0 = measured), got ",
        options.onload_bytes_per_second, " and ", options.recompute_seconds_per_token));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  auto weights = LoadModel(options.model, options.seed);
  if (!weights.ok()) return weights.status();
  return Create(options, *std::move(weights));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       ModelWeights weights) {
  const ModelConfig& c = weights.config;
  if (auto s = c.Validate(); !s.ok()) return s;
  if (auto s = CheckEngineOptions(options); !s.ok()) return s;
  const int64_t pages_per_user = PagesFor(c.max_history_tokens, options.page_size);
  // The default pool size depends on where it lives (fp32 on the CPU, bf16 on a GPU), so "auto"
  // is resolved first: a GPU when one can be used, else the CPU.
  int64_t num_pages = 0;
  auto make_backend = [&](const std::string& device) {
    num_pages = options.cache_pages;
    if (num_pages == 0) {
      const bool cpu = device.rfind("cpu", 0) == 0;  // cpu, cpu-bf16: fp32 pages
      const int64_t page_bytes = 2LL * options.page_size * c.hd() * (cpu ? 4 : 2) * c.num_layers;
      num_pages = std::max(pages_per_user * 2,
                           (cpu ? kDefaultCpuPoolBytes : kDefaultGpuPoolBytes) / page_bytes);
    }
    GraphOptions graphs;
    graphs.enable = options.use_cuda_graphs;
    graphs.buckets = options.graph_buckets;
    return CreateBackend(device, weights, options.page_size, num_pages, graphs);
  };
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      make_backend(options.device == "auto" ? "cuda:0" : options.device);
  // "auto" falls back to the CPU only where no GPU can be used at all (none present, or none this
  // build's kernels run on): a GPU that is present and fails to start (memory held by another
  // process, a model whose shapes its kernels do not run, a capture that fails) is an error, not a
  // silent switch to a far slower engine.
  if (!backend.ok() && options.device == "auto" &&
      backend.status().code() == absl::StatusCode::kUnavailable) {
    spdlog::warn("no usable GPU ({}); running on the CPU reference backend",
                 std::string(backend.status().message()));
    backend = make_backend("cpu");
  }
  if (!backend.ok()) return backend.status();
  if (options.wrap_backend) backend = options.wrap_backend(*std::move(backend));
  int64_t host_pages = options.host_cache_pages;
  if (host_pages == -1) host_pages = AutoHostPages(**backend, num_pages);
  if (!options.enable_cache) host_pages = 0;  // nothing is kept, so nothing moves to the host
  if (host_pages > 0) {
    if (auto s = (*backend)->CreateHostPool(host_pages); !s.ok()) {
      // An automatic size the machine cannot pin costs the tier, not the server; an explicit
      // one is an error.
      if (s.code() != absl::StatusCode::kUnimplemented && options.host_cache_pages != -1) return s;
      spdlog::warn("host KV tier disabled: {}", std::string(s.message()));
      host_pages = 0;
    }
  }
  // Write-behind backlog (offload_backlog_mib; 128 MiB is ~2.4 ms of PCIe at 55 GB/s) but at least
  // one whole user, so the copy engine never falls far behind, a burst of misses cannot pin the
  // GPU pool, and waiting for the copies (when nothing else can be evicted) is short. On an H200
  // under a Zipf load 128 MiB gave 1.2x the throughput of 512 MiB (docs/benchmark_history.md,
  // run 7).
  const int64_t page_bytes = std::max<int64_t>(1, (*backend)->page_bytes());
  const int64_t max_inflight =
      std::max<int64_t>(pages_per_user, (options.offload_backlog_mib << 20) / page_bytes);
  auto cache = std::make_unique<CacheManager>(options.page_size, num_pages, host_pages,
                                              max_inflight, c.max_attn_len);
  std::unique_ptr<Engine> engine(new Engine(options, c, *std::move(backend), std::move(cache)));
  engine->stats_.kv_pool_bytes = engine->backend_->kv_pool_bytes();
  engine->stats_.device_memory_bytes = engine->backend_->device_memory_bytes();
  engine->stats_.weight_bytes = engine->backend_->device_weight_bytes();
  engine->stats_.kv_page_bytes = engine->backend_->page_bytes();
  engine->ResetMeasuredRates();  // their start values into the stats
  return engine;
}

absl::Status Engine::Validate(const RankRequest& request) const {
  return ValidateRankRequest(request, config_, options_.limits);
}

std::vector<double> Engine::TakeOnloadWaits() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  std::vector<double> out;
  out.swap(onload_waits_);
  return out;
}

EngineStats Engine::Stats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    s = stats_;
    s.device_lost = !health_.ok();
  }
  s.cache = cache_->Stats();
  s.graph_replays = backend_->graph_replays();
  s.graph_fallbacks = backend_->graph_fallbacks();
  s.kv_offload_bytes = s.cache.pages_offloaded * static_cast<uint64_t>(s.kv_page_bytes);
  s.kv_onload_bytes = s.cache.pages_onloaded * static_cast<uint64_t>(s.kv_page_bytes);
  return s;
}

absl::Status Engine::health() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return health_;
}

void Engine::CheckDevice() {
  absl::Status lost = backend_->DeviceStatus();
  if (lost.ok()) return;
  std::lock_guard<std::mutex> lock(stats_mu_);
  if (!health_.ok()) return;
  health_ = std::move(lost);
  spdlog::error("device lost: {}; every request is answered UNAVAILABLE from now on",
                std::string(health_.message()));
}

absl::Status Engine::Unavailable() const {
  const absl::Status h = health();
  return h.ok() ? h : absl::UnavailableError(absl::StrCat("engine unavailable: ", h.message()));
}

std::vector<absl::StatusOr<RankResult>> Engine::Rank(absl::Span<const RankRequest> batch) {
  if (absl::Status lost = Unavailable(); !lost.ok()) {
    return std::vector<absl::StatusOr<RankResult>>(batch.size(), lost);
  }
  std::vector<absl::StatusOr<RankResult>> results(batch.size(), absl::UnknownError("not run"));
  // Waves: the k-th request of each user goes into wave k, so a user's later request sees the
  // cache its earlier one committed.
  std::vector<std::vector<size_t>> waves;
  std::unordered_map<uint64_t, size_t> seen;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (auto s = Validate(batch[i]); !s.ok()) {
      results[i] = s;
      continue;
    }
    const size_t wave = seen[batch[i].user_id]++;
    if (waves.size() <= wave) waves.resize(wave + 1);
    waves[wave].push_back(i);
  }
  for (std::vector<size_t> pending : waves) {
    // Requests that did not fit beside the others run again once those committed (before the
    // next wave, which holds later requests of the same users). Each round admits at least one
    // request, since one is deferred only when another holds pages.
    while (!pending.empty()) {
      // A wave that lost the device answers the rest UNAVAILABLE, as Rank() does from then on,
      // without touching the device again.
      if (absl::Status lost = Unavailable(); !lost.ok()) {
        for (size_t i : pending) results[i] = lost;
        break;
      }
      std::vector<const RankRequest*> reqs;
      std::vector<absl::StatusOr<RankResult>*> outs;
      for (size_t i : pending) {
        reqs.push_back(&batch[i]);
        outs.push_back(&results[i]);
      }
      std::vector<size_t> next;
      for (size_t p : RankWave(reqs, outs)) next.push_back(pending[p]);
      pending = std::move(next);
    }
  }
  std::lock_guard<std::mutex> lock(stats_mu_);
  ++stats_.batches;
  stats_.requests += batch.size();
  return results;
}

int64_t Engine::FirstChunkCandidates(const RankRequest& r) const {
  return std::min<int64_t>(static_cast<int64_t>(r.candidate_item_ids.size()),
                           config_.max_candidates);
}

OnloadFilter Engine::MakeOnloadFilter(const double* wave_rows, double before_rows) {
  if (options_.onload_policy == OnloadPolicy::kAlways) return nullptr;
  return [this, wave_rows, before_rows](int64_t pages, int64_t tokens) {
    const double in_wave = wave_rows != nullptr ? *wave_rows : 0;
    const double overlap = onload_cost_.OverlapSeconds(in_wave, config_.num_layers) +
                           onload_cost_.ForwardSeconds(before_rows);
    return onload_cost_.ShouldOnload(pages * backend_->page_bytes(), tokens, NowSeconds(), overlap);
  };
}

void Engine::NoteCopiesIdleIfNoPrefetch() {
  // Onloads complete within the forward that reads them, so between waves only prefetches can
  // still be copying.
  if (cache_->prefetches_pending() && backend_->PrefetchesDone()) cache_->PrefetchesComplete();
  if (!cache_->prefetches_pending()) onload_cost_.CopiesIdle(NowSeconds());
}

void Engine::UpdateOnloadRates() {
  if (std::optional<CopyTiming> t = backend_->TakeOnloadTiming()) {
    onload_cost_.ObserveCopy(t->bytes, t->seconds);
  }
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.onload_bytes_per_second = onload_cost_.bytes_per_second();
  stats_.recompute_seconds_per_token = onload_cost_.seconds_per_token();
}

void Engine::Prefetch(absl::Span<const RankRequest* const> running,
                      absl::Span<const RankRequest* const> queued) {
  if (!has_host_tier() || !health().ok()) return;
  std::vector<uint64_t> keep;
  for (const RankRequest* r : running) keep.push_back(r->user_id);
  // Write-behind copies that have completed make their users evictable to make room.
  SettleOffloads(/*wait=*/false);
  NoteCopiesIdleIfNoPrefetch();
  // The same rule as at admission: a prefetch the policy would refuse is not started (the request
  // is decided again when its batch runs, against the copy backlog of that moment). The copy
  // overlaps the whole of the batch about to run, which does not wait for it: its rows are
  // estimated from its users' cached tokens (their first candidate chunks, and the history beyond
  // what is cached, up to the model's maximum).
  double before_rows = 0;
  for (const RankRequest* r : running) {
    const int64_t tokens = std::min<int64_t>(2 * static_cast<int64_t>(r->history_item_ids.size()),
                                             config_.max_history_tokens);
    before_rows += static_cast<double>(
        FirstChunkCandidates(*r) + std::max<int64_t>(0, tokens - cache_->CachedTokens(r->user_id)));
  }
  // The request's own wave is not known yet: only the batch before it counts.
  const OnloadFilter onload_ok = MakeOnloadFilter(/*wave_rows=*/nullptr, before_rows);
  for (const RankRequest* queued_request : queued) {
    if (!health().ok()) return;  // a failed prefetch below lost the device
    const RankRequest& r = *queued_request;
    // Most queued users are GPU-resident or new: skip them before building their keys. A user
    // of the running batch is skipped too: its running request onloads the entry at admission,
    // and a later request's keys could cut the entry short before that.
    if (std::find(keep.begin(), keep.end(), r.user_id) != keep.end() ||
        !cache_->PrefetchCandidate(r.user_id) || !Validate(r).ok()) {
      continue;
    }
    const KeptHistory kept = KeepHistory(r, config_);
    const PageCopies copies = cache_->Prefetch(r.user_id, kept.keys, keep, onload_ok);
    if (copies.empty()) continue;
    onload_cost_.CopyIssued(static_cast<int64_t>(copies.src.size()) * backend_->page_bytes(),
                            NowSeconds());
    if (auto s = backend_->PrefetchPages(copies.src, copies.dst); !s.ok()) {
      // The pages hold nothing valid: wait for what is in flight and drop the user's entry (its
      // next visit is recomputed).
      spdlog::warn("KV prefetch failed: {}", std::string(s.message()));
      CheckDevice();
      SettleOffloads(/*wait=*/true);
      backend_->WaitCopies().IgnoreError();
      cache_->PrefetchFailed(r.user_id);
      cache_->PrefetchesComplete();
    }
  }
}

absl::Status Engine::CheckPoolHoldsTheLongestHistory() const {
  const int64_t pages_per_user = PagesFor(config_.max_history_tokens, options_.page_size);
  const int64_t pool = cache_->Stats().pages_total;
  if (pool >= pages_per_user) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the KV pool of ", pool, " pages must hold one user of the model's maximum history, ",
      config_.max_history_tokens, " tokens = ", pages_per_user, " pages of ", options_.page_size,
      " (0 sizes it automatically)"));
}

void Engine::ResetMeasuredRates() {
  onload_cost_ = OnloadCostModel(options_.onload_bytes_per_second,
                                 options_.recompute_seconds_per_token);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.onload_bytes_per_second = onload_cost_.bytes_per_second();
  stats_.recompute_seconds_per_token = onload_cost_.seconds_per_token();
}

bool Engine::Forget(uint64_t user_id) {
  SettleOffloads(/*wait=*/true);
  return cache_->Forget(user_id);
}

void Engine::SettleOffloads(bool wait) {
  if (!cache_->offloads_in_flight()) return;
  if (wait) {
    if (auto s = backend_->WaitCopies(); !s.ok()) {
      // A failed copy leaves host pages with unknown contents: nothing cached can be trusted.
      spdlog::error("KV copy failed: {}; clearing the cache", std::string(s.message()));
      CheckDevice();
      cache_->OffloadsComplete();
      cache_->Clear();
      return;
    }
  } else if (!backend_->CopiesDone()) {
    return;
  }
  cache_->OffloadsComplete();
}

std::vector<size_t> Engine::RankWave(absl::Span<const RankRequest* const> wave,
                                     absl::Span<absl::StatusOr<RankResult>* const> results) {
  const ModelConfig& c = config_;
  const int32_t max_cand = c.max_candidates;
  struct Live {
    size_t idx;
    KeptHistory kept;
    Reservation res;
    RankResult result;
  };
  std::vector<Live> live;
  SettleOffloads(/*wait=*/false);
  NoteCopiesIdleIfNoPrefetch();
  // The rows the wave's first pass computes whichever way its host hits go: every user's first
  // candidate chunk, then each admitted user's new and recomputed tokens. A host hit's onload
  // overlaps them (the onload rule, docs/architecture.md).
  double wave_rows = 0;
  for (const RankRequest* r : wave) wave_rows += static_cast<double>(FirstChunkCandidates(*r));
  const OnloadFilter onload_ok = MakeOnloadFilter(&wave_rows);
  // Users whose K/V lives on the host only are admitted last, so that their onload decisions
  // count the other users' compute.
  std::vector<size_t> order(wave.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (onload_ok != nullptr && options_.enable_cache) {
    std::stable_partition(order.begin(), order.end(), [&](size_t i) {
      return !cache_->PrefetchCandidate(wave[i]->user_id);
    });
  }
  bool uses_prefetch = false, uses_onload = false;
  std::vector<size_t> deferred;
  for (const size_t i : order) {
    Live l{i, KeepHistory(*wave[i], c), {}, {}};
    auto acquire = [&] {
      return options_.enable_cache ? cache_->Acquire(wave[i]->user_id, l.kept.keys, onload_ok)
                                   : cache_->AcquireTemporary(wave[i]->user_id, l.kept.length);
    };
    auto res = acquire();
    if (!res.ok() && (cache_->offloads_in_flight() || cache_->prefetches_pending()) &&
        (absl::IsUnavailable(res.status()) || absl::IsResourceExhausted(res.status()))) {
      // The user's own write-behind or prefetch is still in flight, or the pages we need are held
      // by in-flight copies: wait for the copy engines, then try once more.
      SettleOffloads(/*wait=*/true);
      if (backend_->WaitCopies().ok()) {
        cache_->PrefetchesComplete();
        onload_cost_.CopiesIdle(NowSeconds());
      }
      res = acquire();
    }
    if (!res.ok() && absl::IsResourceExhausted(res.status()) && !live.empty()) {
      deferred.push_back(i);  // the pool is pinned by this wave's other users: after them
      continue;
    }
    if (!res.ok()) {
      *results[i] = res.status();
      continue;
    }
    if (!res->onload.empty()) {
      onload_cost_.CopyIssued(static_cast<int64_t>(res->onload.src.size()) * backend_->page_bytes(),
                              NowSeconds());
      // The forward below is ordered after this copy on the backend's streams.
      if (auto s = backend_->CopyPages(CopyKind::kHostToDevice, res->onload.src, res->onload.dst);
          !s.ok()) {
        cache_->Release(*res);
        *results[i] = absl::InternalError(absl::StrCat("KV onload failed: ", s.message()));
        CheckDevice();
        continue;
      }
      uses_onload = true;
    }
    uses_prefetch = uses_prefetch || res->prefetched;
    l.res = *std::move(res);
    l.result.num_tasks = c.num_tasks;
    l.result.reused_tokens = static_cast<uint32_t>(l.res.reused_tokens);
    l.result.computed_tokens = static_cast<uint32_t>(l.kept.length - l.res.reused_tokens);
    wave_rows += static_cast<double>(l.result.computed_tokens);
    l.result.cache_result = l.res.result;
    l.result.scores.resize(wave[i]->candidate_item_ids.size() * c.num_tasks);
    if (options_.keep_hidden) l.result.hidden.resize(wave[i]->candidate_item_ids.size() * c.hidden_dim);
    live.push_back(std::move(l));
  }

  // Pass k scores candidate chunk k of every user; pass 0 also computes the new history.
  absl::Status failure;
  if (uses_prefetch) failure = backend_->MakePrefetchVisible();
  const bool multi_pass = std::any_of(live.begin(), live.end(), [&](const Live& l) {
    return static_cast<int32_t>(wave[l.idx]->candidate_item_ids.size()) > max_cand;
  });
  for (int pass = 0; failure.ok(); ++pass) {
    ForwardBatch fb;
    std::vector<PassItem> items;
    for (size_t u = 0; u < live.size(); ++u) {
      const Live& l = live[u];
      const int32_t num_cands = static_cast<int32_t>(wave[l.idx]->candidate_item_ids.size());
      const int32_t first_cand = pass * max_cand;
      if (first_cand >= num_cands) continue;
      items.push_back({u, l.res.reused_tokens, pass == 0 ? l.kept.length - l.res.reused_tokens : 0,
                       first_cand, std::min(max_cand, num_cands - first_cand)});
    }
    // The arrays are sized once and filled in place (8 users of 512 rows: 14.7 -> 8 µs here
    // against push_back per token, caches cold).
    size_t rows = 0, pages = 0;
    for (const PassItem& it : items) {
      rows += static_cast<size_t>(it.num_new + it.num_cand);
      pages += live[it.request_idx].res.page_ids.size();
    }
    fb.token_ids.resize(rows);
    fb.token_types.resize(rows);
    fb.positions.resize(rows);
    fb.page_ids.resize(pages);
    fb.row_offsets.assign(1, 0);
    fb.page_indptr.assign(1, 0);
    int64_t* ids = fb.token_ids.data();
    int32_t* types = fb.token_types.data();
    int32_t* positions = fb.positions.data();
    int32_t* page_ids = fb.page_ids.data();
    for (const PassItem& it : items) {
      const Live& l = live[it.request_idx];
      const RankRequest& r = *wave[l.idx];
      for (int32_t j = 0; j < it.num_new; ++j) {
        const int64_t t = l.kept.start + it.first_new + j;
        const bool is_action = t % 2 == 1;
        ids[j] = is_action ? r.history_actions[t / 2] : r.history_item_ids[t / 2];
        types[j] = is_action ? kActionToken : kItemToken;
        positions[j] = it.first_new + j;
      }
      std::copy_n(r.candidate_item_ids.data() + it.first_cand, it.num_cand, ids + it.num_new);
      std::fill_n(types + it.num_new, it.num_cand, kItemToken);
      std::fill_n(positions + it.num_new, it.num_cand, l.kept.length);
      const int32_t item_rows = it.num_new + it.num_cand;
      ids += item_rows;
      types += item_rows;
      positions += item_rows;
      // Dead pages (behind the sliding window) hold no key that this pass reads; their slots
      // get the first live page so that every id in the table is a page of the pool.
      const int32_t dead = l.res.dead_pages;
      if (dead > 0) page_ids = std::fill_n(page_ids, dead, l.res.page_ids[dead]);
      page_ids = std::copy(l.res.page_ids.begin() + dead, l.res.page_ids.end(), page_ids);
      fb.row_offsets.push_back(fb.row_offsets.back() + item_rows);
      fb.num_new.push_back(it.num_new);
      fb.num_tokens.push_back(l.kept.length);
      fb.page_indptr.push_back(static_cast<int32_t>(page_ids - fb.page_ids.data()));
    }
    if (items.empty()) break;
    fb.num_users = static_cast<int32_t>(items.size());
    // With the cache off the pages are temporary: only this wave's later passes read them.
    fb.keep_kv = options_.enable_cache || multi_pass;

    ForwardOutput out;
    const auto t0 = std::chrono::steady_clock::now();
    failure = backend_->Forward(fb, options_.keep_hidden, &out);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.forward_passes;
      stats_.compute_seconds += secs;
      stats_.device_seconds += out.device_seconds;
      if (out.waited_for_onloads) {
        ++stats_.onload_waits;
        stats_.onload_wait_seconds += out.onload_wait_seconds;
        constexpr size_t kKeptWaits = 4096;  // a scraper that never comes must not grow this
        if (onload_waits_.size() < kKeptWaits) onload_waits_.push_back(out.onload_wait_seconds);
      }
    }
    if (!failure.ok()) break;
    // Pass 0 may have waited for onloads or prefetches: its time is not the GPU's alone, and
    // counting it would make copies look cheaper the slower they are.
    if (pass > 0 || !(uses_onload || uses_prefetch)) {
      onload_cost_.ObserveCompute(fb.num_rows(), secs);
    }
    UpdateOnloadRates();
    int64_t cand_row = 0;
    for (const PassItem& it : items) {
      RankResult& res = live[it.request_idx].result;
      std::copy_n(out.scores.begin() + cand_row * c.num_tasks, it.num_cand * c.num_tasks,
                  res.scores.begin() + static_cast<int64_t>(it.first_cand) * c.num_tasks);
      if (options_.keep_hidden) {
        std::copy_n(out.hidden.begin() + cand_row * c.hidden_dim, it.num_cand * c.hidden_dim,
                    res.hidden.begin() + static_cast<int64_t>(it.first_cand) * c.hidden_dim);
      }
      cand_row += it.num_cand;
    }
  }

  // A failed wave frees its pages: no copy may still be writing into them.
  if (!failure.ok()) {
    CheckDevice();
    backend_->WaitCopies().IgnoreError();
  }
  for (Live& l : live) {
    // A NaN in the forward (weights that overflow on these inputs) reaches the scores through
    // the sigmoid; the user's new K/V may hold it too, so nothing of the request is kept.
    absl::Status status = failure.ok() ? absl::OkStatus()
                                       : absl::InternalError(absl::StrCat(
                                             "engine forward failed: ", failure.message()));
    if (status.ok() && !std::all_of(l.result.scores.begin(), l.result.scores.end(),
                                    [](float x) { return std::isfinite(x); })) {
      status = absl::InternalError(
          "the model produced non-finite scores for this request (its weights overflow on these "
          "inputs); nothing of it was cached");
    }
    if (status.ok()) {
      const PageCopies offload = cache_->Commit(l.res, l.kept.keys);
      if (!offload.empty()) {
        if (auto s = backend_->CopyPages(CopyKind::kDeviceToHost, offload.src, offload.dst); !s.ok()) {
          spdlog::warn("KV offload failed, host copy dropped: {}", std::string(s.message()));
          cache_->ForgetHostCopy(l.res.user_id);
          CheckDevice();
        }
      }
      *results[l.idx] = std::move(l.result);
    } else {
      cache_->Release(l.res);
      *results[l.idx] = std::move(status);
    }
  }
  // Offloads stay in flight behind the next waves' compute; the cache keeps their pages until
  // SettleOffloads sees them done.
  return deferred;
}

}  // namespace hstu
