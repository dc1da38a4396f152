// Tests of the fused kernel (include/qkv/detail/fused_attention.hpp, Backend::fused) against the float64
// reference (reference.hpp, itself checked against an independent brute force in test_reference.cpp).
//
// Criterion (docs/design.md, Accuracy; FlashAttention's own test rule): over each call's output, the fused float
// error against float64 is at most 2 × the error of a plain float implementation (materialized S, softmax and
// P·V, all in float: support/plain_float.hpp) + 1e-6·max(1, max|V|); NaN appears exactly where float64 has NaN.
// A randomized grid over D, Sq, Skv, every option and combinations, GQA groups, BSHD and BHSD strides and varlen
// batches; the `quick` label runs a slice (the Quick suite), `full` all of it (QKV_FUSED_FULL=1).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <string>
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

/// A case: its shape (brute::Shape: B, Hq, Hkv, Sq, Skv, D, Dv), layout, options and the storage behind them.
struct Case : brute::Shape {
  bool bshd = false;
  qkv::AttentionOptions<float> options{};
  std::vector<float> bias{};  // storage behind options.bias
  std::vector<char> allowed{};
  /// Component 0 of every key set to 3e38 and of every query to 0: the scores do not change (0 · 3e38 = 0 in float
  /// and double), but the base-2 check's bound Σ|q'|·max|k| (run_prefill_task, base2_fits) passes FLT_MAX as soon
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

/// Runs one case: fused vs float64 reference vs plain float; asserts the accuracy rule and NaN placement.
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
  std::vector<float> fused(n_out, -7.0f), plain(n_out, 0.0f), fused_lse(static_cast<std::size_t>(c.B * c.Hq * q_rows));
  std::vector<double> qd64(qd.begin(), qd.end()), kd64(kd.begin(), kd.end()), vd64(vd.begin(), vd.end()), ref(n_out),
      ref_lse(fused_lse.size());
  const auto q = make_view<const float>(qd.data(), c.B, c.Hq, q_rows, c.D, c.bshd);
  const auto k = make_view<const float>(kd.data(), c.B, c.Hkv, k_rows, c.D, c.bshd);
  const auto v = make_view<const float>(vd.data(), c.B, c.Hkv, k_rows, c.Dv, c.bshd);
  c.options.backend = qkv::Backend::fused;
  qkv::attention(q, k, v, make_view(fused.data(), c.B, c.Hq, q_rows, c.Dv, c.bshd),
                 qkv::TensorView3<float>(fused_lse.data(), {c.B, c.Hq, q_rows}), c.options);
  const brute::Params call = qkv_test::to_brute(c.options, c);  // the call as the support helpers take it
  qkv_test::plain_float(q, k, v, call, make_view(plain.data(), c.B, c.Hq, q_rows, c.Dv, c.bshd), {});

  const auto o64 = qkv_test::from_brute<double>(call, qkv::Backend::reference);
  qkv::attention(make_view<const double>(qd64.data(), c.B, c.Hq, q_rows, c.D, c.bshd),
                 make_view<const double>(kd64.data(), c.B, c.Hkv, k_rows, c.D, c.bshd),
                 make_view<const double>(vd64.data(), c.B, c.Hkv, k_rows, c.Dv, c.bshd),
                 make_view(ref.data(), c.B, c.Hq, q_rows, c.Dv, c.bshd),
                 qkv::TensorView3<double>(ref_lse.data(), {c.B, c.Hq, q_rows}), o64.options);

  double err_fused = 0, err_plain = 0, max_v = 0;
  for (float x : vd) max_v = std::max(max_v, std::fabs(double(x)));
  for (std::size_t n = 0; n < n_out; ++n) {
    ASSERT_EQ(std::isnan(fused[n]), std::isnan(ref[n])) << c.describe() << " element " << n;
    if (std::isnan(ref[n])) continue;
    err_fused = std::max(err_fused, std::fabs(fused[n] - ref[n]));
    err_plain = std::max(err_plain, std::fabs(plain[n] - ref[n]));
  }
  EXPECT_LE(err_fused, 2 * err_plain + 1e-6 * std::max(1.0, max_v))
      << c.describe() << " (fused error " << err_fused << ", plain float error " << err_plain << ")";
  for (std::size_t n = 0; n < ref_lse.size(); ++n) {
    if (std::isinf(ref_lse[n])) {
      EXPECT_EQ(fused_lse[n], float(ref_lse[n])) << c.describe() << " lse " << n;
    } else if (!std::isnan(ref_lse[n])) {
      EXPECT_NEAR(fused_lse[n], ref_lse[n], 1e-4 * std::max(1.0, std::fabs(ref_lse[n])))
          << c.describe() << " lse " << n;
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
  // A bias of 3e38 at one late (row, key), key tile 3 of 3: the base-2 run of the task has already updated every
  // row's max, sum and output through two key tiles and most strips of the third when the finished score
  // overflows; the task must start again in base e from a clean state. GQA 2/1 (80 stacked rows), causal, against
  // the float64 reference under the grid's rule; that row is one-hot on the biased key.
  Case c{{1, 2, 1, 40, 600, 16, 16}};
  c.options.causal = true;
  c.options.alignment = qkv::CausalAlignment::bottom_right;
  c.bias.assign(static_cast<std::size_t>(c.Hq * c.Sq * c.Skv), 0.0f);
  c.bias[static_cast<std::size_t>((1 * c.Sq + 30) * c.Skv + 550)] = 3e38f;  // head 1, query 30, key 550 (visible)
  c.options.bias = qkv::TensorView4<const float>(c.bias.data(), {1, c.Hq, c.Sq, c.Skv});
  check_case(c, 31);
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
  std::vector<float> q(5 * 16, 0.5f), k(40 * 16, 0.25f), v(40 * 16, 1.0f), out(5 * 16, 0.0f);
  for (Index dd = 0; dd < 16; ++dd) {
    k[static_cast<std::size_t>(7 * 16 + dd)] = v[static_cast<std::size_t>(7 * 16 + dd)] = std::nanf("");
    k[static_cast<std::size_t>(35 * 16 + dd)] = v[static_cast<std::size_t>(35 * 16 + dd)] = std::nanf("");
  }
  d.options.backend = qkv::Backend::fused;
  qkv::attention(
      qkv::view_bhsd<const float>(q.data(), 1, 1, 5, 16), qkv::view_bhsd<const float>(k.data(), 1, 1, 40, 16),
      qkv::view_bhsd<const float>(v.data(), 1, 1, 40, 16), qkv::view_bhsd(out.data(), 1, 1, 5, 16), d.options);
  for (float x : out) EXPECT_FLOAT_EQ(x, 1.0f);  // mean of the visible (all-one) values
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

/// Runs a prefill and a decode shape with the given thread count; returns the outputs concatenated.
std::vector<float> run_with_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
  std::vector<float> result;
  for (Index sq : {Index(300), Index(1)}) {
    const Index Hq = 8, Hkv = 2, Skv = 4500, D = 64;
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

TEST(Fused, AllocatesNothingProportionalToSqTimesSkv) {
  if (!QKV_COUNTS_ALLOCATIONS) GTEST_SKIP() << "ThreadSanitizer build: operator new is TSan's, not counted";
  // T = 4096, 2 heads, D = 64: Sq·Skv floats per head would be 64 MiB; K, Q, V, out are 2 MiB each.
  const Index T = 4096, H = 2, D = 64;
  std::vector<float> q(static_cast<std::size_t>(H * T * D), 0.01f), k(q.size(), 0.02f), v(q.size(), 1.0f),
      out(q.size());
  qkv::AttentionOptions<float> o;
  o.backend = qkv::Backend::fused;
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

// Every kernel the build compiled (runtime dispatch: scalar, AVX2 and AVX-512 in a plain build), in one binary, each
// against the reference; a kernel this CPU cannot run is skipped.
template <class Tag>
struct FusedPerTag : ::testing::Test {};
TYPED_TEST_SUITE(FusedPerTag, qkv_test::KernelTags, );

TYPED_TEST(FusedPerTag, MatchesTheReferenceWithinTheAccuracyRule) {
  if (!qkv_test::cpu_runs<TypeParam>()) GTEST_SKIP() << "this CPU cannot run the " << TypeParam::kName << " kernel";
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
    qkv::detail::run_fused_as(TypeParam(), shape, qv, kv, vv, ov, nullptr, params);
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

}  // namespace
