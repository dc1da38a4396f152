/// \file test_seed_000.cpp
/// Seed 000, section 2.4 (scaled dot-product attention), as executable checks.
///
/// Covered:
///  - 例 2.4.1 (worked 3×3 example), all five steps: S = QKᵀ, S/√2, P, O = PV, the unscaled softmax, and
///    the symmetry remark (row 0 of O is V's middle row (3, 4) whatever the scale).
///  - 定理 2.4.1 (variance of q·k and softmax saturation): mean 0 and variance d_k of q·k, variance 1 after
///    dividing by √d_k; the gradient p₂(1 − p₂) collapsing at c = 10; the mean row entropy falling as the scores
///    grow; and step (5) of the proof, the expected row maximum of Tk standard-normal scores against √(2 ln Tk).
///  - 定理 2.4.2 (permutation equivariance): permuting the rows of X permutes the output rows the same way
///    without a mask; a causal mask breaks it.
///
/// Every expected value is independent of qkv: the seed's printed tables, closed forms, or float64 loops
/// written here. qkv is only ever the code under test.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <qkv/qkv.hpp>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using Index = Eigen::Index;
using MatrixD = qkv::Matrix<double>;

// ---------------------------------------------------------------------------------------------------------------
// Tolerances, per scalar type.
//   weights:     |P − P_exact|. Weights lie in [0, 1]; float's unit roundoff is 6e-8, so 1e-6 leaves ~16 ulps for
//                a float path (the reference path accumulates in double and should be within 1 ulp); double's
//                1e-12 leaves ~4500 ulps.
//   output:      |O − O_exact| ≤ output · max(1, max|V|): docs/design.md's accuracy contract for the reference path
//                in float (1e-6·max(1, max|V|)); 1e-12 in double.
//   equivariance: permuted and unpermuted runs see inputs that may differ by a rounding of the projection X·W
//                (Eigen may order a row's sum differently for different row positions); 1e-5 · max(1, max|V|)
//                in float is ~100 ulps of the output, 1e-12 in double.
template <class T>
struct Tolerance;
template <>
struct Tolerance<float> {
  static constexpr double kWeights = 1e-6;
  static constexpr double kOutput = 1e-6;
  static constexpr double kEquivariance = 1e-5;
};
template <>
struct Tolerance<double> {
  static constexpr double kWeights = 1e-12;
  static constexpr double kOutput = 1e-12;
  static constexpr double kEquivariance = 1e-12;
};

// Half a unit in the last printed place of a table printed to 3 decimals, and to 4 decimals.
constexpr double kThreeDecimals = 5e-4;
constexpr double kFourDecimals = 5e-5;

// ---------------------------------------------------------------------------------------------------------------
// Independent float64 helpers.

/// Stable softmax of one row, in double.
std::vector<double> softmax_row(const std::vector<double>& scores) {
  const double row_max = *std::max_element(scores.begin(), scores.end());
  std::vector<double> weights(scores.size());
  double sum = 0.0;
  for (std::size_t j = 0; j < scores.size(); ++j) {
    weights[j] = std::exp(scores[j] - row_max);
    sum += weights[j];
  }
  for (double& w : weights) w /= sum;
  return weights;
}

/// P = softmax(scale · Q Kᵀ) by plain loops in double (no mask).
template <class T>
MatrixD exact_weights(const qkv::Matrix<T>& Q, const qkv::Matrix<T>& K, double scale) {
  MatrixD P(Q.rows(), K.rows());
  for (Index i = 0; i < Q.rows(); ++i) {
    std::vector<double> scores(static_cast<std::size_t>(K.rows()));
    for (Index j = 0; j < K.rows(); ++j) {
      double dot = 0.0;
      for (Index d = 0; d < Q.cols(); ++d) dot += static_cast<double>(Q(i, d)) * static_cast<double>(K(j, d));
      scores[static_cast<std::size_t>(j)] = scale * dot;
    }
    const std::vector<double> weights = softmax_row(scores);
    for (Index j = 0; j < K.rows(); ++j) P(i, j) = weights[static_cast<std::size_t>(j)];
  }
  return P;
}

/// O = P V in double.
template <class T>
MatrixD exact_output(const MatrixD& P, const qkv::Matrix<T>& V) {
  MatrixD O = MatrixD::Zero(P.rows(), V.cols());
  for (Index i = 0; i < P.rows(); ++i)
    for (Index j = 0; j < P.cols(); ++j)
      for (Index d = 0; d < V.cols(); ++d) O(i, d) += P(i, j) * static_cast<double>(V(j, d));
  return O;
}

template <class A, class B>
double max_abs_difference(const A& a, const B& b) {
  return (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff();
}

/// A matrix of independent standard-normal entries, drawn in double and rounded to T.
template <class T>
qkv::Matrix<T> normal_matrix(Index rows, Index cols, std::mt19937_64& generator, double stddev = 1.0) {
  std::normal_distribution<double> normal(0.0, stddev);
  qkv::Matrix<T> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<T>(normal(generator));
  return m;
}

/// Mean Shannon entropy (natural log) of the rows of a weight matrix; 0·log 0 = 0.
double mean_row_entropy(const MatrixD& P) {
  double total = 0.0;
  for (Index i = 0; i < P.rows(); ++i) {
    double entropy = 0.0;
    for (Index j = 0; j < P.cols(); ++j)
      if (P(i, j) > 0.0) entropy -= P(i, j) * std::log(P(i, j));
    total += entropy;
  }
  return total / static_cast<double>(P.rows());
}

struct SampleMoments {
  double mean;
  double variance;  // unbiased
};

SampleMoments moments(const std::vector<double>& x) {
  double mean = 0.0;
  for (double v : x) mean += v;
  mean /= static_cast<double>(x.size());
  double squares = 0.0;
  for (double v : x) squares += (v - mean) * (v - mean);
  return {mean, squares / static_cast<double>(x.size() - 1)};
}

constexpr double kPi = 3.14159265358979323846;

/// Standard normal density φ and distribution function Φ.
double normal_pdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2.0 * kPi); }
double normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

/// Composite Simpson's rule over [a, b] with `points` (odd) equally spaced points.
template <class F>
double simpson(F f, double a, double b, int points) {
  const int intervals = points - 1;
  const double h = (b - a) / intervals;
  double sum = f(a) + f(b);
  for (int k = 1; k < intervals; ++k) sum += f(a + k * h) * ((k % 2 == 1) ? 4.0 : 2.0);
  return sum * h / 3.0;
}

/// E[max of n independent standard normals] = ∫ x · n φ(x) Φ(x)^(n−1) dx, by Simpson on [−10, 10] with 20001
/// points (h = 1e-3). Outside [−10, 10] the density n φ Φ^(n−1) is below n·φ(10) ≈ 3e-19 for n ≤ 4096.
double expected_maximum(int n) {
  return simpson([n](double x) { return x * n * normal_pdf(x) * std::pow(normal_cdf(x), n - 1); }, -10.0, 10.0, 20001);
}

using Scalars = ::testing::Types<float, double>;

// ===============================================================================================================
// 例 2.4.1 · 手算一次 3×3 注意力: d_k = d_v = 2, T_q = T_k = 3.

template <class T>
class SeedExample241 : public ::testing::Test {
 protected:
  SeedExample241() : Q(3, 2), K(3, 2), V(3, 2) {
    Q << 1, 0, 0, 1, 1, 1;
    K << 1, 0, 0, 1, 1, 1;
    V << 1, 2, 3, 4, 5, 6;
  }
  qkv::Matrix<T> Q, K, V;

  static qkv::AttentionOptions<T> with_scale(double scale) {
    qkv::AttentionOptions<T> options;
    options.scale = static_cast<T>(scale);
    return options;
  }
  // The seed's tables, as printed.
  static MatrixD seed_scores() {  // step (1)
    MatrixD S(3, 3);
    S << 1, 0, 1, 0, 1, 1, 1, 1, 2;
    return S;
  }
  static MatrixD seed_scaled_scores() {  // step (2), 4 decimals
    MatrixD S(3, 3);
    S << 0.7071, 0, 0.7071, 0, 0.7071, 0.7071, 0.7071, 0.7071, 1.4142;
    return S;
  }
  static MatrixD seed_weights() {  // step (3), 3 decimals
    MatrixD P(3, 3);
    P << 0.401, 0.198, 0.401, 0.198, 0.401, 0.401, 0.248, 0.248, 0.503;
    return P;
  }
  static MatrixD seed_output_corrected() {  // step (4), 3 decimals; see the OutputMatchesSeedTable test
    MatrixD O(3, 2);
    O << 3.000, 4.000, 3.407, 4.407, 3.510, 4.510;  // the seed prints 4.511 for O(2, 1)
    return O;
  }
};
TYPED_TEST_SUITE(SeedExample241, Scalars, );

// Step (1): S = QKᵀ. S is not an output of qkv; the seed's integer table is checked against a plain loop.
TYPED_TEST(SeedExample241, ScoresMatchSeedTableExactly) {
  const MatrixD S_seed = this->seed_scores();
  for (Index i = 0; i < 3; ++i)
    for (Index j = 0; j < 3; ++j) {
      double dot = 0.0;
      for (Index d = 0; d < 2; ++d) dot += static_cast<double>(this->Q(i, d)) * static_cast<double>(this->K(j, d));
      EXPECT_EQ(dot, S_seed(i, j)) << "S(" << i << ", " << j << ")";
    }
}

// Step (1) through qkv: with scale = 1 the weights are the row softmax of the seed's S itself.
TYPED_TEST(SeedExample241, UnitScaleWeightsAreSoftmaxOfSeedScores) {
  using T = TypeParam;
  const MatrixD S_seed = this->seed_scores();
  const qkv::Matrix<T> P = qkv::attention_weights(this->Q, this->K, this->with_scale(1.0));
  ASSERT_EQ(P.rows(), 3);
  ASSERT_EQ(P.cols(), 3);
  for (Index i = 0; i < 3; ++i) {
    const std::vector<double> expected = softmax_row({S_seed(i, 0), S_seed(i, 1), S_seed(i, 2)});
    for (Index j = 0; j < 3; ++j)
      EXPECT_NEAR(static_cast<double>(P(i, j)), expected[static_cast<std::size_t>(j)], Tolerance<T>::kWeights)
          << "P(" << i << ", " << j << ") at scale 1";
  }
}

// Step (2): S/√2 to 4 decimals (the seed's table against S/√2 computed here), and √2 ≈ 1.4142.
TYPED_TEST(SeedExample241, ScaledScoresMatchSeedTable) {
  EXPECT_NEAR(std::sqrt(2.0), 1.4142, kFourDecimals);
  const MatrixD S_seed = this->seed_scores();
  const MatrixD scaled_seed = this->seed_scaled_scores();
  for (Index i = 0; i < 3; ++i)
    for (Index j = 0; j < 3; ++j)
      EXPECT_NEAR(S_seed(i, j) / std::sqrt(2.0), scaled_seed(i, j), kFourDecimals) << "S/√2 (" << i << ", " << j << ")";
}

// Step (3): P = softmax(S/√d_k) from qkv::attention_weights with the default scale (1/√d_k), against the seed's
// 3-decimal table and against the exact weights computed here.
TYPED_TEST(SeedExample241, WeightsMatchSeedTableAndExactValues) {
  using T = TypeParam;
  const qkv::Matrix<T> P = qkv::attention_weights(this->Q, this->K);
  ASSERT_EQ(P.rows(), 3);
  ASSERT_EQ(P.cols(), 3);
  const MatrixD P_seed = this->seed_weights();
  const MatrixD P_exact = exact_weights(this->Q, this->K, 1.0 / std::sqrt(2.0));
  for (Index i = 0; i < 3; ++i) {
    double row_sum = 0.0;
    for (Index j = 0; j < 3; ++j) {
      const double p = static_cast<double>(P(i, j));
      EXPECT_NEAR(p, P_seed(i, j), kThreeDecimals) << "seed table, P(" << i << ", " << j << ")";
      EXPECT_NEAR(p, P_exact(i, j), Tolerance<T>::kWeights) << "exact, P(" << i << ", " << j << ")";
      row_sum += p;
    }
    EXPECT_NEAR(row_sum, 1.0, 3 * Tolerance<T>::kWeights) << "row " << i;
  }
  // The seed's worked first row: e^0.7071 = 2.028, sum 5.056, 2.028/5.056 = 0.401, 1/5.056 = 0.198.
  EXPECT_NEAR(std::exp(1.0 / std::sqrt(2.0)), 2.028, kThreeDecimals);
  EXPECT_NEAR(2.0 * std::exp(1.0 / std::sqrt(2.0)) + 1.0, 5.056, kThreeDecimals);

  // An explicit scale of 1/√2 gives the same weights as the default.
  const qkv::Matrix<T> P_explicit = qkv::attention_weights(this->Q, this->K, this->with_scale(1.0 / std::sqrt(2.0)));
  EXPECT_LE(max_abs_difference(P_explicit, P_exact), Tolerance<T>::kWeights);
}

// Step (4): O = PV from qkv::scaled_dot_product_attention with the default scale.
//
// The seed prints O(2, 1) = 4.511, but the exact value is 4.51047: V's columns differ by exactly 1 and each row
// of P sums to 1, so O(i, 1) = O(i, 0) + 1 = 3.51047 + 1, which rounds to 4.510. The seed's last digit is a
// rounding slip; the table below uses 4.510 and the slip itself is asserted.
TYPED_TEST(SeedExample241, OutputMatchesSeedTable) {
  using T = TypeParam;
  const qkv::Matrix<T> O = qkv::scaled_dot_product_attention(this->Q, this->K, this->V);
  ASSERT_EQ(O.rows(), 3);
  ASSERT_EQ(O.cols(), 2);
  const MatrixD O_seed = this->seed_output_corrected();
  const MatrixD O_exact = exact_output(exact_weights(this->Q, this->K, 1.0 / std::sqrt(2.0)), this->V);
  const double output_tolerance = Tolerance<T>::kOutput * std::max(1.0, 6.0);  // max|V| = 6
  for (Index i = 0; i < 3; ++i)
    for (Index d = 0; d < 2; ++d) {
      const double o = static_cast<double>(O(i, d));
      EXPECT_NEAR(o, O_seed(i, d), kThreeDecimals) << "seed table, O(" << i << ", " << d << ")";
      EXPECT_NEAR(o, O_exact(i, d), output_tolerance) << "exact, O(" << i << ", " << d << ")";
    }
  // The rounding slip: 4.511 is more than half a unit in the third decimal away from the exact value, and the
  // columns of O differ by exactly 1.
  EXPECT_NEAR(O_exact(2, 1), 4.51047, 5e-6);
  EXPECT_GT(std::abs(4.511 - O_exact(2, 1)), kThreeDecimals);
  EXPECT_LT(std::abs(4.510 - static_cast<double>(O(2, 1))), std::abs(4.511 - static_cast<double>(O(2, 1))));
  for (Index i = 0; i < 3; ++i) EXPECT_NEAR(O_exact(i, 1) - O_exact(i, 0), 1.0, 1e-14) << "row " << i;
}

// Step (5): without scaling (scale = 1), row 0 is (0.422, 0.155, 0.422) and row 2 is (0.212, 0.212, 0.576):
// the seed's 3-decimal values within 5e-4, and the exact values e/(2e + 1), 1/(2e + 1), e/(2e + e²), e²/(2e + e²).
TYPED_TEST(SeedExample241, UnscaledWeightsMatchSeedAndClosedForm) {
  using T = TypeParam;
  const qkv::Matrix<T> P = qkv::attention_weights(this->Q, this->K, this->with_scale(1.0));
  const double e = std::exp(1.0);
  const double e2 = std::exp(2.0);
  const double seed_row0[3] = {0.422, 0.155, 0.422};
  const double seed_row2[3] = {0.212, 0.212, 0.576};
  const double exact_row0[3] = {e / (2 * e + 1), 1 / (2 * e + 1), e / (2 * e + 1)};
  const double exact_row1[3] = {1 / (2 * e + 1), e / (2 * e + 1), e / (2 * e + 1)};
  const double exact_row2[3] = {e / (2 * e + e2), e / (2 * e + e2), e2 / (2 * e + e2)};
  for (Index j = 0; j < 3; ++j) {
    const std::size_t k = static_cast<std::size_t>(j);
    EXPECT_NEAR(static_cast<double>(P(0, j)), seed_row0[k], kThreeDecimals) << "seed, row 0, key " << j;
    EXPECT_NEAR(static_cast<double>(P(2, j)), seed_row2[k], kThreeDecimals) << "seed, row 2, key " << j;
    EXPECT_NEAR(static_cast<double>(P(0, j)), exact_row0[k], Tolerance<T>::kWeights) << "exact, row 0, key " << j;
    EXPECT_NEAR(static_cast<double>(P(1, j)), exact_row1[k], Tolerance<T>::kWeights) << "exact, row 1, key " << j;
    EXPECT_NEAR(static_cast<double>(P(2, j)), exact_row2[k], Tolerance<T>::kWeights) << "exact, row 2, key " << j;
  }
  // "Sharper than the scaled distribution": the largest weight of each row grows without the 1/√2.
  const qkv::Matrix<T> P_scaled = qkv::attention_weights(this->Q, this->K);
  for (Index i = 0; i < 3; ++i) EXPECT_GT(P.row(i).maxCoeff(), P_scaled.row(i).maxCoeff()) << "row " << i;
}

// The symmetry remark of step (4): q_0 = (1, 0) is orthogonal to k_1 and scores k_0 and k_2 equally, so row 0 of P
// is (a, b, a) with 2a + b = 1 and O(0, ·) = a(1, 2) + b(3, 4) + a(5, 6) = (3, 4) for every a, i.e. every scale.
TYPED_TEST(SeedExample241, FirstOutputRowIsMiddleValueRowForAnyScale) {
  using T = TypeParam;
  const double output_tolerance = Tolerance<T>::kOutput * 6.0;  // max|V| = 6
  double previous_p0 = -1.0;
  for (double scale : {0.0, 0.1, 1.0 / std::sqrt(2.0), 1.0, 3.0, 10.0, 100.0}) {
    SCOPED_TRACE("scale = " + std::to_string(scale));
    const qkv::AttentionOptions<T> options = this->with_scale(scale);
    const qkv::Matrix<T> O = qkv::scaled_dot_product_attention(this->Q, this->K, this->V, options);
    EXPECT_NEAR(static_cast<double>(O(0, 0)), 3.0, output_tolerance);
    EXPECT_NEAR(static_cast<double>(O(0, 1)), 4.0, output_tolerance);
    // The weights themselves do change with the scale: a = e^s / (2e^s + 1), rising from 1/3 toward 1/2.
    const qkv::Matrix<T> P = qkv::attention_weights(this->Q, this->K, options);
    const double s = static_cast<double>(static_cast<T>(scale));
    const double a = 1.0 / (2.0 + std::exp(-s));
    EXPECT_NEAR(static_cast<double>(P(0, 0)), a, Tolerance<T>::kWeights);
    EXPECT_NEAR(static_cast<double>(P(0, 2)), a, Tolerance<T>::kWeights);
    EXPECT_NEAR(static_cast<double>(P(0, 1)), 1.0 - 2.0 * a, Tolerance<T>::kWeights);
    EXPECT_GT(static_cast<double>(P(0, 0)), previous_p0);
    previous_p0 = static_cast<double>(P(0, 0));
  }
  // A negative scale is a valid option too (only NaN and ±∞ are errors) and the symmetry still holds.
  const qkv::Matrix<T> O_negative =
      qkv::scaled_dot_product_attention(this->Q, this->K, this->V, this->with_scale(-2.0));
  EXPECT_NEAR(static_cast<double>(O_negative(0, 0)), 3.0, output_tolerance);
  EXPECT_NEAR(static_cast<double>(O_negative(0, 1)), 4.0, output_tolerance);
}

// ===============================================================================================================
// 定理 2.4.1 · 点积的方差与 softmax 饱和.

// For independent q, k with N(0, 1) components, q·k has mean 0 and variance d_k; divided by √d_k, variance 1.
// Monte Carlo with n = 4096 pairs per d_k, fixed seed. Tolerances are 5 standard errors:
//   mean:     SE = σ/√n with σ = √d_k.
//   variance: the sample variance s² of n draws has Var(s²) ≈ (μ₄ − σ⁴)/n, where μ₄ = E[(q·k)⁴]. Write
//             q·k = Σ x_i with x_i = q_i k_i independent, E[x_i] = 0, E[x_i²] = 1, E[x_i⁴] = E[q⁴]E[k⁴] = 3·3 = 9.
//             Expanding (Σ x_i)⁴, only terms with every index paired survive: d_k terms E[x_i⁴] = 9 and
//             3·d_k(d_k − 1) terms E[x_i²]E[x_j²] = 1, so μ₄ = 9d_k + 3d_k(d_k − 1) = 3d_k² + 6d_k and
//             μ₄ − σ⁴ = 2d_k² + 6d_k.
//   std:      by the delta method SE(s) ≈ SE(s²)/(2σ).
// Dividing by √d_k scales these by 1/d_k (variance) and 1/√d_k (std).
TEST(SeedTheorem241, DotProductMeanZeroVarianceDkScaledVarianceOne) {
  constexpr int kPairs = 4096;
  const double n = kPairs;
  std::mt19937_64 generator(20240241);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> scaled_stds;
  double first_std = 0.0;
  for (int d_k : {16, 64, 256, 1024}) {
    SCOPED_TRACE("d_k = " + std::to_string(d_k));
    const double d = d_k;
    std::vector<double> dots(kPairs);
    std::vector<double> scaled(kPairs);
    std::vector<double> q(static_cast<std::size_t>(d_k));
    std::vector<double> k(static_cast<std::size_t>(d_k));
    for (int pair = 0; pair < kPairs; ++pair) {
      for (double& x : q) x = normal(generator);
      for (double& x : k) x = normal(generator);
      double dot = 0.0;
      for (std::size_t c = 0; c < q.size(); ++c) dot += q[c] * k[c];
      dots[static_cast<std::size_t>(pair)] = dot;
      scaled[static_cast<std::size_t>(pair)] = dot / std::sqrt(d);
    }
    const SampleMoments raw = moments(dots);
    const SampleMoments unit = moments(scaled);
    const double se_mean = std::sqrt(d) / std::sqrt(n);
    const double se_variance = std::sqrt((2.0 * d * d + 6.0 * d) / n);
    const double se_std = se_variance / (2.0 * std::sqrt(d));

    EXPECT_NEAR(raw.mean, 0.0, 5.0 * se_mean);
    EXPECT_NEAR(raw.variance, d, 5.0 * se_variance);
    EXPECT_NEAR(std::sqrt(raw.variance), std::sqrt(d), 5.0 * se_std);
    EXPECT_NEAR(unit.mean, 0.0, 5.0 * se_mean / std::sqrt(d));
    EXPECT_NEAR(unit.variance, 1.0, 5.0 * se_variance / d);
    EXPECT_NEAR(std::sqrt(unit.variance), 1.0, 5.0 * se_std / std::sqrt(d));
    scaled_stds.push_back(std::sqrt(unit.variance));
    if (d_k == 16) first_std = std::sqrt(raw.variance);
    if (d_k == 1024) {
      // Unscaled, the spread grows like √d_k: √1024/√16 = 8 (the seed: std 32 at d_k = 1024).
      EXPECT_NEAR(std::sqrt(raw.variance), 32.0, 5.0 * se_std);
      EXPECT_NEAR(std::sqrt(raw.variance) / first_std, 8.0, 1.0);
    }
  }
  // Independent of d_k: the four scaled standard deviations agree with each other. Each is within
  // 5·√((2 + 6/d_k)/n)/2 ≤ 5·√(2.375/4096)/2 ≈ 0.060 of 1, so any two are within 0.12.
  const auto [smallest, largest] = std::minmax_element(scaled_stds.begin(), scaled_stds.end());
  EXPECT_LT(*largest - *smallest, 0.12);
}

template <class T>
class SeedTheorem241Saturation : public ::testing::Test {};
TYPED_TEST_SUITE(SeedTheorem241Saturation, Scalars, );

// Step (4): two scores (0, c) give p₂ = e^c/(1 + e^c) and ∂p₂/∂c = p₂(1 − p₂): 0.25 at c = 0, ≈ 4.54e-5 at
// c = 10 (p₂ ≈ 0.99995; the seed rounds to "about 5e-5", four orders of magnitude below 0.25). The weights come
// from qkv::attention_weights on a 1-query, 2-key problem (d_k = 1, q = 1, keys 0 and c, scale 1). Since
// |d/dp [p(1 − p)]| = |1 − 2p| ≤ 1, an error δ in p₂ moves the derivative by at most δ + δ².
TYPED_TEST(SeedTheorem241Saturation, SoftmaxDerivativeCollapsesAtLargeScoreGap) {
  using T = TypeParam;
  qkv::AttentionOptions<T> options;
  options.scale = T(1);
  qkv::Matrix<T> q(1, 1);
  q << T(1);
  double previous_derivative = 1.0;
  double derivative_at_0 = 0.0;
  double derivative_at_10 = 0.0;
  for (double c : {0.0, 1.0, 2.0, 5.0, 10.0}) {
    SCOPED_TRACE("c = " + std::to_string(c));
    qkv::Matrix<T> keys(2, 1);
    keys << T(0), static_cast<T>(c);
    const qkv::Matrix<T> P = qkv::attention_weights(q, keys, options);
    ASSERT_EQ(P.rows(), 1);
    ASSERT_EQ(P.cols(), 2);
    const double p2 = static_cast<double>(P(0, 1));
    const double exact_p2 = 1.0 / (1.0 + std::exp(-c));
    EXPECT_NEAR(p2, exact_p2, Tolerance<T>::kWeights);
    EXPECT_NEAR(static_cast<double>(P(0, 0)), 1.0 - exact_p2, Tolerance<T>::kWeights);
    const double derivative = p2 * (1.0 - p2);
    const double exact_derivative = exact_p2 * (1.0 - exact_p2);
    EXPECT_NEAR(derivative, exact_derivative, 2.0 * Tolerance<T>::kWeights);
    EXPECT_LT(derivative, previous_derivative);
    previous_derivative = derivative;
    if (c == 0.0) derivative_at_0 = derivative;
    if (c == 10.0) {
      derivative_at_10 = derivative;
      EXPECT_NEAR(p2, 0.99995, 5e-6);  // the seed's p₂ ≈ 0.99995
    }
  }
  EXPECT_NEAR(derivative_at_0, 0.25, 2.0 * Tolerance<T>::kWeights);
  EXPECT_NEAR(derivative_at_10, 4.54e-5, 0.05e-5 + 2.0 * Tolerance<T>::kWeights);
  // "Four orders of magnitude smaller": 0.25 / 4.54e-5 ≈ 5500, log10 ≈ 3.7.
  EXPECT_EQ(std::lround(std::log10(derivative_at_0 / derivative_at_10)), 4);
}

// The seed's experiment ③: multiplying the scores by 1, 3, 10 makes the mean row entropy of softmax fall
// strictly. Random Q (16 × 64), K (32 × 64), standard normal; qkv::attention_weights with scale s/√d_k = s/8
// (exact in float). The weights are checked against float64 weights computed here, and the entropy is computed
// here from qkv's weights.
TYPED_TEST(SeedTheorem241Saturation, MeanRowEntropyFallsAsScoresGrow) {
  using T = TypeParam;
  constexpr Index kQueries = 16;
  constexpr Index kKeys = 32;
  constexpr Index kDk = 64;
  std::mt19937_64 generator(241);
  const qkv::Matrix<T> Q = normal_matrix<T>(kQueries, kDk, generator);
  const qkv::Matrix<T> K = normal_matrix<T>(kKeys, kDk, generator);
  double previous_entropy = std::log(static_cast<double>(kKeys));  // the maximum possible: uniform weights
  for (double s : {1.0, 3.0, 10.0}) {
    SCOPED_TRACE("score multiplier = " + std::to_string(s));
    const double scale = s / std::sqrt(static_cast<double>(kDk));
    qkv::AttentionOptions<T> options;
    options.scale = static_cast<T>(scale);
    const qkv::Matrix<T> P = qkv::attention_weights(Q, K, options);
    ASSERT_EQ(P.rows(), kQueries);
    ASSERT_EQ(P.cols(), kKeys);
    const MatrixD P_exact = exact_weights(Q, K, scale);
    EXPECT_LE(max_abs_difference(P, P_exact), Tolerance<T>::kWeights);
    const double entropy = mean_row_entropy(P.template cast<double>());
    // |δ(p log p)| = |log p + 1|·|δp|. With a relative error ε in each weight, a row's entropy moves by at most
    // ε·Σ p_j(|log p_j| + 1) = ε·(H + 1) ≤ ε·(log 32 + 1) ≈ 4.5ε: below 1e-5 for float with ε = 1e-6 (16 ulps,
    // generous) and below 1e-10 for double.
    const double entropy_tolerance = std::is_same<T, float>::value ? 1e-5 : 1e-10;
    EXPECT_NEAR(entropy, mean_row_entropy(P_exact), entropy_tolerance);
    EXPECT_LT(entropy, previous_entropy);
    EXPECT_GE(entropy, 0.0);
    previous_entropy = entropy;
  }
  // At ×10 the rows are close to one-hot: well below half the maximum entropy log 32 ≈ 3.47.
  EXPECT_LT(previous_entropy, 0.5 * std::log(static_cast<double>(kKeys)));
}

// The quadrature used below, on cases with a closed form: the density of the maximum integrates to 1, and
// E[max of 2] = 1/√π, E[max of 3] = 3/(2√π).
TEST(SeedTheorem241, ExpectedMaximumQuadratureMatchesClosedForms) {
  for (int n : {2, 16, 4096}) {
    const double mass =
        simpson([n](double x) { return n * normal_pdf(x) * std::pow(normal_cdf(x), n - 1); }, -10.0, 10.0, 20001);
    EXPECT_NEAR(mass, 1.0, 1e-10) << "n = " << n;
  }
  EXPECT_NEAR(expected_maximum(2), 1.0 / std::sqrt(kPi), 1e-10);
  EXPECT_NEAR(expected_maximum(3), 1.5 / std::sqrt(kPi), 1e-10);
}

// Step (5) of the proof: the row maximum of Tk independent standard-normal scores grows slowly with Tk; its
// expectation E[max] = ∫ x·Tk·φ(x)·Φ(x)^(Tk−1) dx (quadrature above) is approached by the Monte-Carlo mean of
// row maxima, and E[max]/√(2 ln Tk) rises toward 1 (strictly over Tk = 16, 256, 4096, all below 1).
// Monte-Carlo tolerance: 5 standard errors, s/√rows with s the sample standard deviation of the maxima (which is
// well below 1, also asserted: the maximum concentrates).
TEST(SeedTheorem241, RowMaximumOfStandardNormalScoresMatchesExactExpectation) {
  constexpr int kRows = 2000;
  std::mt19937_64 generator(20240245);
  std::normal_distribution<double> normal(0.0, 1.0);
  double previous_ratio = 0.0;
  double previous_mc_ratio = 0.0;
  for (int tk : {16, 256, 4096}) {
    SCOPED_TRACE("Tk = " + std::to_string(tk));
    std::vector<double> maxima(kRows);
    for (double& row_max : maxima) {
      row_max = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < tk; ++j) row_max = std::max(row_max, normal(generator));
    }
    const SampleMoments sample = moments(maxima);
    const double sample_std = std::sqrt(sample.variance);
    EXPECT_LT(sample_std, 1.0);
    const double exact = expected_maximum(tk);
    EXPECT_NEAR(sample.mean, exact, 5.0 * sample_std / std::sqrt(static_cast<double>(kRows)));

    const double asymptote = std::sqrt(2.0 * std::log(static_cast<double>(tk)));
    const double ratio = exact / asymptote;
    const double mc_ratio = sample.mean / asymptote;
    EXPECT_LT(ratio, 1.0);
    EXPECT_GT(ratio, previous_ratio);
    EXPECT_LT(mc_ratio, 1.0);
    EXPECT_GT(mc_ratio, previous_mc_ratio);
    previous_ratio = ratio;
    previous_mc_ratio = mc_ratio;
  }
}

// ===============================================================================================================
// 定理 2.4.2 · 注意力的置换等变性: Attention(P_π X W_Q, P_π X W_K, P_π X W_V) = P_π Attention(X W_Q, X W_K, X W_V)
// without a mask; a causal mask breaks it on purpose.

template <class T>
class SeedTheorem242 : public ::testing::Test {
 protected:
  static constexpr Index kTokens = 7;
  static constexpr Index kModel = 6;
  static constexpr Index kHead = 4;

  SeedTheorem242() {
    std::mt19937_64 generator(242);
    X = normal_matrix<T>(kTokens, kModel, generator);
    // Weights with variance 1/d_model, so the projections have unit-scale entries.
    W_Q = normal_matrix<T>(kModel, kHead, generator, 1.0 / std::sqrt(static_cast<double>(kModel)));
    W_K = normal_matrix<T>(kModel, kHead, generator, 1.0 / std::sqrt(static_cast<double>(kModel)));
    W_V = normal_matrix<T>(kModel, kHead, generator, 1.0 / std::sqrt(static_cast<double>(kModel)));
  }

  /// Row i of the result is row permutation[i] of m.
  static qkv::Matrix<T> permute_rows(const qkv::Matrix<T>& m, const std::vector<Index>& permutation) {
    qkv::Matrix<T> out(m.rows(), m.cols());
    for (Index i = 0; i < m.rows(); ++i) out.row(i) = m.row(permutation[static_cast<std::size_t>(i)]);
    return out;
  }

  /// Attention(X W_Q, X W_K, X W_V) for the given input rows.
  qkv::Matrix<T> attend(const qkv::Matrix<T>& input, const qkv::AttentionOptions<T>& options) const {
    const qkv::Matrix<T> Q = input * W_Q;
    const qkv::Matrix<T> K = input * W_K;
    const qkv::Matrix<T> V = input * W_V;
    return qkv::scaled_dot_product_attention(Q, K, V, options);
  }

  double equivariance_tolerance() const {
    const qkv::Matrix<T> V = X * W_V;
    return Tolerance<T>::kEquivariance * std::max(1.0, static_cast<double>(V.cwiseAbs().maxCoeff()));
  }

  qkv::Matrix<T> X, W_Q, W_K, W_V;
};
TYPED_TEST_SUITE(SeedTheorem242, Scalars, );

TYPED_TEST(SeedTheorem242, PermutingInputRowsPermutesOutputRowsWithoutMask) {
  using T = TypeParam;
  const qkv::AttentionOptions<T> options;  // no mask, default scale
  const qkv::Matrix<T> O = this->attend(this->X, options);
  ASSERT_EQ(O.rows(), this->kTokens);
  ASSERT_EQ(O.cols(), this->kHead);
  const double tolerance = this->equivariance_tolerance();
  const std::vector<std::vector<Index>> permutations = {
      {6, 5, 4, 3, 2, 1, 0}, {3, 6, 0, 5, 1, 4, 2}, {1, 0, 2, 3, 4, 5, 6}, {0, 1, 2, 3, 4, 5, 6}};
  for (const std::vector<Index>& permutation : permutations) {
    const qkv::Matrix<T> O_permuted = this->attend(this->permute_rows(this->X, permutation), options);
    EXPECT_LE(max_abs_difference(O_permuted, this->permute_rows(O, permutation)), tolerance)
        << "permutation starting " << permutation[0] << ", " << permutation[1];
  }
  // The output itself is right (so the equivariance is not that of a constant): against float64 here.
  const qkv::Matrix<T> Q = this->X * this->W_Q;
  const qkv::Matrix<T> K = this->X * this->W_K;
  const qkv::Matrix<T> V = this->X * this->W_V;
  const MatrixD O_exact = exact_output(exact_weights(Q, K, 1.0 / std::sqrt(static_cast<double>(this->kHead))), V);
  EXPECT_LE(max_abs_difference(O, O_exact),
            Tolerance<T>::kOutput * std::max(1.0, static_cast<double>(V.cwiseAbs().maxCoeff())));
}

// The seed's form, Attention(P_π X, P_π X, P_π X) with X itself as queries, keys and values, and the weights:
// P(P_π X, P_π X) = P_π P(X, X) P_πᵀ, i.e. entry (i, j) of the permuted weights is entry (π(i), π(j)).
TYPED_TEST(SeedTheorem242, SeedFormAndWeightsArePermutedTheSameWay) {
  using T = TypeParam;
  const std::vector<Index> permutation = {3, 6, 0, 5, 1, 4, 2};
  const qkv::Matrix<T>& X = this->X;
  const qkv::Matrix<T> X_permuted = this->permute_rows(X, permutation);
  const double tolerance = Tolerance<T>::kEquivariance * std::max(1.0, static_cast<double>(X.cwiseAbs().maxCoeff()));

  const qkv::Matrix<T> O = qkv::scaled_dot_product_attention(X, X, X);
  const qkv::Matrix<T> O_permuted = qkv::scaled_dot_product_attention(X_permuted, X_permuted, X_permuted);
  EXPECT_LE(max_abs_difference(O_permuted, this->permute_rows(O, permutation)), tolerance);

  const qkv::Matrix<T> P = qkv::attention_weights(X, X);
  const qkv::Matrix<T> P_permuted = qkv::attention_weights(X_permuted, X_permuted);
  for (Index i = 0; i < this->kTokens; ++i)
    for (Index j = 0; j < this->kTokens; ++j)
      EXPECT_NEAR(
          static_cast<double>(P_permuted(i, j)),
          static_cast<double>(P(permutation[static_cast<std::size_t>(i)], permutation[static_cast<std::size_t>(j)])),
          Tolerance<T>::kEquivariance)
          << "P(" << i << ", " << j << ")";
}

// A causal mask breaks the equivariance on purpose: reversing the rows of X does not reverse the output rows.
// (Sq = Skv, so the causal alignment does not matter.) Query 0 sees only key 0, so row 0 of the output is row 0
// of V: after reversal it is the old last token's value row, while the reversed old output's row 0 mixes all 7.
TYPED_TEST(SeedTheorem242, CausalMaskBreaksEquivariance) {
  using T = TypeParam;
  qkv::AttentionOptions<T> options;
  options.causal = true;
  const std::vector<Index> reversal = {6, 5, 4, 3, 2, 1, 0};
  const qkv::Matrix<T> O = this->attend(this->X, options);
  const qkv::Matrix<T> O_reversed_input = this->attend(this->permute_rows(this->X, reversal), options);
  EXPECT_GT(max_abs_difference(O_reversed_input, this->permute_rows(O, reversal)), 1e-2);

  // The causal output is the causal attention, not noise: row 0 is V's row 0, exactly a single-key softmax.
  const qkv::Matrix<T> V = this->X * this->W_V;
  const double tolerance = Tolerance<T>::kOutput * std::max(1.0, static_cast<double>(V.cwiseAbs().maxCoeff()));
  EXPECT_LE(max_abs_difference(O.row(0), V.row(0)), tolerance);
}

}  // namespace
