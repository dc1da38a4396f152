// Tests of qkv/scoring.hpp: the seed's classic scores (seed 000 定义 2.4.2, 2.4.3). Each scorer is checked against a
// float64 brute-force loop written here in the seed's column form (W_s s + W_h h with the seed's [out, in] matrices,
// the explicit concatenation [s; h] for concat), with key padding and a boolean mask, S ≠ T; then the identities the
// seed and the issue state: concat = additive when W_a = [W_s; W_h], dot = scaled_dot_product_attention with scale 1,
// general with W_a = I = dot; then edge cases (NaN in padded rows, empty inputs) and every shape error.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "qkv/scoring.hpp"
#include "qkv/sdpa.hpp"
#include "support/expect_shape_error.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

namespace {

using qkv::Index;
using qkv::Matrix;
using qkv_test::random_matrix;
using Vec = std::vector<double>;
using Table = std::vector<std::vector<double>>;  // [row][column]
constexpr double kInf = std::numeric_limits<double>::infinity();

template <class T>
Table to_table(const Matrix<T>& m) {
  Table t(static_cast<std::size_t>(m.rows()), Vec(static_cast<std::size_t>(m.cols())));
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) t[std::size_t(i)][std::size_t(j)] = static_cast<double>(m(i, j));
  return t;
}

/// The seed's [out, in] matrix from qkv's [in, out] one: seed(a, k) = ours(k, a).
template <class T>
Table seed_form(const Matrix<T>& ours) {
  return to_table(Matrix<T>(ours.transpose()));
}

/// y = W x with W [out][in] (the seed's column form).
Vec mat_vec(const Table& W, const Vec& x) {
  Vec y(W.size(), 0.0);
  for (std::size_t a = 0; a < W.size(); ++a)
    for (std::size_t k = 0; k < x.size(); ++k) y[a] += W[a][k] * x[k];
  return y;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t k = 0; k < a.size(); ++k) s += a[k] * b[k];
  return s;
}

/// visible[t][j]: whether decoder step t may attend to encoder position j.
using Visibility = std::vector<std::vector<bool>>;

Visibility all_visible(Index steps, Index T) {
  return Visibility(std::size_t(steps), std::vector<bool>(std::size_t(T), true));
}

struct Expected {
  Table scores, weights, context;
};

/// α = softmax over the visible positions (zeros where hidden or when none is visible), c = Σ α h, in float64.
Expected finish(const Table& e, const Table& H, const Visibility& visible) {
  Expected r;
  r.scores = e;
  r.weights.assign(e.size(), Vec(H.size(), 0.0));
  r.context.assign(e.size(), Vec(H.empty() ? 0 : H[0].size(), 0.0));
  for (std::size_t t = 0; t < e.size(); ++t) {
    double m = -kInf, sum = 0;
    for (std::size_t j = 0; j < H.size(); ++j) {
      if (!visible[t][j]) r.scores[t][j] = -kInf;
      if (visible[t][j]) m = std::max(m, e[t][j]);
    }
    if (m == -kInf) continue;
    for (std::size_t j = 0; j < H.size(); ++j)
      if (visible[t][j]) sum += std::exp(e[t][j] - m);
    for (std::size_t j = 0; j < H.size(); ++j) {
      if (!visible[t][j]) continue;
      r.weights[t][j] = std::exp(e[t][j] - m) / sum;
      for (std::size_t d = 0; d < H[j].size(); ++d) r.context[t][d] += r.weights[t][j] * H[j][d];
    }
  }
  return r;
}

/// Seed 定义 2.4.2: e_tj = v_aᵀ tanh(W_s s + W_h h), W_s [d_a][d_s], W_h [d_a][d_h] (column form).
Expected brute_additive(const Table& S, const Table& H, const Table& W_s, const Table& W_h, const Vec& v_a,
                        const Visibility& visible) {
  Table e(S.size(), Vec(H.size(), 0.0));
  for (std::size_t t = 0; t < S.size(); ++t)
    for (std::size_t j = 0; j < H.size(); ++j) {
      const Vec a = mat_vec(W_s, S[t]), b = mat_vec(W_h, H[j]);
      for (std::size_t k = 0; k < v_a.size(); ++k) e[t][j] += v_a[k] * std::tanh(a[k] + b[k]);
    }
  return finish(e, H, visible);
}

/// Seed 定义 2.4.3, concat: e_tj = v_aᵀ tanh(W_a [s; h]) with the concatenation formed explicitly, W_a [d_a][d_s+d_h].
Expected brute_concat(const Table& S, const Table& H, const Table& W_a, const Vec& v_a, const Visibility& visible) {
  Table e(S.size(), Vec(H.size(), 0.0));
  for (std::size_t t = 0; t < S.size(); ++t)
    for (std::size_t j = 0; j < H.size(); ++j) {
      Vec concat = S[t];
      concat.insert(concat.end(), H[j].begin(), H[j].end());
      const Vec a = mat_vec(W_a, concat);
      for (std::size_t k = 0; k < v_a.size(); ++k) e[t][j] += v_a[k] * std::tanh(a[k]);
    }
  return finish(e, H, visible);
}

/// Seed 定义 2.4.3, general: e_tj = sᵀ W_a h, W_a [d_s][d_h]; dot is W_a = I.
Expected brute_general(const Table& S, const Table& H, const Table* W_a, const Visibility& visible) {
  Table e(S.size(), Vec(H.size(), 0.0));
  for (std::size_t t = 0; t < S.size(); ++t)
    for (std::size_t j = 0; j < H.size(); ++j) {
      if (W_a == nullptr) {
        e[t][j] = dot(S[t], H[j]);
      } else {
        for (std::size_t a = 0; a < S[t].size(); ++a)
          for (std::size_t b = 0; b < H[j].size(); ++b) e[t][j] += S[t][a] * (*W_a)[a][b] * H[j][b];
      }
    }
  return finish(e, H, visible);
}

template <class T>
double tolerance() {
  // The float path evaluates e in float: a few units of rounding per term of a d_a ≤ 8 (or d ≤ 6) sum of O(1) terms.
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

template <class T>
void expect_result(const qkv::ScoredAttention<T>& r, const Expected& x, const std::string& what) {
  const double tol = tolerance<T>();
  ASSERT_EQ(r.scores.rows(), Index(x.scores.size())) << what;
  // Every encoder position has a column, padded ones included (−∞ score, weight 0): steps × T.
  for (std::size_t t = 0; t < x.scores.size(); ++t) {
    ASSERT_EQ(r.scores.cols(), Index(x.scores[t].size())) << what << " scores are steps × T";
    ASSERT_EQ(r.weights.cols(), Index(x.scores[t].size())) << what << " weights are steps × T";
  }
  for (Index t = 0; t < r.scores.rows(); ++t) {
    double row_sum = 0, expected_sum = 0;
    for (Index j = 0; j < r.scores.cols(); ++j) {
      const double e = x.scores[std::size_t(t)][std::size_t(j)];
      if (e == -kInf) {
        EXPECT_EQ(double(r.scores(t, j)), -kInf) << what << " hidden score (" << t << ", " << j << ")";
        EXPECT_EQ(double(r.weights(t, j)), 0.0) << what << " hidden weight (" << t << ", " << j << ")";
      } else {
        EXPECT_NEAR(double(r.scores(t, j)), e, tol * std::max(1.0, std::abs(e))) << what << " score " << t << "," << j;
        EXPECT_NEAR(double(r.weights(t, j)), x.weights[std::size_t(t)][std::size_t(j)], tol)
            << what << " weight (" << t << ", " << j << ")";
      }
      row_sum += double(r.weights(t, j));
      expected_sum += x.weights[std::size_t(t)][std::size_t(j)];
    }
    EXPECT_NEAR(row_sum, expected_sum, tol) << what << " row " << t << " sums to 1 (0 if it sees nothing)";
    for (Index d = 0; d < r.context.cols(); ++d)
      EXPECT_NEAR(double(r.context(t, d)), x.context[std::size_t(t)][std::size_t(d)], tol * 4)
          << what << " context (" << t << ", " << d << ")";
  }
}

/// The masks used below: steps × T with padding from `length`, step 1 forbidden from positions 0 and 3, step 2 sees
/// nothing (an all-false row).
struct Masks {
  Index steps, T, length;
  Matrix<bool> allowed;
  qkv::ScoringOptions options;
  Visibility visible;

  Masks(Index steps_, Index T_, Index length_) : steps(steps_), T(T_), length(length_) {
    allowed = Matrix<bool>::Constant(steps, T, true);
    allowed(1, 0) = allowed(1, 3) = false;
    allowed.row(2).setConstant(false);
    options.key_lengths = {length};
    options.allowed = allowed;
    visible = all_visible(steps, T);
    for (Index t = 0; t < steps; ++t)
      for (Index j = 0; j < T; ++j) visible[std::size_t(t)][std::size_t(j)] = j < length && allowed(t, j);
  }
};

template <class T>
struct Scoring : ::testing::Test {};
TYPED_TEST_SUITE(Scoring, qkv_test::Scalars, );

TYPED_TEST(Scoring, AdditiveMatchesSeedColumnFormBruteForce) {
  using T = TypeParam;
  const Index steps = 5, T_enc = 7, d_s = 3, d_h = 4, d_a = 6;  // S ≠ T, d_s ≠ d_h
  qkv::AdditiveAttention<T> attention(d_s, d_h, d_a);
  attention.W_s = random_matrix<T>(d_s, d_a, 1, 0.7);
  attention.W_h = random_matrix<T>(d_h, d_a, 2, 0.7);
  attention.v_a = random_matrix<T>(d_a, 1, 3);
  const Matrix<T> S = random_matrix<T>(steps, d_s, 4), H = random_matrix<T>(T_enc, d_h, 5);
  const Vec v_a = to_table(Matrix<T>(attention.v_a.transpose()))[0];

  const Expected plain = brute_additive(to_table(S), to_table(H), seed_form(attention.W_s), seed_form(attention.W_h),
                                        v_a, all_visible(steps, T_enc));
  expect_result(attention.forward(S, H), plain, "no mask");

  const Masks masks(steps, T_enc, 6);
  const qkv::ScoredAttention<T> masked = attention.forward(S, H, masks.options);
  expect_result(
      masked,
      brute_additive(to_table(S), to_table(H), seed_form(attention.W_s), seed_form(attention.W_h), v_a, masks.visible),
      "key_lengths + allowed");
  // Step 2 sees nothing: zero weights and context, never NaN.
  EXPECT_TRUE(masked.weights.row(2).isZero(0));
  EXPECT_TRUE(masked.context.row(2).isZero(0));
  // scores() is forward().scores.
  EXPECT_TRUE(attention.scores(S, H, masks.options) == masked.scores);
}

TYPED_TEST(Scoring, ConcatMatchesExplicitConcatenationBruteForce) {
  using T = TypeParam;
  const Index steps = 4, T_enc = 6, d_s = 5, d_h = 3, d_a = 4;
  qkv::ConcatAttention<T> attention(d_s, d_h, d_a);
  attention.W_a = random_matrix<T>(d_s + d_h, d_a, 11, 0.6);
  attention.v_a = random_matrix<T>(d_a, 1, 12);
  const Matrix<T> S = random_matrix<T>(steps, d_s, 13), H = random_matrix<T>(T_enc, d_h, 14);
  const Vec v_a = to_table(Matrix<T>(attention.v_a.transpose()))[0];
  expect_result(attention.forward(S, H),
                brute_concat(to_table(S), to_table(H), seed_form(attention.W_a), v_a, all_visible(steps, T_enc)),
                "no mask");
  const Masks masks(steps, T_enc, 5);
  expect_result(attention.forward(S, H, masks.options),
                brute_concat(to_table(S), to_table(H), seed_form(attention.W_a), v_a, masks.visible), "masked");
}

TYPED_TEST(Scoring, ConcatEqualsAdditiveWhenWaStacksWsOverWh) {
  // Seed 000 定义 2.4.3: concat "与加性注意力等价（拼接口径不同）": W_a [s; h] = W_s s + W_h h when W_a = [W_s, W_h]
  // (column form), i.e. W_a = [W_s; W_h] in qkv's [in, out] storage.
  using T = TypeParam;
  const Index steps = 6, T_enc = 9, d_s = 4, d_h = 5, d_a = 7;
  qkv::AdditiveAttention<T> additive(d_s, d_h, d_a);
  additive.W_s = random_matrix<T>(d_s, d_a, 21, 0.5);
  additive.W_h = random_matrix<T>(d_h, d_a, 22, 0.5);
  additive.v_a = random_matrix<T>(d_a, 1, 23);
  qkv::ConcatAttention<T> concat(d_s, d_h, d_a);
  concat.W_a << additive.W_s, additive.W_h;  // [W_s; W_h]
  concat.v_a = additive.v_a;
  const Matrix<T> S = random_matrix<T>(steps, d_s, 24), H = random_matrix<T>(T_enc, d_h, 25);
  const Masks masks(steps, T_enc, 8);
  for (const qkv::ScoringOptions& options : {qkv::ScoringOptions(), masks.options}) {
    const qkv::ScoredAttention<T> a = additive.forward(S, H, options), c = concat.forward(S, H, options);
    EXPECT_TRUE(a.scores == c.scores);  // the same function, evaluated the same way: bit-identical
    EXPECT_TRUE(a.weights == c.weights);
    EXPECT_TRUE(a.context == c.context);
  }
  // And both equal the explicit-concatenation brute force (so the identity is not just shared code).
  const Vec v_a = to_table(Matrix<T>(concat.v_a.transpose()))[0];
  expect_result(additive.forward(S, H),
                brute_concat(to_table(S), to_table(H), seed_form(concat.W_a), v_a, all_visible(steps, T_enc)),
                "additive vs explicit concat");
}

TYPED_TEST(Scoring, DotMatchesBruteForceAndScaledDotProductWithScaleOne) {
  using T = TypeParam;
  const Index steps = 5, T_enc = 8, d = 6;
  const Matrix<T> S = random_matrix<T>(steps, d, 31), H = random_matrix<T>(T_enc, d, 32);
  const qkv::DotAttention<T> attention;
  expect_result(attention.forward(S, H), brute_general(to_table(S), to_table(H), nullptr, all_visible(steps, T_enc)),
                "no mask");
  const Masks masks(steps, T_enc, 6);
  const qkv::ScoredAttention<T> masked = attention.forward(S, H, masks.options);
  expect_result(masked, brute_general(to_table(S), to_table(H), nullptr, masks.visible), "masked");

  // dot == scaled_dot_product_attention(S, H, H) with scale 1 (queries S, keys and values H), same masks.
  for (bool with_masks : {false, true}) {
    qkv::AttentionOptions<T> options;
    options.scale = T(1);
    if (with_masks) {
      options.key_lengths = masks.options.key_lengths;
      options.allowed = masks.allowed;
    }
    const qkv::ScoredAttention<T> r = with_masks ? masked : attention.forward(S, H);
    const Matrix<T> context = qkv::scaled_dot_product_attention(S, H, H, options);
    const Matrix<T> weights = qkv::attention_weights(S, H, options);
    EXPECT_LE((r.context - context).cwiseAbs().maxCoeff(), tolerance<T>() * 4) << "masks " << with_masks;
    EXPECT_LE((r.weights - weights).cwiseAbs().maxCoeff(), tolerance<T>()) << "masks " << with_masks;
  }
}

TYPED_TEST(Scoring, GeneralMatchesBruteForceAndIdentityGivesDot) {
  using T = TypeParam;
  const Index steps = 3, T_enc = 7, d_s = 4, d_h = 6;  // d_s ≠ d_h: what W_a is for
  qkv::GeneralAttention<T> general(d_s, d_h);
  general.W_a = random_matrix<T>(d_s, d_h, 41, 0.5);
  const Matrix<T> S = random_matrix<T>(steps, d_s, 42), H = random_matrix<T>(T_enc, d_h, 43);
  const Table W_a = to_table(general.W_a);  // the seed's W_a ∈ R^{d_s×d_h} is stored as is
  expect_result(general.forward(S, H), brute_general(to_table(S), to_table(H), &W_a, all_visible(steps, T_enc)),
                "no mask");
  const Masks masks(steps, T_enc, 5);
  expect_result(general.forward(S, H, masks.options), brute_general(to_table(S), to_table(H), &W_a, masks.visible),
                "masked");

  qkv::GeneralAttention<T> identity(d_h, d_h);
  identity.W_a.setIdentity();
  const Matrix<T> S2 = random_matrix<T>(steps, d_h, 44);
  const qkv::ScoredAttention<T> a = identity.forward(S2, H), b = qkv::DotAttention<T>().forward(S2, H);
  EXPECT_LE((a.weights - b.weights).cwiseAbs().maxCoeff(), tolerance<T>());
  EXPECT_LE((a.context - b.context).cwiseAbs().maxCoeff(), tolerance<T>() * 4);
}

TYPED_TEST(Scoring, BroadcastRowMaskAndSoftmaxAlongEncoderAxis) {
  // A 1 × T mask broadcasts over the steps (one padding row for every step); the weights are normalized per step
  // over the encoder axis (rows sum to 1), not per encoder position (seed 000: "softmax 沿键维").
  using T = TypeParam;
  const Index steps = 4, T_enc = 6, d = 3;
  const Matrix<T> S = random_matrix<T>(steps, d, 51), H = random_matrix<T>(T_enc, d, 52);
  Matrix<bool> row = Matrix<bool>::Constant(1, T_enc, true);
  row(0, 1) = row(0, 4) = false;
  qkv::ScoringOptions options;
  options.allowed = row;
  const qkv::ScoredAttention<T> r = qkv::DotAttention<T>().forward(S, H, options);
  for (Index t = 0; t < steps; ++t) {
    EXPECT_NEAR(double(r.weights.row(t).sum()), 1.0, tolerance<T>());
    EXPECT_EQ(r.weights(t, 1), T(0));
    EXPECT_EQ(r.weights(t, 4), T(0));
  }
  EXPECT_GT(std::abs(double(r.weights.col(0).sum()) - 1.0), 1e-3);  // columns are not normalized
}

TYPED_TEST(Scoring, PaddedAndForbiddenEncoderRowsAreNeverRead) {
  using T = TypeParam;
  const Index steps = 3, T_enc = 6, d_s = 2, d_h = 3, d_a = 4;
  qkv::AdditiveAttention<T> attention(d_s, d_h, d_a);
  attention.W_s = random_matrix<T>(d_s, d_a, 61);
  attention.W_h = random_matrix<T>(d_h, d_a, 62);
  attention.v_a = random_matrix<T>(d_a, 1, 63);
  const Matrix<T> S = random_matrix<T>(steps, d_s, 64);
  Matrix<T> H = random_matrix<T>(T_enc, d_h, 65);
  H.row(5).setConstant(std::numeric_limits<T>::quiet_NaN());  // padding (key_lengths = 5)
  H.row(2).setConstant(std::numeric_limits<T>::infinity());   // forbidden for every step
  Matrix<bool> allowed = Matrix<bool>::Constant(1, T_enc, true);
  allowed(0, 2) = false;
  qkv::ScoringOptions options;
  options.key_lengths = {5};
  options.allowed = allowed;
  const qkv::ScoredAttention<T> r = attention.forward(S, H, options);
  EXPECT_TRUE(r.weights.allFinite());
  EXPECT_TRUE(r.context.allFinite());
  const qkv::ScoredAttention<T> d = qkv::DotAttention<T>().forward(H.leftCols(d_h), H, options);
  EXPECT_TRUE(d.weights.topRows(2).allFinite());  // rows of S that are finite (rows 0, 1 of H)
}

TYPED_TEST(Scoring, EmptyInputs) {
  using T = TypeParam;
  qkv::AdditiveAttention<T> attention(2, 3, 4);
  const Matrix<T> S(0, 2), H = random_matrix<T>(5, 3, 71);
  const qkv::ScoredAttention<T> none = attention.forward(S, H);
  EXPECT_EQ(none.weights.rows(), 0);
  EXPECT_EQ(none.context.rows(), 0);
  const Matrix<T> S1 = random_matrix<T>(2, 2, 72), H0(0, 3);
  const qkv::ScoredAttention<T> empty = attention.forward(S1, H0);  // T = 0: nothing to attend to
  EXPECT_EQ(empty.weights.cols(), 0);
  EXPECT_TRUE(empty.context.isZero(0));
  EXPECT_EQ(empty.context.cols(), 3);
  qkv::ScoringOptions all_padding;
  all_padding.key_lengths = {0};
  EXPECT_TRUE(attention.forward(S1, H, all_padding).context.isZero(0));
}

TEST(ScoringSeed, ColumnFormWeightsByHand) {
  // A 2-position example by hand: additive with d_s = d_h = d_a = 1, W_s = 1, W_h = 2, v_a = 1: s = 0.5, h = (0, 1)
  // → e = (tanh 0.5, tanh 2.5) = (0.462117157, 0.986614298); α = softmax(e) = (0.371801, 0.628199);
  // c = α·h = 0.628199.
  qkv::AdditiveAttention<double> attention(1, 1, 1);
  attention.W_s(0, 0) = 1;
  attention.W_h(0, 0) = 2;
  attention.v_a(0) = 1;
  Matrix<double> S(1, 1), H(2, 1);
  S << 0.5;
  H << 0, 1;
  const qkv::ScoredAttention<double> r = attention.forward(S, H);
  EXPECT_NEAR(r.scores(0, 0), 0.462117157, 1e-9);
  EXPECT_NEAR(r.scores(0, 1), 0.986614298, 1e-9);
  const double a1 = 1 / (1 + std::exp(0.462117157 - 0.986614298));
  EXPECT_NEAR(r.weights(0, 1), a1, 1e-9);
  EXPECT_NEAR(r.weights(0, 1), 0.628199, 1e-6);
  EXPECT_NEAR(r.context(0, 0), a1, 1e-9);
}

using qkv_test::expect_shape_error;

TEST(ScoringErrors, ShapesAndMasks) {
  const Matrix<double> S = random_matrix<double>(3, 4, 81), H = random_matrix<double>(5, 6, 82);
  qkv::AdditiveAttention<double> additive(4, 6, 2);
  EXPECT_NO_THROW(additive.forward(S, H));
  expect_shape_error([&] { additive.forward(H, H); }, {"qkv::AdditiveAttention::forward", "S has 6 columns", "d_s 4"});
  expect_shape_error([&] { additive.forward(S, S); }, {"H has 4 columns", "d_h 6"});
  qkv::AdditiveAttention<double> bad = additive;
  bad.v_a.resize(3);
  expect_shape_error([&] { bad.forward(S, H); }, {"v_a has 3 entries", "W_s is 4 × 2"});
  expect_shape_error([&] { qkv::AdditiveAttention<double>(0, 1, 1); }, {"qkv::AdditiveAttention", "d_s is 0"});

  expect_shape_error([&] { qkv::DotAttention<double>().forward(S, H); },
                     {"qkv::DotAttention::forward", "H has 6 columns", "d_s 4"});
  qkv::GeneralAttention<double> general(4, 6);
  expect_shape_error([&] { general.forward(S, S); }, {"qkv::GeneralAttention::forward", "H has 4 columns", "d_h 6"});
  expect_shape_error([&] { general.forward(H, H); }, {"S has 6 columns", "d_s 4"});
  qkv::ConcatAttention<double> concat(4, 6, 3);
  EXPECT_NO_THROW(concat.forward(S, H));
  expect_shape_error([&] { concat.forward(S, S); }, {"qkv::ConcatAttention::forward", "H has 4 columns", "d_h 6"});
  expect_shape_error([&] { concat.forward(random_matrix<double>(3, 10, 83), H); }, {"S has 10 columns", "[1, 9]"});

  qkv::ScoringOptions options;
  options.key_lengths = {6};
  expect_shape_error([&] { additive.forward(S, H, options); }, {"key_lengths[0] is 6", "[0, 5]"});
  options.key_lengths = {1, 2};
  expect_shape_error([&] { additive.forward(S, H, options); }, {"key_lengths has 2 entries", "0 or 1"});
  options.key_lengths.clear();
  const Matrix<bool> wrong_steps = Matrix<bool>::Constant(2, 5, true);
  options.allowed = wrong_steps;
  expect_shape_error([&] { additive.forward(S, H, options); }, {"allowed axis 2 (steps) has extent 2", "expected 3"});
  const Matrix<bool> wrong_T = Matrix<bool>::Constant(3, 4, true);
  options.allowed = wrong_T;
  expect_shape_error([&] { qkv::DotAttention<double>().forward(S, S, options); },
                     {"allowed axis 3 (T) has extent 4", "expected 3"});
}

}  // namespace
