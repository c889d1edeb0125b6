// The paged HSTU attention and the K/V append against their CPU twins (kernels/cpu/ops.h) on random
// paged batches with odd sizes (kernels_test.cc has the other kernels).
// Inputs are rounded to bf16 first so both sides see the same values; outputs are poisoned (NaN)
// before each launch and checked for NaN/Inf.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/hstu_attention.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/util/tolerance.h"

namespace hstu {
namespace {

using test::AllFinite;
using test::bf16;
using test::DeviceArray;
using test::RandomVector;
using test::RoundBf16;
using test::ToBf16;
using test::ToF32;

// A random paged batch: per user some cached tokens already in the pages, some new history rows,
// some candidates; pages scattered over the pool in random order.
struct PagedCase {
  int B = 1, page_size = 16, H = 2, D = 64, W = 0;
  int64_t num_pages = 0;
  std::vector<int32_t> row_offsets, num_new, num_tokens, page_indptr, page_ids;
  std::vector<float> pool;  // [num_pages, 2, page_size, H, D], bf16-rounded
  std::vector<float> uvqk;  // [rows, 4 H D], bf16-rounded
  int rows() const { return row_offsets.back(); }
  int64_t page_elems() const { return 2LL * page_size * H * D; }

  PagedKvView<float> CpuView() {
    return MakePagedKvView(pool.data(), page_size, H, D, B, page_indptr.data(), page_ids.data(),
                           num_tokens.data());
  }
};

// align_cached > 1: every even user's cached prefix is rounded down to a multiple of it (returning
// users whose prefix is whole key blocks, NewKvFromRows), the others' left as drawn.
PagedCase MakeCase(std::mt19937& rng, int B, int page_size, int H, int D, int W, int max_cached,
                   int max_new, int max_cand, int align_cached = 1) {
  PagedCase c;
  c.B = B;
  c.page_size = page_size;
  c.H = H;
  c.D = D;
  c.W = W;
  c.row_offsets = {0};
  c.page_indptr = {0};
  std::vector<int32_t> pages_per_user;
  for (int b = 0; b < B; ++b) {
    // Edge users on purpose: no cache, no history at all, one candidate, no candidates.
    int cached = rng() % (max_cached + 1), nnew = rng() % (max_new + 1), cand = rng() % (max_cand + 1);
    if (b % 5 == 1) cached = 0;
    if (b % 5 == 2) cached = nnew = 0;
    if (b % 5 == 3) cand = 1;
    if (b % 7 == 4) cand = 0;
    if (nnew + cand == 0) cand = 1;
    if (align_cached > 1 && b % 2 == 0) cached -= cached % align_cached;
    c.num_new.push_back(nnew);
    c.num_tokens.push_back(cached + nnew);
    c.row_offsets.push_back(c.row_offsets.back() + nnew + cand);
    const int pages = (cached + nnew + page_size - 1) / page_size + static_cast<int>(rng() % 2);
    pages_per_user.push_back(pages);
    c.page_indptr.push_back(c.page_indptr.back() + pages);
  }
  c.num_pages = c.page_indptr.back() + 3;
  std::vector<int32_t> perm(c.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.page_ids.assign(perm.begin(), perm.begin() + c.page_indptr.back());
  c.pool = RoundBf16(RandomVector(rng, c.num_pages * c.page_elems()));
  // Slots past each user's last token hold NaN: a kernel that reads them into a result (0 · NaN)
  // fails the finiteness check.
  const int64_t hd = static_cast<int64_t>(H) * D;
  for (int b = 0; b < B; ++b) {
    for (int t = c.num_tokens[b]; t < pages_per_user[b] * page_size; ++t) {
      const int64_t page = c.page_ids[c.page_indptr[b] + t / page_size];
      for (int kv = 0; kv < 2; ++kv) {
        float* row = c.pool.data() + page * c.page_elems() + (kv * page_size + t % page_size) * hd;
        std::fill(row, row + hd, std::numeric_limits<float>::quiet_NaN());
      }
    }
  }
  c.pool = RoundBf16(c.pool);  // the NaN as bf16 gives it back (the append check compares bits)
  c.uvqk = RoundBf16(RandomVector(rng, static_cast<size_t>(c.rows()) * 4 * H * D));
  return c;
}

// Fills the pages as the engine does (c.uvqk taken as the UVQK GEMM output: bias + SiLU fused with
// the append), then both sides append and attend over the GPU's post-SiLU rows: the pages bit for
// bit, attention within the bf16 tolerance.
// cluster > 0: a cluster plan (summed in distributed shared memory), which the case must produce.
// kv_from_rows: AttentionParams::new_kv_from_rows on — the users NewKvFromRows picks (fresh ones,
// and those whose cached prefix is whole key blocks) keep their v and k in the rows after the pass
// and the attention stores them to the pages; the pages are then compared after the attention,
// every slot bit for bit except those past such a user's tokens (which hold no token and may be
// overwritten).
void RunPagedCase(PagedCase& c, int concurrent_ctas, const std::string& what, int max_split = 64,
                  bool expect_two_chunks = false, int cluster = 0, bool kv_from_rows = false,
                  bool store_new = true) {
  const int64_t hd = static_cast<int64_t>(c.H) * c.D;
  auto from_rows = [&](int b) {
    return NewKvFromRows(kv_from_rows, true, c.num_tokens[b], c.num_new[b]);
  };
  const std::vector<float> pool0 = c.pool;  // before any append
  DeviceArray<bf16> d_pool(ToBf16(c.pool)), d_uvqk(ToBf16(c.uvqk)), d_out(c.rows() * hd);
  DeviceArray<int32_t> d_ro(c.row_offsets), d_nn(c.num_new), d_nt(c.num_tokens),
      d_pi(c.page_indptr), d_pids(c.page_ids);
  const PagedKvView<bf16> gv = MakePagedKvView(d_pool.get(), c.page_size, c.H, c.D, c.B,
                                                d_pi.get(), d_pids.get(), d_nt.get());

  // Its own generator, so that the cases drawn from the test's generator stay as they were.
  std::mt19937 bias_rng(static_cast<uint32_t>(c.rows() * 131 + hd));
  DeviceArray<float> d_bias(RandomVector(bias_rng, 4 * hd, -0.5f, 0.5f));
  AppendKvParams<bf16> ga;
  ga.uvqk = d_uvqk.get();
  ga.uvqk_row_stride = 4 * hd;
  ga.row_offsets = d_ro.get();
  ga.num_new = d_nn.get();
  ga.kv = gv;
  ga.new_kv_from_rows = kv_from_rows;
  // Every row activated in place (LaunchBiasSilu, same rounding) as the reference of the append.
  DeviceArray<bf16> d_all(d_uvqk.Download());
  HSTU_ASSERT_CUDA(cuda::LaunchBiasSilu(d_all.get(), c.rows(), 4 * hd, d_bias.get(), nullptr));
  HSTU_ASSERT_CUDA(cuda::LaunchBiasSiluAppendKv(d_uvqk.get(), c.rows(), 4 * hd, d_bias.get(), ga,
                                                nullptr));
  HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> raw = c.uvqk;
  c.uvqk = ToF32(d_all.Download());
  ASSERT_TRUE(AllFinite(c.uvqk)) << what;
  {
    // The appended rows' v and k went to the pages only and keep the GEMM output; everything else
    // equals the activated rows bit for bit.
    const std::vector<float> got = ToF32(d_uvqk.Download());
    int64_t wrong = 0;
    for (int b = 0; b < c.B; ++b) {
      for (int32_t r = c.row_offsets[b]; r < c.row_offsets[b + 1]; ++r) {
        const bool appended = r - c.row_offsets[b] < c.num_new[b] && !from_rows(b);
        for (int64_t col = 0; col < 4 * hd; ++col) {
          const bool vk = (col >= kV * hd && col < (kV + 1) * hd) || col >= kK * hd;
          const int64_t at = static_cast<int64_t>(r) * 4 * hd + col;
          const float want = appended && vk ? raw[at] : c.uvqk[at];
          wrong += std::memcmp(&got[at], &want, sizeof(float)) != 0;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << what << ": rows after the append differ from the expected columns";
  }
  AppendKvParams<float> ca;
  ca.uvqk = c.uvqk.data();
  ca.uvqk_row_stride = 4 * hd;
  ca.row_offsets = c.row_offsets.data();
  ca.num_new = c.num_new.data();
  ca.kv = c.CpuView();
  cpu::AppendKv(ca);
  // The pages against cpu::AppendKv, bit for bit; with kv_from_rows the slots past a rows user's
  // tokens are not compared, and without store_new a rows user's pages must be as they were.
  auto check_pool = [&](const char* when) {
    const auto pool_after = ToF32(d_pool.Download());
    ASSERT_EQ(pool_after.size(), c.pool.size());
    std::vector<char> compare(c.pool.size(), 1);
    int64_t written = 0;
    for (int b = 0; b < c.B; ++b) {
      if (!from_rows(b)) continue;
      if (!store_new) {
        for (int32_t i = c.page_indptr[b]; i < c.page_indptr[b + 1]; ++i) {
          const int64_t at = static_cast<int64_t>(c.page_ids[i]) * c.page_elems();
          written += std::memcmp(&pool_after[at], &pool0[at], c.page_elems() * sizeof(float)) != 0;
          std::fill_n(compare.begin() + at, c.page_elems(), 0);
        }
        continue;
      }
      for (int32_t i = c.page_indptr[b]; i < c.page_indptr[b + 1]; ++i) {
        for (int slot = 0; slot < c.page_size; ++slot) {
          if ((i - c.page_indptr[b]) * c.page_size + slot < c.num_tokens[b]) continue;
          for (int kv = 0; kv < 2; ++kv) {
            std::fill_n(compare.begin() + c.page_ids[i] * c.page_elems() +
                            (kv * c.page_size + slot) * hd, hd, 0);
          }
        }
      }
    }
    int64_t wrong = 0;
    for (size_t e = 0; e < c.pool.size(); ++e) {
      wrong += compare[e] && std::memcmp(&pool_after[e], &c.pool[e], sizeof(float)) != 0;
    }
    EXPECT_EQ(wrong, 0) << what << ": pages " << when << " differ from cpu::AppendKv";
    EXPECT_EQ(written, 0) << what << ": the rows users' pages written with store_new_kv off";
  };
  if (!kv_from_rows) check_pool("after the append");

  AttentionParams<float> cp;
  cp.uvqk = c.uvqk.data();
  cp.uvqk_row_stride = 4 * hd;
  std::vector<float> want(c.rows() * hd);
  cp.out = want.data();
  cp.num_rows = c.rows();
  cp.row_offsets = c.row_offsets.data();
  cp.num_new = c.num_new.data();
  cp.kv = c.CpuView();
  cp.alpha = 1.f / std::sqrt(static_cast<float>(c.D));
  cp.inv_norm = 1.f / 97.f;
  cp.max_attn_len = c.W;
  cpu::HstuAttention(cp);

  const cuda::AttentionPlan plan = cuda::PlanHstuAttention(
      c.row_offsets.data(), c.num_new.data(), c.num_tokens.data(), c.B, c.W, c.H, concurrent_ctas,
      max_split, cluster, /*max_clusters=*/cluster > 0 ? 1 << 20 : 0);
  ASSERT_EQ(plan.cluster, cluster) << what << ": the case meant to make a cluster plan";
  if (expect_two_chunks) {
    EXPECT_TRUE(std::any_of(plan.items.begin(), plan.items.end(),
                            [](const cuda::AttentionWorkItem& it) { return it.num_splits == 2; }))
        << what << ": the case meant to cover two-chunk tiles has none";
  }
  std::vector<int32_t> item_words(plan.items.size() * sizeof(cuda::AttentionWorkItem) / 4);
  std::memcpy(item_words.data(), plan.items.data(), item_words.size() * 4);
  DeviceArray<int32_t> d_items(item_words);
  DeviceArray<float> d_partials(std::max<size_t>(1, static_cast<size_t>(plan.num_partials) * c.H *
                                                        cuda::kAttnBlockM * c.D));
  AttentionParams<bf16> gp;
  gp.uvqk = d_uvqk.get();
  gp.uvqk_row_stride = 4 * hd;
  gp.uvqk_rows = c.rows();
  gp.new_kv_from_rows = kv_from_rows;
  gp.store_new_kv = store_new;
  gp.out = d_out.get();
  gp.num_rows = c.rows();
  gp.row_offsets = d_ro.get();
  gp.num_new = d_nn.get();
  gp.kv = gv;
  gp.alpha = cp.alpha;
  gp.inv_norm = cp.inv_norm;
  gp.max_attn_len = c.W;
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    d_out.Poison();
    HSTU_ASSERT_CUDA(cuda::LaunchHstuAttention(
        gp, reinterpret_cast<const cuda::AttentionWorkItem*>(d_items.get()),
        static_cast<int32_t>(plan.items.size()), plan.num_split_tiles, d_partials.get(), nullptr,
        plan.cluster));
    HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto got = ToF32(d_out.Download());
    ASSERT_TRUE(AllFinite(got)) << what << ": NaN/Inf or unwritten rows (items "
                                << plan.items.size() << ")";
    EXPECT_LT(test::RelL2(got, want), test::kBf16RelL2) << what;
    if (run == 0) {
      first = got;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), got.data(), got.size() * 4), 0)
          << what << ": attention is not deterministic";
    }
  }
  if (kv_from_rows) check_pool("after the attention");
}

TEST(CudaKernels, BiasSiluAppendKvMatchesCpu) {
  HSTU_SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  struct Shape { int B, page_size, H, D, cached, nnew, cand, padding; };
  const Shape shapes[] = {
      {1, 16, 1, 64, 0, 1, 0, 0},         // one new token; a row is half a segment (512 columns)
      {3, 16, 2, 64, 30, 0, 5, 0},        // candidates only
      {17, 16, 2, 64, 40, 20, 5, 3},      // 17 users with edge cases, padding rows
      {9, 32, 4, 256, 100, 130, 20, 0},   // decode-step heads: 8 segments a row
      {5, 64, 3, 64, 70, 70, 3, 1},       // H·D = 192: 768 columns, the 2nd segment partial
      {6, 7, 2, 128, 50, 33, 4, 0},       // odd page size
      {4, 17, 8, 256, 20, 40, 2, 2},      // H·D = 2048: 16 segments, odd page size
  };
  for (const Shape& sh : shapes) {
    // Even users' cached prefixes are whole key blocks (NewKvFromRows picks them below), odd
    // users' as drawn.
    PagedCase c = MakeCase(rng, sh.B, sh.page_size, sh.H, sh.D, 0, sh.cached, sh.nnew, sh.cand,
                           /*align_cached=*/64);
    for (int b = 3; b < c.B; b += 4) {
      c.num_tokens[b] -= c.num_new[b];
      c.num_new[b] = 0;
    }
    const std::string what = ::testing::PrintToString(
        std::vector<int>{sh.B, sh.page_size, sh.H, sh.D, sh.cached, sh.nnew, sh.cand});
    const int64_t hd = static_cast<int64_t>(c.H) * c.D, cols = 4 * hd;
    const int64_t rows = c.rows() + sh.padding;
    auto x = RoundBf16(RandomVector(rng, rows * cols, -4.f, 4.f));
    auto bias = RandomVector(rng, cols, -0.5f, 0.5f);
    std::vector<float> want = x;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) want[r * cols + j] += bias[j];
    cpu::SiluInPlace(want.data(), want.size());
    for (int b = 0; b < c.B; ++b) {
      for (int t = c.num_tokens[b] - c.num_new[b]; t < c.num_tokens[b]; ++t) {
        std::fill_n(c.CpuView().K(b, t, 0), hd, std::numeric_limits<float>::quiet_NaN());
        std::fill_n(c.CpuView().V(b, t, 0), hd, std::numeric_limits<float>::quiet_NaN());
      }
    }
    c.pool = RoundBf16(c.pool);  // NaN in its bf16 bit pattern (the pages are compared bitwise)
    const PagedKvView<float> cv = c.CpuView();

    DeviceArray<bf16> d_pool(ToBf16(c.pool)), d_uvqk(ToBf16(x)), d_uvqk2(ToBf16(x));
    DeviceArray<bf16> d_pool2(ToBf16(c.pool));  // for the append alone (LaunchAppendKvFromRows)
    DeviceArray<float> d_bias(bias);
    DeviceArray<int32_t> d_ro(c.row_offsets), d_nn(c.num_new), d_nt(c.num_tokens),
        d_pi(c.page_indptr), d_pids(c.page_ids);
    AppendKvParams<bf16> gp;
    gp.uvqk = d_uvqk.get();
    gp.uvqk_row_stride = cols;
    gp.row_offsets = d_ro.get();
    gp.num_new = d_nn.get();
    gp.kv = MakePagedKvView(d_pool.get(), c.page_size, c.H, c.D, c.B, d_pi.get(), d_pids.get(),
                            d_nt.get());

    // Rejected with nothing launched: a width other than 4·H·D, p.uvqk not the rows, no bias,
    // misaligned rows.
    EXPECT_EQ(cuda::LaunchBiasSiluAppendKv(d_uvqk.get(), rows, cols - 8, d_bias.get(), gp, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::LaunchBiasSiluAppendKv(d_uvqk2.get(), rows, cols, d_bias.get(), gp, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::LaunchBiasSiluAppendKv(d_uvqk.get(), rows, cols, nullptr, gp, nullptr),
              cudaErrorInvalidValue);
    AppendKvParams<bf16> off = gp;
    off.uvqk = d_uvqk.get() + 4;
    EXPECT_EQ(cuda::LaunchBiasSiluAppendKv(d_uvqk.get() + 4, rows, cols, d_bias.get(), off, nullptr),
              cudaErrorInvalidValue);

    HSTU_ASSERT_CUDA(cuda::LaunchBiasSiluAppendKv(d_uvqk.get(), rows, cols, d_bias.get(), gp,
                                                  nullptr));
    // No users: the same bias + SiLU on a copy, nothing appended.
    AppendKvParams<bf16> none = gp;
    none.uvqk = d_uvqk2.get();
    none.kv.batch_size = 0;
    HSTU_ASSERT_CUDA(cuda::LaunchBiasSiluAppendKv(d_uvqk2.get(), rows, cols, d_bias.get(), none,
                                                  nullptr));
    HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
    // got2: every row activated. got: the same, except that the new history rows' v and k
    // columns went to the pages only and keep the GEMM output x.
    const auto got = ToF32(d_uvqk.Download()), got2 = ToF32(d_uvqk2.Download());
    ASSERT_TRUE(AllFinite(got2)) << what;
    EXPECT_LT(test::RelL2(got2, want), test::kBf16RoundRelL2) << what;
    EXPECT_LE(test::MaxRelDiff(got2, want), test::kBf16RoundRelElement) << what;
    // The append alone from the activated rows (the fused-GEMM route): the rows stay as they are,
    // the pages (checked below) get what the fused pass wrote.
    AppendKvParams<bf16> from_rows = gp;
    from_rows.uvqk = d_uvqk2.get();
    from_rows.kv.base = d_pool2.get();
    AppendKvParams<bf16> bad_stride = from_rows;
    bad_stride.uvqk_row_stride = cols + 8;
    EXPECT_EQ(cuda::LaunchAppendKvFromRows(rows, bad_stride, nullptr), cudaErrorInvalidValue);
    HSTU_ASSERT_CUDA(cuda::LaunchAppendKvFromRows(rows, from_rows, nullptr));
    HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto rows_after = ToF32(d_uvqk2.Download());
    EXPECT_EQ(std::memcmp(rows_after.data(), got2.data(), got2.size() * sizeof(float)), 0)
        << what << ": LaunchAppendKvFromRows modified the rows";
    std::vector<float> expect = got2;
    int64_t appended_rows = 0;
    for (int b = 0; b < c.B; ++b) {
      for (int i = 0; i < c.num_new[b]; ++i, ++appended_rows) {
        const int64_t r = c.row_offsets[b] + i;
        for (int64_t j = 0; j < cols; ++j) {
          if ((j >= kV * hd && j < (kV + 1) * hd) || j >= kK * hd) expect[r * cols + j] = x[r * cols + j];
        }
      }
    }
    EXPECT_EQ(std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)), 0)
        << what << " (" << appended_rows << " appended rows)";

    // With new_kv_from_rows the append alone skips the users NewKvFromRows picks (no cached
    // tokens, or a cached prefix of whole key blocks): their new slots keep the poison; the fused
    // pass writes their v and k back to the rows instead.
    const std::vector<float> pool_before = c.pool;
    DeviceArray<bf16> d_pool3(ToBf16(c.pool)), d_uvqk3(ToBf16(x));
    AppendKvParams<bf16> skip = from_rows;
    skip.kv.base = d_pool3.get();
    skip.new_kv_from_rows = true;
    HSTU_ASSERT_CUDA(cuda::LaunchAppendKvFromRows(rows, skip, nullptr));
    skip.uvqk = d_uvqk3.get();
    HSTU_ASSERT_CUDA(cuda::LaunchBiasSiluAppendKv(d_uvqk3.get(), rows, cols, d_bias.get(), skip,
                                                  nullptr));
    HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> expect3 = got;
    int rows_users = 0;
    for (int b = 0; b < c.B; ++b) {
      if (c.num_new[b] == 0 || !NewKvFromRows(true, true, c.num_tokens[b], c.num_new[b])) continue;
      ++rows_users;
      for (int64_t r = c.row_offsets[b]; r < c.row_offsets[b] + c.num_new[b]; ++r) {
        std::copy_n(got2.begin() + r * cols, cols, expect3.begin() + r * cols);
      }
    }
    const auto got3 = ToF32(d_uvqk3.Download());
    EXPECT_EQ(std::memcmp(got3.data(), expect3.data(), got3.size() * sizeof(float)), 0)
        << what << ": the pass with new_kv_from_rows (" << rows_users
        << " users through the rows) must write their rows whole";

    AppendKvParams<float> ca;
    ca.uvqk = got2.data();
    ca.uvqk_row_stride = cols;
    ca.row_offsets = c.row_offsets.data();
    ca.num_new = c.num_new.data();
    ca.kv = cv;
    cpu::AppendKv(ca);
    {
      std::vector<float> want3 = c.pool;  // cpu::AppendKv, the rows users' new slots as before
      for (int b = 0; b < c.B; ++b) {
        if (!NewKvFromRows(true, true, c.num_tokens[b], c.num_new[b])) continue;
        for (int t = 0; t < c.num_tokens[b]; ++t) {
          for (const float* row : {c.CpuView().K(b, t, 0), c.CpuView().V(b, t, 0)}) {
            const int64_t at = row - c.pool.data();
            std::copy_n(pool_before.begin() + at, hd, want3.begin() + at);
          }
        }
      }
      const auto pool3 = ToF32(d_pool3.Download());
      EXPECT_EQ(std::memcmp(pool3.data(), want3.data(), want3.size() * sizeof(float)), 0)
          << what << ": the append with new_kv_from_rows must leave the rows users' pages alone";
    }
    const auto pool_after = ToF32(d_pool.Download());
    ASSERT_EQ(pool_after.size(), c.pool.size());
    EXPECT_EQ(std::memcmp(pool_after.data(), c.pool.data(), c.pool.size() * sizeof(float)), 0)
        << what << ": pages differ from cpu::AppendKv of the post-SiLU rows";
    const auto pool2_after = ToF32(d_pool2.Download());
    EXPECT_EQ(std::memcmp(pool2_after.data(), c.pool.data(), c.pool.size() * sizeof(float)), 0)
        << what << ": LaunchAppendKvFromRows pages differ from cpu::AppendKv";
  }
}

TEST(CudaKernels, PagedAttentionAndAppendMatchCpu) {
  HSTU_SKIP_WITHOUT_GPU();
  std::mt19937 rng(4);
  struct Shape {
    int B, page_size, H, D, W, cached, nnew, cand, ctas, max_split = 64;
    bool expect_two_chunks = false;
  };
  const Shape shapes[] = {
      {1, 16, 2, 64, 0, 0, 1, 1, 264},       // one token, one candidate
      {1, 32, 4, 256, 0, 700, 70, 90, 264},  // one long user: split over keys
      {3, 64, 2, 128, 0, 300, 130, 65, 1},   // no split at all
      {5, 16, 2, 256, 37, 200, 80, 20, 264}, // sliding window (TMA kernel)
      {8, 32, 1, 64, 0, 150, 65, 3, 4096},   // many splits of few blocks
      {17, 64, 2, 128, 0, 120, 40, 17, 264}, // 17 users with edge cases
      {17, 16, 2, 64, 5, 90, 30, 5, 264},    // tiny window
      {2, 7, 2, 128, 0, 100, 20, 10, 264},   // odd page size
      {2, 64, 4, 256, 0, 1000, 128, 256, 132},  // decode-step shape (base heads), split
      {3, 17, 1, 256, 0, 0, 200, 129, 1},    // no cache, no split; 2nd warpgroup partly empty
      // D = 256 without a window takes the warp-specialised TMA kernel: boxes of 64/32/16/8 rows.
      {17, 32, 2, 256, 0, 300, 90, 40, 264},  // 17 users with edge cases, split
      {4, 16, 4, 256, 0, 400, 70, 30, 1},     // 16-row boxes, no split
      {3, 8, 1, 256, 0, 250, 60, 20, 264},    // 8-row boxes (32 per tile)
      {2, 128, 2, 256, 0, 500, 100, 60, 264}, // pages of two 64-key blocks
      // At most two chunks a tile (the batch-8 decode plan's shape of split).
      {8, 32, 4, 256, 0, 900, 128, 256, 4096, 2, true},  // decode-step shape, TMA kernel
      {5, 16, 2, 128, 0, 300, 70, 40, 4096, 2},    // 2-warpgroup kernel
      {3, 32, 2, 256, 50, 400, 90, 30, 4096, 2},   // TMA kernel with a window, two chunks
  };
  for (const Shape& s : shapes) {
    PagedCase c = MakeCase(rng, s.B, s.page_size, s.H, s.D, s.W, s.cached, s.nnew, s.cand);
    RunPagedCase(c, s.ctas,
                 ::testing::PrintToString(
                     std::vector<int>{s.B, s.page_size, s.H, s.D, s.W, s.ctas, s.max_split}),
                 s.max_split, s.expect_two_chunks);
  }
}

// Cluster plans (the warp-specialised kernel; each tile and head one cluster whose CTAs sum their
// chunks in distributed shared memory): against the CPU, with empty chunks, users without history
// or candidates, partial tiles and every cluster size. The split reduction is launched too (as in
// a graph replay) and must leave the output alone.
TEST(CudaKernels, ClusterAttentionMatchesCpu) {
  HSTU_SKIP_WITHOUT_GPU();
  int max_clusters = 0;
  HSTU_ASSERT_CUDA(cuda::HstuAttentionMaxClusters(8, &max_clusters));
  ASSERT_GT(max_clusters, 0) << "no cluster of 8 attention CTAs fits this GPU";
  std::mt19937 rng(12);
  struct Shape { int B, page_size, H, cached, nnew, cand, cluster, W = 0; };
  const Shape shapes[] = {
      {1, 32, 4, 4000, 128, 256, 8},  // the batch-1 decode step
      {1, 32, 4, 4000, 128, 256, 8, 512},  // the same with a window: chunks of 1-2 blocks
      {3, 8, 1, 250, 60, 20, 4, 70},  // a short window, empty chunks
      {17, 32, 2, 300, 90, 40, 8},    // 17 users with edge cases: empty chunks, no history
      {3, 8, 1, 250, 60, 20, 4},      // 8-row boxes, clusters of 4
      {2, 16, 4, 90, 20, 130, 2},     // clusters of 2
      {4, 64, 2, 2000, 150, 3, 8},    // 64-row boxes, a 1-candidate user
  };
  for (const Shape& s : shapes) {
    PagedCase c = MakeCase(rng, s.B, s.page_size, s.H, 256, s.W, s.cached, s.nnew, s.cand);
    RunPagedCase(c, /*concurrent_ctas=*/1,
                 "cluster " + ::testing::PrintToString(std::vector<int>{s.B, s.page_size, s.H,
                                                                       s.cached, s.cluster, s.W}),
                 64, false, s.cluster);
  }
}

// New K/V through the rows (AttentionParams::new_kv_from_rows, the warp-specialised kernel): the
// attention against the CPU and the pages it stores against cpu::AppendKv. All-fresh batches (the
// no-cache block), mixed ones (every 5th user fresh, MakeCase), returning users whose cached
// prefix is whole 64-key blocks (align 64: every even user; the odd ones' prefixes mostly are not,
// and go through the append), every TMA box height, split, unsplit and cluster plans, partial
// last blocks.
TEST(CudaKernels, NewKvFromRowsReadAndStoredToPages) {
  HSTU_SKIP_WITHOUT_GPU();
  std::mt19937 rng(19);
  struct Shape { int B, page_size, H, cached, nnew, cand, ctas, cluster, align, W = 0; };
  const Shape shapes[] = {
      {4, 32, 2, 0, 700, 50, 264, 0, 1},      // all fresh, long histories, split tiles
      {4, 32, 2, 0, 700, 50, 264, 0, 1, 130}, // the same with a window
      {8, 32, 4, 4000, 128, 256, 264, 0, 64, 300},  // returning users, decode, a window
      {17, 16, 2, 500, 200, 40, 264, 0, 64, 77},    // edge cases, unaligned users, a window
      {3, 64, 4, 0, 1000, 256, 1, 0, 1},      // all fresh, no split (the no-cache block's plan)
      {17, 32, 2, 300, 90, 40, 264, 0, 1},    // mixed users with edge cases
      {5, 8, 1, 0, 333, 7, 264, 0, 1},        // 8-row boxes, partial last blocks
      {6, 16, 2, 120, 200, 30, 4096, 0, 1},   // 16-row boxes, many chunks
      {2, 128, 2, 0, 515, 60, 264, 0, 1},     // pages of two 64-key blocks
      {1, 32, 4, 0, 128, 256, 1, 8, 1},       // a fresh decode-size user in a cluster plan
      {3, 16, 2, 100, 150, 20, 1, 4, 1},      // mixed, clusters of 4
      {8, 32, 4, 4000, 128, 256, 264, 0, 64}, // returning users at whole blocks (decode, split)
      {8, 64, 2, 900, 256, 256, 1, 0, 64},    // the same, unsplit, two history tiles a user
      {17, 16, 2, 500, 200, 40, 264, 0, 64},  // with edge cases and unaligned users beside them
      {1, 32, 4, 4000, 128, 256, 1, 8, 64},   // the batch-1 decode step's cluster plan
      {1, 32, 4, 4000, 128, 256, 1, 8, 64, 300},  // the same with a window
      {3, 128, 2, 700, 300, 20, 4096, 0, 64}, // prefixes ending mid-page, many chunks
      {5, 8, 1, 400, 170, 7, 1, 4, 64},       // 8-row boxes, clusters of 4
  };
  for (const Shape& s : shapes) {
    // Then the same shape with the pages not kept (store_new_kv off): those users' pages
    // untouched, the output as before.
    for (bool store : {true, false}) {
      PagedCase c =
          MakeCase(rng, s.B, s.page_size, s.H, 256, s.W, s.cached, s.nnew, s.cand, s.align);
      RunPagedCase(c, s.ctas,
                   std::string(store ? "rows " : "rows, not stored ") +
                       ::testing::PrintToString(std::vector<int>{s.B, s.page_size, s.H, s.cached,
                                                                 s.nnew, s.cluster, s.align, s.W}),
                   64, false, s.cluster, /*kv_from_rows=*/true, store);
    }
  }
  // Refused where the users' K/V would be read from nowhere: the 2-warpgroup kernel (D = 128),
  // and rows the allocation does not hold.
  PagedCase c = MakeCase(rng, 2, 16, 2, 128, 0, 0, 50, 5);
  DeviceArray<bf16> d_pool(ToBf16(c.pool)), d_uvqk(ToBf16(c.uvqk)), d_out(c.rows() * 256);
  DeviceArray<int32_t> d_ro(c.row_offsets), d_nn(c.num_new), d_nt(c.num_tokens),
      d_pi(c.page_indptr), d_pids(c.page_ids);
  const cuda::AttentionPlan plan = cuda::PlanHstuAttention(
      c.row_offsets.data(), c.num_new.data(), c.num_tokens.data(), c.B, 0, c.H, 1, 1);
  std::vector<int32_t> item_words(plan.items.size() * sizeof(cuda::AttentionWorkItem) / 4);
  std::memcpy(item_words.data(), plan.items.data(), item_words.size() * 4);
  DeviceArray<int32_t> d_items(item_words);
  AttentionParams<bf16> gp;
  gp.uvqk = d_uvqk.get();
  gp.uvqk_row_stride = 4 * 256;
  gp.uvqk_rows = c.rows();
  gp.new_kv_from_rows = true;
  gp.out = d_out.get();
  gp.num_rows = c.rows();
  gp.row_offsets = d_ro.get();
  gp.num_new = d_nn.get();
  gp.kv = MakePagedKvView(d_pool.get(), c.page_size, c.H, c.D, c.B, d_pi.get(), d_pids.get(),
                          d_nt.get());
  gp.alpha = 0.1f;
  gp.inv_norm = 0.01f;
  const auto* items = reinterpret_cast<const cuda::AttentionWorkItem*>(d_items.get());
  const int32_t n = static_cast<int32_t>(plan.items.size());
  EXPECT_EQ(cuda::LaunchHstuAttention(gp, items, n, 0, nullptr, nullptr), cudaErrorInvalidValue)
      << "head dim 128 has no kernel that reads K/V from the rows";
  AttentionParams<bf16> g256 = gp;
  g256.kv = MakePagedKvView(d_pool.get(), c.page_size, 1, 256, c.B, d_pi.get(), d_pids.get(),
                            d_nt.get());
  g256.uvqk_row_stride = 4 * 256;
  g256.uvqk_rows = c.rows() - 1;
  EXPECT_EQ(cuda::LaunchHstuAttention(g256, items, n, 0, nullptr, nullptr), cudaErrorInvalidValue)
      << "uvqk_rows below num_rows";
  g256.uvqk_rows = c.rows();
  HSTU_ASSERT_CUDA(cuda::LaunchHstuAttention(g256, items, n, 0, nullptr, nullptr));
  HSTU_ASSERT_CUDA(cudaDeviceSynchronize());
}

TEST(CudaKernels, AttentionRejectsBadArguments) {
  HSTU_SKIP_WITHOUT_GPU();
  AttentionParams<bf16> p;
  DeviceArray<bf16> buf(4096);
  p.uvqk = buf.get();
  p.out = buf.get();
  p.kv.base = buf.get();
  p.kv.num_heads = 1;
  p.kv.head_dim = 96;
  p.kv.page_size = 16;
  p.uvqk_row_stride = 4 * 96;
  // The batch's metadata is present, so that each case below fails on its own check.
  DeviceArray<int32_t> meta(64);
  p.row_offsets = p.num_new = p.kv.indptr = p.kv.page_ids = p.kv.num_tokens = meta.get();
  cuda::AttentionWorkItem* items = nullptr;
  EXPECT_EQ(cuda::LaunchHstuAttention(p, items, 0, 0, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_FALSE(cuda::HeadDimSupported(96));
  EXPECT_TRUE(cuda::HeadDimSupported(256));
  // A supported head dim, but split tiles without partials, or more split tiles than items.
  p.kv.head_dim = 64;
  p.uvqk_row_stride = 4 * 64;
  p.kv.kv_stride = 16 * 64;
  p.kv.page_stride = 2 * p.kv.kv_stride;
  const auto* some_items = reinterpret_cast<const cuda::AttentionWorkItem*>(buf.get());
  EXPECT_EQ(cuda::LaunchHstuAttention(p, some_items, 2, 1, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchHstuAttention(p, some_items, 2, 3, reinterpret_cast<float*>(buf.get()),
                                      nullptr),
            cudaErrorInvalidValue);
  // Cluster plans: only D = 256 (the warp-specialised kernel), sizes 2/4/8 dividing the items, no
  // split tiles.
  EXPECT_EQ(cuda::LaunchHstuAttention(p, some_items, 8, 0, nullptr, nullptr, 8),
            cudaErrorInvalidValue);  // D = 64
  p.kv.head_dim = 256;
  p.uvqk_row_stride = 4 * 256;
  p.kv.kv_stride = 16 * 256;
  p.kv.page_stride = 2 * p.kv.kv_stride;
  EXPECT_EQ(cuda::LaunchHstuAttention(p, some_items, 9, 0, nullptr, nullptr, 3),
            cudaErrorInvalidValue);  // 3 does not divide a 128-row tile
  EXPECT_EQ(cuda::LaunchHstuAttention(p, some_items, 12, 0, nullptr, nullptr, 8),
            cudaErrorInvalidValue);  // 12 items are not whole clusters of 8
  EXPECT_EQ(cuda::LaunchHstuAttention(p, some_items, 8, 1, reinterpret_cast<float*>(buf.get()),
                                      nullptr, 8),
            cudaErrorInvalidValue);  // split tiles in a cluster plan
  EXPECT_EQ(cuda::LaunchHstuAttention(p, some_items, 16, 0, nullptr, nullptr, 16),
            cudaErrorInvalidValue);  // beyond the portable cluster size
  // Rows and pool not 16-byte aligned (the kernels load 16 bytes at a time: a misaligned pool
  // took the cp.async kernel and faulted), or a batch without its metadata.
  auto expect_rejected = [&](AttentionParams<bf16> q, const char* what) {
    EXPECT_EQ(cuda::LaunchHstuAttention(q, some_items, 3, 0, nullptr, nullptr), cudaErrorInvalidValue)
        << what;
  };
  AttentionParams<bf16> q = p;
  q.uvqk = buf.get() + 1;
  expect_rejected(q, "uvqk misaligned");
  q = p;
  q.out = buf.get() + 4;
  expect_rejected(q, "out misaligned");
  q = p;
  q.kv.base = buf.get() + 2;
  expect_rejected(q, "pool misaligned");
  q = p;
  q.kv.base = nullptr;
  expect_rejected(q, "no pool");
  q = p;
  q.row_offsets = nullptr;
  expect_rejected(q, "no row offsets");
  q = p;
  q.kv.page_ids = nullptr;
  expect_rejected(q, "no page ids");
  q = p;
  q.kv.num_tokens = nullptr;
  expect_rejected(q, "no token counts");
  HSTU_ASSERT_CUDA(cudaGetLastError());  // nothing was launched
}

}  // namespace
}  // namespace hstu
