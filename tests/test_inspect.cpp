// Tests of qkv/inspect.hpp. Expected values come from hand calculations (summaries of small weight matrices, seed 000
// 例 2.4.1) and from a float64 brute-force multi-head attention written here with plain loops (projections, masked
// softmax, output projection), which gives the weights of each head, the output with a head removed and the output
// with a key hidden. Covered: summarize_weights, head_weights / summarize_heads, head_weight_correlation against a
// brute-force Pearson correlation, head_redundancy, ablate_head / head_ablation (including the seed's "a weight is
// not a contribution": a head whose values are zero has ablation 0 whatever its weights), key_ablation (with the
// seed's worked example, where a key with weight 0.198 has no effect on query 0), gradient_input_attribution against
// float64 central differences of the brute force along the scaling of each token (self- and cross-attention), and on
// the real PP-OCRv4 layer (tests/fixtures) beside key_ablation, and every error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "qkv/inspect.hpp"
#include "qkv/sdpa.hpp"
#include "safetensors.hpp"
#include "support/expect_shape_error.hpp"
#include "support/npy.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

namespace {

using qkv::Index;
using qkv::Matrix;
using qkv_test::random_matrix;

template <class T>
qkv::MultiHeadAttention<T> random_module(Index d_model, Index n_heads, Index n_kv_heads, Index head_dim,
                                         unsigned seed) {
  typename qkv::MultiHeadAttention<T>::Config config;
  config.d_model = d_model;
  config.n_heads = n_heads;
  config.n_kv_heads = n_kv_heads;
  config.head_dim = head_dim;
  qkv::MultiHeadAttention<T> mha(config);
  mha.W_q = random_matrix<T>(d_model, n_heads * head_dim, seed, 0.5);
  mha.W_k = random_matrix<T>(d_model, n_kv_heads * head_dim, seed + 1, 0.5);
  mha.W_v = random_matrix<T>(d_model, n_kv_heads * head_dim, seed + 2, 0.5);
  mha.W_o = random_matrix<T>(n_heads * head_dim, d_model, seed + 3, 0.5);
  mha.b_q = random_matrix<T>(n_heads * head_dim, 1, seed + 4, 0.1);
  mha.b_k = random_matrix<T>(n_kv_heads * head_dim, 1, seed + 5, 0.1);
  mha.b_v = random_matrix<T>(n_kv_heads * head_dim, 1, seed + 6, 0.1);
  mha.b_o = random_matrix<T>(d_model, 1, seed + 7, 0.1);
  return mha;
}

/// Float64 brute-force multi-head attention with plain loops. `visible(h, i, j)` decides the mask; `skip_head` (if ≥ 0)
/// is left out of the output projection. Fills `weights[h]` (Tq × Tk) when asked.
struct BruteMha {
  Matrix<double> W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o;
  Index Hq, Hkv, D;

  template <class T>
  explicit BruteMha(const qkv::MultiHeadAttention<T>& m)
      : W_q(m.W_q.template cast<double>()),
        W_k(m.W_k.template cast<double>()),
        W_v(m.W_v.template cast<double>()),
        W_o(m.W_o.template cast<double>()),
        b_q(m.b_q.template cast<double>()),
        b_k(m.b_k.template cast<double>()),
        b_v(m.b_v.template cast<double>()),
        b_o(m.b_o.template cast<double>()),
        Hq(m.n_heads()),
        Hkv(m.n_kv_heads()),
        D(m.head_dim()) {}

  static Matrix<double> project(const Matrix<double>& X, const Matrix<double>& W, const Matrix<double>& b) {
    Matrix<double> Y(X.rows(), W.cols());
    for (Index r = 0; r < X.rows(); ++r)
      for (Index c = 0; c < W.cols(); ++c) {
        double s = b.size() > 0 ? b(c) : 0.0;
        for (Index k = 0; k < X.cols(); ++k) s += X(r, k) * W(k, c);
        Y(r, c) = s;
      }
    return Y;
  }

  Matrix<double> forward(const Matrix<double>& X_q, const Matrix<double>& X_kv,
                         const std::function<bool(Index, Index, Index)>& visible, Index skip_head = -1,
                         std::vector<Matrix<double>>* weights = nullptr) const {
    const Matrix<double> Q = project(X_q, W_q, b_q), K = project(X_kv, W_k, b_k), V = project(X_kv, W_v, b_v);
    const Index Tq = X_q.rows(), Tk = X_kv.rows();
    Matrix<double> O = Matrix<double>::Zero(Tq, Hq * D);
    if (weights != nullptr) weights->assign(std::size_t(Hq), Matrix<double>::Zero(Tq, Tk));
    for (Index h = 0; h < Hq; ++h) {
      const Index g = h / (Hq / Hkv);
      for (Index i = 0; i < Tq; ++i) {
        std::vector<double> s(std::size_t(Tk), -std::numeric_limits<double>::infinity());
        double m = -std::numeric_limits<double>::infinity(), sum = 0;
        for (Index j = 0; j < Tk; ++j) {
          if (!visible(h, i, j)) continue;
          double dot = 0;
          for (Index d = 0; d < D; ++d) dot += Q(i, h * D + d) * K(j, g * D + d);
          s[std::size_t(j)] = dot / std::sqrt(double(D));
          m = std::max(m, s[std::size_t(j)]);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;
        for (Index j = 0; j < Tk; ++j)
          if (visible(h, i, j)) sum += std::exp(s[std::size_t(j)] - m);
        for (Index j = 0; j < Tk; ++j) {
          if (!visible(h, i, j)) continue;
          const double p = std::exp(s[std::size_t(j)] - m) / sum;
          if (weights != nullptr) (*weights)[std::size_t(h)](i, j) = p;
          for (Index d = 0; d < D; ++d) O(i, h * D + d) += p * V(j, g * D + d);
        }
      }
    }
    if (skip_head >= 0) O.middleCols(skip_head * D, D).setZero();
    return project(O, W_o, b_o);
  }
};

const auto kAll = [](Index, Index, Index) { return true; };

template <class T>
struct Inspect : ::testing::Test {};
TYPED_TEST_SUITE(Inspect, qkv_test::Scalars, );

/// Accuracy of a float or double module output against float64 (projections of a few terms and the attention path
/// each within about 1e-6 relative in float), with margin.
template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 5e-5 : 1e-11;
}

// ---- summaries -----------------------------------------------------------------------------------------------------

TEST(Summaries, HandComputedWeights) {
  Matrix<double> P(4, 3);
  // clang-format off
  P << 1,       0,       0,         // one-hot: entropy 0, max weight 1, distance 0
       0.5,     0.5,     0,         // entropy ln 2, max 0.5, distance 0.5·1 + 0.5·0 = 0.5
       1.0 / 3, 1.0 / 3, 1.0 / 3,   // entropy ln 3, max 1/3, distance (2 + 1 + 0)/3 = 1
       0,       0,       0;         // sees no key: left out
  // clang-format on
  const qkv::HeadSummary s = qkv::summarize_weights(P, 7);
  EXPECT_EQ(s.head, 7);
  EXPECT_EQ(s.rows, 3);
  EXPECT_NEAR(s.mean_entropy, (std::log(2.0) + std::log(3.0)) / 3, 1e-15);
  EXPECT_NEAR(s.min_entropy, 0.0, 1e-15);
  EXPECT_NEAR(s.max_entropy, std::log(3.0), 1e-15);
  EXPECT_NEAR(s.uniform_entropy, std::log(3.0), 1e-15);
  EXPECT_NEAR(s.mean_max_weight, (1 + 0.5 + 1.0 / 3) / 3, 1e-15);
  EXPECT_NEAR(s.mean_distance, 0.5, 1e-15);

  const qkv::HeadSummary empty = qkv::summarize_weights(Matrix<float>(0, 5));
  EXPECT_EQ(empty.rows, 0);
  EXPECT_EQ(empty.mean_entropy, 0.0);
  EXPECT_NEAR(empty.uniform_entropy, std::log(5.0), 1e-15);
}

TEST(Summaries, SeedWorkedExample) {
  // Seed 000 例 2.4.1: Q = K = [1 0; 0 1; 1 1], P = softmax(QKᵀ/√2) ≈ [0.401 0.198 0.401; 0.198 0.401 0.401;
  // 0.248 0.248 0.503]. Rows 0 and 1 have the same entropy (≈ 1.054 nats, the flattest); row 2 is the sharpest
  // (≈ 1.037): the exact weights are written here from the softmax by hand.
  Matrix<double> Q(3, 2);
  Q << 1, 0, 0, 1, 1, 1;
  const Matrix<double> P = qkv::attention_weights(Q, Q);
  const double r = 1 / std::sqrt(2.0);
  const double a = std::exp(r) / (2 * std::exp(r) + 1), b = 1 / (2 * std::exp(r) + 1);  // rows 0, 1: (a, b, a)
  const double c = std::exp(r) / (2 * std::exp(r) + std::exp(2 * r)),
               e = std::exp(2 * r) / (2 * std::exp(r) + std::exp(2 * r));
  EXPECT_NEAR(a, 0.401, 5e-4);  // the seed's table
  EXPECT_NEAR(b, 0.198, 5e-4);
  EXPECT_NEAR(c, 0.248, 5e-4);
  EXPECT_NEAR(e, 0.503, 5e-4);
  const double h01 = -(2 * a * std::log(a) + b * std::log(b)), h2 = -(2 * c * std::log(c) + e * std::log(e));
  const qkv::HeadSummary s = qkv::summarize_weights(P);
  EXPECT_NEAR(s.mean_entropy, (2 * h01 + h2) / 3, 1e-12);
  EXPECT_NEAR(s.max_entropy, h01, 1e-12);
  EXPECT_NEAR(s.min_entropy, h2, 1e-12);
  EXPECT_NEAR(s.mean_max_weight, (2 * a + e) / 3, 1e-12);
  // Σ_j p_ij·|i − j|: row 0 (a, b, a) → b + 2a; row 1 (b, a, a) → b + a; row 2 (c, c, e) → 2c + c.
  EXPECT_NEAR(s.mean_distance, ((b + 2 * a) + (b + a) + 3 * c) / 3, 1e-12);
}

TYPED_TEST(Inspect, HeadWeightsAndSummariesMatchBruteForce) {
  using T = TypeParam;
  const Index d_model = 12, Hq = 4, Hkv = 2, D = 3, Tq = 5, Tk = 7;  // GQA, cross-attention, Tq ≠ Tk
  const qkv::MultiHeadAttention<T> mha = random_module<T>(d_model, Hq, Hkv, D, 10);
  const Matrix<T> X_q = random_matrix<T>(Tq, d_model, 20), X_kv = random_matrix<T>(Tk, d_model, 21);
  std::vector<Matrix<double>> expected;
  BruteMha(mha).forward(X_q.template cast<double>(), X_kv.template cast<double>(), kAll, -1, &expected);
  const std::vector<Matrix<T>> weights = qkv::head_weights(mha, X_q, X_kv);
  const std::vector<qkv::HeadSummary> summaries = qkv::summarize_heads(mha, X_q, X_kv);
  ASSERT_EQ(weights.size(), std::size_t(Hq));
  ASSERT_EQ(summaries.size(), std::size_t(Hq));
  for (Index h = 0; h < Hq; ++h) {
    EXPECT_LE((weights[std::size_t(h)].template cast<double>() - expected[std::size_t(h)]).cwiseAbs().maxCoeff(),
              tolerance<T>())
        << "head " << h;
    const qkv::HeadSummary from_brute = qkv::summarize_weights(expected[std::size_t(h)], h);
    const qkv::HeadSummary& s = summaries[std::size_t(h)];
    EXPECT_EQ(s.head, h);
    EXPECT_EQ(s.rows, Tq);
    EXPECT_NEAR(s.mean_entropy, from_brute.mean_entropy, 10 * tolerance<T>());
    EXPECT_NEAR(s.mean_distance, from_brute.mean_distance, 10 * tolerance<T>());
    EXPECT_NEAR(s.uniform_entropy, std::log(double(Tk)), 1e-15);
  }
}

// ---- redundancy ----------------------------------------------------------------------------------------------------

double brute_pearson(const std::vector<double>& x, const std::vector<double>& y) {
  double mx = 0, my = 0;
  for (std::size_t k = 0; k < x.size(); ++k) mx += x[k], my += y[k];
  mx /= double(x.size());
  my /= double(y.size());
  double sxy = 0, sxx = 0, syy = 0;
  for (std::size_t k = 0; k < x.size(); ++k) {
    sxy += (x[k] - mx) * (y[k] - my);
    sxx += (x[k] - mx) * (x[k] - mx);
    syy += (y[k] - my) * (y[k] - my);
  }
  return sxy / std::sqrt(sxx * syy);
}

TEST(Redundancy, CorrelationMatchesBruteForcePearson) {
  // Three heads over two inputs of different lengths; flattened per head, input after input.
  std::vector<std::vector<Matrix<double>>> maps(2);
  const Index sizes[2][2] = {{3, 4}, {5, 5}};
  for (std::size_t n = 0; n < 2; ++n)
    for (unsigned h = 0; h < 3; ++h)
      maps[n].push_back(random_matrix<double>(sizes[n][0], sizes[n][1], 30 + 3 * unsigned(n) + h).cwiseAbs());
  maps[0][2] = 2.0 * maps[0][0].array() + 0.25;  // head 2 = an affine map of head 0 on input 0 only
  std::vector<std::vector<double>> flat(3);
  for (std::size_t h = 0; h < 3; ++h)
    for (std::size_t n = 0; n < 2; ++n)
      for (Index i = 0; i < maps[n][h].rows(); ++i)
        for (Index j = 0; j < maps[n][h].cols(); ++j) flat[h].push_back(maps[n][h](i, j));
  const Matrix<double> C = qkv::head_weight_correlation(maps);
  ASSERT_EQ(C.rows(), 3);
  for (std::size_t a = 0; a < 3; ++a)
    for (std::size_t b = 0; b < 3; ++b)
      EXPECT_NEAR(C(Index(a), Index(b)), a == b ? 1.0 : brute_pearson(flat[a], flat[b]), 1e-12) << a << ", " << b;

  // Identical heads correlate 1, an affine copy 1, a mirrored copy −1.
  std::vector<std::vector<Matrix<double>>> copies(1);
  const Matrix<double> A = random_matrix<double>(4, 4, 40).cwiseAbs();
  copies[0] = {A, A, Matrix<double>(3.0 * A.array() + 1.0), Matrix<double>(1.0 - A.array())};
  const Matrix<double> C2 = qkv::head_weight_correlation(copies);
  EXPECT_NEAR(C2(0, 1), 1.0, 1e-12);
  EXPECT_NEAR(C2(0, 2), 1.0, 1e-12);
  EXPECT_NEAR(C2(0, 3), -1.0, 1e-12);
  EXPECT_NEAR(C2(3, 0), -1.0, 1e-12);  // symmetric

  // Constant (uniform) heads: 1 with an identical constant head, 0 with anything else, never NaN.
  std::vector<std::vector<Matrix<double>>> uniform(1);
  const Matrix<double> U = Matrix<double>::Constant(3, 3, 1.0 / 3);
  uniform[0] = {U, U, A.topLeftCorner(3, 3)};
  const Matrix<double> C3 = qkv::head_weight_correlation(uniform);
  EXPECT_EQ(C3(0, 1), 1.0);
  EXPECT_EQ(C3(0, 2), 0.0);
  EXPECT_EQ(C3(2, 2), 1.0);
}

TYPED_TEST(Inspect, HeadRedundancyFindsDuplicatedHeads) {
  // Heads 0 and 1 share their query and key projections (so their weight maps are identical on every input); head 2
  // is independent. Seed 002 §4.3: such heads are candidates for pruning.
  using T = TypeParam;
  const Index d_model = 8, H = 3, D = 4;
  qkv::MultiHeadAttention<T> mha = random_module<T>(d_model, H, H, D, 50);
  mha.W_q.middleCols(D, D) = mha.W_q.leftCols(D);
  mha.W_k.middleCols(D, D) = mha.W_k.leftCols(D);
  mha.b_q.segment(D, D) = mha.b_q.head(D);
  mha.b_k.segment(D, D) = mha.b_k.head(D);
  const std::vector<Matrix<T>> inputs = {random_matrix<T>(5, d_model, 51), random_matrix<T>(7, d_model, 52)};
  const Matrix<double> C = qkv::head_redundancy(mha, inputs);
  EXPECT_NEAR(C(0, 1), 1.0, 1e-6);
  EXPECT_LT(C(0, 2), 0.99);
  // Against brute force: the Pearson correlation of the brute-force weights, flattened over both inputs.
  std::vector<std::vector<double>> flat(static_cast<std::size_t>(H));
  for (const Matrix<T>& X : inputs) {
    std::vector<Matrix<double>> w;
    BruteMha(mha).forward(X.template cast<double>(), X.template cast<double>(), kAll, -1, &w);
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < w[std::size_t(h)].rows(); ++i)
        for (Index j = 0; j < w[std::size_t(h)].cols(); ++j) flat[std::size_t(h)].push_back(w[std::size_t(h)](i, j));
  }
  EXPECT_NEAR(C(0, 2), brute_pearson(flat[0], flat[2]), 10 * tolerance<T>());
  EXPECT_NEAR(C(1, 2), brute_pearson(flat[1], flat[2]), 10 * tolerance<T>());
}

// ---- ablation ------------------------------------------------------------------------------------------------------

TYPED_TEST(Inspect, HeadAblationMatchesBruteForceRemoval) {
  using T = TypeParam;
  const Index d_model = 8, Hq = 4, Hkv = 2, D = 2, Tn = 6;
  const qkv::MultiHeadAttention<T> mha = random_module<T>(d_model, Hq, Hkv, D, 60);
  const Matrix<T> X = random_matrix<T>(Tn, d_model, 61);
  const Matrix<double> Xd = X.template cast<double>();
  const BruteMha brute(mha);
  const Matrix<double> Y = brute.forward(Xd, Xd, kAll);
  const std::vector<double> change = qkv::head_ablation(mha, X, X);
  ASSERT_EQ(change.size(), std::size_t(Hq));
  for (Index h = 0; h < Hq; ++h) {
    const Matrix<double> Y_h = brute.forward(Xd, Xd, kAll, h);
    EXPECT_NEAR(change[std::size_t(h)], (Y - Y_h).norm() / Y.norm(), 10 * tolerance<T>()) << "head " << h;
    EXPECT_GT(change[std::size_t(h)], 1e-3);
    // ablate_head: the module without head h computes Y_h.
    const Matrix<T> Y_ablated = qkv::ablate_head(mha, h).forward(X);
    EXPECT_LE((Y_ablated.template cast<double>() - Y_h).cwiseAbs().maxCoeff(), tolerance<T>()) << "head " << h;
  }
}

TYPED_TEST(Inspect, WeightIsNotContribution) {
  // Seed 000 §2.4.7, "权重不是输出": a head whose value rows are zero has sharp, non-trivial weights and no effect on
  // the output at all. Its ablation is exactly 0 while its summary looks like any other head's.
  using T = TypeParam;
  const Index d_model = 8, H = 2, D = 4;
  qkv::MultiHeadAttention<T> mha = random_module<T>(d_model, H, H, D, 70);
  mha.W_q *= T(4);  // sharpen the weights
  mha.W_v.middleCols(D, D).setZero();
  mha.b_v.segment(D, D).setZero();
  const Matrix<T> X = random_matrix<T>(6, d_model, 71);
  const std::vector<double> change = qkv::head_ablation(mha, X, X);
  EXPECT_EQ(change[1], 0.0);
  EXPECT_GT(change[0], 1e-2);
  const std::vector<qkv::HeadSummary> s = qkv::summarize_heads(mha, X, X);
  EXPECT_LT(s[1].mean_entropy, 0.9 * s[1].uniform_entropy);  // head 1 does attend somewhere
  EXPECT_GT(s[1].mean_max_weight, 1.0 / 6);
}

TEST(KeyAblation, SeedWorkedExampleKeyWithWeightButNoEffect) {
  // 例 2.4.1 as a one-head module: X = [Q | V] (d_model 4), W_q = W_k = [I; 0], W_v = [0; I], W_o = [I 0], no biases.
  // Query 0 weighs the keys (0.401, 0.198, 0.401), yet hiding key 1 leaves its output at (3, 4): keys 0 and 2 have
  // equal scores, so their weights become (0.5, 0.5) and 0.5·(1, 2) + 0.5·(5, 6) = (3, 4). Hiding key 0 instead moves
  // it to softmax(0, 1/√2) over keys 1, 2: ≈ 0.330·(3, 4) + 0.670·(5, 6).
  qkv::MultiHeadAttention<double>::Config config;
  config.d_model = 4;
  config.n_heads = 1;
  config.head_dim = 2;
  config.bias = false;
  qkv::MultiHeadAttention<double> mha(config);
  mha.W_q << 1, 0, 0, 1, 0, 0, 0, 0;
  mha.W_k = mha.W_q;
  mha.W_v << 0, 0, 0, 0, 1, 0, 0, 1;
  mha.W_o << 1, 0, 0, 0, 0, 1, 0, 0;
  Matrix<double> X(3, 4);
  X << 1, 0, 1, 2, 0, 1, 3, 4, 1, 1, 5, 6;
  const Matrix<double> Y = mha.forward(X);
  EXPECT_NEAR(Y(0, 0), 3.0, 1e-12);
  EXPECT_NEAR(Y(0, 1), 4.0, 1e-12);
  const Matrix<double> P = mha.attention_weights(X, X, 0);
  EXPECT_NEAR(P(0, 1), 0.198, 5e-4);
  const Matrix<double> E = qkv::key_ablation(mha, X, X);
  EXPECT_NEAR(E(0, 1), 0.0, 1e-12);  // weight 0.198, effect 0
  const double w = 1 / (1 + std::exp(1 / std::sqrt(2.0)));
  const double moved = std::hypot(w * 3 + (1 - w) * 5 - 3, w * 4 + (1 - w) * 6 - 4);
  EXPECT_NEAR(E(0, 0), moved / 5.0, 1e-12);  // ‖Y_0‖ = ‖(3, 4)‖ = 5
  EXPECT_NEAR(E(0, 0), E(0, 2), 1e-12);      // by symmetry
}

TYPED_TEST(Inspect, KeyAblationMatchesBruteForceWithMasks) {
  using T = TypeParam;
  const Index d_model = 6, Hq = 2, Hkv = 1, D = 3, Tq = 4, Tk = 5;
  const qkv::MultiHeadAttention<T> mha = random_module<T>(d_model, Hq, Hkv, D, 80);
  const Matrix<T> X_q = random_matrix<T>(Tq, d_model, 81), X_kv = random_matrix<T>(Tk, d_model, 82);
  const Matrix<double> Xq = X_q.template cast<double>(), Xkv = X_kv.template cast<double>();
  const BruteMha brute(mha);
  // Options: causal (bottom-right: diag(i) = i + 1) and a per-query mask forbidding (2, 0) and (3, 3).
  Matrix<bool> allowed = Matrix<bool>::Constant(Tq, Tk, true);
  allowed(2, 0) = allowed(3, 3) = false;
  qkv::AttentionOptions<T> options;
  options.causal = true;
  options.allowed = allowed;
  const auto visible = [&](Index, Index i, Index j) { return j <= i + 1 && allowed(i, j); };
  const Matrix<double> Y = brute.forward(Xq, Xkv, visible);
  const Matrix<double> E = qkv::key_ablation(mha, X_q, X_kv, options);
  ASSERT_EQ(E.rows(), Tq);
  ASSERT_EQ(E.cols(), Tk);
  for (Index j = 0; j < Tk; ++j) {
    const Matrix<double> Y_j =
        brute.forward(Xq, Xkv, [&](Index h, Index i, Index k) { return k != j && visible(h, i, k); });
    for (Index i = 0; i < Tq; ++i) {
      const double expected = (Y.row(i) - Y_j.row(i)).norm() / Y.row(i).norm();
      EXPECT_NEAR(E(i, j), expected, 10 * tolerance<T>()) << "query " << i << " key " << j;
      if (!visible(0, i, j)) {
        EXPECT_EQ(E(i, j), 0.0) << "already hidden: query " << i << " key " << j;
      }
    }
  }
  // The user's mask is left as it was (the ablation uses its own copy).
  EXPECT_FALSE(allowed(2, 0));
  EXPECT_TRUE(allowed(2, 1));
}

// ---- gradient × input attribution ---------------------------------------------------------------------------------

/// Accuracy of an attribution against float64 central differences of the brute force: the difference's own error is
/// about 1e-9 relative (h = 1e-5, |u·Y_i| and its derivatives O(1)); a float module's gradients carry about 1e-6
/// relative (float inputs and products of O(T + d_model) terms).
template <class T>
double attribution_tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-7;
}

/// d/dα (u·Y_i)(X_q, X_kv with row j scaled by α) at α = 1, by a float64 central difference of the brute force, for
/// every j; `scale_query` also scales X_q's row j (self-attention: X_q = X_kv = X is one input).
Eigen::VectorXd attribution_by_differences(const BruteMha& brute, const Matrix<double>& X_q, const Matrix<double>& X_kv,
                                           Index row, const Eigen::RowVectorXd& u, bool scale_query,
                                           const std::function<bool(Index, Index, Index)>& visible) {
  constexpr double h = 1e-5;
  Eigen::VectorXd a(X_kv.rows());
  for (Index j = 0; j < X_kv.rows(); ++j) {
    double value[2];
    for (int side = 0; side < 2; ++side) {
      const double alpha = side == 0 ? 1 + h : 1 - h;
      Matrix<double> q = X_q, kv = X_kv;
      kv.row(j) *= alpha;
      if (scale_query) q.row(j) *= alpha;
      value[side] = u.dot(brute.forward(q, kv, visible).row(row));
    }
    a(j) = (value[0] - value[1]) / (2 * h);
  }
  return a;
}

TYPED_TEST(Inspect, GradientInputAttributionMatchesFiniteDifferences) {
  using T = TypeParam;
  const Index d_model = 8, Hq = 4, Hkv = 2, D = 3, Tn = 7;
  const qkv::MultiHeadAttention<T> mha = random_module<T>(d_model, Hq, Hkv, D, 100);
  const Matrix<T> X = random_matrix<T>(Tn, d_model, 101);
  const Matrix<double> Xd = X.template cast<double>();
  const BruteMha brute(mha);
  const Matrix<T> u = random_matrix<T>(1, d_model, 102);
  qkv::AttentionOptions<T> options;
  options.causal = true;
  const auto causal = [](Index, Index i, Index j) { return j <= i; };
  for (const Index i : {Index(0), Index(3), Tn - 1}) {
    const Eigen::VectorXd a = qkv::gradient_input_attribution(mha, X, i, u, options);
    const Eigen::VectorXd expected =
        attribution_by_differences(brute, Xd, Xd, i, u.template cast<double>(), /*scale_query=*/true, causal);
    ASSERT_EQ(a.size(), Tn);
    const double scale = std::max(1.0, expected.cwiseAbs().maxCoeff());
    EXPECT_LE((a - expected).cwiseAbs().maxCoeff(), attribution_tolerance<T>() * scale) << "row " << i;
    for (Index j = i + 1; j < Tn; ++j) EXPECT_EQ(a(j), 0.0) << "a key after row " << i << " (causal)";
    EXPECT_GT(std::abs(a(i)), 1e-3) << "the row's own token (query, key and value) has a share";
  }
  // The direction as a column vector gives the same scores.
  const Matrix<T> u_column = u.transpose();
  EXPECT_EQ(qkv::gradient_input_attribution(mha, X, 2, u_column, options),
            qkv::gradient_input_attribution(mha, X, 2, u, options));
}

TYPED_TEST(Inspect, CrossAttentionAttributionCoversTheKeyValueTokens) {
  using T = TypeParam;
  const Index d_model = 6, Hq = 2, Hkv = 1, D = 3, Tq = 4, Tk = 5;
  const qkv::MultiHeadAttention<T> mha = random_module<T>(d_model, Hq, Hkv, D, 110);
  const Matrix<T> X_q = random_matrix<T>(Tq, d_model, 111), X_kv = random_matrix<T>(Tk, d_model, 112);
  const BruteMha brute(mha);
  const Matrix<T> u = random_matrix<T>(d_model, 1, 113);
  for (Index i = 0; i < Tq; ++i) {
    const Eigen::VectorXd a = qkv::gradient_input_attribution(mha, X_q, X_kv, i, u);
    const Eigen::VectorXd expected =
        attribution_by_differences(brute, X_q.template cast<double>(), X_kv.template cast<double>(), i,
                                   u.transpose().template cast<double>(), /*scale_query=*/false, kAll);
    ASSERT_EQ(a.size(), Tk);
    EXPECT_LE((a - expected).cwiseAbs().maxCoeff(),
              attribution_tolerance<T>() * std::max(1.0, expected.cwiseAbs().maxCoeff()))
        << "row " << i;
  }
}

TEST(GradientInputAttribution, RealLayerBesideKeyAblation) {
  // PP-OCRv4's first attention layer (tests/fixtures/README.md): d_model 120, 8 heads of 15, on its real input of 40
  // tokens, in double. For output rows 0 and 20 (row 0 only with QKV_REDUCED_GRID=1) and the direction of the row
  // itself (u = Y_i/‖Y_i‖, so u·Y_i = ‖Y_i‖), the gradient × input share of each token is printed beside the effect of
  // hiding it (`key_ablation`, row i) and the head-averaged weight; they need not agree (the share is signed and
  // first-order, includes token i's role as the query, and scales a token instead of removing it). Asserted: each
  // share equals the float64 central difference of ‖Y_i‖ along the scaling of that token's row (the definition, 80
  // forward passes), and their sum equals the difference along the scaling of the whole input (the total, computed
  // independently by 2 forward passes).
  const safetensors::File f =
      safetensors::read(std::string(QKV_TEST_FIXTURES_DIR) + "/ppocr_v4_block1_attention.safetensors");
  const qkv_test::NpyArray input =
      qkv_test::read_npy_float32(std::string(QKV_TEST_FIXTURES_DIR) + "/ppocr_v4_block1_attention_input.npy");
  ASSERT_EQ(input.shape, (std::vector<long>{40, 120}));
  const Index T = 40, E = 120;
  const auto matrix = [&](const char* name, Index rows, Index cols) {
    const auto& tensor = f.tensors.at(name);
    EXPECT_EQ(static_cast<Index>(tensor.values.size()), rows * cols) << name;
    Matrix<double> m(rows, cols);
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c) m(r, c) = tensor.values[static_cast<std::size_t>(r * cols + c)];
    return m;
  };
  qkv::MultiHeadAttention<double>::Config config;
  config.d_model = E;
  config.n_heads = 8;
  qkv::MultiHeadAttention<double> mha(config);
  mha.load_fused_qkv(matrix("linear_77.w_0", E, 3 * E), matrix("linear_77.b_0", 1, 3 * E),
                     matrix("linear_78.w_0", E, E), matrix("linear_78.b_0", 1, E));
  Matrix<double> X(T, E);
  for (Index t = 0; t < T; ++t)
    for (Index c = 0; c < E; ++c) X(t, c) = input.values[static_cast<std::size_t>(t * E + c)];

  const Matrix<double> Y = mha.forward(X);
  const Matrix<double> ablation = qkv::key_ablation(mha, X, X);
  Matrix<double> mean_weight = Matrix<double>::Zero(T, T);
  for (const Matrix<double>& P : qkv::head_weights(mha, X, X)) mean_weight += P / double(mha.n_heads());
  constexpr double h = 1e-5;
  const char* reduced = std::getenv("QKV_REDUCED_GRID");  // the valgrind stage: one row
  const std::vector<Index> rows =
      reduced != nullptr && reduced[0] == '1' ? std::vector<Index>{0} : std::vector<Index>{0, 20};
  for (const Index i : rows) {
    const Eigen::RowVectorXd u = Y.row(i).normalized();
    const Eigen::VectorXd a = qkv::gradient_input_attribution(mha, X, i, u);
    const auto norm_of_row = [&](const Matrix<double>& input_rows) { return u.dot(mha.forward(input_rows).row(i)); };
    Eigen::VectorXd by_differences(T);
    for (Index j = 0; j < T; ++j) {
      Matrix<double> plus = X, minus = X;
      plus.row(j) *= 1 + h;
      minus.row(j) *= 1 - h;
      by_differences(j) = (norm_of_row(plus) - norm_of_row(minus)) / (2 * h);
    }
    const double total = (norm_of_row((1 + h) * X) - norm_of_row((1 - h) * X)) / (2 * h);
    const double scale = std::max(1.0, by_differences.cwiseAbs().maxCoeff());
    EXPECT_LE((a - by_differences).cwiseAbs().maxCoeff(), 1e-7 * scale) << "row " << i;
    EXPECT_NEAR(a.sum(), total, 1e-7 * std::max(1.0, std::abs(total))) << "row " << i;

    // Side by side: the five tokens with the largest |share|, and where key ablation and the weights put them.
    std::vector<Index> order(static_cast<std::size_t>(T));
    for (Index j = 0; j < T; ++j) order[static_cast<std::size_t>(j)] = j;
    std::sort(order.begin(), order.end(), [&](Index x, Index y) { return std::abs(a(x)) > std::abs(a(y)); });
    const auto rank_of = [&](const Eigen::VectorXd& v, Index j) {
      Index rank = 0;
      for (Index k = 0; k < T; ++k) rank += v(k) > v(j) ? 1 : 0;
      return rank;
    };
    const Eigen::VectorXd ablation_row = ablation.row(i).transpose(), weight_row = mean_weight.row(i).transpose();
    std::cout << "[ PP-OCRv4 ] output row " << i << ": ‖Y_i‖ = " << Y.row(i).norm() << ", Σ_j a_j = " << a.sum()
              << " (d/dα ‖·‖ along α·X: " << total << ")\n"
              << "  token   gradient×input   key ablation (rank, 0 = largest)   mean weight (rank)\n";
    for (std::size_t k = 0; k < 5; ++k) {
      const Index j = order[k];
      std::printf("  %5td   %+14.4f   %25.4f (%2td)   %11.4f (%2td)\n", j, a(j), ablation_row(j),
                  rank_of(ablation_row, j), weight_row(j), rank_of(weight_row, j));
    }
  }
}

// ---- errors --------------------------------------------------------------------------------------------------------

using qkv_test::expect_shape_error;

TEST(InspectErrors, EveryThrow) {
  using Maps = std::vector<std::vector<Matrix<double>>>;
  expect_shape_error([] { qkv::head_weight_correlation(Maps{}); }, {"qkv::head_weight_correlation", "maps is empty"});
  expect_shape_error([] { qkv::head_weight_correlation(Maps(1)); }, {"maps[0] has no heads"});
  Maps heads(2);
  heads[0] = {Matrix<double>::Zero(2, 2), Matrix<double>::Zero(2, 2)};
  heads[1] = {Matrix<double>::Zero(2, 2)};
  expect_shape_error([&] { qkv::head_weight_correlation(heads); }, {"maps[1] has 1 heads, expected 2"});
  heads[1] = {Matrix<double>::Zero(3, 3), Matrix<double>::Zero(3, 2)};
  expect_shape_error([&] { qkv::head_weight_correlation(heads); }, {"maps[1][1] is 3 × 2, expected 3 × 3"});

  const qkv::MultiHeadAttention<double> mha = random_module<double>(4, 2, 2, 2, 90);
  expect_shape_error([&] { qkv::head_redundancy(mha, std::vector<Matrix<double>>{}); },
                     {"qkv::head_redundancy", "inputs is empty"});
  expect_shape_error([&] { qkv::ablate_head(mha, 2); }, {"qkv::ablate_head", "head is 2", "[0, 2)"});
  const Matrix<double> X = random_matrix<double>(3, 4, 91);
  qkv::AttentionOptions<double> varlen;
  varlen.cu_seqlens_q = {0, 1, 3};
  varlen.cu_seqlens_k = {0, 1, 3};
  expect_shape_error([&] { qkv::key_ablation(mha, X, X, varlen); }, {"qkv::key_ablation", "varlen"});
  expect_shape_error([&] { qkv::head_ablation(mha, X, random_matrix<double>(3, 5, 92)); }, {"X_kv has 5 columns"});
  const Matrix<double> u = random_matrix<double>(1, 4, 93);
  expect_shape_error([&] { qkv::gradient_input_attribution(mha, X, 3, u); },
                     {"qkv::gradient_input_attribution", "row is 3", "[0, 3)"});
  expect_shape_error([&] { qkv::gradient_input_attribution(mha, X, -1, u); }, {"row is -1"});
  expect_shape_error([&] { qkv::gradient_input_attribution(mha, X, 0, random_matrix<double>(1, 3, 94)); },
                     {"direction is 1 × 3", "d_model = 4"});
  expect_shape_error([&] { qkv::gradient_input_attribution(mha, X, 0, random_matrix<double>(2, 2, 95)); },
                     {"direction is 2 × 2"});
  expect_shape_error([&] { qkv::gradient_input_attribution(mha, X, X, 4, u); }, {"row is 4", "(the rows of X_q)"});
  expect_shape_error([&] { qkv::gradient_input_attribution(mha, X, random_matrix<double>(3, 5, 96), 0, u); },
                     {"X_kv has 5 columns"});
}

}  // namespace
