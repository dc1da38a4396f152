// qkv/softmax.hpp — stable row softmax, log-sum-exp, entropy, and the merge of two (out, lse) states.
#pragma once

#include <cmath>
#include <limits>

#include "qkv/config.hpp"

namespace qkv {

/// Row-wise softmax p_ij = exp(s_ij − m_i) / Σ_j exp(s_ij − m_i), m_i = max_j s_ij (the max is subtracted
/// first, so finite scores of any magnitude give finite weights).
///
/// Shapes: scores R × C (any Eigen expression) → R × C row-major. Entries of −∞ get weight 0; a row of only
/// −∞ (or with C = 0) gets zeros, not NaN. A NaN or a +∞ in a row makes that row NaN (∞ − ∞ is undefined);
/// other rows are unaffected.
/// Complexity O(R·C), one allocation (the result). Source: seed 000 定义 2.4.1 (softmax along the key axis).
template <class Derived>
Matrix<typename Derived::Scalar> softmax_rows(const Eigen::MatrixBase<Derived>& scores) {
  using Scalar = typename Derived::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  Matrix<Scalar> p = scores;
  for (Index i = 0; i < p.rows(); ++i) {
    Scalar m = kNegInf;
    bool has_nan = false;
    for (Index j = 0; j < p.cols(); ++j) {
      has_nan |= std::isnan(p(i, j));
      m = std::max(m, p(i, j));
    }
    if (m == kNegInf && !has_nan) {
      p.row(i).setZero();
      continue;
    }
    Scalar sum = 0;
    for (Index j = 0; j < p.cols(); ++j) {
      p(i, j) = p(i, j) == kNegInf ? Scalar(0) : std::exp(p(i, j) - m);
      sum += p(i, j);
    }
    p.row(i) /= sum;
  }
  return p;
}

/// Row-wise log-sum-exp lse_i = log Σ_j exp(s_ij), computed as m_i + log Σ_j exp(s_ij − m_i).
///
/// Shapes: scores R × C → a column vector of R. A row of only −∞ (or C = 0) gives −∞ (the log of an empty
/// sum). NaN propagates to its row. Complexity O(R·C).
template <class Derived>
Eigen::Matrix<typename Derived::Scalar, Eigen::Dynamic, 1> log_sum_exp_rows(const Eigen::MatrixBase<Derived>& scores) {
  using Scalar = typename Derived::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const auto& s = scores.derived();
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> lse(s.rows());
  for (Index i = 0; i < s.rows(); ++i) {
    Scalar m = kNegInf;
    bool has_nan = false;
    for (Index j = 0; j < s.cols(); ++j) {
      has_nan |= std::isnan(s(i, j));
      m = std::max(m, Scalar(s(i, j)));
    }
    if (has_nan) {
      lse(i) = std::numeric_limits<Scalar>::quiet_NaN();
      continue;
    }
    if (m == kNegInf || m == -kNegInf) {
      lse(i) = m;
      continue;
    }
    Scalar sum = 0;
    for (Index j = 0; j < s.cols(); ++j) sum += std::exp(Scalar(s(i, j)) - m);
    lse(i) = m + std::log(sum);
  }
  return lse;
}

/// Row-wise entropy H_i = −Σ_j p_ij·ln p_ij of weights (natural log, nats; 0·ln 0 = 0).
///
/// Shapes: weights R × C, each row a distribution → a column vector of R. Uniform weights over n keys give
/// ln n; a one-hot row gives 0. Used to see softmax saturation (seed 000 定理 2.4.1: larger score scales give
/// sharper, lower-entropy rows) and to summarize heads (seed 000 §2.4.7). Complexity O(R·C).
template <class Derived>
Eigen::Matrix<typename Derived::Scalar, Eigen::Dynamic, 1> row_entropy(const Eigen::MatrixBase<Derived>& weights) {
  using Scalar = typename Derived::Scalar;
  const auto& p = weights.derived();
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> h(p.rows());
  for (Index i = 0; i < p.rows(); ++i) {
    Scalar sum = 0;
    for (Index j = 0; j < p.cols(); ++j) {
      const Scalar x = p(i, j);
      if (x > Scalar(0)) sum -= x * std::log(x);
    }
    h(i) = sum;
  }
  return h;
}

namespace detail {

/// Merges two attention states of the same query over disjoint key sets (split-K, key shards):
///
///     lse = log(exp(lse_a) + exp(lse_b))
///     out = exp(lse_a − lse)·out_a + exp(lse_b − lse)·out_b
///
/// A state with lse_a = −∞ (it saw no key) contributes nothing and its `out_a` is not read; two such states
/// give zeros and −∞. `out` may be the same memory as `out_a` (each element is read before it is written).
/// Dv elements per state, contiguous. Public, checked form: `qkv::merge_attention_states` (attention.hpp).
template <class T>
void merge_state(const T* out_a, T lse_a, const T* out_b, T lse_b, T* out, T& lse, Index Dv) noexcept {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  if (lse_b == kNegInf) {
    for (Index d = 0; d < Dv; ++d) out[d] = lse_a == kNegInf ? T(0) : out_a[d];
    lse = lse_a;
    return;
  }
  if (lse_a == kNegInf) {
    for (Index d = 0; d < Dv; ++d) out[d] = out_b[d];
    lse = lse_b;
    return;
  }
  // The weights come from the difference of the two lse alone, as 1 / (1 + e) and e / (1 + e) with
  // e = exp(−|lse_a − lse_b|) ≤ 1. Forming exp(lse_a − lse) from the rounded merged lse instead would lose
  // |lse|·2^-24 of relative accuracy (2e-6 in float at |lse| ≈ 40; fuzz/README.md, finding 2).
  // NaN in either lse propagates through e.
  const bool a_larger = lse_a >= lse_b;
  const T e = std::exp(-std::abs(lse_a - lse_b));
  const T weight_larger = T(1) / (T(1) + e), weight_smaller = e * weight_larger;
  const T weight_a = a_larger ? weight_larger : weight_smaller, weight_b = a_larger ? weight_smaller : weight_larger;
  const T merged = std::max(lse_a, lse_b) + std::log1p(e);
  for (Index d = 0; d < Dv; ++d) out[d] = weight_a * out_a[d] + weight_b * out_b[d];
  // A NaN lse is the one quiet NaN: the sign of a sum of two NaNs follows the operand order the compiler picked.
  lse = std::isnan(merged) ? std::numeric_limits<T>::quiet_NaN() : merged;
}

}  // namespace detail
}  // namespace qkv
