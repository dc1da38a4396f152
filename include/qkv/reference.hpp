// qkv/reference.hpp — the materialized attention path in plain Eigen, accumulating in double.
//
// This is the executable specification: every fast path is tested against it. It forms the scores
// S = Q·Kᵀ of one (sequence, query head) in double, decides visibility with `HeadMask` (mask.hpp), takes a
// stable softmax over the visible keys and multiplies by V, also in double. Memory O(Sq·Skv) per head;
// `Backend::reference` selects it.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/mask.hpp"

namespace qkv {
namespace reference {

/// Accumulation type of the reference path.
using Acc = double;
using AccMatrix = Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using AccVector = Eigen::Matrix<Acc, Eigen::Dynamic, 1>;

/// Weights and log-sum-exp of one (sequence, query head), in double.
///
///     P_ij = exp(s_ij − lse_i) for visible (i, j), 0 otherwise;  lse_i = log(Σ_visible exp(s_ij) + exp(sink))
///
/// Shapes: q Sq × D, k Skv × D (any Eigen expressions; only the first `mask.geometry.skv` rows of k are read);
/// on return `weights` is Sq × k.rows() and `lse` has Sq entries. `sink` is the head's sink logit, or −∞ for
/// none. A row with no visible key (and no sink) gets zeros and lse = −∞; with a sink, zeros and lse = sink.
/// A NaN or +∞ among a row's visible scores makes that row's weights and lse NaN. Hidden keys are selected
/// away, never multiplied by zero. Complexity O(Sq·Skv·D); allocates the Sq × Skv scores.
template <class T, class QDerived, class KDerived>
void head_weights(const Eigen::MatrixBase<QDerived>& q, const Eigen::MatrixBase<KDerived>& k, const HeadMask<T>& mask,
                  Acc sink, AccMatrix& weights, AccVector& lse) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  constexpr Acc kNaN = std::numeric_limits<Acc>::quiet_NaN();
  const Index sq = q.rows(), skv = mask.geometry.skv;
  weights.setZero(sq, k.rows());
  lse.resize(sq);
  const AccMatrix dots = q.template cast<Acc>() * k.topRows(skv).template cast<Acc>().transpose();
  for (Index i = 0; i < sq; ++i) {
    auto row = weights.row(i);
    // Scores of the visible keys; −∞ marks a hidden key (selected away below, never multiplied by zero).
    Acc m = sink;
    bool undefined = false;
    for (Index j = 0; j < skv; ++j) {
      const Acc s = mask.visible(i, j) ? mask.score(dots(i, j), i, j) : kNegInf;
      row(j) = s;
      undefined |= std::isnan(s);
      m = std::max(m, s);
    }
    if (undefined || m == -kNegInf) {  // NaN or +∞ among the visible scores: this row is undefined
      for (Index j = 0; j < skv; ++j) row(j) = row(j) == kNegInf ? Acc(0) : kNaN;
      lse(i) = kNaN;
      continue;
    }
    if (m == kNegInf) {  // no visible key and no sink
      row.setZero();
      lse(i) = kNegInf;
      continue;
    }
    Acc sum = sink == kNegInf ? Acc(0) : std::exp(sink - m);
    for (Index j = 0; j < skv; ++j) {
      row(j) = row(j) == kNegInf ? Acc(0) : std::exp(row(j) - m);
      sum += row(j);
    }
    row /= sum;
    lse(i) = m + std::log(sum);  // = sink when only the sink is visible
  }
}

/// One (sequence, query head) of attention: out = P·V with P from `head_weights`, in double, then rounded to T.
///
/// Shapes: q Sq × D, k Skv × D, v Skv × Dv (only the first `mask.geometry.skv` rows of k and v are read),
/// out Sq × Dv (written, never read); `lse` null or Sq entries spaced `lse_stride` apart. A V row is read
/// only where its weight is visible: NaN or ∞ stored in a hidden value slot cannot reach the output.
/// Complexity O(Sq·Skv·(D + Dv)); allocates O(Sq·Skv).
template <class T, class QDerived, class KDerived, class VDerived, class OutDerived>
void head_attention(const Eigen::MatrixBase<QDerived>& q, const Eigen::MatrixBase<KDerived>& k,
                    const Eigen::MatrixBase<VDerived>& v, const HeadMask<T>& mask, Acc sink,
                    const Eigen::MatrixBase<OutDerived>& out_expression, T* lse, Index lse_stride) {
  auto& out = const_cast<Eigen::MatrixBase<OutDerived>&>(out_expression);  // Eigen's idiom for writable blocks
  const Index sq = q.rows(), skv = mask.geometry.skv;
  AccMatrix weights;
  AccVector row_lse;
  head_weights(q, k, mask, sink, weights, row_lse);
  AccMatrix values = v.topRows(skv).template cast<Acc>();
  // Value rows holding NaN or ∞ are zeroed for the product and summed separately for the rows that give them a
  // non-zero weight (NaN weights included, so an undefined row stays undefined). Hidden weights are exactly 0, so
  // hidden slots are never read, and a row that reads no such value gets the same product, to the bit, as if those
  // slots held any finite number (NaN elsewhere changes no other row, not even its rounding).
  std::vector<Index> bad_rows;
  for (Index j = 0; j < skv; ++j) {
    if (!values.row(j).allFinite()) bad_rows.push_back(j);
  }
  // One evaluation for both cases, so the rounding of a row cannot depend on whether another row saw a bad value.
  const AccMatrix bad_values = values(bad_rows, Eigen::all);
  for (Index j : bad_rows) values.row(j).setZero();
  AccMatrix product = weights.leftCols(skv) * values;
  for (std::size_t n = 0; n < bad_rows.size(); ++n) {
    for (Index i = 0; i < sq; ++i) {
      const Acc weight = weights(i, bad_rows[n]);
      if (weight != Acc(0)) product.row(i) += weight * bad_values.row(static_cast<Index>(n));
    }
  }
  out = product.template cast<T>();
  if (lse != nullptr) {
    for (Index i = 0; i < sq; ++i) lse[i * lse_stride] = static_cast<T>(row_lse(i));
  }
}

}  // namespace reference
}  // namespace qkv
