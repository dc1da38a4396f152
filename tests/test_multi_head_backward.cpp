// Tests of MultiHeadAttention::backward (qkv/multi_head.hpp): the gradients of the module with respect to its inputs
// and every parameter.
//
// Expected values come from float64 central finite differences of the scalar loss L = Σ dY ∘ forward(inputs) (dY a
// fixed random matrix), perturbing one entry of one input or parameter at a time; the forward is the module's own
// (tested against PyTorch and float64 loops in test_multi_head), so the check is that backward differentiates exactly
// what forward computes. Covered: the self-attention form (dX = the three paths summed), the cross-attention forms
// with two and three inputs (kdim ≠ vdim ≠ d_model), MHA, GQA and MQA, with and without biases, RoPE in both layouts,
// causal (both alignments), a row that sees no key, varlen, options passed through (window, ALiBi, softcap, sinks)
// and dropout (the same seed and offset in forward and backward: the same mask); the float module against the double
// one; and every throw.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "qkv/multi_head.hpp"
#include "support/expect_shape_error.hpp"
#include "support/problem.hpp"

namespace {

using qkv::Index;
using qkv::Matrix;
using qkv_test::random_matrix;

template <class T>
using Module = qkv::MultiHeadAttention<T>;

/// The sizes of a test module.
struct Sizes {
  Index d_model = 6, n_heads = 2, n_kv_heads = 0, head_dim = 2, kdim = 0, vdim = 0;
  bool bias = true;
  std::optional<qkv::RopeOptions> rope;
};

template <class T>
Module<T> random_module(const Sizes& sizes, unsigned seed) {
  typename Module<T>::Config config;
  config.d_model = sizes.d_model;
  config.n_heads = sizes.n_heads;
  config.n_kv_heads = sizes.n_kv_heads;
  config.head_dim = sizes.head_dim;
  config.kdim = sizes.kdim;
  config.vdim = sizes.vdim;
  config.bias = sizes.bias;
  config.rope = sizes.rope;
  Module<T> mha(config);
  // Weights of about 1/√in, so that the scores are O(1) and the softmax is neither uniform nor saturated.
  mha.W_q = random_matrix<T>(mha.W_q.rows(), mha.W_q.cols(), seed, 0.8);
  mha.W_k = random_matrix<T>(mha.W_k.rows(), mha.W_k.cols(), seed + 1, 0.8);
  mha.W_v = random_matrix<T>(mha.W_v.rows(), mha.W_v.cols(), seed + 2, 0.5);
  mha.W_o = random_matrix<T>(mha.W_o.rows(), mha.W_o.cols(), seed + 3, 0.5);
  if (sizes.bias) {
    mha.b_q = random_matrix<T>(mha.b_q.size(), 1, seed + 4, 0.3);
    mha.b_k = random_matrix<T>(mha.b_k.size(), 1, seed + 5, 0.3);
    mha.b_v = random_matrix<T>(mha.b_v.size(), 1, seed + 6, 0.3);
    mha.b_o = random_matrix<T>(mha.b_o.size(), 1, seed + 7, 0.3);
  }
  return mha;
}

/// Which forward form a case runs.
enum class Form { self, cross, three };

/// The inputs of a case (X_k and X_v unused by the self form, X_v unused by the two-input form).
struct Inputs {
  Matrix<double> X_q, X_k, X_v, dY;
};

Matrix<double> run_forward(const Module<double>& mha, Form form, const Inputs& in,
                           const qkv::AttentionOptions<double>& options) {
  switch (form) {
    case Form::self:
      return mha.forward(in.X_q, options);
    case Form::cross:
      return mha.forward(in.X_q, in.X_k, options);
    case Form::three:
      break;
  }
  return mha.forward(in.X_q, in.X_k, in.X_v, options);
}

template <class T>
typename Module<T>::Gradients run_backward(const Module<T>& mha, Form form, const Matrix<T>& X_q, const Matrix<T>& X_k,
                                           const Matrix<T>& X_v, const Matrix<T>& dY,
                                           const qkv::AttentionOptions<T>& options) {
  switch (form) {
    case Form::self:
      return mha.backward(X_q, dY, options);
    case Form::cross:
      return mha.backward(X_q, X_k, dY, options);
    case Form::three:
      break;
  }
  return mha.backward(X_q, X_k, X_v, dY, options);
}

/// The float64 central difference (L(x + h) − L(x − h)) / 2h of `loss` in every entry of `x`, x restored after.
template <class M>
M finite_difference(M& x, const std::function<double()>& loss) {
  constexpr double h = 1e-5;
  M gradient(x.rows(), x.cols());
  for (Index r = 0; r < x.rows(); ++r)
    for (Index c = 0; c < x.cols(); ++c) {
      const double saved = x(r, c);
      x(r, c) = saved + h;
      const double plus = loss();
      x(r, c) = saved - h;
      const double minus = loss();
      x(r, c) = saved;
      gradient(r, c) = (plus - minus) / (2 * h);
    }
  return gradient;
}

/// Accuracy rule of a gradient against its central difference: |analytic − difference| ≤ 1e-7·max(1, max |gradient|).
/// With h = 1e-5 the difference's truncation error is h²/6·|L'''| ≈ 2e-11·|L'''| and its rounding error about
/// ε·|L|/h ≈ 2e-11·|L|; on these problems (|L| and the derivatives O(1..10)) the largest measured error is 1.2e-9
/// relative, so 1e-7 leaves a factor of about 100 and still catches any wrong term (a missing path or a rotation not
/// taken back moves a gradient by O(1)).
template <class A, class B>
void expect_gradient(const char* name, const A& analytic, const B& difference) {
  ASSERT_EQ(analytic.rows(), difference.rows()) << name;
  ASSERT_EQ(analytic.cols(), difference.cols()) << name;
  if (analytic.size() == 0) return;
  const double scale = std::max(1.0, difference.cwiseAbs().maxCoeff());
  const double error = (analytic - difference).cwiseAbs().maxCoeff();
  EXPECT_LE(error, 1e-7 * scale) << name << ": max |analytic − finite difference| " << error << " (max |gradient| "
                                 << scale << ")";
  EXPECT_TRUE(analytic.allFinite()) << name;
}

/// A case: the module's sizes, the form, the row counts and the options.
struct Case {
  std::string name;
  Sizes sizes;
  Form form = Form::self;
  Index Tq = 5, Tk = 5;
  std::function<void(qkv::AttentionOptions<double>&)> set_options;
};

/// Runs a case: the module's backward (double, Backend::reference) against the central differences of every input
/// and every parameter.
void check_against_finite_differences(const Case& c, unsigned seed) {
  SCOPED_TRACE(c.name);
  Module<double> mha = random_module<double>(c.sizes, seed);
  const Index Tk = c.form == Form::self ? c.Tq : c.Tk;
  Inputs in;
  in.X_q = random_matrix<double>(c.Tq, mha.d_model(), seed + 10);
  in.X_k = random_matrix<double>(Tk, mha.kdim(), seed + 11);
  in.X_v = random_matrix<double>(Tk, mha.vdim(), seed + 12);
  in.dY = random_matrix<double>(c.Tq, mha.d_model(), seed + 13);
  qkv::AttentionOptions<double> options;
  options.backend = qkv::Backend::reference;
  if (c.set_options) c.set_options(options);

  const auto g = run_backward(mha, c.form, in.X_q, in.X_k, in.X_v, in.dY, options);
  const std::function<double()> loss = [&] { return run_forward(mha, c.form, in, options).cwiseProduct(in.dY).sum(); };

  expect_gradient("dW_q", g.dW_q, finite_difference(mha.W_q, loss));
  expect_gradient("dW_k", g.dW_k, finite_difference(mha.W_k, loss));
  expect_gradient("dW_v", g.dW_v, finite_difference(mha.W_v, loss));
  expect_gradient("dW_o", g.dW_o, finite_difference(mha.W_o, loss));
  expect_gradient("db_q", g.db_q, finite_difference(mha.b_q, loss));
  expect_gradient("db_k", g.db_k, finite_difference(mha.b_k, loss));
  expect_gradient("db_v", g.db_v, finite_difference(mha.b_v, loss));
  expect_gradient("db_o", g.db_o, finite_difference(mha.b_o, loss));
  EXPECT_EQ(g.dW_q.rows(), mha.W_q.rows());
  EXPECT_EQ(g.dW_o.cols(), mha.W_o.cols());
  EXPECT_EQ(g.db_q.size(), mha.b_q.size());
  EXPECT_EQ(g.db_o.size(), mha.b_o.size());

  switch (c.form) {
    case Form::self: {
      // X feeds the queries, keys and values at once: its difference is the gradient of the whole self-attention.
      expect_gradient("dX", g.dX, finite_difference(in.X_q, loss));
      expect_gradient("dX = dX_q + dX_k + dX_v", g.dX, g.dX_q + g.dX_k + g.dX_v);
      EXPECT_EQ(g.dX_kv.size(), 0);
      break;
    }
    case Form::cross: {
      expect_gradient("dX_q", g.dX_q, finite_difference(in.X_q, loss));
      expect_gradient("dX_kv", g.dX_kv, finite_difference(in.X_k, loss));
      expect_gradient("dX_kv = dX_k + dX_v", g.dX_kv, g.dX_k + g.dX_v);
      EXPECT_EQ(g.dX.size(), 0);
      break;
    }
    case Form::three: {
      expect_gradient("dX_q", g.dX_q, finite_difference(in.X_q, loss));
      expect_gradient("dX_k", g.dX_k, finite_difference(in.X_k, loss));
      expect_gradient("dX_v", g.dX_v, finite_difference(in.X_v, loss));
      EXPECT_EQ(g.dX.size(), 0);
      EXPECT_EQ(g.dX_kv.size(), 0);
      break;
    }
  }
}

Sizes sizes(Index d_model, Index n_heads, Index n_kv_heads, Index head_dim, bool bias = true,
            std::optional<qkv::RopeOptions> rope = std::nullopt, Index kdim = 0, Index vdim = 0) {
  Sizes s;
  s.d_model = d_model;
  s.n_heads = n_heads;
  s.n_kv_heads = n_kv_heads;
  s.head_dim = head_dim;
  s.bias = bias;
  s.rope = rope;
  s.kdim = kdim;
  s.vdim = vdim;
  return s;
}

qkv::RopeOptions interleaved_rope() {
  qkv::RopeOptions rope;
  rope.layout = qkv::RopeLayout::interleaved;
  rope.base = 100;  // angles that turn visibly within a few positions
  return rope;
}

qkv::RopeOptions rotate_half_rope() {
  qkv::RopeOptions rope;
  rope.base = 50;
  return rope;
}

const auto kCausal = [](qkv::AttentionOptions<double>& o) { o.causal = true; };

std::vector<Case> cases() {
  std::vector<Case> list;
  list.push_back({"self, MHA 2 heads, biases", sizes(6, 2, 2, 3), Form::self, 5, 5, nullptr});
  list.push_back({"self, no biases", sizes(6, 2, 2, 3, false), Form::self, 4, 4, nullptr});
  list.push_back({"self, GQA 4/2, causal", sizes(6, 4, 2, 2), Form::self, 5, 5, kCausal});
  list.push_back({"self, MQA 3/1, causal, RoPE rotate_half, no biases", sizes(5, 3, 1, 4, false, rotate_half_rope()),
                  Form::self, 6, 6, kCausal});
  list.push_back({"self, RoPE interleaved, GQA 4/2, biases", sizes(4, 4, 2, 2, true, interleaved_rope()), Form::self, 5,
                  5, nullptr});
  list.push_back({"self, varlen {0, 2, 2, 6} with RoPE and causal", sizes(6, 2, 1, 2, true, rotate_half_rope()),
                  Form::self, 6, 6, [](qkv::AttentionOptions<double>& o) {
                    o.causal = true;
                    o.cu_seqlens_q = {0, 2, 2, 6};
                    o.cu_seqlens_k = {0, 2, 2, 6};
                  }});
  list.push_back({"cross (X_q, X_kv), kdim = vdim = 5, GQA 4/2, RoPE, causal top-left",
                  sizes(6, 4, 2, 2, true, rotate_half_rope(), 5, 5), Form::cross, 3, 5,
                  [](qkv::AttentionOptions<double>& o) {
                    o.causal = true;
                    o.alignment = qkv::CausalAlignment::top_left;
                  }});
  list.push_back(
      {"cross (X_q, X_kv), no biases, bottom-right causal", sizes(6, 2, 2, 3, false), Form::cross, 2, 5, kCausal});
  list.push_back({"three inputs, kdim 5, vdim 7, GQA 2/1, biases", sizes(6, 2, 1, 3, true, std::nullopt, 5, 7),
                  Form::three, 4, 6, nullptr});
  list.push_back({"three inputs, RoPE interleaved, no biases", sizes(4, 2, 2, 2, false, interleaved_rope(), 3, 5),
                  Form::three, 3, 4, kCausal});
  list.push_back({"self, a row that sees no key (allowed), GQA", sizes(6, 2, 1, 3), Form::self, 4, 4,
                  [](qkv::AttentionOptions<double>& o) {
                    Matrix<bool> allowed = Matrix<bool>::Constant(4, 4, true);
                    allowed.row(1).setConstant(false);  // query 1 sees nothing: Y_1 = b_o
                    allowed(2, 0) = false;
                    o.set_allowed(std::move(allowed));
                  }});
  list.push_back({"self, window, ALiBi, softcap and sinks passed through", sizes(6, 2, 2, 3), Form::self, 6, 6,
                  [](qkv::AttentionOptions<double>& o) {
                    o.causal = true;
                    o.window_left = 2;
                    o.alibi_slopes = {0.5, 0.25};
                    o.softcap = 2.0;
                    o.sinks = {0.3, -0.7};
                    o.scale = 0.8;
                  }});
  list.push_back({"self, dropout 0.3 (same seed and offset in forward and backward), GQA 4/2, RoPE, causal",
                  sizes(6, 4, 2, 2, true, rotate_half_rope()), Form::self, 7, 7, [](qkv::AttentionOptions<double>& o) {
                    o.causal = true;
                    o.dropout_p = 0.3;
                    o.dropout_seed = 1234;
                    o.dropout_offset = 5;
                  }});
  list.push_back({"cross, dropout 0.5, varlen", sizes(6, 2, 2, 3, true, std::nullopt, 4, 4), Form::cross, 5, 6,
                  [](qkv::AttentionOptions<double>& o) {
                    o.dropout_p = 0.5;
                    o.dropout_seed = 99;
                    o.cu_seqlens_q = {0, 2, 5};
                    o.cu_seqlens_k = {0, 4, 6};
                  }});
  return list;
}

TEST(MultiHeadBackward, EveryGradientMatchesFiniteDifferences) {
  unsigned seed = 100;
  for (const Case& c : cases()) {
    check_against_finite_differences(c, seed);
    seed += 20;
  }
}

TEST(MultiHeadBackward, LossOfEveryRowSeesEveryPath) {
  // The gradients are not trivially zero: on the first case every parameter and input gets a non-zero gradient (the
  // finite differences above would also pass for a module that ignored a path only if that path had no effect).
  const Module<double> mha = random_module<double>(sizes(6, 2, 2, 3), 7);
  const Matrix<double> X = random_matrix<double>(5, 6, 8), dY = random_matrix<double>(5, 6, 9);
  const auto g = mha.backward(X, dY);
  for (const Matrix<double>* m : {&g.dX, &g.dX_q, &g.dX_k, &g.dX_v, &g.dW_q, &g.dW_k, &g.dW_v, &g.dW_o})
    EXPECT_GT(m->cwiseAbs().maxCoeff(), 1e-3);
  for (const Module<double>::Vector* v : {&g.db_q, &g.db_v, &g.db_o}) EXPECT_GT(v->cwiseAbs().maxCoeff(), 1e-3);
  // b_k shifts every score of a row by the same q·b_k: the softmax cannot see it, so its gradient is zero (up to
  // rounding), as in any attention layer.
  EXPECT_LE(g.db_k.cwiseAbs().maxCoeff(), 1e-12);
}

TEST(MultiHeadBackward, DropoutActsAndFollowsItsSeedAndOffset) {
  // The finite differences above hold the mask fixed through the seed and offset; here: the mask really drops (the
  // gradients differ from p = 0), a different offset draws a different mask (different gradients), and the same
  // options give the same gradients bit for bit (nothing is stored between calls).
  const Module<double> mha = random_module<double>(sizes(6, 2, 2, 3), 30);
  const Matrix<double> X = random_matrix<double>(8, 6, 31), dY = random_matrix<double>(8, 6, 32);
  qkv::AttentionOptions<double> options;
  options.dropout_p = 0.4;
  options.dropout_seed = 5;
  const auto a = mha.backward(X, dY, options);
  const auto again = mha.backward(X, dY, options);
  EXPECT_EQ(a.dX, again.dX);
  EXPECT_EQ(a.dW_q, again.dW_q);
  qkv::AttentionOptions<double> next = options;
  next.dropout_offset = 1;
  const auto b = mha.backward(X, dY, next);
  const auto none = mha.backward(X, dY);
  EXPECT_GT((a.dX - b.dX).cwiseAbs().maxCoeff(), 1e-3);
  EXPECT_GT((a.dW_v - none.dW_v).cwiseAbs().maxCoeff(), 1e-3);
  // p = 1 drops every weight: the attention output is zero, so only W_o's bias sees the loss.
  qkv::AttentionOptions<double> all = options;
  all.dropout_p = 1;
  const auto dropped = mha.backward(X, dY, all);
  EXPECT_EQ(dropped.dX.cwiseAbs().maxCoeff(), 0.0);
  EXPECT_EQ(dropped.dW_o.cwiseAbs().maxCoeff(), 0.0);
  EXPECT_LE((dropped.db_o - dY.colwise().sum().transpose()).cwiseAbs().maxCoeff(), 1e-14);
}

TEST(MultiHeadBackward, EmptyInputs) {
  const Module<double> mha = random_module<double>(sizes(6, 2, 2, 3), 11);
  const Matrix<double> X(0, 6), dY(0, 6);
  const auto g = mha.backward(X, dY);
  EXPECT_EQ(g.dX.rows(), 0);
  EXPECT_EQ(g.dX.cols(), 6);
  EXPECT_EQ(g.dW_q.rows(), 6);
  EXPECT_EQ(g.dW_q.cols(), 6);
  EXPECT_EQ(g.dW_q.cwiseAbs().maxCoeff(), 0.0);
  EXPECT_EQ(g.db_o.cwiseAbs().maxCoeff(), 0.0);
  // No keys (Tk = 0): every Y row is b_o, so only db_o gets a gradient: Σ_t dY_t.
  const Matrix<double> X_q = random_matrix<double>(3, 6, 12), X_kv(0, 6), dY3 = random_matrix<double>(3, 6, 13);
  const auto c = mha.backward(X_q, X_kv, dY3);
  EXPECT_EQ(c.dX_kv.rows(), 0);
  EXPECT_EQ(c.dX_q.cwiseAbs().maxCoeff(), 0.0);
  EXPECT_EQ(c.dW_o.cwiseAbs().maxCoeff(), 0.0);
  EXPECT_LE((c.db_o - dY3.colwise().sum().transpose()).cwiseAbs().maxCoeff(), 1e-15);
}

// ---- float ---------------------------------------------------------------------------------------------------------

/// The float module against the double one with the same weights (each rounded to float) on the same inputs (rounded
/// to float), every gradient. Rule: |g_float − g_double| ≤ 1e-5·S per entry, S = max(1, the largest |entry| of any
/// double gradient of the call). The scale is the call's, not each gradient's own: every gradient is assembled from
/// intermediates (dO, dS, dQ, dK, dV) of about that size, and db_k, zero in exact arithmetic (b_k shifts a row's
/// scores uniformly), is a sum of such terms that cancel. A float gradient is a chain of products and sums of
/// O(T + d_model + head_dim) terms; measured here: ≤ 1.4e-6·S on the fused path and ≤ 5e-7·S on the reference path, so
/// 1e-5 leaves a margin of 7 and still catches a wrong or missing term, which moves a gradient by O(S).
TEST(MultiHeadBackward, FloatMatchesDoubleWithinTheFloatRule) {
  struct FloatCase {
    const char* name;
    Sizes sizes;
    Form form;
    Index Tq, Tk;
    bool causal;
    qkv::Backend backend;
  };
  const FloatCase float_cases[] = {
      {"self, GQA 4/2, causal, fused/automatic", sizes(16, 4, 2, 8), Form::self, 19, 19, true, qkv::Backend::automatic},
      {"self, GQA 4/2, causal, reference", sizes(16, 4, 2, 8), Form::self, 19, 19, true, qkv::Backend::reference},
      {"self, RoPE, MHA, no biases", sizes(12, 3, 3, 4, false, rotate_half_rope()), Form::self, 33, 33, false,
       qkv::Backend::automatic},
      {"cross, kdim = vdim = 10", sizes(16, 2, 1, 8, true, std::nullopt, 10, 10), Form::cross, 7, 17, false,
       qkv::Backend::automatic},
      {"three inputs", sizes(8, 2, 2, 4, true, std::nullopt, 6, 5), Form::three, 5, 9, true, qkv::Backend::automatic},
  };
  unsigned seed = 500;
  for (const FloatCase& c : float_cases) {
    SCOPED_TRACE(c.name);
    const Module<double> reference = random_module<double>(c.sizes, seed);
    Module<float> mha(random_module<float>(c.sizes, seed));  // the same draws, rounded to float
    const Matrix<float> X_q = random_matrix<float>(c.Tq, mha.d_model(), seed + 1);
    const Matrix<float> X_k = random_matrix<float>(c.form == Form::self ? c.Tq : c.Tk, mha.kdim(), seed + 2);
    const Matrix<float> X_v = random_matrix<float>(X_k.rows(), mha.vdim(), seed + 3);
    const Matrix<float> dY = random_matrix<float>(c.Tq, mha.d_model(), seed + 4);
    Module<double> widened = reference;  // the float weights, exactly, in double
    widened.W_q = mha.W_q.cast<double>();
    widened.W_k = mha.W_k.cast<double>();
    widened.W_v = mha.W_v.cast<double>();
    widened.W_o = mha.W_o.cast<double>();
    widened.b_q = mha.b_q.cast<double>();
    widened.b_k = mha.b_k.cast<double>();
    widened.b_v = mha.b_v.cast<double>();
    widened.b_o = mha.b_o.cast<double>();
    qkv::AttentionOptions<float> options;
    options.causal = c.causal;
    options.backend = c.backend;
    qkv::AttentionOptions<double> options_d;
    options_d.causal = c.causal;
    const auto gf = run_backward(mha, c.form, X_q, X_k, X_v, dY, options);
    const auto gd =
        run_backward(widened, c.form, Matrix<double>(X_q.cast<double>()), Matrix<double>(X_k.cast<double>()),
                     Matrix<double>(X_v.cast<double>()), Matrix<double>(dY.cast<double>()), options_d);
    double scale = 1;
    for (const Matrix<double>* m :
         {&gd.dX, &gd.dX_kv, &gd.dX_q, &gd.dX_k, &gd.dX_v, &gd.dW_q, &gd.dW_k, &gd.dW_v, &gd.dW_o})
      if (m->size() > 0) scale = std::max(scale, m->cwiseAbs().maxCoeff());
    for (const Module<double>::Vector* v : {&gd.db_q, &gd.db_k, &gd.db_v, &gd.db_o})
      if (v->size() > 0) scale = std::max(scale, v->cwiseAbs().maxCoeff());
    const auto check = [scale](const char* name, const auto& f, const auto& d) {
      ASSERT_EQ(f.rows(), d.rows()) << name;
      ASSERT_EQ(f.cols(), d.cols()) << name;
      if (d.size() == 0) return;
      const double error = (f.template cast<double>() - d).cwiseAbs().maxCoeff();
      EXPECT_LE(error, 1e-5 * scale) << name << ": error " << error << ", largest |gradient| of the call " << scale;
      EXPECT_TRUE(f.allFinite()) << name;
    };
    check("dX", gf.dX, gd.dX);
    check("dX_kv", gf.dX_kv, gd.dX_kv);
    check("dX_q", gf.dX_q, gd.dX_q);
    check("dX_k", gf.dX_k, gd.dX_k);
    check("dX_v", gf.dX_v, gd.dX_v);
    check("dW_q", gf.dW_q, gd.dW_q);
    check("dW_k", gf.dW_k, gd.dW_k);
    check("dW_v", gf.dW_v, gd.dW_v);
    check("dW_o", gf.dW_o, gd.dW_o);
    check("db_q", gf.db_q, gd.db_q);
    check("db_k", gf.db_k, gd.db_k);
    check("db_v", gf.db_v, gd.db_v);
    check("db_o", gf.db_o, gd.db_o);
    seed += 10;
  }
}

// ---- errors --------------------------------------------------------------------------------------------------------

using qkv_test::expect_shape_error;

TEST(MultiHeadBackwardErrors, EveryThrow) {
  const Module<double> mha = random_module<double>(sizes(6, 2, 2, 3), 20);
  const Matrix<double> X = random_matrix<double>(4, 6, 21);
  expect_shape_error([&] { mha.backward(X, Matrix<double>(3, 6)); },
                     {"qkv::MultiHeadAttention::backward", "dY is 3 × 6, expected 4 × 6"});
  expect_shape_error([&] { mha.backward(X, Matrix<double>(4, 5)); }, {"dY is 4 × 5, expected 4 × 6"});
  expect_shape_error([&] { mha.backward(Matrix<double>(4, 5), Matrix<double>(4, 6)); },
                     {"X has 5 columns, expected d_model 6"});
  expect_shape_error([&] { mha.backward(X, X, Matrix<double>(2, 6)); }, {"dY is 2 × 6, expected 4 × 6"});
  expect_shape_error([&] { mha.backward(X, Matrix<double>(3, 6), Matrix<double>(2, 6), X); },
                     {"X_v has 2 rows, expected 3 (the rows of X_k)"});
  qkv::AttentionOptions<double> varlen;
  varlen.cu_seqlens_q = {0, 2, 5};
  varlen.cu_seqlens_k = {0, 2, 5};
  expect_shape_error([&] { mha.backward(X, X, varlen); }, {"cu_seqlens_q"});

  // kdim ≠ d_model: the self-attention form needs one input of every width; kdim ≠ vdim: the two-input form.
  const Module<double> cross = random_module<double>(sizes(6, 2, 2, 3, true, std::nullopt, 5, 7), 22);
  expect_shape_error([&] { cross.backward(X, X); }, {"kdim = vdim = d_model", "kdim is 5"});
  expect_shape_error([&] { cross.backward(X, Matrix<double>(3, 5), X); }, {"kdim = vdim", "vdim is 7"});

  // A KV-cache call is not differentiated.
  qkv::KVCache<double> cache = mha.make_cache(8);
  mha.forward(X, cache);
  expect_shape_error([&] { mha.backward(X.topRows(1), cache, Matrix<double>(1, 6)); },
                     {"qkv::MultiHeadAttention::backward", "KV-cache", "not differentiated"});
  EXPECT_EQ(cache.length(), 4);

  // A weight assigned a wrong shape.
  Module<double> broken = mha;
  broken.W_o = Matrix<double>::Zero(5, 6);
  expect_shape_error([&] { broken.backward(X, X); }, {"W_o is 5 × 6"});
}

}  // namespace

// ---- dropout in a KV-cache step ---------------------------------------------------------------------------------------

TEST(ModuleDropout, CachedStepsDrawTheMaskOfOneForwardOverAllTokens) {
  // forward(X_new, cache) keys the dropout mask of its new rows at their positions L … L + T_new − 1, so decoding
  // token by token (and in chunks) gives the rows of one causal forward over all the tokens with the same options,
  // mask included (double, reference path: the same arithmetic up to rounding).
  const Module<double> mha = random_module<double>(Sizes{8, 4, 2, 2, 0, 0, true, std::nullopt}, 41);
  const Matrix<double> X = random_matrix<double>(9, 8, 43, 1.0);
  qkv::AttentionOptions<double> options;
  options.causal = true;
  options.dropout_p = 0.4;
  options.dropout_seed = 77;
  options.dropout_offset = 3;
  const Matrix<double> whole = mha.forward(X, options);
  qkv::KVCache<double> cache = mha.make_cache(9);
  Matrix<double> stepped(9, 8);
  stepped.topRows(4) = mha.forward(X.topRows(4), cache, options);  // a chunk, then one token at a time
  for (Index t = 4; t < 9; ++t) stepped.row(t) = mha.forward(X.row(t), cache, options);
  EXPECT_LE((stepped - whole).cwiseAbs().maxCoeff(), 1e-12 * std::max(1.0, whole.cwiseAbs().maxCoeff()));
  // And the mask matters: without it the rows differ.
  qkv::AttentionOptions<double> no_dropout = options;
  no_dropout.dropout_p = 0.0;
  EXPECT_GT((mha.forward(X, no_dropout) - whole).cwiseAbs().maxCoeff(), 1e-3);
}
