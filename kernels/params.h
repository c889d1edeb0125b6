// Argument structs of the ops that CPU and CUDA implement alike. Shapes in comments; all matrices
// row-major. `T` is the activation / KV element type (float on the CPU, bf16 on CUDA).
//
// Rows of a batch ("jagged"): user b owns rows [row_offsets[b], row_offsets[b+1]); its first
// num_new[b] rows are new history tokens (oldest first), the rest are its candidates.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/paged_kv_view.h"

namespace hstu {

// Token kinds of the embedding gather.
enum TokenType : int32_t { kItemToken = 0, kActionToken = 1 };

template <typename T>
struct EmbeddingParams {
  const T* item_table = nullptr;      // [item_rows, d]
  const T* action_table = nullptr;    // [action_rows, d]
  const T* position_table = nullptr;  // [position_rows, d], nullptr when the model has none
  int64_t item_rows = 0;
  int64_t action_rows = 0;
  int64_t position_rows = 0;
  int32_t hidden_dim = 0;              // d
  int32_t num_rows = 0;                // T
  const int64_t* token_ids = nullptr;  // [T]; item id (hashed mod item_rows) or action id
  const int32_t* token_types = nullptr;  // [T], TokenType
  const int32_t* positions = nullptr;    // [T], index in the kept history (candidates: its length)
  T* out = nullptr;                      // [T, d]
};

// HSTU attention over a paged cache (DESIGN §2.2). History K/V of every user, the new rows included,
// must already be in the pages (append runs first); a candidate's own K/V come from its uvqk row.
// With new_kv_from_rows (CUDA, warp-specialised kernel only) a user whose cached prefix ends on a
// 64-key block boundary (NewKvFromRows: every fresh user, with no cached tokens, and the decode
// steps' returning users) is the exception: its new history K/V are read from its uvqk rows (the
// append skipped them, AppendKvParams::new_kv_from_rows), and the attention kernel stores them to
// the user's pages from shared memory as it goes. Slots at or past num_tokens[b] of that user's
// last page may then be overwritten (they hold no token). With store_new_kv false as well (a
// batch whose pages nobody reads again: the cache is off), those users' pages are not written.
template <typename T>
struct AttentionParams {
  const T* uvqk = nullptr;       // [T, 4 * H * D]: u | v | q | k, head h at columns h*D .. (h+1)*D
  int64_t uvqk_row_stride = 0;   // elements between rows (= 4 * H * D)
  int64_t uvqk_rows = 0;         // rows the uvqk allocation holds (>= T; new_kv_from_rows only)
  bool new_kv_from_rows = false;
  bool returning_kv_from_rows = true;  // with new_kv_from_rows: returning users too (NewKvFromRows)
  bool store_new_kv = true;      // with new_kv_from_rows: store those users' new K/V to their pages
  T* out = nullptr;              // [T, H * D]
  int32_t num_rows = 0;          // T
  const int32_t* row_offsets = nullptr;  // [B + 1]
  const int32_t* num_new = nullptr;      // [B] new history rows of each user
  PagedKvView<T> kv;                     // kv.num_tokens[b] = cached + new history tokens
  float alpha = 0.f;             // 1 / sqrt(D)
  float inv_norm = 0.f;          // 1 / attention_norm_len
  int32_t max_attn_len = 0;      // W, 0 = no window
};

// Copies the K and V of the new history rows into their pages.
template <typename T>
struct AppendKvParams {
  const T* uvqk = nullptr;       // [T, 4 * H * D]
  int64_t uvqk_row_stride = 0;
  const int32_t* row_offsets = nullptr;  // [B + 1]
  const int32_t* num_new = nullptr;      // [B]
  PagedKvView<T> kv;                     // kv.num_tokens[b] = cached + new (after the append)
  // Skip the users NewKvFromRows picks: the attention reads their new K/V from the rows and stores
  // them to the pages itself (AttentionParams::new_kv_from_rows). The CUDA bias + SiLU pass then
  // writes their v and k back to the rows. The CPU ops ignore it.
  bool new_kv_from_rows = false;
  bool returning_kv_from_rows = true;  // as AttentionParams's: the same on both sides
};

// The attention's key blocks (64 keys) a user's K/V may come from its rows: one block never mixes
// keys from the pages with keys from the rows.
constexpr int32_t kKvFromRowsAlign = 64;

// With new_kv_from_rows (`enabled`) on, whether a user's new history K/V come from its uvqk rows
// (key num_tokens - num_new + i = its new row i) instead of its pages: a fresh user (nothing
// cached) always; a returning one when `returning` (returning_kv_from_rows) and its cached prefix
// is whole key blocks.
HSTU_HOST_DEVICE bool NewKvFromRows(bool enabled, bool returning, int32_t num_tokens,
                                    int32_t num_new) {
  const int32_t cached = num_tokens - num_new;
  return enabled && (cached == 0 || (returning && cached % kKvFromRowsAlign == 0));
}

// A candidate's score from its head's logit: the sigmoid, kept inside (0, 1) as the wire contract
// has it. In fp32 the sigmoid rounds to 1 from a logit of ~16.6 up, is subnormal below ~-87.3 and
// 0 below ~-88.7 (expf overflows); such scores become the closest normal floats inside (0, 1)
// instead (saturated candidates tie). NaN stays NaN: the engine refuses non-finite scores.
constexpr float kMinScore = 0x1p-126f;         // FLT_MIN
constexpr float kMaxScore = 0x1.fffffep-1f;    // 1 - 2^-24
HSTU_HOST_DEVICE float ScoreFromLogit(float logit) {
  const float s = 1.f / (1.f + expf(-logit));
  return s < kMinScore ? kMinScore : (s > kMaxScore ? kMaxScore : s);
}

// Column offsets of u, v, q, k inside a uvqk row, in units of H * D.
enum UvqkPart : int32_t { kU = 0, kV = 1, kQ = 2, kK = 3 };

}  // namespace hstu
