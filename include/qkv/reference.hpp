// qkv/reference.hpp — the materialized attention path in plain Eigen, accumulating in double.
//
// This is the executable specification: every fast path is tested against it. It forms the scores
// S = Q·Kᵀ of one (sequence, query head) in double, decides visibility with `HeadMask` (mask.hpp), takes a
// stable softmax over the visible keys, drops weights where the call asks for dropout (dropout.hpp) and multiplies by
// V, also in double. Memory O(Sq·Skv) per head; `Backend::reference` selects it.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/dropout.hpp"
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

/// Where one (sequence, query head) sits for dropout (dropout.hpp): the call's rule, the sequence index (batch index,
/// or varlen sequence index), the query head, and the positions in the sequence of its first query row and first key
/// row (global positions with `options.global_positions`). A null or inactive rule drops nothing.
template <class T>
struct HeadDropout {
  const detail::DropoutRule<T>* rule = nullptr;
  Index sequence = 0, h = 0, q_begin = 0, k_begin = 0;
};

/// Dropout on the weights of `head_weights`, in place: weight (i, j), j < skv, is kept and scaled by 1/(1 − p) (in
/// double) or set to exactly 0, as `dropout.rule` decides for (sequence, h, q_begin + i, k_begin + j). Rows whose lse
/// is NaN (undefined: NaN or +∞ among their visible scores) stay NaN, as the fused kernel's do; rows that see no key
/// stay zero. Complexity O(Sq·Skv) (one Philox call per 4 weights); no allocation.
template <class T>
void drop_weights(const HeadDropout<T>& dropout, Index skv, AccMatrix& weights, const AccVector& lse) {
  if (dropout.rule == nullptr || !dropout.rule->active() || skv <= 0) return;
  for (Index i = 0; i < weights.rows(); ++i) {
    if (std::isnan(lse(i)) || lse(i) == -std::numeric_limits<Acc>::infinity()) continue;
    dropout.rule->apply_row(dropout.sequence, dropout.h, dropout.q_begin + i, dropout.k_begin, skv, &weights(i, 0));
  }
}

/// One (sequence, query head) of attention: out = P·V with P from `head_weights`, in double, then rounded to T.
///
/// Shapes: q Sq × D, k Skv × D, v Skv × Dv (only the first `mask.geometry.skv` rows of k and v are read),
/// out Sq × Dv (written, never read); `lse` null or Sq entries spaced `lse_stride` apart. With an active `dropout`,
/// P is dropped as `drop_weights` says before the product, and lse stays the undropped softmax's. A V row is read
/// only where its weight is non-zero: NaN or ∞ stored in a hidden or dropped value slot cannot reach the output.
/// Complexity O(Sq·Skv·(D + Dv)); allocates O(Sq·Skv).
template <class T, class QDerived, class KDerived, class VDerived, class OutDerived>
void head_attention(const Eigen::MatrixBase<QDerived>& q, const Eigen::MatrixBase<KDerived>& k,
                    const Eigen::MatrixBase<VDerived>& v, const HeadMask<T>& mask, Acc sink,
                    const Eigen::MatrixBase<OutDerived>& out_expression, T* lse, Index lse_stride,
                    const HeadDropout<T>& dropout = HeadDropout<T>()) {
  auto& out = const_cast<Eigen::MatrixBase<OutDerived>&>(out_expression);  // Eigen's idiom for writable blocks
  const Index sq = q.rows(), skv = mask.geometry.skv;
  AccMatrix weights;
  AccVector row_lse;
  head_weights(q, k, mask, sink, weights, row_lse);
  drop_weights(dropout, skv, weights, row_lse);
  AccMatrix values = v.topRows(skv).template cast<Acc>();
  // Value rows holding NaN or ∞ are zeroed for the product and summed separately for the rows that give them a
  // non-zero weight (NaN weights included, so an undefined row stays undefined). Hidden and dropped weights are
  // exactly 0, so those slots are never read, and a row that reads no such value gets the same product, to the bit, as
  // if those slots held any finite number (NaN elsewhere changes no other row, not even its rounding).
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
