// Tests of qkv/positional.hpp. Expected values come from hand calculations (sinusoidal values, ALiBi slopes, T5's
// bucket table) or from float64 brute force written here (RoPE as an explicit rotation of each feature pair, attention
// as plain loops through the Eigen entry points' independent counterpart). Covered: the sinusoidal encoding (odd
// d_model, offsets) and the seed's rotation property; RoPE in both layouts against brute force, the relative-position
// property, decode-with-offset = prefill, linear and NTK-aware scaling; ALiBi slopes (8, 12 and other head counts) and
// ALiBi through `alibi_slopes` = the same bias as a `bias` view; T5 buckets and bias; seed 000 定理 2.4.2 with
// positions (a sinusoidal encoding breaks permutation equivariance); every error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "qkv/positional.hpp"
#include "qkv/sdpa.hpp"
#include "support/expect_shape_error.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

namespace {

using qkv::Index;
using qkv::Matrix;
using qkv_test::random_matrix;

template <class T>
struct Positional : ::testing::Test {};
TYPED_TEST_SUITE(Positional, qkv_test::Scalars, );

template <class T>
double eps() {
  return std::is_same_v<T, float> ? 1e-6 : 1e-13;  // one rounding of an O(1) value to T, with margin
}

/// Two attention calls on the same math, each within the reference path's bound of float64 (docs/design.md, Accuracy:
/// 1e-6·max(1, max|V|) in float), differ by at most twice that bound.
template <class T>
double attention_tolerance(const Matrix<T>& V) {
  return (std::is_same_v<T, float> ? 2e-6 : 1e-12) * std::max(1.0, double(V.cwiseAbs().maxCoeff()));
}

// ---- sinusoidal ----------------------------------------------------------------------------------------------------

TYPED_TEST(Positional, SinusoidalValuesByHand) {
  using T = TypeParam;
  // d = 4: frequencies 10000^(−0/4) = 1 and 10000^(−2/4) = 1/100.
  const Matrix<T> pe = qkv::sinusoidal_encoding<T>(4, 4);
  const double expected[4][4] = {{0, 1, 0, 1},
                                 {0.8414709848078965, 0.5403023058681398, 0.009999833334166664, 0.9999500004166653},
                                 {0.9092974268256817, -0.4161468365471424, 0.01999866669333308, 0.9998000066665778},
                                 {0.1411200080598672, -0.9899924966004454, 0.02999550020249566, 0.9995500337489875}};
  for (Index p = 0; p < 4; ++p)
    for (Index c = 0; c < 4; ++c) EXPECT_NEAR(double(pe(p, c)), expected[p][c], eps<T>()) << p << ", " << c;

  // Odd d = 5: frequencies 1, 10000^−0.4 = 0.0251188643, 10000^−0.8 = 0.000630957344; the last column is a sine
  // with no cosine partner. Position 3:
  const Matrix<T> odd = qkv::sinusoidal_encoding<T>(4, 5);
  const double row3[5] = {0.1411200080598672, -0.9899924966004454, 0.07528529299888893, 0.997162035307237,
                          0.0018928709030918874};
  ASSERT_EQ(odd.cols(), 5);
  for (Index c = 0; c < 5; ++c) EXPECT_NEAR(double(odd(3, c)), row3[c], eps<T>()) << c;
  EXPECT_EQ(double(odd(0, 4)), 0.0);

  // first_position: rows of a later window are the same rows of a longer table.
  const Matrix<T> window = qkv::sinusoidal_encoding<T>(3, 6, 5), table = qkv::sinusoidal_encoding<T>(8, 6);
  EXPECT_TRUE(window == table.bottomRows(3));
  EXPECT_EQ(qkv::sinusoidal_encoding<T>(0, 6).rows(), 0);
}

TEST(Sinusoidal, ShiftIsARotationOfEachFrequencyPair) {
  // Seed 002 §6.1: "一个位置向量可以用其他位置向量的线性组合来表示". For frequency ω_i,
  // [sin((p+k)ω); cos((p+k)ω)] = [[cos kω, sin kω], [−sin kω, cos kω]] · [sin pω; cos pω]: a rotation by kω that
  // depends on k only. Checked numerically against a matrix built here, for many p and k.
  const Index d = 16, length = 300;
  const Matrix<double> pe = qkv::sinusoidal_encoding<double>(length, d);
  for (Index i = 0; i < d / 2; ++i) {
    const double omega = std::pow(10000.0, -2.0 * double(i) / double(d));
    for (Index k : {1, 3, 17, 100}) {
      const double c = std::cos(double(k) * omega), s = std::sin(double(k) * omega);
      for (Index p = 0; p + k < length; p += 7) {
        const double sin_p = pe(p, 2 * i), cos_p = pe(p, 2 * i + 1);
        EXPECT_NEAR(pe(p + k, 2 * i), c * sin_p + s * cos_p, 1e-9) << "i " << i << " k " << k << " p " << p;
        EXPECT_NEAR(pe(p + k, 2 * i + 1), -s * sin_p + c * cos_p, 1e-9) << "i " << i << " k " << k << " p " << p;
      }
    }
  }
  // Hence PE(p)·PE(p + k) = Σ_i cos(kω_i) depends on k only (the seed's "点积只依赖于它们之间的距离差").
  for (Index k : {0, 1, 5, 40}) {
    double expected = 0;
    for (Index i = 0; i < d / 2; ++i) expected += std::cos(double(k) * std::pow(10000.0, -2.0 * double(i) / double(d)));
    for (Index p = 0; p + k < length; p += 13) EXPECT_NEAR(pe.row(p).dot(pe.row(p + k)), expected, 1e-9);
  }
}

// ---- RoPE ----------------------------------------------------------------------------------------------------------

/// Float64 brute force: rotates each pair (a, b) of each head of row t by (first + t)/s · θ_i, θ_i = base^(−2i/D),
/// with the pairs of the layout: (i, i + D/2) for rotate_half, (2i, 2i + 1) for interleaved.
template <class T>
Matrix<double> brute_rope(const Matrix<T>& X, Index n_heads, Index first, qkv::RopeLayout layout, double base = 10000,
                          double s = 1) {
  Matrix<double> Y = X.template cast<double>();
  const Index D = X.cols() / n_heads;
  for (Index t = 0; t < X.rows(); ++t)
    for (Index h = 0; h < n_heads; ++h)
      for (Index i = 0; i < D / 2; ++i) {
        const double angle = double(first + t) / s * std::pow(base, -2.0 * double(i) / double(D));
        const Index a = h * D + (layout == qkv::RopeLayout::rotate_half ? i : 2 * i);
        const Index b = h * D + (layout == qkv::RopeLayout::rotate_half ? i + D / 2 : 2 * i + 1);
        const double x_a = double(X(t, a)), x_b = double(X(t, b));
        Y(t, a) = std::cos(angle) * x_a - std::sin(angle) * x_b;
        Y(t, b) = std::sin(angle) * x_a + std::cos(angle) * x_b;
      }
  return Y;
}

const qkv::RopeLayout kLayouts[] = {qkv::RopeLayout::rotate_half, qkv::RopeLayout::interleaved};

TYPED_TEST(Positional, RopeBothLayoutsMatchBruteForce) {
  using T = TypeParam;
  const Index rows = 6, n_heads = 3, D = 8, first = 11;
  const Matrix<T> X = random_matrix<T>(rows, n_heads * D, 1);
  for (qkv::RopeLayout layout : kLayouts) {
    qkv::RopeOptions options;
    options.layout = layout;
    Matrix<T> Y = X;
    qkv::apply_rope(Y, n_heads, first, options);
    const Matrix<double> expected = brute_rope(X, n_heads, first, layout);
    EXPECT_LE((Y.template cast<double>() - expected).cwiseAbs().maxCoeff(), 4 * eps<T>()) << int(layout);
    // Norms are preserved (rotations), and the two layouts differ.
    EXPECT_NEAR(double(Y.norm()), double(X.norm()), 1e-5 * double(X.norm()));
  }
  Matrix<T> half = X, interleaved = X;
  qkv::RopeOptions interleaved_options;
  interleaved_options.layout = qkv::RopeLayout::interleaved;
  qkv::apply_rope(half, n_heads, first);
  qkv::apply_rope(interleaved, n_heads, first, interleaved_options);
  EXPECT_GT((half - interleaved).cwiseAbs().maxCoeff(), T(0.1));
}

TYPED_TEST(Positional, RopeOnViewsAndBlocksEqualsThePackedForm) {
  using T = TypeParam;
  const Index B = 2, S = 5, H = 3, D = 6, first = 4;
  // A BSHD buffer: batch b, row s, head h at ((b·S + s)·H + h)·D. The packed matrix of batch b is rows [b·S, (b+1)·S).
  Matrix<T> packed = random_matrix<T>(B * S, H * D, 2);
  Matrix<T> expected = packed;
  for (Index b = 0; b < B; ++b) qkv::apply_rope(expected.middleRows(b * S, S), H, first);  // a block (rvalue)
  qkv::apply_rope(qkv::view_bshd(packed.data(), B, S, H, D), first);
  EXPECT_TRUE(packed == expected);

  // A column-major matrix and one head's column block give the same numbers.
  const Matrix<T> X = random_matrix<T>(4, H * D, 3);
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> col_major = X;
  Matrix<T> row_major = X, one_head = X;
  qkv::apply_rope(col_major, H, 2);
  qkv::apply_rope(row_major, H, 2);
  qkv::apply_rope(one_head.middleCols(D, D), 1, 2);
  EXPECT_TRUE(Matrix<T>(col_major) == row_major);
  EXPECT_TRUE(one_head.middleCols(D, D) == row_major.middleCols(D, D));
  EXPECT_TRUE(one_head.leftCols(D) == X.leftCols(D));  // untouched
}

TEST(Rope, DotProductDependsOnlyOnThePositionDifference) {
  // RoFormer: (R(m) q)·(R(n) k) = qᵀ R(n − m) k. Shift both positions by several offsets; the score is unchanged.
  const Index D = 16;
  const Matrix<double> q = random_matrix<double>(1, D, 4), k = random_matrix<double>(1, D, 5);
  for (qkv::RopeLayout layout : kLayouts) {
    qkv::RopeOptions options;
    options.layout = layout;
    const auto score = [&](Index m, Index n) {
      Matrix<double> qm = q, kn = k;
      qkv::apply_rope(qm, 1, m, options);
      qkv::apply_rope(kn, 1, n, options);
      return qm.row(0).dot(kn.row(0));
    };
    for (Index m : {0, 3, 9}) {
      for (Index n : {0, 2, 9}) {
        const double reference = score(m, n);
        for (Index offset : {1, 7, 100, 1000, 12345}) {
          EXPECT_NEAR(score(m + offset, n + offset), reference, 1e-9 * std::max(1.0, std::abs(reference)))
              << "layout " << int(layout) << " m " << m << " n " << n << " offset " << offset;
        }
      }
    }
    EXPECT_GT(std::abs(score(0, 5) - score(0, 0)), 1e-3);  // but it does depend on the difference
  }
}

TYPED_TEST(Positional, RopeDecodeWithOffsetEqualsPrefill) {
  using T = TypeParam;
  const Index Tn = 7, Hq = 4, Hkv = 2, D = 8;
  const Matrix<T> Q0 = random_matrix<T>(Tn, Hq * D, 6), K0 = random_matrix<T>(Tn, Hkv * D, 7),
                  V = random_matrix<T>(Tn, Hkv * D, 8);
  for (qkv::RopeLayout layout : kLayouts) {
    qkv::RopeOptions options;
    options.layout = layout;
    // Prefill: rotate the whole sequence at once, causal attention over it.
    Matrix<T> Q = Q0, K = K0;
    qkv::apply_rope(Q, Hq, 0, options);
    qkv::apply_rope(K, Hkv, 0, options);
    qkv::AttentionOptions<T> causal;
    causal.causal = true;
    const Matrix<T> prefill = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{Hq, Hkv}, causal);
    // Decode: token t rotated alone with first_position = t (the cache length), appended to a growing key cache.
    Matrix<T> K_cache(0, Hkv * D);
    for (Index t = 0; t < Tn; ++t) {
      Matrix<T> q = Q0.row(t), k = K0.row(t);
      qkv::apply_rope(q, Hq, t, options);
      qkv::apply_rope(k, Hkv, t, options);
      EXPECT_TRUE(q == Q.row(t)) << "t " << t;  // the same angles: bit-identical rows
      EXPECT_TRUE(k == K.row(t)) << "t " << t;
      K_cache.conservativeResize(t + 1, Eigen::NoChange);
      K_cache.row(t) = k;
      const Matrix<T> out = qkv::scaled_dot_product_attention(q, K_cache, V.topRows(t + 1), qkv::Heads{Hq, Hkv});
      EXPECT_LE((out - prefill.row(t)).cwiseAbs().maxCoeff(), attention_tolerance(V)) << "t " << t;
    }
  }
}

TEST(Rope, LinearInterpolationAndNtkScaling) {
  const Index D = 8, n_heads = 2;
  const Matrix<double> X = random_matrix<double>(5, n_heads * D, 9);
  // Linear position interpolation (Chen et al.): position m with factor s is position m / s.
  qkv::RopeOptions linear;
  linear.interpolation_factor = 4;
  Matrix<double> Y = X;
  qkv::apply_rope(Y, n_heads, 30, linear);
  EXPECT_LE((Y - brute_rope(X, n_heads, 30, qkv::RopeLayout::rotate_half, 10000, 4)).cwiseAbs().maxCoeff(), 1e-12);
  Matrix<double> at_8 = X.topRows(1), at_2 = X.topRows(1);
  qkv::apply_rope(at_8, n_heads, 8, linear);
  qkv::apply_rope(at_2, n_heads, 2);
  EXPECT_LE((at_8 - at_2).cwiseAbs().maxCoeff(), 1e-14);

  // NTK-aware (bloc97): base' = base·α^(D/(D−2)). The highest frequency is unchanged and the lowest is divided by α.
  qkv::RopeOptions ntk;
  ntk.ntk_factor = 8;
  const std::vector<double> plain = qkv::rope_frequencies(D), scaled = qkv::rope_frequencies(D, ntk);
  ASSERT_EQ(scaled.size(), std::size_t(D / 2));
  EXPECT_DOUBLE_EQ(scaled[0], 1.0);
  EXPECT_NEAR(scaled.back(), plain.back() / 8, 1e-15);
  EXPECT_NEAR(plain.back(), std::pow(10000.0, -6.0 / 8.0), 1e-15);
  for (std::size_t i = 1; i + 1 < scaled.size(); ++i) {
    EXPECT_LT(scaled[i], plain[i]);      // every other frequency is slowed,
    EXPECT_GT(scaled[i], plain[i] / 8);  // by less than linear interpolation would
  }
  const double ntk_base = 10000.0 * std::pow(8.0, 8.0 / 6.0);
  Y = X;
  qkv::apply_rope(Y, n_heads, 1000, ntk);
  EXPECT_LE((Y - brute_rope(X, n_heads, 1000, qkv::RopeLayout::rotate_half, ntk_base)).cwiseAbs().maxCoeff(), 1e-9);
  // Custom base, interleaved, large position.
  qkv::RopeOptions custom;
  custom.base = 500000;
  custom.layout = qkv::RopeLayout::interleaved;
  Y = X;
  qkv::apply_rope(Y, n_heads, 100000, custom);
  EXPECT_LE((Y - brute_rope(X, n_heads, 100000, qkv::RopeLayout::interleaved, 500000)).cwiseAbs().maxCoeff(), 1e-9);
}

// ---- ALiBi ---------------------------------------------------------------------------------------------------------

TEST(Alibi, SlopesOfThePublishedRule) {
  // Powers of two: 2^(−8(h+1)/n). 8 heads: 1/2, 1/4, …, 1/256.
  const std::vector<double> eight = qkv::alibi_slopes(8);
  ASSERT_EQ(eight.size(), 8u);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(eight[std::size_t(h)], std::ldexp(1.0, -(h + 1))) << h;
  // 12 heads (not a power of two): the 8-head slopes, then every other slope of 16 heads (2^−0.5, 2^−1.5, …), 4 of
  // them — the rule of Press et al.'s get_slopes.
  const std::vector<double> twelve = qkv::alibi_slopes(12);
  ASSERT_EQ(twelve.size(), 12u);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(twelve[std::size_t(h)], std::ldexp(1.0, -(h + 1))) << h;
  const double extra[4] = {std::pow(2.0, -0.5), std::pow(2.0, -1.5), std::pow(2.0, -2.5), std::pow(2.0, -3.5)};
  for (int k = 0; k < 4; ++k) EXPECT_DOUBLE_EQ(twelve[std::size_t(8 + k)], extra[k]) << k;
  // 6 heads: 4-head slopes 2^−2, 2^−4, 2^−6, 2^−8, then 2^−1, 2^−3 from the 8-head slopes.
  const std::vector<double> six = qkv::alibi_slopes(6);
  const double six_expected[6] = {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125};
  for (int h = 0; h < 6; ++h) EXPECT_DOUBLE_EQ(six[std::size_t(h)], six_expected[h]) << h;
  // 1 head: 2^−8; 16 heads: 2^−0.5 … 2^−8.
  EXPECT_EQ(qkv::alibi_slopes(1)[0], std::ldexp(1.0, -8));
  const std::vector<float> sixteen = qkv::alibi_slopes<float>(16);
  for (int h = 0; h < 16; ++h) EXPECT_FLOAT_EQ(sixteen[std::size_t(h)], float(std::pow(2.0, -0.5 * (h + 1)))) << h;
}

TEST(Alibi, BiasValuesByHand) {
  // Slope 0.5, Sq = 2, Skv = 4. bottom_right: diag(0) = 2, diag(1) = 3; top_left: diag(i) = i.
  const qkv::PositionBias<double> br = qkv::alibi_bias(std::vector<double>{0.5}, 2, 4);
  const double expected_br[2][4] = {{-1, -0.5, 0, -0.5}, {-1.5, -1, -0.5, 0}};
  const qkv::PositionBias<double> tl = qkv::alibi_bias(std::vector<double>{0.5}, 2, 4, qkv::CausalAlignment::top_left);
  const double expected_tl[2][4] = {{0, -0.5, -1, -1.5}, {-0.5, 0, -0.5, -1}};
  for (Index i = 0; i < 2; ++i)
    for (Index j = 0; j < 4; ++j) {
      EXPECT_EQ(br(0, i, j), expected_br[i][j]);
      EXPECT_EQ(tl(0, i, j), expected_tl[i][j]);
    }
  const qkv::TensorView4<const double> view = br.view();
  EXPECT_EQ(view.extent(0), 1);
  EXPECT_EQ(view.extent(1), 1);
  EXPECT_EQ(view.extent(2), 2);
  EXPECT_EQ(view.extent(3), 4);
  EXPECT_EQ(view(0, 0, 1, 2), -0.5);
  EXPECT_EQ(br.head(0)(1, 0), -1.5);
}

// A temporary bias must not convert to a view (it would dangle); an lvalue does.
static_assert(!std::is_convertible_v<qkv::PositionBias<float>&&, qkv::TensorView4<const float>>,
              "the view of a temporary PositionBias would dangle");
static_assert(std::is_convertible_v<qkv::PositionBias<float>&, qkv::TensorView4<const float>>,
              "an lvalue PositionBias converts to a bias view");

TYPED_TEST(Positional, AlibiSlopesEqualTheSameBiasAsAView) {
  using T = TypeParam;
  const Index Hq = 12, Hkv = 4, D = 4;
  for (Index Sq : {1, 5, 9}) {
    const Index Skv = 9;
    const Matrix<T> Q = random_matrix<T>(Sq, Hq * D, 10), K = random_matrix<T>(Skv, Hkv * D, 11),
                    V = random_matrix<T>(Skv, Hkv * D, 12);
    for (bool causal : {false, true})
      for (qkv::CausalAlignment alignment : {qkv::CausalAlignment::bottom_right, qkv::CausalAlignment::top_left}) {
        if (causal && alignment == qkv::CausalAlignment::top_left && Sq > Skv) continue;
        qkv::AttentionOptions<T> by_slopes;
        by_slopes.causal = causal;
        by_slopes.alignment = alignment;
        by_slopes.alibi_slopes = qkv::alibi_slopes<T>(Hq);
        const qkv::PositionBias<T> bias = qkv::alibi_bias(by_slopes.alibi_slopes, Sq, Skv, alignment);
        qkv::AttentionOptions<T> by_bias = by_slopes;
        by_bias.alibi_slopes.clear();
        by_bias.bias = bias;
        const Matrix<T> a = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{Hq, Hkv}, by_slopes);
        const Matrix<T> b = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{Hq, Hkv}, by_bias);
        EXPECT_LE((a - b).cwiseAbs().maxCoeff(), attention_tolerance(V))
            << "Sq " << Sq << " causal " << causal << " alignment " << int(alignment);
        // The slopes matter: without them the output differs (unless the only query sees one key: causal top-left
        // with Sq = 1, where every bias gives weight 1).
        if (causal && alignment == qkv::CausalAlignment::top_left && Sq == 1) continue;
        qkv::AttentionOptions<T> none = by_bias;
        none.bias = qkv::TensorView4<const T>();
        EXPECT_GT((a - qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{Hq, Hkv}, none)).cwiseAbs().maxCoeff(),
                  T(1e-3))
            << "Sq " << Sq << " causal " << causal << " alignment " << int(alignment);
      }
  }
}

// ---- T5 relative position bias -------------------------------------------------------------------------------------

TEST(RelativePositionBias, BucketsOfT5) {
  using Bias = qkv::RelativePositionBias<float>;
  // Bidirectional, 32 buckets, max_distance 128: 16 buckets per direction, 8 exact (|r| < 8), 8 logarithmic over
  // [8, 128): boundaries at 8·16^(k/8) = 8, 11.3, 16, 22.6, 32, 45.3, 64, 90.5. A key after the query (r > 0) adds 16.
  const Index table[][2] = {{0, 0},   {1, 1},   {7, 7},   {8, 8},   {11, 8},   {12, 9},   {15, 9},
                            {16, 10}, {22, 10}, {23, 11}, {31, 11}, {32, 12},  {45, 12},  {46, 13},
                            {63, 13}, {64, 14}, {90, 14}, {91, 15}, {127, 15}, {128, 15}, {100000, 15}};
  for (const auto& row : table) {
    EXPECT_EQ(Bias::bucket(-row[0]), row[1]) << "r = " << -row[0];
    if (row[0] > 0) {
      EXPECT_EQ(Bias::bucket(row[0]), row[1] + 16) << "r = " << row[0];
    }
  }
  // Unidirectional (decoder): keys after the query share bucket 0; d = −r, 16 exact, 16 logarithmic over [16, 128):
  // bucket = 16 + ⌊ln(d/16)/ln 8 · 16⌋ → d = 16 → 16, 22 → 18 (ln 1.375/ln 8·16 = 2.45), 32 → 21 (5.33), 64 → 26
  // (10.67), 127 → 31 (15.94), ≥ 128 → 31.
  const Index uni[][2] = {{0, 0}, {5, 5}, {15, 15}, {16, 16}, {22, 18}, {32, 21}, {64, 26}, {127, 31}, {500, 31}};
  for (const auto& row : uni) EXPECT_EQ(Bias::bucket(-row[0], false), row[1]) << "d = " << row[0];
  EXPECT_EQ(Bias::bucket(5, false), 0);
  // A small configuration: 8 buckets, max_distance 16, bidirectional: 4 per side, exact 0, 1; log buckets 2, 3.
  EXPECT_EQ(Bias::bucket(-1, true, 8, 16), 1);
  EXPECT_EQ(Bias::bucket(-2, true, 8, 16), 2);  // 2 + ⌊ln 1 / ln 8 · 2⌋
  EXPECT_EQ(Bias::bucket(-5, true, 8, 16), 2);  // ln 2.5 / ln 8 · 2 = 0.88
  EXPECT_EQ(Bias::bucket(-6, true, 8, 16), 3);  // ln 3 / ln 8 · 2 = 1.06
  EXPECT_EQ(Bias::bucket(3, true, 8, 16), 6);   // key after the query: 4 + 2 (ln 1.5 / ln 8 · 2 = 0.39)
}

TYPED_TEST(Positional, T5BiasLooksUpTheBucketOfEachPair) {
  using T = TypeParam;
  typename qkv::RelativePositionBias<T>::Config config;
  config.n_heads = 3;
  config.num_buckets = 8;
  config.max_distance = 16;
  qkv::RelativePositionBias<T> t5(config);
  for (Index b = 0; b < 8; ++b)
    for (Index h = 0; h < 3; ++h) t5.weights(b, h) = T(10 * b + h);  // weight = 10·bucket + head
  const Index Sq = 4, Skv = 9;
  const qkv::PositionBias<T> bias = t5.bias(Sq, Skv);
  ASSERT_EQ(bias.n_heads(), 3);
  for (Index h = 0; h < 3; ++h)
    for (Index i = 0; i < Sq; ++i)
      for (Index j = 0; j < Skv; ++j)
        EXPECT_EQ(bias(h, i, j), T(10 * qkv::RelativePositionBias<T>::bucket(j - i, true, 8, 16) + h));
  // By hand: query 0, key 0 → bucket 0; key 1 → 4 + 1 = 5; key 7 → 4 + 3 = 7 (log branch: ln 3.5/ln 8·2 = 1.2 → 3).
  EXPECT_EQ(bias(1, 0, 0), T(1));
  EXPECT_EQ(bias(1, 0, 1), T(51));
  EXPECT_EQ(bias(2, 0, 7), T(72));
  EXPECT_EQ(bias(0, 3, 0), T(20));  // r = −3: ⌊ln 1.5/ln 8·2⌋ = 0 → bucket 2

  // Decoding: the last query of 9 with first_query_position = Skv − 1 is the last row of the full bias.
  const qkv::PositionBias<T> full = t5.bias(Skv, Skv), last = t5.bias(1, Skv, Skv - 1);
  for (Index h = 0; h < 3; ++h) EXPECT_TRUE(last.head(h) == full.head(h).bottomRows(1));

  // As a bias view in attention: equals adding the head's bias matrix per head.
  const Index D = 4;
  const Matrix<T> Q = random_matrix<T>(Sq, 3 * D, 13), K = random_matrix<T>(Skv, 3 * D, 14),
                  V = random_matrix<T>(Skv, 3 * D, 15);
  for (Index b = 0; b < 8; ++b)
    for (Index h = 0; h < 3; ++h) t5.weights(b, h) = T(0.3 * std::sin(double(b + 3 * h)));
  const qkv::PositionBias<T> small = t5.bias(Sq, Skv);
  qkv::AttentionOptions<T> options;
  options.scale = T(1);  // T5 does not scale
  options.bias = small;
  const Matrix<T> packed = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{3, 3}, options);
  for (Index h = 0; h < 3; ++h) {
    const Matrix<T> head_bias = small.head(h);
    qkv::AttentionOptions<T> one;
    one.scale = T(1);
    one.bias = head_bias;
    const Matrix<T> expected =
        qkv::scaled_dot_product_attention(Q.middleCols(h * D, D), K.middleCols(h * D, D), V.middleCols(h * D, D), one);
    EXPECT_LE((packed.middleCols(h * D, D) - expected).cwiseAbs().maxCoeff(), 10 * eps<T>()) << "head " << h;
  }
}

// ---- seed 000 定理 2.4.2 with positions ----------------------------------------------------------------------------

TEST(PermutationEquivariance, SinusoidalEncodingBreaksIt) {
  // 定理 2.4.2: Attention(P X W_q, P X W_k, P X W_v) = P Attention(X W_q, X W_k, X W_v) without masks or positions.
  // With X + PE the positions are attached to slots, not to tokens, and the equality fails.
  const Index T = 6, d = 8;
  const Matrix<double> X = random_matrix<double>(T, d, 16), W_q = random_matrix<double>(d, d, 17, 0.5),
                       W_k = random_matrix<double>(d, d, 18, 0.5), W_v = random_matrix<double>(d, d, 19, 0.5);
  const auto attention = [&](const Matrix<double>& input) {
    return Matrix<double>(qkv::scaled_dot_product_attention(input * W_q, input * W_k, input * W_v));
  };
  const std::vector<Index> pi = {3, 0, 5, 1, 4, 2};  // row r of P·X is row pi[r] of X
  const auto permute = [&](const Matrix<double>& m) {
    Matrix<double> out(m.rows(), m.cols());
    for (Index r = 0; r < T; ++r) out.row(r) = m.row(pi[std::size_t(r)]);
    return out;
  };
  // Without positions: equivariant (to rounding).
  EXPECT_LE((attention(permute(X)) - permute(attention(X))).cwiseAbs().maxCoeff(), 1e-12);
  // With a sinusoidal encoding added to the slots: not equivariant.
  const Matrix<double> PE = qkv::sinusoidal_encoding<double>(T, d);
  const Matrix<double> permuted_then_encoded = attention(permute(X) + PE);
  const Matrix<double> encoded_then_permuted = permute(attention(X + PE));
  EXPECT_GT((permuted_then_encoded - encoded_then_permuted).cwiseAbs().maxCoeff(), 1e-2);
  // Moving the encoding with the tokens (P·(X + PE)) restores equivariance: it is the position that breaks it.
  EXPECT_LE((attention(permute(X + PE)) - encoded_then_permuted).cwiseAbs().maxCoeff(), 1e-12);
}

// ---- errors --------------------------------------------------------------------------------------------------------

using qkv_test::expect_shape_error;

TEST(PositionalErrors, EveryThrow) {
  expect_shape_error([] { qkv::sinusoidal_encoding<float>(-1, 4); }, {"qkv::sinusoidal_encoding", "length is -1"});
  expect_shape_error([] { qkv::sinusoidal_encoding<float>(3, 0); }, {"d_model is 0"});
  expect_shape_error([] { qkv::sinusoidal_encoding<float>(3, 4, 0, 0.0); }, {"base is 0"});

  Matrix<float> X = random_matrix<float>(2, 12, 20);
  const Matrix<float> before = X;
  expect_shape_error([&] { qkv::apply_rope(X, 5); }, {"qkv::apply_rope", "X has 12 columns", "n_heads 5"});
  expect_shape_error([&] { qkv::apply_rope(X, 4); }, {"qkv::apply_rope", "head_dim is 3", "even"});
  expect_shape_error([&] { qkv::apply_rope(X, 0); }, {"n_heads is 0"});
  qkv::RopeOptions bad;
  bad.interpolation_factor = 0;
  expect_shape_error([&] { qkv::apply_rope(X, 2, 0, bad); }, {"options.interpolation_factor is 0"});
  bad = qkv::RopeOptions();
  bad.ntk_factor = std::numeric_limits<double>::quiet_NaN();
  expect_shape_error([&] { qkv::apply_rope(X, 2, 0, bad); }, {"options.ntk_factor is nan"});
  bad = qkv::RopeOptions();
  bad.base = -1;
  expect_shape_error([&] { qkv::apply_rope(X, 2, 0, bad); }, {"options.base is -1"});
  EXPECT_TRUE(X == before);  // nothing written on error
  std::vector<float> buffer(2 * 3 * 4);
  const qkv::TensorView4<float> strided(buffer.data(), {1, 1, 3, 4}, {12, 12, 8, 2});
  expect_shape_error([&] { qkv::apply_rope(strided); }, {"x axis 3 (D) has stride 2, expected 1"});
  const qkv::TensorView4<float> odd(buffer.data(), {1, 2, 4, 3});
  expect_shape_error([&] { qkv::apply_rope(odd); }, {"qkv::apply_rope", "head_dim is 3"});
  expect_shape_error([] { qkv::rope_frequencies(5); }, {"qkv::rope_frequencies", "head_dim is 5"});
  const qkv::TensorView4<float> null_data(nullptr, {1, 1, 2, 4});
  expect_shape_error([&] { qkv::apply_rope(null_data); }, {"null data"});

  expect_shape_error([] { qkv::alibi_slopes(0); }, {"qkv::alibi_slopes", "n_heads is 0"});
  expect_shape_error([] { qkv::alibi_bias(std::vector<float>{}, 2, 2); }, {"qkv::alibi_bias", "slopes is empty"});
  expect_shape_error([] { qkv::alibi_bias(std::vector<float>{0.5f}, -1, 2); }, {"Sq is -1"});
  expect_shape_error([] { qkv::alibi_bias(std::vector<double>{std::nan("")}, 1, 2); }, {"slopes[0] is nan"});
  expect_shape_error([] { qkv::PositionBias<float>(2, -1, 3); }, {"qkv::PositionBias", "[2, -1, 3]"});

  using Bias = qkv::RelativePositionBias<float>;
  Bias::Config config;
  config.n_heads = 0;
  expect_shape_error([&] { Bias b(config); }, {"qkv::RelativePositionBias", "n_heads is 0"});
  config.n_heads = 2;
  config.num_buckets = 3;
  expect_shape_error([&] { Bias b(config); }, {"num_buckets is 3", "at least 4"});
  config.num_buckets = 32;
  config.max_distance = 8;
  expect_shape_error([&] { Bias b(config); }, {"max_distance is 8", "exact range 8"});
  expect_shape_error([] { Bias::bucket(1, false, 1, 10); }, {"qkv::RelativePositionBias::bucket", "num_buckets is 1"});
  config.max_distance = 128;
  Bias t5(config);
  t5.weights.resize(4, 2);
  expect_shape_error([&] { t5.bias(2, 2); }, {"qkv::RelativePositionBias::bias", "weights is 4 × 2", "32 × 2"});
}

}  // namespace
