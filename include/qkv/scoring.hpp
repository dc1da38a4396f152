// qkv/scoring.hpp — the seed's classic attention scores (seed 000 §2.4.2): additive (Bahdanau) and Luong's dot,
// general and concat, over all decoder steps at once.
//
// Each class holds its parameters and, for decoder states S (one state per row: row t is the state s_{t−1} that
// queries at decoder step t) and encoder states H (one per row: row j is h_j), computes
//
//     e = scores (steps × T),   α = softmax(e) along the encoder axis (each row sums to 1),   c = α·H (steps × d_h).
//
// Rows are tokens and weights are stored [in, out], as everywhere in qkv. The seed writes column vectors and
// [out, in] matrices; the mapping (a row of S is s_{t−1}ᵀ, a row of H is h_jᵀ):
//
//     score     seed (columns)                         qkv (rows)
//     additive  v_aᵀ tanh(W_s s_{t−1} + W_h h_j)      tanh(s·W_s + h·W_h)·v_a    W_s = seed W_sᵀ (d_s × d_a),
//                                                                                W_h = seed W_hᵀ (d_h × d_a)
//     dot       s_{t−1}ᵀ h_j                           s·hᵀ                       no parameters (d_s = d_h)
//     general   s_{t−1}ᵀ W_a h_j                       s·W_a·hᵀ                   W_a = seed W_a, unchanged (d_s × d_h)
//     concat    v_aᵀ tanh(W_a [s_{t−1}; h_j])         tanh([s, h]·W_a)·v_a       W_a = seed W_aᵀ ((d_s + d_h) × d_a)
//
// Concat and additive are the same function (seed 000 定义 2.4.3, "与加性注意力等价"): [s, h]·W_a = s·W_a_top +
// h·W_a_bottom, so concat with W_a = [W_s; W_h] (W_s stacked above W_h; the seed's column form reads W_a = [W_s, W_h])
// equals additive with those W_s, W_h. Dot is scaled dot-product attention with scale 1 and V = K = H.
//
// Shapes (names used below): steps = rows of S, T = rows of H, d_s = columns of S, d_h = columns of H, d_a = the
// attention (hidden) width of the additive scorers.
//
// Masks (`ScoringOptions`): `key_lengths` = {L} marks encoder positions j ≥ L as padding; `allowed` (true = may
// attend) hides single (step, position) pairs. A hidden position gets e = −∞, α = 0 and is never read into the
// arithmetic (its row of H may hold NaN); a step that sees no position gets α = 0 and c = 0 (never NaN).
//
// Sources: seed 000 §2.4.2 (定义 2.4.2, 定义 2.4.3); Bahdanau, Cho & Bengio 2015, "Neural Machine Translation by
// Jointly Learning to Align and Translate" (additive); Luong, Pham & Manning 2015, "Effective Approaches to
// Attention-based Neural Machine Translation" (dot, general, concat).
#pragma once

#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/errors.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

/// Masks of a classic-score call (one decoder sequence S against one encoder sequence H).
///
/// `key_lengths`: empty, or one length L in [0, T]: encoder positions j ≥ L are padding (right padding), as
/// `AttentionOptions::key_lengths` on the Eigen entry points. `allowed`: empty, or a boolean view of extents
/// [1, 1, steps or 1, T], true = may attend (an extent-1 step axis broadcasts: one padding row for every step);
/// built implicitly from a row-major Eigen bool matrix lvalue (steps × T or 1 × T), which the caller keeps alive.
struct ScoringOptions {
  std::vector<Index> key_lengths;
  TensorView4<const bool> allowed;
};

/// The result of a classic-score call: e (steps × T, −∞ at hidden positions), α = softmax(e) along the encoder
/// axis (steps × T; rows sum to 1, or are all 0 for a step that sees no position) and c = α·H (steps × d_h).
template <class Scalar>
struct ScoredAttention {
  Matrix<Scalar> scores;
  Matrix<Scalar> weights;
  Matrix<Scalar> context;
};

namespace detail {

/// A row-major, unit-inner-stride matrix bound to any Eigen expression (copied into a temporary if needed).
template <class Scalar>
using ScoringRef = Eigen::Ref<const Matrix<Scalar>, 0, Eigen::OuterStride<>>;

template <class Scalar, class Derived>
constexpr void check_scoring_scalar() {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "qkv: the classic scores support float and double");
  static_assert(std::is_same_v<typename Derived::Scalar, Scalar>, "qkv: the states must have the scorer's scalar type");
}

/// Checks the masks against steps × T and returns the number of leading positions that are not padding.
inline Index check_scoring_options(const char* function, const ScoringOptions& options, Index steps, Index T) {
  check_shape(options.key_lengths.size() <= 1, function, ": options.key_lengths has ", options.key_lengths.size(),
              " entries, expected 0 or 1 (one encoder sequence)");
  Index length = T;
  if (!options.key_lengths.empty()) {
    length = options.key_lengths[0];
    check_shape(length >= 0 && length <= T, function, ": options.key_lengths[0] is ", length,
                ", expected a length in [0, ", T, "] (the rows of H)");
  }
  const TensorView4<const bool>& a = options.allowed;
  // "No mask" is the default view (null data, every extent 0). A view with an extent 0 where steps or T is not 0 is
  // a wrong shape, not "no mask": the checks below reject it.
  bool unset = a.data() == nullptr;
  for (Index e : a.extents()) unset = unset && e == 0;
  if (unset) return length;
  check_shape(a.empty() || a.data() != nullptr, function, ": options.allowed has ", a.size(),
              " elements but null data");
  check_shape(a.extent(0) == 1, function, ": options.allowed axis 0 (B) has extent ", a.extent(0), ", expected 1");
  check_shape(a.extent(1) == 1, function, ": options.allowed axis 1 (H) has extent ", a.extent(1), ", expected 1");
  check_shape(a.extent(2) == steps || a.extent(2) == 1, function, ": options.allowed axis 2 (steps) has extent ",
              a.extent(2), ", expected ", steps, " (the rows of S) or 1");
  check_shape(a.extent(3) == T, function, ": options.allowed axis 3 (T) has extent ", a.extent(3), ", expected ", T,
              " (the rows of H)");
  check_shape(a.extent(3) <= 1 || a.stride(3) == 1, function, ": options.allowed axis 3 (T) has stride ", a.stride(3),
              ", expected 1");
  check_shape(a.extent(2) <= 1 || a.stride(2) >= 0, function, ": options.allowed axis 2 (steps) has negative stride ",
              a.stride(2));
  return length;
}

inline bool scoring_allowed(const ScoringOptions& options, Index t, Index j) {
  const TensorView4<const bool>& a = options.allowed;
  return a.empty() || a(0, 0, a.extent(2) == 1 ? 0 : t, j);
}

/// e(t, j) = Σ_a v_a(a)·tanh(A_s(t, a) + A_h(j, a)) for j < length, −∞ for length ≤ j < T (the masks are
/// applied later), with A_s = S·W_s (steps × d_a) and A_h = h[0, length)·W_h (length × d_a); e is steps × T, T the
/// rows of h. W_s and W_h may be blocks of one matrix (the concat score). One length × d_a scratch;
/// O(steps·length·d_a) tanh.
template <class Scalar, class DS, class WS, class WH>
Matrix<Scalar> additive_scores(const Eigen::MatrixBase<DS>& S, const WS& W_s, const ScoringRef<Scalar>& h,
                               const WH& W_h, const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>& v_a, Index length) {
  const Matrix<Scalar> A_s = S * W_s, A_h = h.topRows(length) * W_h;
  Matrix<Scalar> e = Matrix<Scalar>::Constant(A_s.rows(), h.rows(), -std::numeric_limits<Scalar>::infinity());
  Matrix<Scalar> hidden(length, A_h.cols());
  for (Index t = 0; t < A_s.rows(); ++t) {
    hidden = (A_h.topRows(length).rowwise() + A_s.row(t)).array().tanh();
    e.row(t).head(length) = (hidden * v_a).transpose();
  }
  return e;
}

/// Applies the masks to e (−∞ at hidden positions: selected, never multiplied); then, if `with_weights`,
/// α = softmax(e) along the encoder axis and c = α·H over the visible positions only.
template <class Scalar>
ScoredAttention<Scalar> finish_scoring(Matrix<Scalar> e, const ScoringRef<Scalar>& H, const ScoringOptions& options,
                                       Index length, bool with_weights) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index steps = e.rows(), T = e.cols();
  for (Index t = 0; t < steps; ++t)
    for (Index j = 0; j < T; ++j)
      if (j >= length || !scoring_allowed(options, t, j)) e(t, j) = kNegInf;
  ScoredAttention<Scalar> result;
  if (!with_weights) {
    result.scores = std::move(e);
    return result;
  }
  result.weights = softmax_rows(e);
  result.scores = std::move(e);
  if (options.allowed.empty()) {
    result.context.noalias() = result.weights.leftCols(length) * H.topRows(length);
  } else {
    result.context = Matrix<Scalar>::Zero(steps, H.cols());
    for (Index t = 0; t < steps; ++t)
      for (Index j = 0; j < length; ++j)
        if (scoring_allowed(options, t, j)) result.context.row(t) += result.weights(t, j) * H.row(j);
  }
  return result;
}

inline void check_scoring_width(const char* function, const char* argument, Index cols, const char* name,
                                Index expected, const char* from) {
  check_shape(cols == expected, function, ": ", argument, " has ", cols, " columns, expected ", name, " ", expected,
              " (", from, ")");
}

inline void check_scoring_dims(const char* function, Index d_s, Index d_h, Index d_a) {
  check_shape(d_s >= 1, function, ": d_s is ", d_s, ", expected at least 1");
  check_shape(d_h >= 1, function, ": d_h is ", d_h, ", expected at least 1");
  check_shape(d_a >= 1, function, ": d_a is ", d_a, ", expected at least 1");
}

/// e = X·hᵀ over the first `length` rows of h, −∞ for length ≤ j < T (the masks are applied later): the dot score
/// (X = S) and the general one (X = S·W_a). X is steps × d_h; e is steps × T.
template <class Scalar, class DX>
Matrix<Scalar> dot_scores(const Eigen::MatrixBase<DX>& X, const ScoringRef<Scalar>& h, Index length) {
  Matrix<Scalar> e = Matrix<Scalar>::Constant(X.rows(), h.rows(), -std::numeric_limits<Scalar>::infinity());
  e.leftCols(length).noalias() = X * h.topRows(length).transpose();
  return e;
}

/// The function names a scorer's `scores` and `forward` report in their messages.
struct ScorerNames {
  const char* scores;
  const char* forward;
};

inline constexpr ScorerNames kAdditiveNames{"qkv::AdditiveAttention::scores", "qkv::AdditiveAttention::forward"};
inline constexpr ScorerNames kDotNames{"qkv::DotAttention::scores", "qkv::DotAttention::forward"};
inline constexpr ScorerNames kGeneralNames{"qkv::GeneralAttention::scores", "qkv::GeneralAttention::forward"};
inline constexpr ScorerNames kConcatNames{"qkv::ConcatAttention::scores", "qkv::ConcatAttention::forward"};

/// The public `scores` and `forward` of the classic scorers, written once (CRTP: `Scorer` derives from this and
/// befriends it). `Scorer` supplies `check_inputs(function, d_s, d_h)` for its weights and the widths of S and H
/// (checked before the masks) and `raw_scores(S, h, length)`: e before the masks, −∞ at positions j ≥ length.
template <class Scorer, class Scalar, const ScorerNames& kNames>
class ClassicScores {
 public:
  /// The scores e (steps × T): the scorer's score at visible positions, −∞ at hidden ones (α and c are not
  /// computed). Shapes, throws and complexity as `forward`.
  template <class DS, class DH>
  Matrix<Scalar> scores(const Eigen::MatrixBase<DS>& S, const Eigen::MatrixBase<DH>& H,
                        const ScoringOptions& options = ScoringOptions()) const {
    return evaluate(kNames.scores, S, H, options, false).scores;
  }

  /// Scores, weights and contexts of every decoder step at once (see the scorer's class comment).
  template <class DS, class DH>
  ScoredAttention<Scalar> forward(const Eigen::MatrixBase<DS>& S, const Eigen::MatrixBase<DH>& H,
                                  const ScoringOptions& options = ScoringOptions()) const {
    return evaluate(kNames.forward, S, H, options, true);
  }

 private:
  template <class DS, class DH>
  ScoredAttention<Scalar> evaluate(const char* function, const Eigen::MatrixBase<DS>& S, const Eigen::MatrixBase<DH>& H,
                                   const ScoringOptions& options, bool with_weights) const {
    check_scoring_scalar<Scalar, DS>();
    check_scoring_scalar<Scalar, DH>();
    const Scorer& scorer = static_cast<const Scorer&>(*this);
    scorer.check_inputs(function, S.cols(), H.cols());
    const Index length = check_scoring_options(function, options, S.rows(), H.rows());
    const ScoringRef<Scalar> h = H.derived();
    return finish_scoring<Scalar>(scorer.raw_scores(S, h, length), h, options, length, with_weights);
  }
};

}  // namespace detail

/// Additive (Bahdanau) attention: e_tj = tanh(s_t·W_s + h_j·W_h)·v_a, α = softmax_j(e), c_t = Σ_j α_tj·h_j
/// (seed 000 定义 2.4.2; the seed's v_aᵀ tanh(W_s s_{t−1} + W_h h_j) with W_s, W_h transposed to [in, out]).
///
/// Shapes: W_s d_s × d_a, W_h d_h × d_a, v_a d_a entries (public members, zero after construction; set them or
/// assign matrices of the same shapes). S steps × d_s, H T × d_h → e, α steps × T, c steps × d_h.
/// Mapping to the seed: row t of S is s_{t−1}ᵀ (the decoder state before step t), row j of H is h_jᵀ; the seed's
/// W_s ∈ R^{d_a×d_s} is stored as its transpose (W_s s becomes s·W_s), likewise W_h.
/// Parameters: `options` masks padded or forbidden encoder positions (see `ScoringOptions`).
/// Edge cases: T = 0 or a step that sees no position gives α = 0 and c = 0; hidden rows of H are never read (NaN
/// there cannot reach α or c); steps = 0 gives empty results. S ≠ T is the normal case (rectangular e).
/// Throws: shape_error when S does not have W_s.rows() columns, H does not have W_h.rows() columns, W_s, W_h and
/// v_a disagree on d_a, or the masks do not fit (see `ScoringOptions`); the constructor when a size is < 1.
/// Complexity: S·W_s and H·W_h are one matrix product each for all steps (O((steps·d_s + T·d_h)·d_a)); the scores
/// cost O(steps·T·d_a) tanh evaluations, one T × d_a row block at a time (nothing of size steps × T × d_a is
/// formed); α and c cost O(steps·T·d_h). Allocates the results and O((steps + T)·d_a) scratch.
/// Members: `forward(S, H, options)` returns e, α and c; `scores(S, H, options)` only e = tanh(s_t·W_s + h_j·W_h)·v_a
/// at visible positions, −∞ at hidden ones (both from `detail::ClassicScores`).
/// Thread safety: `scores` and `forward` are const and may run concurrently; changing the weights needs exclusive
/// access.
/// Example:
///
///     qkv::AdditiveAttention<float> attention(/*d_s=*/256, /*d_h=*/512, /*d_a=*/128);
///     attention.W_s = ...; attention.W_h = ...; attention.v_a = ...;
///     qkv::ScoredAttention<float> r = attention.forward(S, H);   // r.weights: steps × T, r.context: steps × 512
///
/// Source: Bahdanau, Cho & Bengio 2015 (ICLR), eq. (6) and appendix A.1.2; seed 000 §2.4.2, 定义 2.4.2.
template <class Scalar>
class AdditiveAttention : public detail::ClassicScores<AdditiveAttention<Scalar>, Scalar, detail::kAdditiveNames> {
 public:
  /// A scorer with zero weights: W_s d_s × d_a, W_h d_h × d_a, v_a d_a. Throws shape_error when a size is < 1.
  AdditiveAttention(Index d_s, Index d_h, Index d_a) {
    detail::check_scoring_dims("qkv::AdditiveAttention", d_s, d_h, d_a);
    W_s = Matrix<Scalar>::Zero(d_s, d_a);
    W_h = Matrix<Scalar>::Zero(d_h, d_a);
    v_a = Vector::Zero(d_a);
  }

  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;  ///< the type of v_a

  /// Decoder-state projection [in = d_s, out = d_a] (the seed's W_s transposed).
  Matrix<Scalar> W_s;
  /// Encoder-state projection [in = d_h, out = d_a] (the seed's W_h transposed).
  Matrix<Scalar> W_h;
  /// Score vector, d_a entries (the seed's v_a).
  Vector v_a;

 private:
  void check_inputs(const char* function, Index d_s, Index d_h) const {
    detail::check_shape(W_h.cols() == W_s.cols() && v_a.size() == W_s.cols(), function, ": W_s is ", W_s.rows(), " × ",
                        W_s.cols(), ", W_h is ", W_h.rows(), " × ", W_h.cols(), " and v_a has ", v_a.size(),
                        " entries; expected d_s × d_a, d_h × d_a and d_a with one d_a");
    detail::check_scoring_width(function, "S", d_s, "d_s", W_s.rows(), "the rows of W_s");
    detail::check_scoring_width(function, "H", d_h, "d_h", W_h.rows(), "the rows of W_h");
  }

  template <class DS>
  Matrix<Scalar> raw_scores(const Eigen::MatrixBase<DS>& S, const detail::ScoringRef<Scalar>& h, Index length) const {
    return detail::additive_scores<Scalar>(S, W_s, h, W_h, v_a, length);
  }

  friend class detail::ClassicScores<AdditiveAttention, Scalar, detail::kAdditiveNames>;  // calls the two hooks above
};

/// Luong dot attention: e_tj = s_t·h_j, α = softmax_j(e), c_t = Σ_j α_tj·h_j (seed 000 定义 2.4.3, "dot"; the
/// seed's s_{t−1}ᵀ h_j).
///
/// Shapes: S steps × d, H T × d (d_s = d_h, no parameters) → e, α steps × T, c steps × d.
/// Equals `qkv::scaled_dot_product_attention(S, H, H, options)` with `options.scale = 1` (no 1/√d: the seed's dot
/// score is unscaled), and the same `key_lengths` / `allowed`.
/// Edge cases, masks: as `AdditiveAttention`. Throws: shape_error when S and H have different column counts, or
/// the masks do not fit. Complexity: O(steps·T·d), e = S·Hᵀ in one matrix product; allocates the results.
/// Members: `forward(S, H, options)` returns e, α and c; `scores(S, H, options)` only e = S·Hᵀ (visible positions;
/// −∞ at hidden ones), both from `detail::ClassicScores`.
/// Thread safety: stateless; any number of concurrent calls.
/// Example: `qkv::DotAttention<double>().forward(S, H).weights`.
/// Source: Luong, Pham & Manning 2015 (EMNLP), §3.1, eq. (8) "dot"; seed 000 §2.4.2, 定义 2.4.3.
template <class Scalar>
class DotAttention : public detail::ClassicScores<DotAttention<Scalar>, Scalar, detail::kDotNames> {
 private:
  void check_inputs(const char* function, Index d_s, Index d_h) const {
    detail::check_scoring_width(function, "H", d_h, "d_s", d_s,
                                "the columns of S: the dot score needs d_s = d_h; use GeneralAttention otherwise");
  }

  template <class DS>
  Matrix<Scalar> raw_scores(const Eigen::MatrixBase<DS>& S, const detail::ScoringRef<Scalar>& h, Index length) const {
    return detail::dot_scores<Scalar>(S, h, length);
  }

  friend class detail::ClassicScores<DotAttention, Scalar, detail::kDotNames>;  // calls the two hooks above
};

/// Luong general attention: e_tj = s_t·W_a·h_jᵀ, α = softmax_j(e), c_t = Σ_j α_tj·h_j (seed 000 定义 2.4.3,
/// "general"; the seed's s_{t−1}ᵀ W_a h_j with the same W_a, which is already [in = d_s, out = d_h] in row form).
///
/// Shapes: W_a d_s × d_h (public member, zero after construction); S steps × d_s, H T × d_h → e, α steps × T,
/// c steps × d_h. d_s ≠ d_h is allowed (the point of W_a). With W_a = I (d_s = d_h) it equals `DotAttention`.
/// Edge cases, masks: as `AdditiveAttention`. Throws: shape_error when S does not have W_a.rows() columns, H does
/// not have W_a.cols() columns, or the masks do not fit; the constructor when a size is < 1.
/// Complexity: O(steps·d_s·d_h + steps·T·d_h): S·W_a once, then one product with Hᵀ; allocates the results and
/// steps × d_h scratch. Thread safety: const calls may run concurrently.
/// Members: `forward(S, H, options)` returns e, α and c; `scores(S, H, options)` only e = S·W_a·Hᵀ (visible
/// positions; −∞ at hidden ones), both from `detail::ClassicScores`.
/// Example: `qkv::GeneralAttention<float> attention(256, 512); attention.W_a = W; auto r = attention.forward(S, H);`
/// Source: Luong, Pham & Manning 2015 (EMNLP), §3.1, eq. (8) "general"; seed 000 §2.4.2, 定义 2.4.3.
template <class Scalar>
class GeneralAttention : public detail::ClassicScores<GeneralAttention<Scalar>, Scalar, detail::kGeneralNames> {
 public:
  /// A scorer with W_a = 0 (d_s × d_h). Throws shape_error when a size is < 1.
  GeneralAttention(Index d_s, Index d_h) {
    detail::check_scoring_dims("qkv::GeneralAttention", d_s, d_h, 1);
    W_a = Matrix<Scalar>::Zero(d_s, d_h);
  }

  /// Bilinear score matrix [in = d_s, out = d_h] (the seed's W_a ∈ R^{d_s×d_h}, unchanged).
  Matrix<Scalar> W_a;

 private:
  void check_inputs(const char* function, Index d_s, Index d_h) const {
    detail::check_scoring_width(function, "S", d_s, "d_s", W_a.rows(), "the rows of W_a");
    detail::check_scoring_width(function, "H", d_h, "d_h", W_a.cols(), "the columns of W_a");
  }

  template <class DS>
  Matrix<Scalar> raw_scores(const Eigen::MatrixBase<DS>& S, const detail::ScoringRef<Scalar>& h, Index length) const {
    const Matrix<Scalar> SW = S * W_a;
    return detail::dot_scores<Scalar>(SW, h, length);
  }

  friend class detail::ClassicScores<GeneralAttention, Scalar, detail::kGeneralNames>;  // calls the two hooks above
};

/// Luong concat attention: e_tj = tanh([s_t, h_j]·W_a)·v_a, α = softmax_j(e), c_t = Σ_j α_tj·h_j (seed 000 定义
/// 2.4.3, "concat"; the seed's v_aᵀ tanh(W_a [s_{t−1}; h_j]) with W_a transposed to [in = d_s + d_h, out = d_a]).
///
/// Shapes: W_a (d_s + d_h) × d_a, v_a d_a entries (public members, zero after construction); S steps × d_s,
/// H T × d_h → e, α steps × T, c steps × d_h. The split of W_a's rows is read from S: the first S.cols() rows
/// multiply s, the remaining rows multiply h.
/// Identity: [s, h]·W_a = s·W_a.topRows(d_s) + h·W_a.bottomRows(d_h), so this is `AdditiveAttention` with
/// W_s = W_a.topRows(d_s), W_h = W_a.bottomRows(d_h) — i.e. concat with W_a = [W_s; W_h] is additive (the seed:
/// "与加性注意力等价（拼接口径不同）"); it is computed that way, without forming any [s, h] concatenation.
/// Edge cases, masks: as `AdditiveAttention`. Throws: shape_error when S has W_a.rows() or more columns, H does not
/// have W_a.rows() − S.cols() columns, v_a does not have W_a.cols() entries, or the masks do not fit; the
/// constructor when a size is < 1.
/// Complexity: as `AdditiveAttention`. Thread safety: const calls may run concurrently.
/// Members: `forward(S, H, options)` returns e, α and c; `scores(S, H, options)` only e = tanh([s_t, h_j]·W_a)·v_a
/// (visible positions; −∞ at hidden ones), both from `detail::ClassicScores`.
/// Example: `qkv::ConcatAttention<float> attention(256, 512, 128); attention.W_a = W; attention.v_a = v;`
/// Source: Luong, Pham & Manning 2015 (EMNLP), §3.1, eq. (8) "concat"; seed 000 §2.4.2, 定义 2.4.3.
template <class Scalar>
class ConcatAttention : public detail::ClassicScores<ConcatAttention<Scalar>, Scalar, detail::kConcatNames> {
 public:
  /// A scorer with zero weights: W_a (d_s + d_h) × d_a, v_a d_a. Throws shape_error when a size is < 1.
  ConcatAttention(Index d_s, Index d_h, Index d_a) {
    detail::check_scoring_dims("qkv::ConcatAttention", d_s, d_h, d_a);
    W_a = Matrix<Scalar>::Zero(d_s + d_h, d_a);
    v_a = Vector::Zero(d_a);
  }

  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;  ///< the type of v_a

  /// Projection of the concatenation [s, h], [in = d_s + d_h, out = d_a] (the seed's W_a transposed).
  Matrix<Scalar> W_a;
  /// Score vector, d_a entries (the seed's v_a).
  Vector v_a;

 private:
  /// d_s is read from S; the remaining rows of W_a multiply h.
  void check_inputs(const char* function, Index d_s, Index d_h) const {
    detail::check_shape(v_a.size() == W_a.cols(), function, ": v_a has ", v_a.size(), " entries, expected d_a ",
                        W_a.cols(), " (the columns of W_a)");
    detail::check_shape(d_s >= 1 && d_s < W_a.rows(), function, ": S has ", d_s, " columns, expected d_s in [1, ",
                        W_a.rows() - 1, "] (W_a has d_s + d_h = ", W_a.rows(), " rows)");
    detail::check_scoring_width(function, "H", d_h, "d_h", W_a.rows() - d_s, "the rows of W_a minus the columns of S");
  }

  template <class DS>
  Matrix<Scalar> raw_scores(const Eigen::MatrixBase<DS>& S, const detail::ScoringRef<Scalar>& h, Index length) const {
    const Index d_s = S.cols(), d_h = W_a.rows() - d_s;
    return detail::additive_scores<Scalar>(S, W_a.topRows(d_s), h, W_a.bottomRows(d_h), v_a, length);
  }

  friend class detail::ClassicScores<ConcatAttention, Scalar, detail::kConcatNames>;  // calls the two hooks above
};

}  // namespace qkv
