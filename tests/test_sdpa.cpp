// Tests of qkv/sdpa.hpp: the Eigen entry points. Packed heads equal per-head calls on column blocks (the
// independent expectation is a float64 loop in this file), GQA/MQA through qkv::Heads, column-major and
// expression inputs equal row-major ones, and every Heads/shape error. (The seed's worked example is in
// test_seed_000.cpp; masks against brute force in test_reference.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "qkv/sdpa.hpp"
#include "support/expect_shape_error.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

namespace {

using qkv::Index;
using qkv::Matrix;
using qkv_test::random_matrix;

/// float64 attention of one head with plain loops (no mask): out_i = Σ_j softmax_j(q_i·k_j·scale) v_j.
Matrix<double> brute_force_head(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                                double scale) {
  Matrix<double> out = Matrix<double>::Zero(q.rows(), v.cols());
  for (Index i = 0; i < q.rows(); ++i) {
    std::vector<double> s(static_cast<std::size_t>(k.rows()));
    double m = -std::numeric_limits<double>::infinity(), sum = 0;
    for (Index j = 0; j < k.rows(); ++j) {
      double dot = 0;
      for (Index d = 0; d < q.cols(); ++d) dot += q(i, d) * k(j, d);
      s[static_cast<std::size_t>(j)] = dot * scale;
      m = std::max(m, dot * scale);
    }
    for (auto& x : s) sum += (x = std::exp(x - m));
    for (Index j = 0; j < k.rows(); ++j)
      for (Index d = 0; d < v.cols(); ++d) out(i, d) += s[static_cast<std::size_t>(j)] / sum * v(j, d);
  }
  return out;
}

template <class T>
struct Sdpa : ::testing::Test {};
TYPED_TEST_SUITE(Sdpa, qkv_test::Scalars, );

template <class T>
double tolerance(const Matrix<double>& v) {
  // docs/design.md, Accuracy: the reference path in float is within 1e-6·max(1, max|V|) of float64.
  return (std::is_same_v<T, float> ? 1e-6 : 1e-12) * std::max(1.0, v.cwiseAbs().maxCoeff());
}

TYPED_TEST(Sdpa, PackedGqaHeadsEqualPerHeadBruteForce) {
  using T = TypeParam;
  const Index Tq = 5, Tk = 7, Hq = 6, Hkv = 2, dk = 3, dv = 4;
  const Matrix<T> Q = random_matrix<T>(Tq, Hq * dk, 1), K = random_matrix<T>(Tk, Hkv * dk, 2),
                  V = random_matrix<T>(Tk, Hkv * dv, 3);
  const Matrix<T> out = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{Hq, Hkv});
  ASSERT_EQ(out.rows(), Tq);
  ASSERT_EQ(out.cols(), Hq * dv);
  for (Index h = 0; h < Hq; ++h) {
    const Index g = h / (Hq / Hkv);  // query heads 0,1,2 → kv head 0; 3,4,5 → kv head 1
    const Matrix<double> Vg = V.middleCols(g * dv, dv).template cast<double>();
    const Matrix<double> expected =
        brute_force_head(Q.middleCols(h * dk, dk).template cast<double>(),
                         K.middleCols(g * dk, dk).template cast<double>(), Vg, 1 / std::sqrt(double(dk)));
    EXPECT_LE((out.middleCols(h * dv, dv).template cast<double>() - expected).cwiseAbs().maxCoeff(), tolerance<T>(Vg))
        << "head " << h;
  }
}

TYPED_TEST(Sdpa, MultiQueryAndWeightsOfOneHead) {
  using T = TypeParam;
  const Index Tq = 4, Tk = 6, Hq = 3, dk = 2;
  const Matrix<T> Q = random_matrix<T>(Tq, Hq * dk, 4), K = random_matrix<T>(Tk, dk, 5), V = random_matrix<T>(Tk, 2, 6);
  const Matrix<T> out = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{Hq, 1});
  for (Index h = 0; h < Hq; ++h) {
    const Matrix<T> one = qkv::scaled_dot_product_attention(Matrix<T>(Q.middleCols(h * dk, dk)), K, V);
    EXPECT_EQ(out.middleCols(h * 2, 2), one) << "MQA head " << h << " must equal a single-head call bit for bit";
    const Matrix<T> w = qkv::attention_weights(Q, K, qkv::Heads{Hq, 1}, h);
    const Matrix<T> w_one = qkv::attention_weights(Matrix<T>(Q.middleCols(h * dk, dk)), K);
    EXPECT_EQ(w, w_one);
    for (Index i = 0; i < Tq; ++i) EXPECT_NEAR(w.row(i).template cast<double>().sum(), 1.0, 1e-6);
  }
}

TYPED_TEST(Sdpa, ColumnMajorAndExpressionsEqualRowMajor) {
  using T = TypeParam;
  const Matrix<T> Q = random_matrix<T>(5, 4, 7), K = random_matrix<T>(9, 4, 8), V = random_matrix<T>(9, 3, 9);
  qkv::AttentionOptions<T> o;
  o.causal = true;
  const Matrix<T> row_major = qkv::scaled_dot_product_attention(Q, K, V, o);
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> Qc = Q, Kc = K, Vc = V;  // column-major copies
  EXPECT_EQ(qkv::scaled_dot_product_attention(Qc, Kc, Vc, o), row_major);
  // An expression (a scaled Q with the scale compensated) is evaluated into a temporary.
  o.scale = T(0.25);
  const Matrix<T> from_expression = qkv::scaled_dot_product_attention(Q * T(2), K, V, o);
  o.scale = T(0.5);
  EXPECT_LE((from_expression - qkv::scaled_dot_product_attention(Q, K, V, o)).cwiseAbs().maxCoeff(), T(1e-6));
  // A block of a larger matrix (outer stride ≠ columns) binds without a copy and gives the same answer.
  Matrix<T> wide = Matrix<T>::Zero(5, 10);
  wide.leftCols(4) = Q;
  o.scale.reset();
  o.causal = true;
  EXPECT_EQ(qkv::scaled_dot_product_attention(wide.leftCols(4), K, V, o), row_major);
}

TYPED_TEST(Sdpa, MasksFromEigenMatrices) {
  using T = TypeParam;
  const Matrix<T> Q = random_matrix<T>(3, 2, 10), K = random_matrix<T>(4, 2, 11), V = random_matrix<T>(4, 2, 12);
  Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> allowed(3, 4);
  allowed << true, false, true, false, true, true, true, true, false, false, false, false;
  qkv::AttentionOptions<T> o;
  o.allowed = allowed;
  const Matrix<T> w = qkv::attention_weights(Q, K, o);
  EXPECT_EQ(w(0, 1), T(0));
  EXPECT_EQ(w(0, 3), T(0));
  EXPECT_NEAR(double(w(0, 0) + w(0, 2)), 1.0, 1e-6);
  EXPECT_EQ(w.row(2), Matrix<T>::Zero(1, 4));  // a row that sees nothing
  const Matrix<T> out = qkv::scaled_dot_product_attention(Q, K, V, o);
  EXPECT_EQ(out.row(2), Matrix<T>::Zero(1, 2));
  // The same mask as a −∞ bias gives the same weights.
  Matrix<T> bias(3, 4);
  for (Index i = 0; i < 3; ++i)
    for (Index j = 0; j < 4; ++j) bias(i, j) = allowed(i, j) ? T(0) : -std::numeric_limits<T>::infinity();
  qkv::AttentionOptions<T> ob;
  ob.bias = bias;
  EXPECT_EQ(qkv::attention_weights(Q, K, ob), w);
  // key_lengths has one entry on the Eigen path.
  qkv::AttentionOptions<T> ok;
  ok.key_lengths = {2};
  const Matrix<T> padded = qkv::attention_weights(Q, K, ok);
  EXPECT_EQ(padded.rightCols(2), Matrix<T>::Zero(3, 2));
}

using qkv_test::expect_shape_error;

TEST(SdpaErrors, EveryHeadsAndShapeError) {
  const Matrix<float> Q = Matrix<float>::Ones(2, 8), K = Matrix<float>::Ones(3, 4), V = Matrix<float>::Ones(3, 6);
  expect_shape_error([&] { qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{0, 0}); }, {"Heads::n_heads is 0"});
  expect_shape_error(
      [&] {
        qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{4, -1});
      },
      {"Heads::n_kv_heads is -1"});
  expect_shape_error(
      [&] {
        qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{4, 3});
      },
      {"n_heads 4 is not a multiple of Heads::n_kv_heads 3"});
  expect_shape_error(
      [&] {
        qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{3, 1});
      },
      {"Q has 8 columns, not a multiple of n_heads 3"});
  expect_shape_error(
      [&] {
        qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{4, 1});
      },
      {"K has 4 columns, expected 2"});
  expect_shape_error(
      [&] {
        qkv::scaled_dot_product_attention(Q, K, Matrix<float>::Ones(4, 6).eval(), qkv::Heads{4, 2});
      },
      {"V has 4 rows, expected 3"});
  expect_shape_error(
      [&] {
        qkv::scaled_dot_product_attention(Q, K, Matrix<float>::Ones(3, 5).eval(), qkv::Heads{4, 2});
      },
      {"V has 5 columns, not a multiple of n_kv_heads 2"});
  expect_shape_error(
      [&] {
        qkv::attention_weights(Q, K, qkv::Heads{4, 2}, 4);
      },
      {"head is 4, expected an index in [0, 4)"});
  EXPECT_NO_THROW(qkv::scaled_dot_product_attention(Q.leftCols(4), K, V.leftCols(4)));  // valid shapes
}

}  // namespace
