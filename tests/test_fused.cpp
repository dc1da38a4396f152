// Tests of the fused kernel (include/qkv/detail/fused_attention.hpp, Backend::fused) against the float64
// reference (reference.hpp, itself checked against an independent brute force in test_reference.cpp).
//
// Criterion (docs/design.md, Accuracy; FlashAttention's own test rule): over each call's output, the fused float
// error against float64 is at most 2 × the error of a plain float implementation (materialized S, softmax and
// P·V, all in float: support/plain_float.hpp) + 1e-6·max(1, max|V|); NaN appears exactly where float64 has NaN.
// A randomized grid over D, Sq, Skv, every option and combinations, GQA groups, BSHD and BHSD strides and varlen
// batches; the `quick` label runs a slice (the Quick suite), `full` all of it (QKV_FUSED_FULL=1).
//
// Every case runs on two kernels against the same float64 and plain float results: the one isa.hpp chose (through
// qkv::attention) and the kernel instantiated on the emulated 16-lane tag (support/emulated_tag.hpp), so that
// AVX-512's tile shapes, tails and masks run on any CPU (QKV_SKIP_EMULATED=1 leaves the latter out).
#include "support/run_fused_with.hpp"  // the emulated 16-lane tag (its place here: support/emulated_tag.hpp)
// The line above stays apart from the headers below.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/simd/simd.hpp"
#include "support/options.hpp"
#include "support/plain_float.hpp"
#include "support/type_lists.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "support/counting_allocator.hpp"  // this file is the one translation unit of test_fused that includes it

namespace {

using qkv::Index;

/// The kernels every case runs on: the one isa.hpp chose (qkv::attention, Backend::fused) and the fused kernel
/// instantiated on the emulated 16-lane tag (qkv_test::fused_attention_with: AVX-512's tile shapes on any CPU).
enum class Kernel { dispatched, emulated16 };
constexpr Kernel kKernels[] = {Kernel::dispatched, Kernel::emulated16};

const char* kernel_name(Kernel kernel) {
  return kernel == Kernel::emulated16 ? "emulated 16-lane kernel" : "kernel isa.hpp chose";
}

/// QKV_SKIP_EMULATED=1 leaves the emulated kernel out: for runs that would repeat another run's emulated cases (it
/// does not depend on QKV_ISA, and .ci/run runs the suite under several pins) or cannot afford them (valgrind; the
/// sanitize stage checks its memory accesses with ASan).
bool skip_emulated() { return std::getenv("QKV_SKIP_EMULATED") != nullptr; }

/// The fused kernel on q, k, v → out (and lse where not null) on the chosen kernel; options.backend must be fused.
void run_kernel(Kernel kernel, const qkv::TensorView4<const float>& q, const qkv::TensorView4<const float>& k,
                const qkv::TensorView4<const float>& v, const qkv::TensorView4<float>& out,
                const qkv::TensorView3<float>* lse, const qkv::AttentionOptions<float>& options) {
  if (kernel == Kernel::emulated16) {
    qkv_test::fused_attention_with(qkv_test::Emulated16Tag(), q, k, v, out, lse, options);
  } else if (lse != nullptr) {
    qkv::attention(q, k, v, out, *lse, options);
  } else {
    qkv::attention(q, k, v, out, options);
  }
}

/// A case: its shape (brute::Shape: B, Hq, Hkv, Sq, Skv, D, Dv), layout, options and the storage behind them.
struct Case : brute::Shape {
  bool bshd = false;
  qkv::AttentionOptions<float> options{};
  std::vector<float> bias{};  // storage behind options.bias
  std::vector<char> allowed{};
  /// Component 0 of every key set to 3e38 and of every query to 0: the scores do not change (0 · 3e38 = 0 in float
  /// and double), but the base-2 check's bound Σ|q'|·max|k| (begin_prefill, base2_fits) passes FLT_MAX as soon
  /// as Σ|q'| of some row of a task exceeds 1.14, so that task runs its softmax in base e. Without softcap, bias or
  /// ALiBi (whose tasks are checked score by score instead) and with D ≥ 3 every prefill task of the grid below
  /// does: its rows' Σ|q'| are far above 1.14.
  bool huge_unused_key_component = false;
  std::string describe() const {
    std::ostringstream s;
    s << "B " << B << " Hq " << Hq << " Hkv " << Hkv << " Sq " << Sq << " Skv " << Skv << " D " << D << " Dv " << Dv
      << (bshd ? " bshd" : " bhsd") << " causal " << options.causal << " align "
      << (options.alignment == qkv::CausalAlignment::top_left ? "tl" : "br") << " window " << options.window_left << ","
      << options.window_right << " global " << options.global_tokens << " softcap " << options.softcap
      << " key_lengths " << options.key_lengths.size() << " bias " << !bias.empty() << " allowed " << !allowed.empty()
      << " alibi " << options.alibi_slopes.size() << " sinks " << options.sinks.size() << " varlen "
      << options.cu_seqlens_q.size() << (huge_unused_key_component ? " huge unused key component" : "");
    return s.str();
  }
};

template <class T>
qkv::TensorView4<T> make_view(T* data, Index B, Index H, Index S, Index D, bool bshd) {
  return bshd ? qkv::view_bshd(data, B, S, H, D) : qkv::view_bhsd(data, B, H, S, D);
}

/// Runs one case on both kernels (Kernel): fused vs float64 reference vs plain float, the two computed once; asserts
/// the accuracy rule and NaN placement for each kernel.
void check_case(Case& c, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const Index q_rows = c.options.cu_seqlens_q.empty() ? c.Sq : c.options.cu_seqlens_q.back();
  const Index k_rows = c.options.cu_seqlens_k.empty() ? c.Skv : c.options.cu_seqlens_k.back();
  std::vector<float> qd(static_cast<std::size_t>(c.B * c.Hq * q_rows * c.D)),
      kd(static_cast<std::size_t>(c.B * c.Hkv * k_rows * c.D)),
      vd(static_cast<std::size_t>(c.B * c.Hkv * k_rows * c.Dv));
  for (auto& x : qd) x = 2.0f * normal(rng);
  for (auto& x : kd) x = 2.0f * normal(rng);
  for (auto& x : vd) x = normal(rng);
  if (c.huge_unused_key_component && c.D > 0) {
    const auto q_mut = make_view<float>(qd.data(), c.B, c.Hq, q_rows, c.D, c.bshd);
    const auto k_mut = make_view<float>(kd.data(), c.B, c.Hkv, k_rows, c.D, c.bshd);
    for (Index b = 0; b < c.B; ++b) {
      for (Index h = 0; h < c.Hq; ++h)
        for (Index i = 0; i < q_rows; ++i) q_mut(b, h, i, 0) = 0.0f;
      for (Index h = 0; h < c.Hkv; ++h)
        for (Index j = 0; j < k_rows; ++j) k_mut(b, h, j, 0) = 3e38f;
    }
  }
  const std::size_t n_out = static_cast<std::size_t>(c.B * c.Hq * q_rows * c.Dv);
  const std::size_t n_lse = static_cast<std::size_t>(c.B * c.Hq * q_rows);
  std::vector<float> plain(n_out, 0.0f);
  std::vector<double> qd64(qd.begin(), qd.end()), kd64(kd.begin(), kd.end()), vd64(vd.begin(), vd.end()), ref(n_out),
      ref_lse(n_lse);
  const auto q = make_view<const float>(qd.data(), c.B, c.Hq, q_rows, c.D, c.bshd);
  const auto k = make_view<const float>(kd.data(), c.B, c.Hkv, k_rows, c.D, c.bshd);
  const auto v = make_view<const float>(vd.data(), c.B, c.Hkv, k_rows, c.Dv, c.bshd);
  c.options.backend = qkv::Backend::fused;
  const brute::Params call = qkv_test::to_brute(c.options, c);  // the call as the support helpers take it
  qkv_test::plain_float(q, k, v, call, make_view(plain.data(), c.B, c.Hq, q_rows, c.Dv, c.bshd), {});

  const auto o64 = qkv_test::from_brute<double>(call, qkv::Backend::reference);
  qkv::attention(make_view<const double>(qd64.data(), c.B, c.Hq, q_rows, c.D, c.bshd),
                 make_view<const double>(kd64.data(), c.B, c.Hkv, k_rows, c.D, c.bshd),
                 make_view<const double>(vd64.data(), c.B, c.Hkv, k_rows, c.Dv, c.bshd),
                 make_view(ref.data(), c.B, c.Hq, q_rows, c.Dv, c.bshd),
                 qkv::TensorView3<double>(ref_lse.data(), {c.B, c.Hq, q_rows}), o64.options);

  double err_plain = 0, max_v = 0;
  for (float x : vd) max_v = std::max(max_v, std::fabs(double(x)));
  for (std::size_t n = 0; n < n_out; ++n) {
    if (!std::isnan(ref[n])) err_plain = std::max(err_plain, std::fabs(plain[n] - ref[n]));
  }

  for (Kernel kernel : kKernels) {
    if (kernel == Kernel::emulated16 && skip_emulated()) continue;
    std::vector<float> fused(n_out, -7.0f), fused_lse(n_lse);
    const qkv::TensorView3<float> fused_lse_view(fused_lse.data(), {c.B, c.Hq, q_rows});
    run_kernel(kernel, q, k, v, make_view(fused.data(), c.B, c.Hq, q_rows, c.Dv, c.bshd), &fused_lse_view, c.options);
    const std::string what = c.describe() + " on the " + kernel_name(kernel);
    double err_fused = 0;
    for (std::size_t n = 0; n < n_out; ++n) {
      ASSERT_EQ(std::isnan(fused[n]), std::isnan(ref[n])) << what << " element " << n;
      if (!std::isnan(ref[n])) err_fused = std::max(err_fused, std::fabs(fused[n] - ref[n]));
    }
    EXPECT_LE(err_fused, 2 * err_plain + 1e-6 * std::max(1.0, max_v))
        << what << " (fused error " << err_fused << ", plain float error " << err_plain << ")";
    for (std::size_t n = 0; n < n_lse; ++n) {
      if (std::isinf(ref_lse[n])) {
        EXPECT_EQ(fused_lse[n], float(ref_lse[n])) << what << " lse " << n;
      } else if (!std::isnan(ref_lse[n])) {
        EXPECT_NEAR(fused_lse[n], ref_lse[n], 1e-4 * std::max(1.0, std::fabs(ref_lse[n]))) << what << " lse " << n;
      }
    }
  }
}

/// A random case: shapes from the given lists, options switched on at random.
Case random_case(std::mt19937& rng, const std::vector<Index>& dims, Index max_len) {
  auto pick = [&](Index lo, Index hi) { return std::uniform_int_distribution<Index>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  Case c;
  c.D = dims[static_cast<std::size_t>(pick(0, static_cast<Index>(dims.size()) - 1))];
  c.Dv = coin(0.7) ? c.D : dims[static_cast<std::size_t>(pick(0, static_cast<Index>(dims.size()) - 1))];
  const Index groups[] = {1, 1, 2, 4, 8};
  c.Hkv = pick(1, 2);
  c.Hq = c.Hkv * groups[pick(0, 4)];
  if (coin(0.15)) c.Hkv = 1;  // MQA
  c.B = pick(1, 2);
  c.Sq = coin(0.2) ? pick(0, 3) : pick(1, max_len);
  c.Skv = coin(0.1) ? pick(0, 2) : pick(1, max_len);
  c.bshd = coin(0.5);
  auto& o = c.options;
  o.causal = coin(0.5);
  o.alignment = coin(0.5) ? qkv::CausalAlignment::bottom_right : qkv::CausalAlignment::top_left;
  if (coin(0.3)) o.window_left = pick(0, 40);
  if (coin(0.2)) o.window_right = pick(0, 40);
  if (coin(0.15)) o.global_tokens = pick(1, 8);
  if (coin(0.15)) o.softcap = 5.0f;
  if (coin(0.15)) o.scale = 0.3f;
  if (coin(0.2)) {
    for (Index b = 0; b < c.B; ++b) o.key_lengths.push_back(pick(0, c.Skv));
  }
  if (coin(0.15)) {
    for (Index h = 0; h < c.Hq; ++h) o.alibi_slopes.push_back(std::ldexp(1.0f, -static_cast<int>(h + 1)));
  }
  if (coin(0.15)) {
    for (Index h = 0; h < c.Hq; ++h) o.sinks.push_back(static_cast<float>(pick(-3, 3)));
  }
  if (coin(0.15)) {  // bias [1, Hq, Sq, Skv] with some −∞
    c.bias.resize(static_cast<std::size_t>(c.Hq * c.Sq * c.Skv));
    std::normal_distribution<float> normal;
    for (auto& x : c.bias) x = coin(0.1) ? -std::numeric_limits<float>::infinity() : normal(rng);
    o.bias = qkv::TensorView4<const float>(c.bias.data(), {1, c.Hq, c.Sq, c.Skv});
  }
  if (coin(0.15)) {  // allowed [B, 1, 1, Skv]
    c.allowed.resize(static_cast<std::size_t>(c.B * c.Skv));
    for (auto& x : c.allowed) x = coin(0.8) ? 1 : 0;
    o.allowed = qkv::TensorView4<const bool>(reinterpret_cast<const bool*>(c.allowed.data()), {c.B, 1, 1, c.Skv});
  }
  // Whether the views are set, not whether their vectors are empty: with Sq·Skv = 0 the bias vector is empty but
  // options.bias is still set (extents {1, Hq, 0, Skv}), and varlen rejects it.
  const bool bias_or_allowed =
      !c.bias.empty() || !c.allowed.empty() || o.bias.extent(1) != 0 || o.allowed.extent(0) != 0;
  if (!bias_or_allowed && o.key_lengths.empty() && coin(0.15)) {  // varlen batch of 3
    c.B = 1;
    o.cu_seqlens_q = {0};
    o.cu_seqlens_k = {0};
    for (int s = 0; s < 3; ++s) {
      o.cu_seqlens_q.push_back(o.cu_seqlens_q.back() + pick(0, max_len / 2));
      o.cu_seqlens_k.push_back(o.cu_seqlens_k.back() + pick(0, max_len / 2));
    }
    c.Sq = o.cu_seqlens_q.back();
    c.Skv = o.cu_seqlens_k.back();
  }
  return c;
}

/// Sanitizer and valgrind runs set QKV_REDUCED_GRID=1 (their test presets): shorter sequences, fewer trials.
bool reduced_grid() { return std::getenv("QKV_REDUCED_GRID") != nullptr; }

/// The tile sizes of the emulated 16-lane kernel (AVX-512's), for the tests that aim at its tile edges.
using Tiles16 = qkv_test::emulated_pass::FusedTiles<qkv_test::Emulated16Tag>;

struct FusedGrid : ::testing::TestWithParam<int> {};

TEST_P(FusedGrid, QuickSlice) {
  std::mt19937 rng(static_cast<unsigned>(1000 + GetParam()));
  const std::vector<Index> dims = {1, 3, 8, 15, 16, 33, 64, 80};
  const int trials = reduced_grid() ? 2 : 6;
  for (int trial = 0; trial < trials; ++trial) {
    Case c = random_case(rng, dims, reduced_grid() ? 120 : 300);
    check_case(c, static_cast<unsigned>(GetParam() * 100 + trial));
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, FusedGrid, ::testing::Range(0, 16));

TEST(FusedGridFull, WholeGrid) {
  if (std::getenv("QKV_FUSED_FULL") == nullptr) GTEST_SKIP() << "set QKV_FUSED_FULL=1 (ctest label full)";
  std::mt19937 rng(77);
  const std::vector<Index> dims = {1, 3, 8, 15, 16, 33, 64, 80, 96, 128, 256};
  for (int trial = 0; trial < 400; ++trial) {
    Case c = random_case(rng, dims, 1000);
    check_case(c, static_cast<unsigned>(trial));
    if (HasFailure()) return;
  }
}

TEST(Fused, PrefillInBaseEWhereBase2WouldOverflow) {
  // The prefill softmax in base e (taken where a score could pass FLT_MAX / log2 e ≈ 2.4e38 in base 2) under the
  // grid's accuracy rule, with every option but softcap and ALiBi: see Case::huge_unused_key_component. (Changing
  // the base-e exp to exp2 makes this test fail.)
  std::mt19937 rng(2468);
  const std::vector<Index> dims = {3, 8, 16, 33, 64, 80};
  for (int trial = 0; trial < (reduced_grid() ? 6 : 16); ++trial) {
    Case c = random_case(rng, dims, reduced_grid() ? 120 : 300);
    c.options.softcap = 0.0f;
    c.options.alibi_slopes.clear();
    c.huge_unused_key_component = true;
    check_case(c, static_cast<unsigned>(500 + trial));
    if (HasFailure()) return;
  }
}

TEST(Fused, PrefillRerunInBaseEAfterALateOverflow) {
  // A bias of 3e38 at one late (row, key), in the last key tile (3 of 3 with 256-key tiles, 2 of 2 with 16 lanes'
  // 512): the base-2 run of the task has already updated every row's max, sum and output through the earlier key
  // tiles and most strips of the last when the finished score overflows; the task must start again in base e from a
  // clean state. GQA 2/1 (80 stacked rows), causal, against the float64 reference under the grid's rule; that row is
  // one-hot on the biased key.
  Case c{{1, 2, 1, 40, 600, 16, 16}};
  c.options.causal = true;
  c.options.alignment = qkv::CausalAlignment::bottom_right;
  c.bias.assign(static_cast<std::size_t>(c.Hq * c.Sq * c.Skv), 0.0f);
  c.bias[static_cast<std::size_t>((1 * c.Sq + 30) * c.Skv + 550)] = 3e38f;  // head 1, query 30, key 550 (visible)
  c.options.bias = qkv::TensorView4<const float>(c.bias.data(), {1, c.Hq, c.Sq, c.Skv});
  check_case(c, 31);
}

/// Pins the calling thread's OpenMP team to one thread while it lives, then restores the count. Prefill groups shrink
/// on a team until each thread has kPrefillGroupsPerThread of them: the group tests' shapes, a few query tiles, keep
/// their groups on one thread only.
struct OneThread {
#if defined(_OPENMP)
  const int before = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(before); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;
#else
  OneThread() {}  // nothing to pin without OpenMP
#endif
};

// A (sequence, kv head) whose packed K and V exceed kPrefillGroupBytes (more than 4096 keys at D = Dv = 128 on every
// tag) runs its query tiles in groups of kPrefillGroupTiles, key chunk by key chunk (2048 keys), each tile keeping its
// softmax state from one chunk to the next (fused_attention.hpp, run_prefill_group). Every option of the grid against
// the float64 reference under its rule: tiles whose keys end inside a chunk (causal, windows, key_lengths), groups of
// fewer tiles than kPrefillGroupTiles, a varlen batch with an ungrouped sequence beside a grouped one.
TEST(Fused, PrefillGroupsTakeTheirKeysChunkByChunk) {
  const OneThread one_thread;  // these shapes' few query tiles would go alone on a team (kPrefillGroupsPerThread)
  static_assert(Tiles16::kPrefillChunkBytes / (256 * sizeof(float)) == 2048, "chunks of 2048 keys at D = Dv = 128");
  static_assert(Tiles16::kPrefillGroupBytes / (256 * sizeof(float)) == 4096, "groups past 4096 keys at D = Dv = 128");
  std::mt19937 rng(5150);
  auto pick = [&](Index lo, Index hi) { return std::uniform_int_distribution<Index>(lo, hi)(rng); };
  for (int trial = 0; trial < (reduced_grid() ? 1 : 6); ++trial) {
    Case c = random_case(rng, {128}, 300);  // the options; the shape is set below
    qkv::AttentionOptions<float>& o = c.options;
    c.D = c.Dv = 128;
    c.B = 1;
    c.Hkv = reduced_grid() ? 1 : pick(1, 2);
    c.Hq = c.Hkv * pick(1, 2);
    c.Sq = reduced_grid() ? pick(100, 140) : pick(97, 260);  // 2 to 6 query tiles (48 or 96 rows each)
    c.Skv = reduced_grid() ? pick(4100, 4400) : pick(4097, 6500);
    if (!o.alibi_slopes.empty()) {
      o.alibi_slopes.clear();
      for (Index h = 0; h < c.Hq; ++h) o.alibi_slopes.push_back(std::ldexp(1.0f, -static_cast<int>(h + 1)));
    }
    if (!o.sinks.empty()) o.sinks.assign(static_cast<std::size_t>(c.Hq), 1.5f);
    if (!o.key_lengths.empty()) o.key_lengths = {pick(4097, c.Skv)};  // still past kPrefillGroupBytes
    if (!c.bias.empty() || o.bias.extent(1) != 0) {
      c.bias.assign(static_cast<std::size_t>(c.Hq * c.Sq * c.Skv), 0.25f);
      c.bias[7] = -std::numeric_limits<float>::infinity();
      o.bias = qkv::TensorView4<const float>(c.bias.data(), {1, c.Hq, c.Sq, c.Skv});
    }
    if (!c.allowed.empty() || o.allowed.extent(0) != 0) {
      c.allowed.assign(static_cast<std::size_t>(c.Skv), 1);
      for (Index j = 0; j < c.Skv; j += 5) c.allowed[static_cast<std::size_t>(j)] = 0;
      o.allowed = qkv::TensorView4<const bool>(reinterpret_cast<const bool*>(c.allowed.data()), {1, 1, 1, c.Skv});
    }
    if (!o.cu_seqlens_q.empty()) {  // an ungrouped sequence, an empty one, a grouped one (two query tiles or more)
      o.cu_seqlens_q = {0, 100, 100, c.Sq + 100};
      o.cu_seqlens_k = {0, 1500, 1900, c.Skv + 1900};
      c.Sq += 100;
      c.Skv += 1900;
    }
    check_case(c, static_cast<unsigned>(600 + trial));
    if (HasFailure()) return;
  }
}

TEST(Fused, PrefillGroupRerunsOneTileInBaseEAfterAnOverflowInALaterChunk) {
  // A bias of 3e38 at query 60 of 200 (the second of five tiles of 48 query rows, 96 stacked, GQA 2/1; of three tiles
  // in the reduced grid's 100 rows) and key 2300, in the second chunk of 2048 keys: the group's tiles have taken the
  // first in base 2 when that tile's finished score overflows; that tile alone runs again in base e from a clean
  // state, the others go on in base 2 with their state. Causal, bottom-right (row i sees keys up to i + Skv − Sq, so
  // key 2300 is visible to every row), against the float64 reference under the grid's rule; that row is one-hot on
  // the biased key. On one thread (OneThread): on two, these few tiles would go alone. The reduced grid (the
  // sanitizers' runs: the full shape took 114 s there on a Zen 5, most of it in plain_float before it indexed its data
  // directly) takes 4200 keys, still past kPrefillGroupBytes.
  const OneThread one_thread;
  Case c{{1, 2, 1, reduced_grid() ? 100 : 200, reduced_grid() ? 4200 : 4400, 128, 128}};
  c.options.causal = true;
  c.options.alignment = qkv::CausalAlignment::bottom_right;
  c.bias.assign(static_cast<std::size_t>(c.Hq * c.Sq * c.Skv), 0.0f);
  c.bias[static_cast<std::size_t>((1 * c.Sq + 60) * c.Skv + 2300)] = 3e38f;
  c.options.bias = qkv::TensorView4<const float>(c.bias.data(), {1, c.Hq, c.Sq, c.Skv});
  check_case(c, 32);
}

TEST(Fused, DecodeSplitKEqualsOnePassAndHiddenNaNsDoNotLeak) {
  // Decoding shape (Sq = 1, GQA 8/2, Skv = 5000 > one split chunk): split-K merge vs the reference.
  Case c{{1, 8, 2, 1, 5000, 64, 64}};
  c.options.causal = true;
  check_case(c, 5);
  // NaN in hidden K/V slots: past key_lengths (not read) and under a false `allowed`.
  Case d{{1, 1, 1, 5, 40, 16, 16}};
  d.allowed.assign(40, 1);
  d.allowed[7] = 0;
  d.options.allowed = qkv::TensorView4<const bool>(reinterpret_cast<const bool*>(d.allowed.data()), {1, 1, 1, 40});
  d.options.key_lengths = {30};
  std::vector<float> q(5 * 16, 0.5f), k(40 * 16, 0.25f), v(40 * 16, 1.0f);
  for (Index dd = 0; dd < 16; ++dd) {
    k[static_cast<std::size_t>(7 * 16 + dd)] = v[static_cast<std::size_t>(7 * 16 + dd)] = std::nanf("");
    k[static_cast<std::size_t>(35 * 16 + dd)] = v[static_cast<std::size_t>(35 * 16 + dd)] = std::nanf("");
  }
  d.options.backend = qkv::Backend::fused;
  for (Kernel kernel : kKernels) {
    if (kernel == Kernel::emulated16 && skip_emulated()) continue;
    std::vector<float> out(5 * 16, 0.0f);
    run_kernel(kernel, qkv::view_bhsd<const float>(q.data(), 1, 1, 5, 16),
               qkv::view_bhsd<const float>(k.data(), 1, 1, 40, 16), qkv::view_bhsd<const float>(v.data(), 1, 1, 40, 16),
               qkv::view_bhsd(out.data(), 1, 1, 5, 16), nullptr, d.options);
    for (float x : out) EXPECT_FLOAT_EQ(x, 1.0f) << kernel_name(kernel);  // mean of the visible (all-one) values
  }
}

TEST(Fused, PrefillValuesReadInPlaceHideTheirNaNs) {
  // Float V whose rows abut and are one chunk of whole vectors wide (values_packed_as_stored: Dv = 16 or 64 on
  // AVX-512 and the emulated tag, 16 on AVX2) is read in place, not packed; its finiteness counts then come from
  // count_nonfinite_values. NaN and ±∞ values of keys hidden by `allowed` must not reach the output, as when V is
  // packed (Dv = 24, 72: packed on every tag): with all other values 1, every output is exactly 1. Sq = 40 > 16 rows,
  // so the prefill kernel; the poisoned keys fall in the first and in a later group of 64 keys.
  for (const Index Dv : {Index(16), Index(24), Index(64), Index(72)}) {
    const Index Sq = 40, Skv = 150, D = 16;
    Case c{{1, 1, 1, Sq, Skv, D, Dv}};
    c.allowed.assign(static_cast<std::size_t>(Skv), 1);
    const Index hidden[] = {3, 64, 100, 149};
    for (const Index j : hidden) c.allowed[static_cast<std::size_t>(j)] = 0;
    c.options.allowed = qkv::TensorView4<const bool>(reinterpret_cast<const bool*>(c.allowed.data()), {1, 1, 1, Skv});
    c.options.backend = qkv::Backend::fused;
    std::vector<float> q(static_cast<std::size_t>(Sq * D), 0.5f), k(static_cast<std::size_t>(Skv * D), 0.25f),
        v(static_cast<std::size_t>(Skv * Dv), 1.0f);
    const float poison[] = {std::nanf(""), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::nanf("")};
    for (int h = 0; h < 4; ++h) {
      for (Index d = 0; d < Dv; ++d) v[static_cast<std::size_t>(hidden[h] * Dv + d)] = poison[h];
    }
    for (Kernel kernel : kKernels) {
      if (kernel == Kernel::emulated16 && skip_emulated()) continue;
      std::vector<float> out(static_cast<std::size_t>(Sq * Dv), 0.0f);
      run_kernel(kernel, qkv::view_bhsd<const float>(q.data(), 1, 1, Sq, D),
                 qkv::view_bhsd<const float>(k.data(), 1, 1, Skv, D),
                 qkv::view_bhsd<const float>(v.data(), 1, 1, Skv, Dv), qkv::view_bhsd(out.data(), 1, 1, Sq, Dv),
                 nullptr, c.options);
      for (float x : out) ASSERT_EQ(x, 1.0f) << kernel_name(kernel) << ", Dv " << Dv;
    }
  }
}

// count_nonfinite_values (V read in place) leaves the counts pack_values leaves; values_packed_as_stored says when
// V's packed layout is V itself.
TEST(Fused, CountNonfiniteValuesIsPackValuesCounts) {
  using Tag = qkv_test::Emulated16Tag;
  namespace pass = qkv_test::emulated_pass;
  for (const Index skv : {Index(1), Index(63), Index(64), Index(200)}) {
    const Index Dv = 64;
    std::vector<float> v(static_cast<std::size_t>(skv * Dv));
    std::mt19937 rng(static_cast<unsigned>(skv));
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    for (auto& x : v) x = dist(rng);
    std::uint32_t poisoned = 0;
    for (const Index j : {Index(0), Index(62), Index(64), Index(131), Index(199)}) {
      if (j >= skv) continue;
      v[static_cast<std::size_t>(j * Dv + (j * 7) % Dv)] =
          j % 2 ? std::nanf("") : -std::numeric_limits<float>::infinity();
      ++poisoned;
    }
    std::vector<std::uint32_t> packed_counts(static_cast<std::size_t>(skv + 1), 99u), counts = packed_counts;
    std::vector<float> packed(static_cast<std::size_t>(skv * Dv));
    pass::pack_values<Tag>(v.data(), Dv, skv, Dv, packed.data(), packed_counts.data());
    pass::count_nonfinite_values<Tag>(v.data(), Dv, skv, Dv, counts.data());
    EXPECT_EQ(counts, packed_counts) << "skv " << skv;
    EXPECT_EQ(std::memcmp(packed.data(), v.data(), v.size() * sizeof(float)), 0) << "the same layout, skv " << skv;
    EXPECT_EQ(counts[static_cast<std::size_t>(skv)], poisoned) << "skv " << skv;
  }
  EXPECT_TRUE((pass::values_packed_as_stored<Tag, float>(64, 64)));
  EXPECT_TRUE((pass::values_packed_as_stored<Tag, float>(16, 16)));
  EXPECT_FALSE((pass::values_packed_as_stored<Tag, float>(128, 64)));  // rows apart (token-major)
  EXPECT_FALSE((pass::values_packed_as_stored<Tag, float>(72, 72)));   // two chunks
  EXPECT_FALSE((pass::values_packed_as_stored<Tag, float>(24, 24)));   // a chunk padded to whole vectors
  EXPECT_FALSE((pass::values_packed_as_stored<Tag, float>(0, 0)));
  EXPECT_FALSE((pass::values_packed_as_stored<Tag, Eigen::half>(64, 64)));  // converted to float
}

TEST(Fused, DecodeShapesWithEveryOption) {
  // Sq·G ≤ 16 reads K in place; long key ranges split into chunks. Every option, several seeds.
  std::mt19937 rng(4242);
  const std::vector<Index> dims = {3, 16, 64, 80, 128};
  for (int trial = 0; trial < (reduced_grid() ? 6 : 24); ++trial) {
    Case c = random_case(rng, dims, 3000);
    c.Sq = std::uniform_int_distribution<Index>(1, 2)(rng);
    if (!c.options.cu_seqlens_q.empty()) {
      c.options.cu_seqlens_q = {0, 1, 1, 2};
      c.Sq = 2;
    }
    if (!c.bias.empty()) {  // rebuild the bias for the new Sq
      c.bias.assign(static_cast<std::size_t>(c.Hq * c.Sq * c.Skv), 0.5f);
      c.bias[0] = -std::numeric_limits<float>::infinity();
      c.options.bias = qkv::TensorView4<const float>(c.bias.data(), {1, c.Hq, c.Sq, c.Skv});
    }
    check_case(c, static_cast<unsigned>(trial));
    if (HasFailure()) return;
  }
}

// head_dim pairs (D, Dv) around the decoding micro-kernels' unrolled 64 and 128 (decode_kernels.hpp, with_head_dim).
const std::pair<Index, Index> kUnrolledDimPairs[] = {{64, 64},  {128, 128}, {128, 64}, {64, 128},
                                                     {128, 80}, {80, 128},  {72, 64}};

TEST(Fused, DecodeAtTheUnrolledHeadDims) {
  // The decoding micro-kernels are compiled for D (and Dv) = 64 and 128 with their column loops unrolled
  // (decode_kernels.hpp, with_head_dim), and keep the runtime loop for any other head_dim: both, mixed in one call (D
  // unrolled, Dv not, and the reverse), with 1 to 4, 8 and 12 query rows per kv head (qk_in_place's and pv_in_place's
  // R; on AVX-512 and the emulated 16-lane tag, 8 rows are one call and 12 two, of 8 and 4 rows: their kQkDecodeRows
  // and kPvDecodeRows), against the float64 reference. Skv = 1027 ends with 3 keys after the whole steps (a pair and
  // one key); 2053 puts 5 keys in a second split-K chunk; each runs with and without key_lengths (which end the keys
  // mid-step). Token-major K and V with one kv head per task take the same kernels: Hkv = 1 here, and Hkv = 7 in
  // DecodeGroupedAtTheUnrolledHeadDims. In the L1 copy, float K and V on 16 lanes (AVX-512, the emulated tag), 1 to 4
  // rows go by sub-blocks of FusedTiles::kDecodePacedBytes with a PrefetchCursor (kHeadMajorPaced): many per block at
  // every head_dim here. The sanitize stage of .ci/run runs this test pinned to the L1 copy as well.
  int trial = 0;
  for (const auto& [D, Dv] : kUnrolledDimPairs) {
    for (const Index group : {1, 2, 3, 4, 8, 12}) {
      if (group == 8 && reduced_grid()) continue;  // a reduced grid (valgrind): 12 rows (8 + 4) stand for 8
      for (const Index skv : {Index(1027), Index(2053)}) {
        Case c;
        c.B = 2;
        c.Hkv = 2;
        c.Hq = c.Hkv * group;
        c.Sq = 1;
        c.Skv = skv;
        c.D = D;
        c.Dv = Dv;
        if (trial % 4 >= 2) c.options.key_lengths = {skv - 6, 3};
        if (trial % 8 == 7) {  // token-major, one kv head
          c.bshd = true;
          c.Hkv = 1;
          c.Hq = group;
        }
        check_case(c, static_cast<unsigned>(trial++));
        if (HasFailure()) return;
      }
    }
  }
}

TEST(Fused, DecodeGroupedAtTheUnrolledHeadDims) {
  // A grouped decoding task (token-major K and V, several kv heads, the micro-kernels paced by a PrefetchCursor: four
  // keys per P·V step for float V on 16-lane tags in the L2 copy, two in the L1 copy, kPvGroupedKeysPerStep) at every
  // pair of head_dims of DecodeAtTheUnrolledHeadDims with 1, 3 and 4 query rows per kv head, against the float64
  // reference: Skv = 1027 leaves 3 keys after the last whole step of the last sub-block (a pair and one key), and
  // key_lengths of 1021 end it after 13 keys by turns. Hkv = 7 at 16 query rows per kv head: the plan's tasks of 6 kv
  // heads leave a last task of one, its rows 7·D apart. The sanitize stage of .ci/run runs this test pinned to the L2
  // copy as well.
  int trial = 0;
  for (const auto& [D, Dv] : kUnrolledDimPairs) {
    for (const Index group : {1, 3, 4}) {
      Case c;
      c.bshd = true;
      c.B = 1;
      c.Hkv = 3;
      c.Hq = c.Hkv * group;
      c.Sq = 1;
      c.Skv = 1027;
      c.D = D;
      c.Dv = Dv;
      if (trial % 2 == 1) c.options.key_lengths = {Index(1021)};
      check_case(c, static_cast<unsigned>(trial++));
      if (HasFailure()) return;
    }
  }
  for (const Index D : {64, 128}) {
    Case c;
    c.bshd = true;
    c.Hkv = 7;
    c.Hq = 7 * 16;
    c.Sq = 1;
    c.Skv = 1027;
    c.D = c.Dv = D;
    check_case(c, static_cast<unsigned>(trial++));
    if (HasFailure()) return;
  }
}

TEST(Fused, PrefillOfOneQueryTileSplitK) {
  // A prefill of one query tile (kDecodeRows < Sq·G ≤ kBlockM stacked rows) against more keys than a split-K chunk
  // (kSplitKeys): its chunks run as tasks of their own, each packed and in base 2, and merge by lse (split_k.hpp).
  // GQA 1, 2 and 4, D and Dv with tails, key counts that are no multiple of a panel, and by turns no mask, causal
  // (bottom right, so the last chunk holds the diagonal), a window that hides whole chunks, key padding inside the
  // last chunk, and ALiBi with sinks; BSHD and BHSD. (Sizes from the 16-lane tiles; the other tags' are the same.)
  const Index split = Tiles16::kSplitKeys, block_rows = Tiles16::kBlockM, decode_rows = Tiles16::kDecodeRows;
  struct Shape {
    Index Hq, Hkv, Sq, Skv, D, Dv;
  };
  const Shape shapes[] = {{2, 2, decode_rows + 1, split + 1, 33, 33},
                          {1, 1, 20, split + 515, 80, 17},
                          {4, 2, 9, 2 * split + 103, 64, 50},
                          {4, 1, block_rows / 4, split + 300, 15, 80}};
  int n = 0;
  for (int shape = 0; shape < (reduced_grid() ? 2 : 4); ++shape) {  // reduced runs: the two smallest, once each
    const Shape& s = shapes[shape];
    for (int turn = 0; turn < (reduced_grid() ? 1 : 3); ++turn, ++n) {
      const int variant = n % 5;
      Case c{{1, s.Hq, s.Hkv, s.Sq, s.Skv, s.D, s.Dv}};
      c.bshd = n % 2 == 1;
      if (variant == 1) c.options.causal = true;
      if (variant == 2) c.options.window_left = split / 2, c.options.window_right = 10;
      if (variant == 3) c.options.key_lengths = {s.Skv - 77};
      if (variant == 4) {
        for (Index h = 0; h < s.Hq; ++h) {
          c.options.alibi_slopes.push_back(std::ldexp(1.0f, -static_cast<int>(h + 4)));
          c.options.sinks.push_back(0.5f * static_cast<float>(h));
        }
      }
      check_case(c, static_cast<unsigned>(700 + n));
      if (HasFailure()) return;
    }
  }
}

TEST(Fused, VectorTailsAndTileEdges) {
  // D and Dv below, at and past a vector (16 lanes; 8 on AVX2), a packed key panel and a value chunk (4 vectors on 16
  // lanes: 64; 2 on AVX2: 16), so that every count of partial vectors in pv_chunk_tail and the D tails of the decoding
  // kernels occur; key counts around a panel and a key tile (kBlockN). Each (D, Dv) meets each key count once, by
  // turns in a prefill (Sq·G = 24: four strips of six rows), decodings with six rows (calls of 4 and 2 rows), three and
  // twelve (calls of 8 and 4 rows on 16 lanes); causal, a window, key padding and BSHD by turns.
  const Index panel = Tiles16::kPanel, key_tile = Tiles16::kBlockN;
  const Index dims[][2] = {{1, 1},   {3, 15},  {16, 17}, {17, 31},   {31, 33},  {48, 49},
                           {57, 63}, {64, 64}, {65, 80}, {100, 127}, {128, 130}};
  const Index keys[] = {1, panel - 1, panel + 1, 3 * panel + 5, key_tile + 1, 2 * key_tile - 3};
  struct Rows {
    Index Hq, Hkv, Sq;
  };
  const Rows rows[] = {{4, 2, 12}, {6, 1, 1}, {2, 2, 3}, {12, 1, 1}};  // prefill; decoding with 6, 3 and 12 rows
  const int stride = reduced_grid() ? 5 : 1;               // reduced runs take every fifth case
  int n = 0;
  for (std::size_t i = 0; i < std::size(dims); ++i) {
    for (std::size_t j = 0; j < std::size(keys); ++j, ++n) {
      if (n % stride != 0) continue;
      const Rows& r = rows[(i + j) % std::size(rows)];
      Case c{{1, r.Hq, r.Hkv, r.Sq, keys[j], dims[i][0], dims[i][1]}};
      c.bshd = n % 4 == 1;
      c.options.causal = n % 2 == 0;
      if (n % 3 == 0) c.options.window_left = 40;
      if (n % 5 == 2) c.options.key_lengths = {std::max<Index>(0, keys[j] - 7)};
      check_case(c, static_cast<unsigned>(900 + n));
      if (HasFailure()) return;
    }
  }
}

/// Runs two prefill shapes and a decode shape with the given thread count; returns the outputs concatenated. At D =
/// 128 the prefill's K and V (4.4 MiB per kv head) exceed kPrefillGroupBytes: its 9 query tiles per kv head (18 in
/// all) go in groups of 8 and 1 on one thread, of 2 (and a 1) on two (kPrefillGroupsPerThread) and alone on three,
/// so that the comparison also holds groups against tiles alone.
std::vector<float> run_with_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
  std::vector<float> result;
  const std::pair<Index, Index> shapes[] = {{300, 64}, {1, 64}, {200, 128}};  // (Sq, D = Dv)
  for (const auto& [sq, D] : shapes) {
    const Index Hq = 8, Hkv = 2, Skv = 4500;
    std::mt19937 rng(9);
    std::normal_distribution<float> normal;
    std::vector<float> q(static_cast<std::size_t>(Hq * sq * D)), k(static_cast<std::size_t>(Hkv * Skv * D)),
        v(k.size()), out(static_cast<std::size_t>(Hq * sq * D));
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = normal(rng);
    qkv::AttentionOptions<float> o;
    o.causal = true;
    o.backend = qkv::Backend::fused;
    qkv::attention(qkv::view_bhsd<const float>(q.data(), 1, Hq, sq, D),
                   qkv::view_bhsd<const float>(k.data(), 1, Hkv, Skv, D),
                   qkv::view_bhsd<const float>(v.data(), 1, Hkv, Skv, D), qkv::view_bhsd(out.data(), 1, Hq, sq, D), o);
    result.insert(result.end(), out.begin(), out.end());
  }
  return result;
}

// Found by fuzz/fuzz_attention.cpp: Hq = 0 with Hkv ≥ 1 is a valid call (an empty output), but the kernel built
// tasks for each kv head with a GQA group of 0 and read the first head's mask from an empty vector.
TEST(Fused, ZeroQueryHeadsWriteNothing) {
  std::vector<float> q(1), k(2 * 7 * 4, 0.5f), v(2 * 7 * 3, 1.0f), out(1, 7.0f), lse(1, 7.0f);
  qkv::AttentionOptions<float> options;
  options.backend = qkv::Backend::fused;
  EXPECT_NO_THROW(qkv::attention(
      qkv::TensorView4<const float>(q.data(), {1, 0, 5, 4}), qkv::TensorView4<const float>(k.data(), {1, 2, 7, 4}),
      qkv::TensorView4<const float>(v.data(), {1, 2, 7, 3}), qkv::TensorView4<float>(out.data(), {1, 0, 5, 3}),
      qkv::TensorView3<float>(lse.data(), {1, 0, 5}), options));
  EXPECT_EQ(out[0], 7.0f);
  EXPECT_EQ(lse[0], 7.0f);
}

TEST(Fused, BitIdenticalForAnyThreadCount) {
  const auto one = run_with_threads(1);
  const auto two = run_with_threads(2);
  const auto three = run_with_threads(3);
  ASSERT_EQ(one.size(), two.size());
  for (std::size_t n = 0; n < one.size(); ++n) {
    ASSERT_EQ(std::memcmp(&one[n], &two[n], sizeof(float)), 0) << n;
    ASSERT_EQ(std::memcmp(&one[n], &three[n], sizeof(float)), 0) << n;
  }
}

// One thread packs each (sequence, kv head) just before its tasks, into the place of the pair before it; a team packs
// each pair on its first task, into a place of its own, by the thread that takes that task (pack.hpp, PackOrder). A
// varlen batch of two prefill sequences around a decoding one (not packed), GQA with two kv heads and D = Dv = 80 (V
// packed on every tag, a narrow last chunk on AVX-512): each pair's tasks must read its own packed K and V, never the
// pair packed before, so one thread gives the bits of two and three. A team's task that read its pair before pack_once
// had finished it would differ here only by chance; ThreadSanitizer's run of this test (label threads) checks that.
TEST(Fused, PackingEachPairJustBeforeItsTasksGivesTheSameBitsOnAnyThreadCount) {
  const Index Hq = 4, Hkv = 2, D = 80;
  qkv::AttentionOptions<float> o;
  o.backend = qkv::Backend::fused;
  o.cu_seqlens_q = {0, 200, 202, 352};  // 200 rows, 2 (decoding: Sq·G = 4), 150
  o.cu_seqlens_k = {0, 700, 1600, 1933};
  const Index sq = o.cu_seqlens_q.back(), skv = o.cu_seqlens_k.back();
  std::mt19937 rng(23);
  std::normal_distribution<float> normal;
  std::vector<float> q(static_cast<std::size_t>(Hq * sq * D)), k(static_cast<std::size_t>(Hkv * skv * D)), v(k.size());
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = normal(rng);
  const auto run = [&](int threads) {
#if defined(_OPENMP)
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    std::vector<float> out(q.size(), -1.0f);
    qkv::attention(qkv::view_bhsd<const float>(q.data(), 1, Hq, sq, D),
                   qkv::view_bhsd<const float>(k.data(), 1, Hkv, skv, D),
                   qkv::view_bhsd<const float>(v.data(), 1, Hkv, skv, D), qkv::view_bhsd(out.data(), 1, Hq, sq, D), o);
    return out;
  };
#if defined(_OPENMP)
  const int before = omp_get_max_threads();
#endif
  const std::vector<float> one = run(1), two = run(2), three = run(3);
#if defined(_OPENMP)
  omp_set_num_threads(before);
#endif
  for (std::size_t n = 0; n < one.size(); ++n) {
    ASSERT_EQ(std::memcmp(&one[n], &two[n], sizeof(float)), 0) << n << ": " << one[n] << " against " << two[n];
    ASSERT_EQ(std::memcmp(&one[n], &three[n], sizeof(float)), 0) << n << ": " << one[n] << " against " << three[n];
  }
  // And one thread's result is the attention: every head and row against the float64 brute force.
  brute::Params p;
  static_cast<brute::Shape&>(p) = brute::Shape{1, Hq, Hkv, sq, skv, D, D};
  p.cu_seqlens_q.assign(o.cu_seqlens_q.begin(), o.cu_seqlens_q.end());
  p.cu_seqlens_k.assign(o.cu_seqlens_k.begin(), o.cu_seqlens_k.end());
  const brute::Result expected =
      brute::attention(std::vector<double>(q.begin(), q.end()), std::vector<double>(k.begin(), k.end()),
                       std::vector<double>(v.begin(), v.end()), p);
  for (std::size_t n = 0; n < one.size(); ++n) ASSERT_NEAR(one[n], expected.out[n], 2e-5) << n;
}

TEST(Fused, AllocatesNothingProportionalToSqTimesSkv) {
  if (!QKV_COUNTS_ALLOCATIONS) GTEST_SKIP() << "ThreadSanitizer build: operator new is TSan's, not counted";
  // T = 4096, 2 heads, D = 64: Sq·Skv floats per head would be 64 MiB; K, Q, V, out are 2 MiB each.
  const Index T = 4096, H = 2, D = 64;
  std::vector<float> q(static_cast<std::size_t>(H * T * D), 0.01f), k(q.size(), 0.02f), v(q.size(), 1.0f),
      out(q.size());
  qkv::AttentionOptions<float> o;
  o.backend = qkv::Backend::fused;
  qkv::release_workspace();  // what the call itself allocates, not what earlier calls left on this thread
  const qkv_test::AllocationCount allocated = qkv_test::count_allocations([&] {
    qkv::attention(qkv::view_bhsd<const float>(q.data(), 1, H, T, D), qkv::view_bhsd<const float>(k.data(), 1, H, T, D),
                   qkv::view_bhsd<const float>(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D), o);
  });
  const std::size_t kv_bytes = k.size() * sizeof(float);
  // Packed K and V (each the size of K here: 2 MiB) plus per-thread scratch (a few hundred KiB): O(T·D), far below
  // one T × T matrix.
  EXPECT_LE(allocated.bytes, kv_bytes + (std::size_t(4) << 20)) << "allocated " << allocated.bytes;
  EXPECT_LT(allocated.largest, std::size_t(T) * std::size_t(T) * sizeof(float) / 16);
  EXPECT_NEAR(out[0], 1.0f, 1e-6f);
}

TEST(Fused, KeepsThePackedKeysAndValuesBetweenCallsUntilReleased) {
  if (!QKV_COUNTS_ALLOCATIONS) GTEST_SKIP() << "ThreadSanitizer build: operator new is TSan's, not counted";
  // T = 256, 2 heads, D = 96: the packed K and V are 192 KiB each (no padding at these sizes on any tag; V wider than
  // one chunk on every tag, so packed, not read in place as at D = 64 on AVX-512: values_packed_as_stored; the
  // test below calls D = 64).
  const Index T = 256, H = 2, D = 96;
  const std::size_t n = static_cast<std::size_t>(H * T * D);
  std::vector<float> q(n), k1(n), k2(n), v1(n), v2(n), out(n), first(n), again(n);
  for (std::size_t i = 0; i < n; ++i) {  // two different K/V of one shape, so a stale packed copy would show
    q[i] = 0.01f * float(i % 97) - 0.4f;
    k1[i] = 0.02f * float(i % 89) - 0.8f;
    k2[i] = 0.03f * float(i % 83) - 1.1f;
    v1[i] = float(i % 13);
    v2[i] = float(i % 7) - 3.0f;
  }
  qkv::AttentionOptions<float> o;
  o.backend = qkv::Backend::fused;
  const auto call = [&](const std::vector<float>& k, const std::vector<float>& v, std::vector<float>& result) {
    return qkv_test::count_allocations([&] {
      qkv::attention(qkv::view_bhsd<const float>(q.data(), 1, H, T, D), qkv::view_bhsd<const float>(k.data(), 1, H, T, D),
                     qkv::view_bhsd<const float>(v.data(), 1, H, T, D), qkv::view_bhsd(result.data(), 1, H, T, D), o);
    });
  };
  // A team has room for both heads' packed K and V; one thread packs each head just before its own tasks, in one
  // head's room.
#if defined(_OPENMP)
  const bool team = omp_get_max_threads() > 1;
#else
  const bool team = false;
#endif
  const std::size_t packed_bytes = 2 * n * sizeof(float) / (team ? 1 : static_cast<std::size_t>(H));
  qkv::release_workspace();
  call(k2, v2, first);  // K2, V2 on a fresh workspace
  qkv::release_workspace();
  const qkv_test::AllocationCount fresh = call(k1, v1, out);
  const qkv_test::AllocationCount kept = call(k2, v2, again);  // the same shape: the workspace is reused
  EXPECT_GE(fresh.bytes, packed_bytes);
  EXPECT_LE(kept.bytes + packed_bytes, fresh.bytes) << "fresh " << fresh.bytes << ", kept " << kept.bytes;
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(std::memcmp(&first[i], &again[i], sizeof(float)), 0) << i;
  qkv::release_workspace();
  EXPECT_EQ(call(k1, v1, out).bytes, fresh.bytes);  // released: allocated afresh
}

// V read in place (D = 64: values_packed_as_stored on AVX-512) while the packed K is kept between calls: a call on
// other K and V of the same shape, then the first K and V again, gives the first call's bits, so nothing of the
// earlier call's V (its rows, its finiteness counts) is used by the next.
TEST(Fused, ValuesReadInPlaceAreNeverTheLastCallsValues) {
  const Index T = 256, H = 2, D = 64;
  const std::size_t n = static_cast<std::size_t>(H * T * D);
  std::vector<float> q(n), k1(n), k2(n), v1(n), v2(n), first(n), between(n), again(n);
  for (std::size_t i = 0; i < n; ++i) {
    q[i] = 0.01f * float(i % 97) - 0.4f;
    k1[i] = 0.02f * float(i % 89) - 0.8f;
    k2[i] = 0.03f * float(i % 83) - 1.1f;
    v1[i] = float(i % 13);
    v2[i] = float(i % 7) - 3.0f;
  }
  for (Index d = 0; d < D; ++d) v2[static_cast<std::size_t>(5 * D + d)] = std::nanf("");  // key 5 of head 0
  qkv::AttentionOptions<float> o;
  o.backend = qkv::Backend::fused;
  const auto call = [&](const std::vector<float>& k, const std::vector<float>& v, std::vector<float>& result) {
    qkv::attention(qkv::view_bhsd<const float>(q.data(), 1, H, T, D), qkv::view_bhsd<const float>(k.data(), 1, H, T, D),
                   qkv::view_bhsd<const float>(v.data(), 1, H, T, D), qkv::view_bhsd(result.data(), 1, H, T, D), o);
  };
  qkv::release_workspace();
  call(k1, v1, first);
  call(k2, v2, between);
  call(k1, v1, again);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(std::memcmp(&first[i], &again[i], sizeof(float)), 0) << i;
  for (std::size_t i = 0; i < static_cast<std::size_t>(T * D); ++i) ASSERT_TRUE(std::isnan(between[i])) << i;
  for (float x : first) ASSERT_TRUE(std::isfinite(x));
}

// Every kernel the build compiled (runtime dispatch: scalar, AVX2 and AVX-512 in a plain build) and the emulated
// 16-lane one, in one binary, each against the reference; a kernel this CPU cannot run is skipped.
template <class Tag>
struct FusedPerTag : ::testing::Test {};
TYPED_TEST_SUITE(FusedPerTag, qkv_test::KernelTags, );

TYPED_TEST(FusedPerTag, MatchesTheReferenceWithinTheAccuracyRule) {
  if (!qkv_test::cpu_runs<TypeParam>()) GTEST_SKIP() << "this CPU cannot run the " << TypeParam::kName << " kernel";
  if (std::is_same_v<TypeParam, qkv_test::Emulated16Tag> && skip_emulated()) GTEST_SKIP() << "QKV_SKIP_EMULATED is set";
  std::mt19937 rng(31);
  std::normal_distribution<float> normal;
  for (int trial = 0; trial < 12; ++trial) {
    const Index Hq = 4, Hkv = trial % 2 == 0 ? 2 : 4, Sq = trial < 6 ? 70 + trial : 1 + trial % 3,
                Skv = 130 + 37 * trial;
    const Index D = trial % 3 == 0 ? 33 : 64, Dv = trial % 4 == 0 ? 17 : D;
    std::vector<float> q(static_cast<std::size_t>(Hq * Sq * D)), k(static_cast<std::size_t>(Hkv * Skv * D)),
        v(static_cast<std::size_t>(Hkv * Skv * Dv)), out(static_cast<std::size_t>(Hq * Sq * Dv));
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = normal(rng);
    qkv::AttentionOptions<float> o;
    o.causal = trial % 3 != 1;
    o.window_left = trial % 5 == 0 ? 20 : -1;
    const auto qv = qkv::view_bhsd<const float>(q.data(), 1, Hq, Sq, D);
    const auto kv = qkv::view_bhsd<const float>(k.data(), 1, Hkv, Skv, D);
    const auto vv = qkv::view_bhsd<const float>(v.data(), 1, Hkv, Skv, Dv);
    const auto ov = qkv::view_bhsd(out.data(), 1, Hq, Sq, Dv);
    const auto shape = qkv::detail::validate<float>("test", qv, kv, &vv, &ov, nullptr, o);
    const auto params = qkv::detail::resolve_params(o, D);
    qkv_test::run_fused_with(TypeParam(), shape, qv, kv, vv, ov, nullptr, params);
    // Expected: the float64 reference on the same (float) inputs.
    const brute::Params call = qkv_test::to_brute(o, {1, Hq, Hkv, Sq, Skv, D, Dv});
    std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end()), ref(out.size());
    qkv::attention(qkv::view_bhsd<const double>(q64.data(), 1, Hq, Sq, D),
                   qkv::view_bhsd<const double>(k64.data(), 1, Hkv, Skv, D),
                   qkv::view_bhsd<const double>(v64.data(), 1, Hkv, Skv, Dv), qkv::view_bhsd(ref.data(), 1, Hq, Sq, Dv),
                   qkv_test::from_brute<double>(call).options);
    // The accuracy rule, with the plain float implementation as the yardstick.
    std::vector<float> plain(out.size());
    qkv_test::plain_float(qv, kv, vv, call, qkv::view_bhsd(plain.data(), 1, Hq, Sq, Dv), {});
    double err = 0, err_plain = 0, max_v = 0;
    for (std::size_t n = 0; n < out.size(); ++n) {
      err = std::max(err, std::fabs(out[n] - ref[n]));
      err_plain = std::max(err_plain, std::fabs(plain[n] - ref[n]));
    }
    for (float x : v) max_v = std::max(max_v, std::fabs(double(x)));
    EXPECT_LE(err, 2 * err_plain + 1e-6 * std::max(1.0, max_v)) << TypeParam::kName << " trial " << trial;
  }
}

#if defined(QKV_KERNEL_AVX512)
/// out followed by lse of one case on the kernel of `tag` (inputs drawn as check_case draws them).
template <class Tag>
std::vector<float> fused_result(Tag tag, Case& c, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const Index q_rows = c.options.cu_seqlens_q.empty() ? c.Sq : c.options.cu_seqlens_q.back();
  const Index k_rows = c.options.cu_seqlens_k.empty() ? c.Skv : c.options.cu_seqlens_k.back();
  std::vector<float> q(static_cast<std::size_t>(c.B * c.Hq * q_rows * c.D)),
      k(static_cast<std::size_t>(c.B * c.Hkv * k_rows * c.D)), v(static_cast<std::size_t>(c.B * c.Hkv * k_rows * c.Dv));
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = 2.0f * normal(rng);
  const std::size_t n_out = static_cast<std::size_t>(c.B * c.Hq * q_rows * c.Dv);
  std::vector<float> result(n_out + static_cast<std::size_t>(c.B * c.Hq * q_rows), -7.0f);
  const qkv::TensorView3<float> lse(result.data() + n_out, {c.B, c.Hq, q_rows});
  c.options.backend = qkv::Backend::fused;
  qkv_test::fused_attention_with(tag, make_view<const float>(q.data(), c.B, c.Hq, q_rows, c.D, c.bshd),
                                 make_view<const float>(k.data(), c.B, c.Hkv, k_rows, c.D, c.bshd),
                                 make_view<const float>(v.data(), c.B, c.Hkv, k_rows, c.Dv, c.bshd),
                                 make_view(result.data(), c.B, c.Hq, q_rows, c.Dv, c.bshd), &lse, c.options);
  return result;
}

// On a CPU with AVX-512, the emulated kernel gives the AVX-512 kernel's bits (out and lse): its ops are avx512.hpp's
// lane by lane (support/emulated_tag.hpp), so the emulated runs above stand for the AVX-512 kernel's on every CPU.
// A change to an op of avx512.hpp, or a new one, changes emulated_tag.hpp with it. Random cases of the grid (every
// option, tails), decoding and split-K shapes. Needs FMA in the build's flags: the emulated kernel's scalar code
// (the lse, score finishing) is compiled with the flags, the AVX-512 copy with FMA, and a multiply-add contracted in
// one copy and not in the other would differ in the last bit.
TEST(FusedEmulated16, BitIdenticalToTheAvx512Kernel) {
#if !defined(__FMA__)
  GTEST_SKIP() << "built without FMA: the emulated kernel's scalar code would round where the AVX-512 copy's fuses";
#else
  if (!qkv_test::cpu_runs<qkv::simd::Avx512Tag>()) GTEST_SKIP() << "this CPU cannot run the avx512 kernel";
  if (skip_emulated()) GTEST_SKIP() << "QKV_SKIP_EMULATED is set";
  std::mt19937 rng(8080);
  const std::vector<Index> dims = {1, 3, 15, 16, 33, 50, 64, 80, 128};
  for (int trial = 0; trial < 40; ++trial) {
    Case c = random_case(rng, dims, trial < 30 ? 700 : 3000);
    if (trial >= 30) {  // decoding, and a prefill of one query tile, both split-K where Skv > kSplitKeys
      if (c.options.bias.extent(1) != 0 || !c.options.cu_seqlens_q.empty()) continue;  // shaped for the old Sq
      c.Sq = trial < 35 ? 1 : 20;
    }
    const std::vector<float> avx512 = fused_result(qkv::simd::Avx512Tag(), c, static_cast<unsigned>(trial));
    const std::vector<float> emulated = fused_result(qkv_test::Emulated16Tag(), c, static_cast<unsigned>(trial));
    ASSERT_EQ(avx512.size(), emulated.size());
    for (std::size_t n = 0; n < avx512.size(); ++n) {
      const bool both_nan = std::isnan(avx512[n]) && std::isnan(emulated[n]);
      ASSERT_TRUE(both_nan || std::memcmp(&avx512[n], &emulated[n], sizeof(float)) == 0)
          << c.describe() << ": element " << n << " of out then lse: avx512 " << avx512[n] << ", emulated "
          << emulated[n];
    }
  }
#endif
}
#endif

// pack_keys (pack.hpp) on the emulated 16-lane tag (AVX-512's panel of 64 keys; the generic transpose through
// memory; test_simd checks each tag's own transpose): every element of every panel, the zero padding of the last one
// and the largest finite |k|, against a plain loop, for float, half and bfloat16 storage, rows further apart than D,
// key counts and D off the 16 × 16 blocks, and NaN and ∞ in K, inside a block and in the last key's last d (left out
// of the bound, copied as they are).
template <class S>
void check_pack_keys(Index skv, Index D, Index ld) {
  constexpr Index kPanel = qkv_test::emulated_pass::FusedTiles<qkv_test::Emulated16Tag>::kPanel;
  std::vector<S> k(static_cast<std::size_t>(std::max<Index>(1, skv * ld)));
  std::mt19937 rng(static_cast<unsigned>(skv * 131 + D * 7 + ld));
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (auto& e : k) e = S(dist(rng));
  if (skv > 2 && D > 1) {
    k[static_cast<std::size_t>(ld + 1)] = S(std::numeric_limits<float>::quiet_NaN());
    k[static_cast<std::size_t>(2 * ld)] = S(-std::numeric_limits<float>::infinity());
  }
  if (skv > 0 && D > 0)
    k[static_cast<std::size_t>((skv - 1) * ld + D - 1)] = S(std::numeric_limits<float>::quiet_NaN());
  const Index panels = (skv + kPanel - 1) / kPanel;
  std::vector<float> packed(static_cast<std::size_t>(std::max<Index>(1, panels * D * kPanel)), -7.0f),
      row(static_cast<std::size_t>(D));
  const float bound =
      qkv_test::emulated_pass::pack_keys<qkv_test::Emulated16Tag>(k.data(), ld, skv, D, packed.data(), row.data());
  float expected_bound = 0.0f;
  const std::string where = "skv " + std::to_string(skv) + ", D " + std::to_string(D) + ", ld " + std::to_string(ld);
  for (Index p = 0; p < panels; ++p) {
    for (Index d = 0; d < D; ++d) {
      for (Index c = 0; c < kPanel; ++c) {
        const Index j = p * kPanel + c;
        const float got = packed[static_cast<std::size_t>((p * D + d) * kPanel + c)];
        const float want = j < skv ? static_cast<float>(k[static_cast<std::size_t>(j * ld + d)]) : 0.0f;
        if (j < skv && std::isfinite(want)) expected_bound = std::max(expected_bound, std::fabs(want));
        ASSERT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << where << ": key " << j << ", d " << d;
      }
    }
  }
  EXPECT_EQ(bound, expected_bound) << where;
}

TEST(Fused, PackKeysTransposesEveryKeyIntoItsPanel) {
  check_pack_keys<float>(64, 128, 128);   // one whole panel of whole blocks, head-major
  check_pack_keys<float>(200, 72, 1024);  // a partial last panel, D off the blocks, token-major rows
  check_pack_keys<float>(7, 5, 9);        // less than one block either way
  check_pack_keys<float>(0, 64, 64);      // nothing
  check_pack_keys<Eigen::half>(130, 40, 48);
  check_pack_keys<Eigen::bfloat16>(33, 16, 512);
}

// pack_values (pack.hpp) on the emulated 16-lane tag (AVX-512's chunks of 64 columns): every element of every chunk,
// the zero padding of a last chunk narrower than a chunk (whole vectors wide), and the counts of non-finite rows,
// against a plain loop, for float, half and bfloat16 storage, rows further apart than Dv, Dv off the vectors and the
// chunks, and NaN and ∞ in V (copied as they are, counted). The buffer starts filled with -7, so a padding lane left
// unwritten, or a write past the packed size, shows.
template <class S>
void check_pack_values(Index skv, Index Dv, Index ld) {
  using Tiles = qkv_test::emulated_pass::FusedTiles<qkv_test::Emulated16Tag>;
  constexpr Index kChunk = Tiles::kChunk;
  std::vector<S> v(static_cast<std::size_t>(std::max<Index>(1, skv * ld)));
  std::mt19937 rng(static_cast<unsigned>(skv * 37 + Dv * 11 + ld));
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (auto& e : v) e = S(dist(rng));
  std::vector<char> bad(static_cast<std::size_t>(skv), 0);
  for (const Index j : {Index(1), Index(70), skv - 1}) {
    if (j < 0 || j >= skv || Dv == 0) continue;
    v[static_cast<std::size_t>(j * ld + (j * 5) % Dv)] =
        S(j % 2 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity());
    bad[static_cast<std::size_t>(j)] = 1;
  }
  const Index full = Dv / kChunk * kChunk, last = Tiles::chunk_floats(Dv - full);
  const std::size_t size = static_cast<std::size_t>(skv * (full + last));
  std::vector<float> packed(size + 16, -7.0f);
  std::vector<std::uint32_t> counts(static_cast<std::size_t>(skv + 1), 99u);
  qkv_test::emulated_pass::pack_values<qkv_test::Emulated16Tag>(v.data(), ld, skv, Dv, packed.data(), counts.data());
  const std::string where = "skv " + std::to_string(skv) + ", Dv " + std::to_string(Dv) + ", ld " + std::to_string(ld);
  for (Index c = 0; c < Dv; c += kChunk) {
    const Index stride = c < full ? kChunk : last;
    for (Index j = 0; j < skv; ++j) {
      for (Index d = 0; d < stride; ++d) {
        const float got = packed[static_cast<std::size_t>(c * skv + j * stride + d)];
        const float want = c + d < Dv ? static_cast<float>(v[static_cast<std::size_t>(j * ld + c + d)]) : 0.0f;
        ASSERT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << where << ": key " << j << ", column " << c + d;
      }
    }
  }
  for (std::size_t i = size; i < packed.size(); ++i) ASSERT_EQ(packed[i], -7.0f) << where << ": written past the end";
  std::uint32_t before = 0;
  for (Index j = 0; j <= skv; ++j) {
    ASSERT_EQ(counts[static_cast<std::size_t>(j)], before) << where << ": count before key " << j;
    if (j < skv) before += bad[static_cast<std::size_t>(j)];
  }
}

TEST(Fused, PackValuesCopiesEveryValueIntoItsChunk) {
  check_pack_values<float>(100, 128, 128);  // two whole chunks, head-major
  check_pack_values<float>(130, 80, 640);   // a last chunk of one vector, token-major rows
  check_pack_values<float>(65, 72, 72);     // a last chunk of 8 columns in one masked vector
  check_pack_values<float>(3, 5, 9);        // less than one vector
  check_pack_values<float>(0, 64, 64);      // nothing
  check_pack_values<float>(70, 130, 130);   // two whole chunks and a masked 2-column one
  check_pack_values<Eigen::half>(71, 40, 48);
  check_pack_values<Eigen::bfloat16>(66, 100, 512);
}

// OnlineSoftmax::update_rows (online_softmax.hpp), which the prefill calls for a strip's rows at once, against
// update() (update_rows<1>) called row by row on a copy of the same state: the weights written in place, row_max,
// row_sum, row_nan and acc_o must be the same bits. Rows whose max rises (acc_o rescaled) or does not, rows that have seen no key yet, a
// row of only −∞ (the group then goes row by row) and one of −∞ and NaN (row_nan set), a +∞ score, a NaN at every
// position of a short range (where the tag's max keeps it, it reaches the tile's max), ranges that start past 0 and
// end inside a vector, Dv off the vectors, and an empty range; in base 2 and base e, on the emulated 16-lane tag and
// on this build's own tag (simd::BestTag, whose max and reductions are the intrinsics).
struct UpdateRowsCase {
  Index first = 0, n = 0, Dv = 0;
  unsigned seed = 0;
  bool empty_row = false;       // the last row: −∞ throughout (and a NaN with special_scores), nothing seen before
  bool special_scores = false;  // +∞ in row 0, NaN in row 1
  bool row0_seen = false;       // row 0 has a finite max before the call (else −∞: nothing seen)
  int nan_row = -1;             // a NaN at nan_at in this row
  Index nan_at = 0;
};

template <class Tag, int kRows, bool kBase2>
void check_update_rows(const UpdateRowsCase& c) {
  using Softmax = qkv_test::emulated_pass::OnlineSoftmax<Tag, kBase2>;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  const Index first = c.first, n = c.n, Dv = c.Dv, ld = n + 21;  // rows further apart than their scores
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<float> dist(-12.0f, 12.0f);
  struct State {
    std::vector<float> scores, row_max, row_sum, acc_o;
    std::vector<char> row_nan;
  } a;
  a.scores.resize(static_cast<std::size_t>(kRows * ld));
  for (auto& x : a.scores) x = dist(rng);
  a.row_max.resize(kRows);
  a.row_sum.resize(kRows);
  a.row_nan.assign(kRows, 0);
  a.acc_o.resize(static_cast<std::size_t>(kRows * Dv));
  for (auto& x : a.acc_o) x = dist(rng);
  for (int k = 0; k < kRows; ++k) {
    // Row 0 has seen nothing unless row0_seen; the others a max below, within or above the tile's scores (|s| ≤ 12).
    const bool seen = k > 0 || c.row0_seen;
    a.row_max[k] = seen ? -20.0f + 15.0f * static_cast<float>(k % 4) : kNegInf;
    a.row_sum[k] = seen ? 1.0f + static_cast<float>(k) : 0.0f;
  }
  const auto at = [&](int k, Index j) -> float& { return a.scores[static_cast<std::size_t>(k * ld + j)]; };
  if (c.empty_row && n > first) {
    for (Index j = first; j < n; ++j) at(kRows - 1, j) = kNegInf;
    if (c.special_scores) at(kRows - 1, n - 1) = kNaN;
    a.row_max[kRows - 1] = kNegInf;
    a.row_sum[kRows - 1] = 0.0f;
  }
  if (c.special_scores && n > first + 2 && kRows > 1) {
    at(1, n - 1) = kNaN;
    at(0, first + 1) = std::numeric_limits<float>::infinity();
  }
  if (c.nan_row >= 0 && c.nan_row < kRows && c.nan_at >= first && c.nan_at < n) at(c.nan_row, c.nan_at) = kNaN;
  const std::vector<float> before = a.scores;
  State b = a;
  Softmax by_rows(a.row_max.data(), a.row_sum.data(), a.row_nan.data(), a.acc_o.data(), Dv);
  for (int k = 0; k < kRows; ++k) by_rows.update(k, a.scores.data() + k * ld, first, n);
  Softmax together(b.row_max.data(), b.row_sum.data(), b.row_nan.data(), b.acc_o.data(), Dv);
  together.template update_rows<kRows>(0, b.scores.data(), ld, first, n);
  const std::string where =
      std::to_string(Tag::kLanes) + " lanes, " + std::to_string(kRows) + " rows, base " + (kBase2 ? "2" : "e") + ", [" +
      std::to_string(first) + ", " + std::to_string(n) + "), Dv " + std::to_string(Dv) +
      (c.empty_row ? ", a row of -inf" : "") + (c.special_scores ? ", NaN and +inf" : "") +
      (c.row0_seen ? ", row 0 seen" : "") +
      (c.nan_row >= 0 ? ", NaN in row " + std::to_string(c.nan_row) + " at " + std::to_string(c.nan_at) : "");
  const auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(a.scores, b.scores)) << where << ": the weights";
  EXPECT_TRUE(same_bits(a.row_max, b.row_max)) << where << ": row_max";
  EXPECT_TRUE(same_bits(a.row_sum, b.row_sum)) << where << ": row_sum";
  EXPECT_TRUE(same_bits(a.acc_o, b.acc_o)) << where << ": acc_o";
  EXPECT_EQ(a.row_nan, b.row_nan) << where << ": row_nan";
  // The comparison sees real work: nothing outside [first, n) was touched, some score changed, and in a row without
  // NaN every score became a weight in [0, 1] (or NaN, from +∞); a row with a NaN score is NaN in its state (row_nan
  // or row_sum), so that its output is NaN (its weights are not checked: where the NaN reaches the tile's max, the
  // row keeps its old max and its weights may exceed 1, in update() as here).
  bool changed = false;
  for (int k = 0; k < kRows; ++k) {
    const float* row = before.data() + k * ld;
    const bool has_nan = std::any_of(row + first, row + n, [](float x) { return std::isnan(x); });
    EXPECT_TRUE(!has_nan || b.row_nan[k] || std::isnan(b.row_sum[k])) << where << ": row " << k;
    for (Index j = 0; j < ld; ++j) {
      const std::size_t e = static_cast<std::size_t>(k * ld + j);
      if (j < first || j >= n) {
        ASSERT_TRUE(same_bits({b.scores[e]}, {before[e]})) << where << ": row " << k << ", column " << j;
      } else {
        ASSERT_TRUE(has_nan || std::isnan(b.scores[e]) || (b.scores[e] >= 0.0f && b.scores[e] <= 1.0f))
            << where << ": row " << k << ", column " << j << ": " << b.scores[e];
        changed |= !same_bits({b.scores[e]}, {before[e]});
      }
    }
  }
  EXPECT_TRUE(changed || n == first) << where;
}

template <class Tag, bool kBase2>
void check_update_rows_cases() {
  for (bool empty_row : {false, true}) {
    for (bool special : {false, true}) {
      const auto with = [&](Index first, Index n, Index Dv, unsigned seed) {
        UpdateRowsCase c;
        c.first = first;
        c.n = n;
        c.Dv = Dv;
        c.seed = seed;
        c.empty_row = empty_row;
        c.special_scores = special;
        return c;
      };
      check_update_rows<Tag, 6, kBase2>(with(0, 512, 128, 1));  // a whole tile, D = 128
      check_update_rows<Tag, 6, kBase2>(with(64, 301, 64, 2));  // past a panel, ending inside a vector
      check_update_rows<Tag, 5, kBase2>(with(0, 37, 17, 3));    // a tail of 5 scores; Dv off the vectors
      check_update_rows<Tag, 3, kBase2>(with(16, 29, 72, 4));   // less than one vector
      check_update_rows<Tag, 4, kBase2>(with(0, 1024, 128, 5));
      check_update_rows<Tag, 1, kBase2>(with(0, 96, 32, 6));
      check_update_rows<Tag, 2, kBase2>(with(32, 32, 64, 7));  // an empty range, row 0 unseen: row by row
      UpdateRowsCase empty = with(32, 32, 64, 8);
      empty.row0_seen = true;
      check_update_rows<Tag, 2, kBase2>(empty);  // an empty range, every row seen: together
    }
  }
  // A NaN at each position of a range, in a row that has seen keys (its max may or may not keep the NaN) and in one
  // that has not (where the NaN reaches the tile's max, the group goes row by row).
  for (int nan_row : {0, 1}) {
    for (Index at = 3; at < 40; ++at) {
      UpdateRowsCase c;
      c.first = 3;
      c.n = 40;
      c.Dv = 24;
      c.seed = 100 + static_cast<unsigned>(at);
      c.nan_row = nan_row;
      c.nan_at = at;
      check_update_rows<Tag, 4, kBase2>(c);
    }
  }
}

TEST(Fused, SoftmaxUpdateRowsIsUpdateRowByRow) {
  check_update_rows_cases<qkv_test::Emulated16Tag, true>();
  check_update_rows_cases<qkv_test::Emulated16Tag, false>();
  check_update_rows_cases<qkv::simd::BestTag, true>();
  check_update_rows_cases<qkv::simd::BestTag, false>();
}

// PrefetchCursor (decode_kernels.hpp), which paces a grouped decoding task's prefetches: over its steps
// (next_run) and the flush it hands out the first address of every 64-byte line of each row's span exactly once, in
// memory order, and nothing outside the spans (addresses only; nothing is read). A step's run is min(share, lines
// left) lines where the rows abut, and never crosses the end of a row's span where they do not; issued column by
// column (Run::issue_column, 1, 2 or 4 lines a column where they divide the run) it names the same lines in the same
// order. Expected addresses are enumerated here line by line, row by row.
template <class S>
void check_prefetch_cursor(Index ld, Index rows, Index span, Index steps, Index calls) {
  using Cursor = qkv_test::emulated_pass::PrefetchCursor<S>;
  constexpr Index kPerLine = Cursor::kElementsPerLine;
  static_assert(kPerLine * static_cast<Index>(sizeof(S)) == 64, "a line is 64 bytes");
  std::vector<S> buffer(static_cast<std::size_t>(std::max<Index>(rows, 0) * ld + 1));
  const S* first = buffer.data();
  std::vector<const S*> expected;
  for (Index r = 0; r < rows; ++r) {
    for (Index e = 0; e < span; e += kPerLine) expected.push_back(first + r * ld + e);
  }
  const Index lines_per_row = (span + kPerLine - 1) / kPerLine;
  const bool abut = ld == lines_per_row * kPerLine;
  const Index share = steps > 0 ? (Index(expected.size()) + steps - 1) / steps : Index(expected.size());
  const std::string where = "ld " + std::to_string(ld) + ", rows " + std::to_string(rows) + ", span " +
                            std::to_string(span) + ", steps " + std::to_string(steps) + ", calls " +
                            std::to_string(calls);
  std::vector<const S*> seen;
  Cursor cursor(first, ld, rows, span, steps);
  for (Index c = 0; c < calls; ++c) {
    const typename Cursor::Run run = cursor.next_run();
    const Index left = Index(expected.size() - seen.size());
    if (abut) {
      EXPECT_EQ(run.lines, std::min(share, left)) << where << ", step " << c;
    } else {
      EXPECT_LE(run.lines, share) << where << ", step " << c;
      EXPECT_TRUE(run.lines > 0 || left == 0) << where << ", step " << c << ": no progress";
    }
    std::vector<const S*> run_lines;
    for (Index t = 0; t < run.lines; ++t) run_lines.push_back(run.first + t * kPerLine);
    // A run issued straight-line, kPerColumn lines a column (pv_step where kStraightRuns holds): the same lines.
    const auto by_columns = [&](auto per_column) {
      constexpr Index kPerColumn = decltype(per_column)::value;
      if (run.lines % kPerColumn != 0) return;
      std::vector<const S*> lines;
      for (Index column = 0; column < run.lines / kPerColumn; ++column) {
        run.template issue_column<kPerColumn>(column, [&](const S* p) { lines.push_back(p); });
      }
      EXPECT_EQ(lines, run_lines) << where << ", step " << c << ", " << kPerColumn << " lines a column";
    };
    by_columns(std::integral_constant<Index, 1>());
    by_columns(std::integral_constant<Index, 2>());
    by_columns(std::integral_constant<Index, 4>());
    seen.insert(seen.end(), run_lines.begin(), run_lines.end());
  }
  const auto record = [&](const S* p) { seen.push_back(p); };
  cursor.flush(record);
  cursor.flush(record);  // a second flush has nothing left
  EXPECT_EQ(cursor.next_run().lines, 0) << where << ": a step after the flush";
  EXPECT_EQ(seen, expected) << where;
}

TEST(Fused, PrefetchCursorIssuesEachLineOfTheRowsOnceInOrder) {
  // Token-major rows that abut (Hkv = 8, D = 128 floats: one run of lines), at the kernel's pace and with fewer
  // steps than planned (a sub-block's odd last key): the flush issues the rest.
  check_prefetch_cursor<float>(1024, 16, 1024, 64, 64);
  check_prefetch_cursor<float>(1024, 16, 1024, 64, 61);
  // Rows with gaps between the spans (padded rows, or a task of fewer heads than the row holds) and a span that
  // ends inside a line.
  check_prefetch_cursor<float>(1100, 5, 1000, 7, 7);
  // A span that ends inside a line whose rest is the gap to the next row: the rows' lines abut (one run).
  check_prefetch_cursor<float>(1008, 3, 1000, 4, 2);
  check_prefetch_cursor<Eigen::half>(1024, 16, 1024, 64, 64);
  check_prefetch_cursor<Eigen::half>(520, 4, 260, 9, 9);
  check_prefetch_cursor<Eigen::bfloat16>(512, 2, 40, 3, 0);  // flush alone
  // No rows ahead: nothing at all; no steps: one share of everything.
  check_prefetch_cursor<float>(1024, 0, 1024, 8, 8);
  check_prefetch_cursor<float>(1024, 2, 1024, 0, 1);
}

// spread_rows (decode_kernels.hpp): the first of a step's rows ahead, kDecodeSpreadKeys (8) or, for a head-major step
// prefetching into L2, kDecodeSpreadKeysL2 (16; kSpreadKeys) past its key j in reading order, is one of the call's rows
// or, from the call's end on, one of the `next` rows the task reads after them (a grouped task's next kv head or
// sub-block), so that all `count` rows from it lie inside one of the two; never a row outside both. Both lie in one
// buffer here (the call's rows from row 0, at most 20 of them; the next rows from row 40; all `ld` apart), so that the
// check compares row indices in it. The named cases are worked out by hand; the sweep checks the bounds.
TEST(Fused, SpreadRowsNameOnlyRowsOfTheCallOrTheNext) {
  namespace pass = qkv_test::emulated_pass;
  using Tag = qkv_test::Emulated16Tag;
  static_assert(pass::FusedTiles<Tag>::kDecodeSpreadKeys == 8, "the named cases assume 8 keys ahead");
  const Index ld = 24, next_row0 = 40;
  std::vector<float> buffer(static_cast<std::size_t>(64 * ld));
  const float* own = buffer.data();
  const float* other = own + next_row0 * ld;
  // ahead: 8 (kDecodeSpreadKeys) or 16 (kDecodeSpreadKeysL2, a head-major step prefetching into L2).
  const auto row_ahead = [&](Index ahead, Index count, Index j, Index keys, Index next_keys) {
    const pass::NextRows<float> next{next_keys > 0 ? other : nullptr, next_keys};
    return (pass::spread_rows(own, ld, j, keys, count, next, ahead) - own) / ld;
  };
  const auto row = [&](Index count, Index j, Index keys, Index next_keys) {
    return row_ahead(8, count, j, keys, next_keys);
  };
  static_assert(pass::FusedTiles<Tag>::kDecodeSpreadKeysL2 == 16, "the named 16-ahead cases assume 16 keys ahead");
  const Index l2 = 16;
  // kSpreadKeys: 16 only for a head-major step (unpaced) prefetching into L2.
  EXPECT_EQ((pass::kSpreadKeys<Tag, false, 2>), 16);
  EXPECT_EQ((pass::kSpreadKeys<Tag, false, 3>), 8);  // into L1
  EXPECT_EQ((pass::kSpreadKeys<Tag, true, 2>), 8);   // a grouped task's paced steps
  // (count, j, keys, next keys) → buffer row.
  EXPECT_EQ(row(2, 0, 16, 16), 8);               // inside the call
  EXPECT_EQ(row(2, 6, 16, 16), 14);              // the call's last two rows
  EXPECT_EQ(row(2, 8, 16, 16), next_row0);       // 16: the next rows' first
  EXPECT_EQ(row(2, 14, 16, 16), next_row0 + 6);  // 22: the next rows' seventh
  EXPECT_EQ(row(2, 14, 16, 3), next_row0 + 1);   // 22, but the next rows hold 3: their last two
  EXPECT_EQ(row(2, 14, 16, 1), 14);              // the next rows hold fewer than 2: the call's last two again
  EXPECT_EQ(row(2, 14, 16, 0), 14);              // no next rows
  EXPECT_EQ(row(2, 0, 9, 16), 7);                // 8 with 9 keys: row 8 alone is left, so rows 7 and 8
  EXPECT_EQ(row(4, 4, 16, 16), 12);              // 12: the call's last four
  EXPECT_EQ(row(4, 8, 16, 16), next_row0);       // 16
  EXPECT_EQ(row(4, 12, 16, 4), next_row0);       // 20, clamped to the next rows' only four
  EXPECT_EQ(row(1, 3, 5, 2), next_row0 + 1);     // 11: past the next rows' two, their last
  EXPECT_EQ(row_ahead(l2, 2, 0, 20, 16), 16);    // 16 ahead: inside the call
  EXPECT_EQ(row_ahead(l2, 2, 2, 20, 16), 18);    // 18: the call's last two
  EXPECT_EQ(row_ahead(l2, 2, 4, 20, 16), next_row0);       // 20: the next rows' first
  EXPECT_EQ(row_ahead(l2, 2, 4, 20, 0), 18);               // no next rows: the call's last two
  EXPECT_EQ(row_ahead(l2, 4, 12, 20, 16), next_row0 + 8);  // 28
  const auto sweep = [&](Index ahead) {
    for (Index count : {1, 2, 4}) {
      for (Index keys = count; keys <= 20; ++keys) {
        for (Index next_keys : {0, 1, 3, 16}) {
          for (Index j = 0; j + count <= keys; j += count) {
            const Index r = row_ahead(ahead, count, j, keys, next_keys);
            const bool in_own = r >= 0 && r + count <= keys;
            const bool in_next = next_keys >= count && r >= next_row0 && r + count <= next_row0 + next_keys;
            EXPECT_TRUE(in_own || in_next) << ahead << " ahead, count " << count << ", keys " << keys << ", next "
                                           << next_keys << ", j " << j << ": row " << r;
          }
        }
      }
    }
  };
  sweep(8);
  sweep(l2);
}

// The decoding micro-kernels give a score and an output element the same bits whatever rows their call takes
// (decode_kernels.hpp: a head-major task's calls of 8 rows on 16 lanes, kQkDecodeRows and kPvDecodeRows): on the
// emulated 16-lane tag (the AVX-512 kernel's arithmetic), one call of 8 rows (qk_in_place with 2 keys per step, its
// steps ending where 4-key steps end; pv_in_place with kPvKeysPerStep8 = 3) against two calls of 4 (4 keys per step),
// byte for byte, at key counts around the steps and a 1024-key block, head_dims with tails (72, 81) and the unrolled
// 64 and 128, rows of K and V `ld` apart, and every storage type of K and V.
template <class S>
void check_eight_rows_as_two_calls_of_four() {
  namespace pass = qkv_test::emulated_pass;
  using Tag = qkv_test::Emulated16Tag;
  static_assert(pass::kQkDecodeRows<Tag, float> == 8 && pass::kPvDecodeRows<Tag> == 8, "16 lanes take 8 rows");
  std::mt19937 rng(808);
  std::normal_distribution<float> normal;
  // A reduced grid (valgrind) takes D = 81 and 128 and the keys 0 to 7, 1022 and 1027.
  const std::vector<Index> key_counts =
      reduced_grid() ? std::vector<Index>{0, 1, 2, 3, 4, 5, 6, 7, 1022, 1027}
                     : std::vector<Index>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1021, 1022, 1023, 1024, 1025, 1026, 1027};
  const std::vector<Index> head_dims =
      reduced_grid() ? std::vector<Index>{81, 128} : std::vector<Index>{64, 72, 81, 128};
  for (const Index D : head_dims) {
    for (const Index keys : key_counts) {
      const Index ld = D + 5, n = std::max<Index>(keys, 1);
      std::vector<float> q(static_cast<std::size_t>(8 * D)), p(static_cast<std::size_t>(8 * n)),
          o_init(static_cast<std::size_t>(8 * D));
      std::vector<S> k(static_cast<std::size_t>(n * ld)), v(k.size());
      for (auto* x : {&q, &p, &o_init})
        for (auto& e : *x) e = normal(rng);
      for (auto* x : {&k, &v})
        for (auto& e : *x) e = S(normal(rng));
      std::vector<float> s8(p.size(), -1.0f), s4(s8), o8(o_init), o4(o_init);  // keys = 0: nothing written
      pass::qk_in_place<Tag, 8>(q.data(), D, k.data(), ld, keys, D, s8.data(), n);
      for (Index r0 : {0, 4})
        pass::qk_in_place<Tag, 4>(q.data() + r0 * D, D, k.data(), ld, keys, D, s4.data() + r0 * n, n);
      EXPECT_EQ(std::memcmp(s8.data(), s4.data(), s8.size() * sizeof(float)), 0)
          << "Q·Kᵀ, D " << D << ", keys " << keys;
      pass::pv_in_place<Tag, 8, S, pass::kPvKeysPerStep8>(p.data(), n, v.data(), ld, keys, o8.data(), D, D);
      for (Index r0 : {0, 4}) {
        pass::pv_in_place<Tag, 4, S>(p.data() + r0 * n, n, v.data(), ld, keys, o4.data() + r0 * D, D, D);
      }
      EXPECT_EQ(std::memcmp(o8.data(), o4.data(), o8.size() * sizeof(float)), 0) << "P·V, D " << D << ", keys " << keys;
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST(Fused, EightRowDecodingCallsGiveTheBitsOfTwoCallsOfFour) {
  check_eight_rows_as_two_calls_of_four<float>();
  check_eight_rows_as_two_calls_of_four<Eigen::half>();
  check_eight_rows_as_two_calls_of_four<Eigen::bfloat16>();
}

// A paced head-major decoding task (kHeadMajorPaced: float K and V, 16 lanes, the L1 copy; fused_attention.hpp,
// run_decode_task) calls the micro-kernels over sub-blocks of keys (FusedTiles::kDecodePacedBytes, a multiple of 4
// keys) with a PrefetchCursor, where the calls it replaces took a whole 1024-key block without one: on the emulated
// 16-lane tag, the sub-block calls (P·V with four keys per step, kPvKeysPerStep, as the paced head-major task takes,
// and with two, kPvGroupedKeysPerStep, as a grouped task takes in that copy) against the one call, byte for byte, for 1
// to 4 rows, at key counts around the steps and a block, head_dims with tails (72, 81) and the unrolled 64 and 128,
// rows `ld` apart: padded, or abutting (ld = D), where at D = 64 and 128 a cursor's runs over a whole next sub-block
// are as long as a step's own rows and clang++ builds issue them straight-line (kStraightRuns). The cursors name the
// rows after each sub-block, over as many steps as the calls take, as the task's do.
TEST(Fused, PacedSubBlockDecodingCallsGiveTheBitsOfOneBlockCall) {
  namespace pass = qkv_test::emulated_pass;
  using Tag = qkv_test::Emulated16Tag;
  static_assert(pass::kHeadMajorPaced<Tag, float, 3> && !pass::kHeadMajorPaced<Tag, float, 2> &&
                    !pass::kHeadMajorPaced<Tag, Eigen::half, 3>,
                "paced: float on 16 lanes in the L1 copy only");
  constexpr int kGroupedStep = static_cast<int>(pass::kPvGroupedKeysPerStep<Tag, float, 3>);
  static_assert(kGroupedStep == 2 && pass::kPvKeysPerStep<Tag> == 4, "the step sizes this test compares");
  std::mt19937 rng(909);
  std::normal_distribution<float> normal;
  const std::vector<Index> key_counts =
      reduced_grid() ? std::vector<Index>{1, 3, 5, 33, 1027}
                     : std::vector<Index>{1, 2, 3, 4, 5, 31, 32, 33, 34, 35, 1021, 1022, 1023, 1024, 1025, 1027};
  const std::vector<Index> head_dims =
      reduced_grid() ? std::vector<Index>{81, 128} : std::vector<Index>{64, 72, 81, 128};
  for (const Index D : head_dims) {
    for (const Index keys : key_counts) {
      for (const Index sub : {Index(4), Index(32)}) {
        for (const Index ld : {D + 5, D}) {
          if (ld == D && D != 64 && D != 128) continue;  // abutting rows matter where the head_dim is compiled in
          std::vector<float> q(static_cast<std::size_t>(4 * D)), p(static_cast<std::size_t>(4 * keys)),
              o_init(static_cast<std::size_t>(4 * D));
          std::vector<float> k(static_cast<std::size_t>(keys * ld)), v(k.size());
          for (auto* x : {&q, &p, &o_init, &k, &v})
            for (auto& e : *x) e = normal(rng);
          const auto check_rows = [&](auto rows_constant) {
            constexpr int R = decltype(rows_constant)::value;
            std::vector<float> s_one(static_cast<std::size_t>(R * keys), -1.0f), s_sub(s_one), o_one(o_init),
                o_sub(o_init), o_sub2(o_init);
            pass::qk_in_place<Tag, R>(q.data(), D, k.data(), ld, keys, D, s_one.data(), keys);
            pass::pv_in_place<Tag, R, float>(p.data(), keys, v.data(), ld, keys, o_one.data(), D, D);
            for (Index jb = 0; jb < keys; jb += sub) {
              const Index n = std::min(sub, keys - jb), after = std::min(sub, keys - jb - n);
              pass::PrefetchCursor<float> k_ahead(k.data() + (jb + n) * ld, ld, after, D, (n + 3) / 4);
              pass::qk_in_place<Tag, R>(q.data(), D, k.data() + jb * ld, ld, n, D, s_sub.data() + jb, keys, &k_ahead);
              pass::PrefetchCursor<float> v_ahead(v.data() + (jb + n) * ld, ld, after, D, (n + 3) / 4);
              const pass::NextRows<float> next{after > 0 ? v.data() + (jb + n) * ld : nullptr, after};
              pass::pv_in_place<Tag, R, float, static_cast<int>(pass::kPvKeysPerStep<Tag>)>(
                  p.data() + jb, keys, v.data() + jb * ld, ld, n, o_sub.data(), D, D, &v_ahead, next);
              pass::PrefetchCursor<float> v_ahead2(v.data() + (jb + n) * ld, ld, after, D, (n + 1) / 2);
              pass::pv_in_place<Tag, R, float, kGroupedStep>(p.data() + jb, keys, v.data() + jb * ld, ld, n,
                                                             o_sub2.data(), D, D, &v_ahead2, next);
            }
            EXPECT_EQ(std::memcmp(s_one.data(), s_sub.data(), s_one.size() * sizeof(float)), 0)
                << "Q·Kᵀ, rows " << R << ", D " << D << ", keys " << keys << ", sub-blocks of " << sub << ", ld " << ld;
            EXPECT_EQ(std::memcmp(o_one.data(), o_sub.data(), static_cast<std::size_t>(R * D) * sizeof(float)), 0)
                << "P·V, rows " << R << ", D " << D << ", keys " << keys << ", sub-blocks of " << sub << ", ld " << ld;
            EXPECT_EQ(std::memcmp(o_one.data(), o_sub2.data(), static_cast<std::size_t>(R * D) * sizeof(float)), 0)
                << "P·V by pairs, rows " << R << ", D " << D << ", keys " << keys << ", sub-blocks of " << sub
                << ", ld " << ld;
          };
          check_rows(std::integral_constant<int, 1>());
          check_rows(std::integral_constant<int, 2>());
          check_rows(std::integral_constant<int, 3>());
          check_rows(std::integral_constant<int, 4>());
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

}  // namespace
