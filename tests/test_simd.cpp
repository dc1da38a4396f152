// Tests of include/qkv/simd/: every op of every tag this unit's flags enable (scalar always; AVX2 with
// -march=x86-64-v3 or native on an AVX2 machine; AVX-512 with -march=x86-64-v4: tests/CMakeLists.txt builds this file
// as test_simd, test_simd_v3 and test_simd_v4) against its scalar definition,
// and the vectorized exp's and exp2's error bounds over dense sweeps against double-precision exp and exp2.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qkv/simd/simd.hpp"
#include "support/type_lists.hpp"

namespace {

template <class Tag>
struct Simd : ::testing::Test {};
TYPED_TEST_SUITE(Simd, qkv_test::SimdTags, );

/// Applies `op` (a vector of the tag → a vector) to `x`, a full vector at a time; the tail one element at a time in
/// lane 0.
template <class Tag, class Op>
std::vector<float> apply_lanes(const std::vector<float>& x, Op op) {
  constexpr int L = Tag::kLanes;
  std::vector<float> y(x.size());
  std::size_t n = 0;
  for (; n + L <= x.size(); n += L) qkv::simd::store(Tag(), y.data() + n, op(qkv::simd::load(Tag(), x.data() + n)));
  for (; n < x.size(); ++n) {
    float lane[L] = {};
    lane[0] = x[n];
    qkv::simd::store(Tag(), lane, op(qkv::simd::load(Tag(), lane)));
    y[n] = lane[0];
  }
  return y;
}

/// `exp` of the tag on every element of `x`.
template <class Tag>
std::vector<float> vector_exp(const std::vector<float>& x) {
  return apply_lanes<Tag>(x, [](auto v) { return qkv::simd::exp(Tag(), v); });
}

/// `exp2` of the tag on every element of `x`.
template <class Tag>
std::vector<float> vector_exp2(const std::vector<float>& x) {
  return apply_lanes<Tag>(x, [](auto v) { return qkv::simd::exp2(Tag(), v); });
}

/// Distance in units in the last place between a float result and the exact value.
double ulp_error(float got, double exact) {
  const float rounded = static_cast<float>(exact);
  const double ulp = std::nextafter(rounded, std::numeric_limits<float>::infinity()) - rounded;
  return std::fabs(double(got) - exact) / ulp;
}

/// Expects y[n] within 2 ulp of exact(x[n]) for every n; records the largest error as the test's max_ulp property.
template <class Exact>
void expect_within_two_ulp(const std::vector<float>& x, const std::vector<float>& y, Exact exact) {
  double worst = 0;
  float worst_x = 0;
  for (std::size_t n = 0; n < x.size(); ++n) {
    const double e = ulp_error(y[n], exact(double(x[n])));
    if (e > worst) worst = e, worst_x = x[n];
  }
  EXPECT_LE(worst, 2.0) << "worst at x = " << worst_x;
  ::testing::Test::RecordProperty("max_ulp", std::to_string(worst));
}

TYPED_TEST(Simd, ExpWithinTwoUlpOnTheSoftmaxRange) {
  // Dense sweep of [−87.3, 0]: every 2^-12 below −8, every float step of 2^-20 near 0 (about 400 000 points).
  std::vector<float> x;
  for (double v = -87.3; v < -8.0; v += 1.0 / 4096) x.push_back(static_cast<float>(v));
  for (double v = -8.0; v <= 0.0; v += 1.0 / 1048576 * 16) x.push_back(static_cast<float>(v));
  expect_within_two_ulp(x, vector_exp<TypeParam>(x), [](double v) { return std::exp(v); });
}

TYPED_TEST(Simd, ExpEdgeValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {-inf,  -1e30f,        -104.0f, -88.0f, -87.5f, 0.0f,
                                -0.0f, std::nanf(""), 1.0f,    88.0f,  89.0f,  inf};
  const auto y = vector_exp<TypeParam>(x);
  EXPECT_EQ(y[0], 0.0f);  // exactly 0 for −∞
  for (int n = 1; n <= 4; ++n) {
    EXPECT_GE(y[static_cast<std::size_t>(n)], 0.0f)
        << x[static_cast<std::size_t>(n)];  // below the range: in [0, FLT_MIN]
    EXPECT_LE(y[static_cast<std::size_t>(n)], FLT_MIN) << x[static_cast<std::size_t>(n)];
  }
  EXPECT_EQ(y[5], 1.0f);
  EXPECT_EQ(y[6], 1.0f);
  EXPECT_TRUE(std::isnan(y[7]));  // NaN for NaN
  EXPECT_LE(ulp_error(y[8], std::exp(1.0)), 2.0);
  EXPECT_LE(ulp_error(y[9], std::exp(88.0)), 2.0);
  EXPECT_EQ(y[10], inf);
  EXPECT_EQ(y[11], inf);
}

TYPED_TEST(Simd, Exp2WithinTwoUlpOnTheSoftmaxRange) {
  // The fused kernel's softmax works in base 2 (scores pre-multiplied by log2 e). Dense sweep of [−126, 0] (every
  // 2^-12 below −8, every 2^-16 above: about 640 000 points) and of [0, 127] every 2^-10, against double exp2.
  // Bound: 2 ulp (measured on AVX2: 0.91 ulp; the C library's exp2 for the scalar tag: 0.50).
  std::vector<float> x;
  for (double v = -126.0; v < -8.0; v += 1.0 / 4096) x.push_back(static_cast<float>(v));
  for (double v = -8.0; v <= 0.0; v += 1.0 / 65536) x.push_back(static_cast<float>(v));
  for (double v = 0.0; v <= 127.0; v += 1.0 / 1024) x.push_back(static_cast<float>(v));
  expect_within_two_ulp(x, vector_exp2<TypeParam>(x), [](double v) { return std::exp2(v); });
}

TYPED_TEST(Simd, Exp2EdgeValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {-inf,  -1e30f,        -150.0f, -127.0f, -126.75f, 0.0f,
                                -0.0f, std::nanf(""), -3.0f,   127.0f,  128.0f,   inf};
  const auto y = vector_exp2<TypeParam>(x);
  EXPECT_EQ(y[0], 0.0f);  // exactly 0 for −∞: a hidden key's weight
  for (int n = 1; n <= 4; ++n) {
    EXPECT_GE(y[static_cast<std::size_t>(n)], 0.0f) << x[static_cast<std::size_t>(n)];  // below 2^−126: in [0, FLT_MIN]
    EXPECT_LE(y[static_cast<std::size_t>(n)], FLT_MIN) << x[static_cast<std::size_t>(n)];
  }
  EXPECT_EQ(y[5], 1.0f);
  EXPECT_EQ(y[6], 1.0f);
  EXPECT_TRUE(std::isnan(y[7]));  // NaN for NaN
  EXPECT_EQ(y[8], 0.125f);        // integers are exact
  EXPECT_EQ(y[9], std::ldexp(1.0f, 127));
  EXPECT_EQ(y[10], inf);
  EXPECT_EQ(y[11], inf);
}

TYPED_TEST(Simd, Exp2OfSixteenLanesIsZeroBelowMinus126) {
  // The 16-lane tags (AVX-512 and the emulated one: vreduceps, vscalefps under a zeroing mask) give exactly 0 for
  // every x < −126 and never a subnormal, which would cost Intel cores a microcode assist in the P·V FMAs; 2^−126 at
  // x = −126 and within 2 ulp just above. (The 8-lane tag gives subnormals for x in (−126.5, −126), the scalar tag,
  // the C library's exp2, down to −149.)
  if (TypeParam::kLanes != 16) GTEST_SKIP() << "the 16-lane exp2's rule";
  std::vector<float> x;
  for (double v = -160.0; v < -126.0; v += 1.0 / 64) x.push_back(static_cast<float>(v));
  x.push_back(std::nextafter(-126.0f, -200.0f));
  x.push_back(-std::numeric_limits<float>::infinity());
  const auto y = vector_exp2<TypeParam>(x);
  for (std::size_t n = 0; n < x.size(); ++n) EXPECT_EQ(y[n], 0.0f) << "exp2(" << x[n] << ")";
  const std::vector<float> at = {-126.0f, std::nextafter(-126.0f, 0.0f), -125.75f, -125.5f, -125.25f};
  const auto z = vector_exp2<TypeParam>(at);
  EXPECT_EQ(z[0], FLT_MIN);
  for (std::size_t n = 1; n < at.size(); ++n) EXPECT_LE(ulp_error(z[n], std::exp2(double(at[n]))), 2.0) << at[n];
}

TYPED_TEST(Simd, ArithmeticAndReductionsMatchScalar) {
  using Tag = TypeParam;
  constexpr int L = Tag::kLanes;
  float a[L], b[L], c[L], out[L];
  for (int n = 0; n < L; ++n) a[n] = 0.5f * float(n) - 3, b[n] = float(n * n) / 7, c[n] = 1.0f / float(n + 1);
  using namespace qkv::simd;
  store(Tag(), out, fmadd(load(Tag(), a), load(Tag(), b), load(Tag(), c)));
  for (int n = 0; n < L; ++n) EXPECT_EQ(out[n], std::fma(a[n], b[n], c[n])) << "fmadd(a, b, c) = a·b + c, rounded once";
  store(Tag(), out, max(load(Tag(), a), load(Tag(), b)));
  for (int n = 0; n < L; ++n) EXPECT_EQ(out[n], std::max(a[n], b[n]));
  store(Tag(), out, sub(add(load(Tag(), a), load(Tag(), b)), mul(load(Tag(), c), set1(Tag(), 2.0f))));
  for (int n = 0; n < L; ++n) EXPECT_EQ(out[n], (a[n] + b[n]) - c[n] * 2.0f);
  float expected_max = a[0], expected_sum = 0;
  for (int n = 0; n < L; ++n) expected_max = std::max(expected_max, a[n]), expected_sum += b[n];
  EXPECT_EQ(reduce_max(Tag(), load(Tag(), a)), expected_max);
  EXPECT_NEAR(reduce_sum(Tag(), load(Tag(), b)), expected_sum, 1e-5f * std::fabs(expected_sum));
  EXPECT_EQ(reduce_sum(Tag(), zero(Tag())), 0.0f);
  float sums[4], expected[4] = {0, 0, 0, 0};
  for (int n = 0; n < L; ++n) expected[0] += a[n], expected[1] += b[n], expected[2] += c[n], expected[3] += float(n);
  float ramp[L];
  for (int n = 0; n < L; ++n) ramp[n] = float(n);
  reduce_sum4(Tag(), load(Tag(), a), load(Tag(), b), load(Tag(), c), load(Tag(), ramp), sums);
  for (int m = 0; m < 4; ++m) EXPECT_NEAR(sums[m], expected[m], 1e-5f * std::max(1.0f, std::fabs(expected[m]))) << m;
}

TYPED_TEST(Simd, SixteenLaneSumsAtOncePairAsFourAtATime) {
  // reduce_sum16 (16-lane tags) must give reduce_sum4's bits for each vector: the decoding Q·Kᵀ uses one or the other
  // by its row count. Values spanning many binades, so that a different pairing would change low bits; and small
  // integers, whose sums are exact, against a plain loop.
  using Tag = TypeParam;
  constexpr int L = Tag::kLanes;
  if constexpr (L != 16) {
    GTEST_SKIP() << "reduce_sum16 exists for 16-lane tags";
  } else {
    using namespace qkv::simd;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
    std::uniform_int_distribution<int> exponent(-20, 20), sign(0, 1), small(-50, 50);
    for (int trial = 0; trial < 200; ++trial) {
      const bool integers = trial % 4 == 0;
      float x[16][L];
      for (auto& row : x) {
        for (float& e : row) {
          e = integers ? float(small(rng)) : std::ldexp(mantissa(rng), exponent(rng)) * (sign(rng) ? -1.0f : 1.0f);
        }
      }
      typename Tag::Vec v[16];
      for (int m = 0; m < 16; ++m) v[m] = load(Tag(), x[m]);
      float at_once[16], by_four[16];
      reduce_sum16(Tag(), v, at_once);
      for (int m = 0; m < 16; m += 4) reduce_sum4(Tag(), v[m], v[m + 1], v[m + 2], v[m + 3], by_four + m);
      for (int m = 0; m < 16; ++m) {
        EXPECT_EQ(std::memcmp(&at_once[m], &by_four[m], sizeof(float)), 0) << "trial " << trial << ", vector " << m;
        if (integers) {
          float exact = 0;
          for (int n = 0; n < L; ++n) exact += x[m][n];
          EXPECT_EQ(at_once[m], exact) << "trial " << trial << ", vector " << m;
        }
      }
    }
  }
}

TYPED_TEST(Simd, TransposeExchangesRowsAndLanes) {
  // transpose (packing Kᵀ panels, pack.hpp): lane j of row i becomes lane i of row j, for distinct values (so a
  // lane landing anywhere else fails), the NaN and infinities among them (moved, never computed on).
  using Tag = TypeParam;
  using namespace qkv::simd;
  constexpr int L = Tag::kLanes;
  float x[L][L];
  for (int i = 0; i < L; ++i) {
    for (int j = 0; j < L; ++j) x[i][j] = float(100 * i + j) + 0.25f;
  }
  x[0][L - 1] = std::numeric_limits<float>::quiet_NaN();
  x[L - 1][0] = std::numeric_limits<float>::infinity();
  x[L / 2][L / 2] = -std::numeric_limits<float>::infinity();
  typename Tag::Vec rows[L];
  for (int i = 0; i < L; ++i) rows[i] = load(Tag(), x[i]);
  transpose(Tag(), rows);
  for (int i = 0; i < L; ++i) {
    float lanes[L];
    store(Tag(), lanes, rows[i]);
    for (int j = 0; j < L; ++j) {
      EXPECT_EQ(std::memcmp(&lanes[j], &x[j][i], sizeof(float)), 0) << "row " << i << ", lane " << j;
    }
  }
}

TYPED_TEST(Simd, PartialLoadsAndStoresTouchOnlyTheirLanes) {
  using Tag = TypeParam;
  constexpr int L = Tag::kLanes;
  for (int n = 0; n < L; ++n) {
    std::vector<float> source(L, 0.0f), target(L, -1.0f), loaded(L, 0.0f);
    for (int m = 0; m < L; ++m) source[std::size_t(m)] = float(m + 1);
    qkv::simd::store(Tag(), loaded.data(), qkv::simd::load_partial(Tag(), source.data(), n));
    qkv::simd::store_partial(Tag(), target.data(), qkv::simd::load(Tag(), source.data()), n);
    for (int m = 0; m < L; ++m) {
      EXPECT_EQ(loaded[std::size_t(m)], m < n ? float(m + 1) : 0.0f) << "lane " << m << " of " << n;
      EXPECT_EQ(target[std::size_t(m)], m < n ? float(m + 1) : -1.0f) << "lane " << m << " of " << n;
    }
  }
}

}  // namespace
