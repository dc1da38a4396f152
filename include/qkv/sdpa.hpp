// qkv/sdpa.hpp — Eigen-matrix entry points: one head, or heads packed side by side in the columns.
//
// Rows are tokens. A packed-heads matrix holds head h in columns [h·d, (h+1)·d), which is how a projection
// X·W_q lays them out: Q (Tq × Hq·dk), K (Tk × Hkv·dk), V (Tk × Hkv·dv). The functions view these matrices as
// [1, H, T, d] tensors (no copy for row-major inputs) and call `qkv::attention`.
#pragma once

#include <type_traits>

#include "qkv/attention.hpp"
#include "qkv/config.hpp"
#include "qkv/detail/validate.hpp"
#include "qkv/errors.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

/// Head counts of a packed-heads call. n_kv_heads = 0 means n_heads (multi-head attention); 1 is multi-query
/// attention; anything dividing n_heads is grouped-query attention. Write `qkv::Heads{8, 2}`: a bare `{8, 2}`
/// would also fit `AttentionOptions` and the call would be ambiguous.
struct Heads {
  Index n_heads = 1;
  Index n_kv_heads = 0;
};

namespace detail {

/// A row-major matrix with unit inner stride bound to any Eigen expression: row-major objects bind without a
/// copy; column-major objects and expressions are evaluated into a row-major temporary owned by the Ref.
template <class Scalar>
using RowMajorRef = Eigen::Ref<const Matrix<Scalar>, 0, Eigen::OuterStride<>>;

/// A bound packed-heads matrix as a [1, H, T, D] view. Its row stride is the outer stride, or the width when it has
/// a single row (the stride is then never stepped).
template <class Scalar>
TensorView4<const Scalar> packed_view(const RowMajorRef<Scalar>& m, Index heads, Index head_dim) {
  return packed_heads_view(m.data(), m.rows(), heads, head_dim, m.rows() > 1 ? m.outerStride() : m.cols());
}

struct PackedShape {
  Index Hq, Hkv, dk, dv;
};

inline PackedShape packed_shape(const char* function, Heads heads, Index q_cols, Index k_cols, Index k_rows,
                                const Index* v_cols, const Index* v_rows) {
  check_shape(heads.n_heads >= 1, function, ": Heads::n_heads is ", heads.n_heads, ", expected at least 1");
  check_shape(heads.n_kv_heads >= 0, function, ": Heads::n_kv_heads is ", heads.n_kv_heads,
              ", expected 0 (= n_heads) or at least 1");
  PackedShape s;
  s.Hq = heads.n_heads;
  s.Hkv = heads.n_kv_heads == 0 ? heads.n_heads : heads.n_kv_heads;
  check_shape(s.Hq % s.Hkv == 0, function, ": Heads::n_heads ", s.Hq, " is not a multiple of Heads::n_kv_heads ",
              s.Hkv);
  check_shape(q_cols % s.Hq == 0, function, ": Q has ", q_cols, " columns, not a multiple of n_heads ", s.Hq);
  check_shape(q_cols >= s.Hq, function, ": Q has ", q_cols, " columns, expected at least n_heads ", s.Hq,
              " (head_dim = columns / n_heads must be at least 1)");
  s.dk = q_cols / s.Hq;
  check_shape(k_cols == s.Hkv * s.dk, function, ": K has ", k_cols, " columns, expected ", s.Hkv * s.dk,
              " (n_kv_heads ", s.Hkv, " × head_dim ", s.dk, " from Q)");
  s.dv = 0;
  if (v_cols != nullptr) {
    check_shape(*v_rows == k_rows, function, ": V has ", *v_rows, " rows, expected ", k_rows, " (the rows of K)");
    check_shape(*v_cols % s.Hkv == 0, function, ": V has ", *v_cols, " columns, not a multiple of n_kv_heads ", s.Hkv);
    s.dv = *v_cols / s.Hkv;
  }
  return s;
}

/// Q's scalar type is float or double; K and V share Q's, or (Q float) both hold Eigen::half or Eigen::bfloat16.
template <class DQ, class DK, class DV>
constexpr void check_scalars() {
  using Scalar = typename DQ::Scalar;
  using Storage = typename DK::Scalar;
  check_scalar_type<Scalar>();
  static_assert(std::is_same_v<Storage, typename DV::Scalar>, "qkv: K and V must have the same scalar type");
  static_assert(std::is_same_v<Scalar, Storage> || (std::is_same_v<Scalar, float> && is_kv16_v<Storage>),
                "qkv: K and V must have Q's scalar type, or (Q float) both Eigen::half or both Eigen::bfloat16");
}

inline namespace QKV_ISA_NAME {  // these call the ISA-dependent core (STYLE.md, ODR safety)

template <class Scalar, class Storage>
Matrix<Scalar> sdpa_packed(const char* function, const RowMajorRef<Scalar>& q, const RowMajorRef<Storage>& k,
                           const RowMajorRef<Storage>& v, Heads heads, const AttentionOptions<Scalar>& options) {
  const Index v_cols = v.cols(), v_rows = v.rows();
  const PackedShape s = packed_shape(function, heads, q.cols(), k.cols(), k.rows(), &v_cols, &v_rows);
  Matrix<Scalar> out(q.rows(), s.Hq * s.dv);
  attention_impl<Scalar, Storage>(function, packed_view(q, s.Hq, s.dk), packed_view(k, s.Hkv, s.dk), packed_view(v, s.Hkv, s.dv),
                         packed_heads_view(out.data(), out.rows(), s.Hq, s.dv, out.cols()), nullptr, options);
  return out;
}

template <class Scalar, class Storage>
Matrix<Scalar> weights_packed(const char* function, const RowMajorRef<Scalar>& q, const RowMajorRef<Storage>& k,
                              Heads heads, Index head, const AttentionOptions<Scalar>& options) {
  const PackedShape s = packed_shape(function, heads, q.cols(), k.cols(), k.rows(), nullptr, nullptr);
  check_shape(head >= 0 && head < s.Hq, function, ": head is ", head, ", expected an index in [0, ", s.Hq, ")");
  const TensorView4<const Scalar> q_view = packed_view(q, s.Hq, s.dk);
  const TensorView4<const Storage> k_view = packed_view(k, s.Hkv, s.dk);
  const AttentionShape shape = validate<Scalar>(function, q_view, k_view, nullptr, nullptr, nullptr, options);
  (void)use_fused(function, options);  // weights come from the reference path; this only rejects fused for double
  const SequenceRows all_q{0, q.rows()}, all_k{0, k.rows()};
  Matrix<Scalar> weights = Matrix<Scalar>::Zero(q.rows(), k.rows());
  const Index h_kv = head / shape.group;
  reference::AccMatrix p;
  reference::AccVector lse;
  const AttentionParams<Scalar> params = resolve_params(options, s.dk);
  const double sink = static_cast<double>(params.sink(head));
  for (Index b = 0; b < shape.n_sequences; ++b) {
    const std::size_t s_b = static_cast<std::size_t>(b);
    const SequenceRows q_rows = shape.varlen ? shape.q_rows[s_b] : all_q;
    const SequenceRows kv_rows = shape.varlen ? shape.kv_rows[s_b] : all_k;
    const HeadMask<Scalar> mask = params.head_mask(0, head, q_rows.length, shape.key_counts[s_b]);
    reference::head_weights(rows_of(q_view, 0, head, q_rows), rows_of(k_view, 0, h_kv, kv_rows), mask, sink, p, lse);
    const reference::HeadDropout<Scalar> dropout{&params.dropout, b, head, params.dropout_q_begin,
                                                 params.dropout_k_begin};
    reference::drop_weights(dropout, shape.key_counts[s_b], p, lse);  // the weights P·V uses (options.dropout_p)
    weights.block(q_rows.begin, kv_rows.begin, q_rows.length, kv_rows.length) = p.template cast<Scalar>();
  }
  return weights;
}

}  // namespace QKV_ISA_NAME
}  // namespace detail

inline namespace QKV_ISA_NAME {

/// Scaled dot-product attention of one head: softmax(Q·Kᵀ·scale + masks)·V (seed 000 定义 2.4.1).
///
/// Shapes: Q Tq × dk, K Tk × dk, V Tk × dv → Tq × dv. Any Eigen expression of float or double binds (K and V may
/// also hold Eigen::half or Eigen::bfloat16 with a float Q: `qkv::attention`'s 16-bit keys and values, the result
/// float; e.g. `Kf.cast<Eigen::half>()`, better stored once than cast per call); row-major objects are read in place, column-major ones and expressions are first copied into a row-major temporary
/// (a documented O(size) cost). Options as `AttentionOptions` (B = 1: `key_lengths` has one entry, `allowed`
/// and `bias` are Tq × Tk row-major matrices or broadcast views). Default scale 1/√dk; causal alignment is
/// bottom-right (PyTorch's `is_causal` is top-left). Edge cases, errors and accuracy as `qkv::attention`.
/// Throws: shape_error (e.g. K with a different column count than Q), unsupported_error.
/// Complexity: O(Tq·Tk·(dk + dv)); allocates the result and, on the reference backend, O(Tq·Tk).
/// Example (seed 000 例 2.4.1; examples/worked_example.cpp):
///
///     qkv::Matrix<double> Q(3, 2), K(3, 2), V(3, 2);
///     Q << 1, 0, 0, 1, 1, 1;  K = Q;  V << 1, 2, 3, 4, 5, 6;
///     qkv::Matrix<double> O = qkv::scaled_dot_product_attention(Q, K, V);  // O ≈ [3 4; 3.407 4.407; 3.510 4.510]
///
/// Source: Vaswani et al. 2017; seed 000 §2.4 (定义 2.4.1, 例 2.4.1); PyTorch's scaled_dot_product_attention.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const AttentionOptions<typename DQ::Scalar>& options = AttentionOptions<typename DQ::Scalar>()) {
  detail::check_scalars<DQ, DK, DV>();
  using Scalar = typename DQ::Scalar;
  return detail::sdpa_packed<Scalar, typename DK::Scalar>("qkv::scaled_dot_product_attention", Q.derived(), K.derived(), V.derived(),
                                     Heads{1, 1}, options);
}

/// Packed multi-head attention with GQA/MQA: head h of Q (columns [h·dk, (h+1)·dk)) attends with key/value head
/// h / (Hq / Hkv) of K and V (seed 000 §2.4.6, GQA / MQA; seed 002 §4).
///
/// Shapes: Q Tq × Hq·dk, K Tk × Hkv·dk, V Tk × Hkv·dv → Tq × Hq·dv, head h of the output in columns
/// [h·dv, (h+1)·dv) (the concatenation that W_o multiplies). Hq = heads.n_heads, Hkv = heads.n_kv_heads (0 = Hq).
/// `alibi_slopes` and `sinks` have Hq entries; `allowed` and `bias` may be [1, Hq or 1, Tq or 1, Tk] views.
/// Throws: shape_error when Q's columns are not a multiple of Hq, K's are not Hkv·dk, V's not a multiple of
/// Hkv, Hq % Hkv ≠ 0, or as `qkv::attention`. Complexity: O(Hq·Tq·Tk·(dk + dv)).
/// Example: `qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{32, 8})` (Llama-style GQA).
/// Source: PyTorch's scaled_dot_product_attention(enable_gqa=True) head mapping; Ainslie et al. 2023 (GQA).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> scaled_dot_product_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, Heads heads,
    const AttentionOptions<typename DQ::Scalar>& options = AttentionOptions<typename DQ::Scalar>()) {
  detail::check_scalars<DQ, DK, DV>();
  using Scalar = typename DQ::Scalar;
  return detail::sdpa_packed<Scalar, typename DK::Scalar>("qkv::scaled_dot_product_attention", Q.derived(), K.derived(), V.derived(), heads,
                                     options);
}

/// The attention weights P (Tq × Tk) of one head, for inspection (seed 000 §2.4.7): row i is the softmax of
/// query i's scores over the visible keys, exactly 0 at hidden keys; visible rows sum to 1 (1 − p_sink with
/// `sinks`); a row that sees no key is all zeros. With `options.dropout_p` > 0 they are the weights the call
/// multiplies V by: each kept weight scaled by 1/(1 − dropout_p) (in double, then rounded), each dropped one exactly 0,
/// the same mask as `scaled_dot_product_attention` with the same options (so out = P·V); rows then sum to 1 only in
/// expectation. (qkv/dropout.hpp: the mask of query i, key j is DropoutRule::keep(0, head, i, j); for varlen sequence
/// b, keep(b, head, i, j) with i, j positions in that sequence; with global positions, q_begin + i and k_begin + j.)
///
/// Shapes: Q Tq × dk, K Tk × dk. Computed by the reference path in double whatever `backend` says (the fused
/// kernel never forms P); `Backend::fused` with double throws unsupported_error as everywhere.
/// Throws: shape_error as `scaled_dot_product_attention`. Complexity O(Tq·Tk·dk); allocates O(Tq·Tk).
/// Source: seed 000 例 2.4.1 step (3); PyTorch's `need_weights`.
template <class DQ, class DK>
Matrix<typename DQ::Scalar> attention_weights(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const AttentionOptions<typename DQ::Scalar>& options = AttentionOptions<typename DQ::Scalar>()) {
  detail::check_scalars<DQ, DK, DK>();
  using Scalar = typename DQ::Scalar;
  return detail::weights_packed<Scalar, typename DK::Scalar>("qkv::attention_weights", Q.derived(), K.derived(), Heads{1, 1}, 0, options);
}

/// The weights of query head `head` of a packed-heads call (shapes as the packed
/// `scaled_dot_product_attention`; key head head / (Hq / Hkv)). Throws shape_error for a head outside [0, Hq).
template <class DQ, class DK>
Matrix<typename DQ::Scalar> attention_weights(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, Heads heads, Index head,
    const AttentionOptions<typename DQ::Scalar>& options = AttentionOptions<typename DQ::Scalar>()) {
  detail::check_scalars<DQ, DK, DK>();
  using Scalar = typename DQ::Scalar;
  return detail::weights_packed<Scalar, typename DK::Scalar>("qkv::attention_weights", Q.derived(), K.derived(), heads, head, options);
}

}  // namespace QKV_ISA_NAME
}  // namespace qkv
