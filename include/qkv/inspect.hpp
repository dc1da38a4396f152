// qkv/inspect.hpp — tools to look at what attention does: per-head summaries of the weights, head redundancy
// (correlation of heads' weight maps), ablations (the output change when a head is zeroed or a key is hidden) and
// gradient × input attribution (each token's first-order share in an output row, from the module's backward pass).
//
// Layering: this header sits above multi_head.hpp (it is the only header besides the umbrella that includes it), so
// the module's `attention_weights` and `forward` are available; positional.hpp and scoring.hpp stay below the module.
// The generic tools (`summarize_weights`, `head_weight_correlation`) take plain weight matrices from any source
// (`qkv::attention_weights`, a classic scorer's `ScoredAttention::weights`, PyTorch's attn_output_weights); the
// module forms run a `MultiHeadAttention`.
//
// Read the numbers as the seed says (seed 000 §2.4.7, "注意力权重能当解释吗"): attention weights are a debugging
// signal, not an explanation. A weight is not a contribution (the output is P·V, and a heavily weighted value row may
// be near zero or projected away by W_o); residual connections and later layers dilute or rewrite a head's pattern;
// the weights of a row sum to 1, so one weight rising pushes the others down; and heads are redundant (seed 002 §4.3:
// "部分头的注意力模式高度相似", many can be pruned with little loss), so a prunable head cannot carry the explanation.
// To test a reading of the weights, ablate (`key_ablation`, `head_ablation`: does the output really change?), check
// stability across heads and layers (`head_redundancy`), compare with gradient attributions
// (`gradient_input_attribution`), and validate on a synthetic task with a known answer (examples/train_tiny.cpp
// trains one and checks where its weights go).
//
// Sources: seed 000 §2.4.7 (the four reasons and the four checks) and 例 2.4.1 (equal outputs for any weights when
// the keys are symmetric); seed 002 §4.2–4.3 (head specialization, redundancy, correlation analysis, head pruning);
// Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than One?" (head ablation); Jain & Wallace 2019,
// "Attention is not Explanation"; Clark et al. 2019, "What Does BERT Look At?" (per-head entropy and distance);
// Simonyan et al. 2014 and Ancona et al. 2018 (gradient × input).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/errors.hpp"
#include "qkv/multi_head.hpp"
#include "qkv/options.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

/// A summary of one head's weights P (Tq × Tk), over the query rows that see at least one key (rows that are all
/// zero — every key hidden — are left out and counted in neither `rows` nor the means).
struct HeadSummary {
  Index head = 0;              ///< the head these numbers describe
  Index rows = 0;              ///< query rows summarized
  double mean_entropy = 0;     ///< mean over rows of H_i = −Σ_j p_ij·ln p_ij (nats; see `row_entropy`)
  double min_entropy = 0;      ///< the sharpest row
  double max_entropy = 0;      ///< the flattest row
  double uniform_entropy = 0;  ///< ln Tk: the entropy of uniform weights over all Tk keys (the ceiling)
  double mean_max_weight = 0;  ///< mean over rows of max_j p_ij (1 = every row one-hot)
  double mean_distance = 0;    ///< mean over rows of Σ_j p_ij·|i − j| ("attention distance", by index)
};

/// Summarizes one weight matrix P (rows = queries, each a distribution over the keys): entropies, peak weight and
/// attention distance (see `HeadSummary`). Accumulates in double.
///
/// Shapes: P Tq × Tk, any Eigen expression of float or double (e.g. `qkv::attention_weights(Q, K)`).
/// Parameters: `head` is copied into the summary. Edge cases: Tq = 0, or no row that sees a key, gives zeros
/// (rows = 0); Tk = 0 gives uniform_entropy = 0. Precondition: entries are weights (≥ 0, rows summing to 1 or 0); a
/// NaN entry makes the means NaN. Throws: nothing. Complexity O(Tq·Tk), no allocation beyond the entropies.
/// Thread safety: a pure function.
/// Example: `qkv::HeadSummary s = qkv::summarize_weights(qkv::attention_weights(Q, K));`
/// Source: seed 000 §2.4.7 and 定理 2.4.1 (entropy shows softmax saturation); Clark et al. 2019 (entropy, distance).
template <class Derived>
HeadSummary summarize_weights(const Eigen::MatrixBase<Derived>& weights, Index head = 0) {
  const auto& p = weights.derived();
  HeadSummary s;
  s.head = head;
  s.uniform_entropy = p.cols() > 0 ? std::log(static_cast<double>(p.cols())) : 0.0;
  const Eigen::Matrix<double, Eigen::Dynamic, 1> entropy = row_entropy(p.template cast<double>());
  double sum_entropy = 0, sum_max = 0, sum_distance = 0;
  s.min_entropy = std::numeric_limits<double>::infinity();
  s.max_entropy = -std::numeric_limits<double>::infinity();
  for (Index i = 0; i < p.rows(); ++i) {
    double row_sum = 0, row_max = 0, distance = 0;
    for (Index j = 0; j < p.cols(); ++j) {
      const double w = static_cast<double>(p(i, j));
      row_sum += w;
      row_max = std::max(row_max, w);
      distance += w * static_cast<double>(i >= j ? i - j : j - i);
    }
    if (row_sum == 0) continue;  // a row that sees no key
    ++s.rows;
    sum_entropy += entropy(i);
    sum_max += row_max;
    sum_distance += distance;
    s.min_entropy = std::min(s.min_entropy, entropy(i));
    s.max_entropy = std::max(s.max_entropy, entropy(i));
  }
  if (s.rows == 0) {
    s.min_entropy = s.max_entropy = 0;
    return s;
  }
  const double n = static_cast<double>(s.rows);
  s.mean_entropy = sum_entropy / n;
  s.mean_max_weight = sum_max / n;
  s.mean_distance = sum_distance / n;
  return s;
}

/// The weights of every query head of a module, in head order: result[h] = mha.attention_weights(X_q, X_kv, h,
/// options) (Tq × Tk; see `MultiHeadAttention::attention_weights`). For self-attention pass X_q = X_kv = X.
/// Shapes: X_q Tq × d_model, X_kv Tk × kdim. Throws: as `MultiHeadAttention::attention_weights`.
/// Complexity: n_heads calls, each O((Tq·d_model + Tk·kdim)·(Hq + Hkv)·head_dim + Tq·Tk·head_dim) (the projections
/// are recomputed per head: this is an inspection tool); allocates n_heads·Tq·Tk. Thread safety: const on the module.
/// Source: PyTorch nn.MultiheadAttention(need_weights = True, average_attn_weights = False); seed 000 §2.4.7.
template <class Scalar, class DQ, class DKV>
std::vector<Matrix<Scalar>> head_weights(const MultiHeadAttention<Scalar>& mha, const Eigen::MatrixBase<DQ>& X_q,
                                         const Eigen::MatrixBase<DKV>& X_kv,
                                         const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) {
  std::vector<Matrix<Scalar>> weights;
  weights.reserve(static_cast<std::size_t>(mha.n_heads()));
  for (Index h = 0; h < mha.n_heads(); ++h) weights.push_back(mha.attention_weights(X_q, X_kv, h, options));
  return weights;
}

/// Head-by-head summary of a module's weights on one input: result[h] = summarize_weights(weights of head h, h).
/// Shapes, throws and complexity as `head_weights` (plus O(n_heads·Tq·Tk)).
/// Example (examples/attention_map.cpp draws these beside each head's heat map):
///
///     for (const qkv::HeadSummary& s : qkv::summarize_heads(mha, X, X))
///       std::printf("head %td: mean entropy %.3f of %.3f nats\n", s.head, s.mean_entropy, s.uniform_entropy);
///
/// Source: seed 000 §2.4.7; Clark et al. 2019.
template <class Scalar, class DQ, class DKV>
std::vector<HeadSummary> summarize_heads(const MultiHeadAttention<Scalar>& mha, const Eigen::MatrixBase<DQ>& X_q,
                                         const Eigen::MatrixBase<DKV>& X_kv,
                                         const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) {
  std::vector<HeadSummary> summaries;
  summaries.reserve(static_cast<std::size_t>(mha.n_heads()));
  for (Index h = 0; h < mha.n_heads(); ++h)
    summaries.push_back(summarize_weights(mha.attention_weights(X_q, X_kv, h, options), h));
  return summaries;
}

/// Head redundancy as seed 002 §4.3 measures it: the pairwise Pearson correlation of the heads' weight maps over a
/// set of inputs. maps[n][h] is the weight matrix of head h on input n; each head's maps over all inputs are read as
/// one long vector (every entry of every input, hidden ones included), and
///
///     C(a, b) = Σ (x_a − mean x_a)(x_b − mean x_b) / √(Σ (x_a − mean x_a)² · Σ (x_b − mean x_b)²).
///
/// C(a, b) near 1: the two heads attend alike on these inputs (candidates for pruning, seed 002 §4.3); C(a, a) = 1.
/// Shapes: maps has N ≥ 1 inputs, each with the same number of heads H ≥ 1; the H maps of one input share their
/// shape (inputs may differ in shape) → H × H, symmetric, in double.
/// Edge cases: a head whose maps are constant (zero variance, e.g. uniform rows of one length) has no Pearson
/// correlation; it is given C = 1 with heads whose vectors equal it exactly and 0 with any other (never NaN).
/// Throws: shape_error when maps is empty, an input has no heads or a different head count, or two maps of one input
/// differ in shape. Complexity O(H²·E) for E entries per head; allocates H·E doubles. Thread safety: a pure function.
/// Source: seed 002 §4.3 ("把各头在验证集上的注意力矩阵拿出来做相关性分析"); Michel et al. 2019; Clark et al. 2019.
template <class Scalar>
Matrix<double> head_weight_correlation(const std::vector<std::vector<Matrix<Scalar>>>& maps) {
  const char* function = "qkv::head_weight_correlation";
  detail::check_shape(!maps.empty(), function, ": maps is empty, expected at least one input");
  const std::size_t n_heads = maps[0].size();
  detail::check_shape(n_heads >= 1, function, ": maps[0] has no heads, expected at least 1");
  Index entries = 0;
  for (std::size_t n = 0; n < maps.size(); ++n) {
    detail::check_shape(maps[n].size() == n_heads, function, ": maps[", n, "] has ", maps[n].size(),
                        " heads, expected ", n_heads, " (the heads of maps[0])");
    for (std::size_t h = 1; h < n_heads; ++h)
      detail::check_shape(maps[n][h].rows() == maps[n][0].rows() && maps[n][h].cols() == maps[n][0].cols(), function,
                          ": maps[", n, "][", h, "] is ", maps[n][h].rows(), " × ", maps[n][h].cols(), ", expected ",
                          maps[n][0].rows(), " × ", maps[n][0].cols(), " (the shape of maps[", n, "][0])");
    entries += maps[n][0].size();
  }
  const Index H = static_cast<Index>(n_heads);
  Matrix<double> centered(H, entries);  // row h: head h's entries over all inputs, minus their mean
  for (Index h = 0; h < H; ++h) {
    Index offset = 0;
    for (const auto& input : maps) {
      const auto& m = input[static_cast<std::size_t>(h)];
      centered.row(h).segment(offset, m.size()) =
          Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(m.data(), m.size()).template cast<double>();
      offset += m.size();
    }
    if (entries > 0) centered.row(h).array() -= centered.row(h).mean();
  }
  Matrix<double> C(H, H);
  for (Index a = 0; a < H; ++a)
    for (Index b = a; b < H; ++b) {
      const double norm_a = centered.row(a).norm(), norm_b = centered.row(b).norm();
      double c = 0;
      if (norm_a > 0 && norm_b > 0) {
        c = centered.row(a).dot(centered.row(b)) / (norm_a * norm_b);
      } else {  // a constant head: correlated only with an identical one
        bool identical = true;
        for (const auto& input : maps)
          identical = identical && input[static_cast<std::size_t>(a)] == input[static_cast<std::size_t>(b)];
        c = identical ? 1.0 : 0.0;
      }
      C(a, b) = C(b, a) = a == b ? 1.0 : c;
    }
  return C;
}

/// Head redundancy of a module over a set of self-attention inputs: `head_weight_correlation` of the heads' weights
/// on each X in `inputs` (seed 002 §4.3: "把各头在验证集上的注意力矩阵拿出来做相关性分析"). For cross-attention,
/// collect `head_weights(mha, X_q, X_kv)` per input and call `head_weight_correlation` directly.
/// Shapes: inputs N ≥ 1 matrices T_n × d_model → n_heads × n_heads in double.
/// Throws: shape_error when inputs is empty, or as `head_weights`. Complexity: N `head_weights` calls plus
/// O(H²·Σ T_n²). Thread safety: const on the module.
/// Source: seed 002 §4.3; Michel et al. 2019.
template <class Scalar>
Matrix<double> head_redundancy(const MultiHeadAttention<Scalar>& mha, const std::vector<Matrix<Scalar>>& inputs,
                               const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) {
  detail::check_shape(!inputs.empty(), "qkv::head_redundancy: inputs is empty, expected at least one input");
  std::vector<std::vector<Matrix<Scalar>>> maps;
  maps.reserve(inputs.size());
  for (const Matrix<Scalar>& X : inputs) maps.push_back(head_weights(mha, X, X, options));
  return head_weight_correlation(maps);
}

/// A copy of the module with query head `head` zeroed: its attention output no longer reaches Y (the rows
/// [head·head_dim, (head+1)·head_dim) of W_o are set to zero, which is exactly removing the head from the
/// concatenation; b_o stays). With GQA the kv head stays (other query heads read it).
/// Throws: shape_error for a head outside [0, n_heads). Complexity: copies the module's weights.
/// Source: seed 002 §4.3 (head pruning, "砍掉一部分冗余头"); Michel et al. 2019 (head masks).
template <class Scalar>
MultiHeadAttention<Scalar> ablate_head(const MultiHeadAttention<Scalar>& mha, Index head) {
  detail::check_shape(head >= 0 && head < mha.n_heads(), "qkv::ablate_head: head is ", head,
                      ", expected an index in [0, ", mha.n_heads(), ") (n_heads)");
  MultiHeadAttention<Scalar> ablated = mha;
  const Index D = mha.head_dim();
  detail::check_shape(ablated.W_o.rows() == mha.n_heads() * D, "qkv::ablate_head: W_o has ", ablated.W_o.rows(),
                      " rows, expected n_heads·head_dim = ", mha.n_heads() * D);
  ablated.W_o.middleRows(head * D, D).setZero();
  return ablated;
}

namespace detail {

/// ‖a‖ / ‖b‖, with 0/0 = 0 and x/0 = +∞ for x > 0.
inline double relative_norm(double change, double reference) {
  if (reference > 0) return change / reference;
  return change > 0 ? std::numeric_limits<double>::infinity() : 0.0;
}

}  // namespace detail

/// The seed's head ablation (seed 002 §4.3): for each query head h, how much the module's output changes when h is
/// zeroed (`ablate_head`):
///
///     result[h] = ‖Y − Y_{−h}‖_F / ‖Y‖_F,   Y = mha.forward(X_q, X_kv, options),  Y_{−h} the same with head h zeroed.
///
/// Small values: the output barely depends on the head — it can be pruned whatever its weights look like (and its
/// weights cannot be the explanation of the output, seed 000 §2.4.7). Equal to ‖O_h·W_o[h]‖_F / ‖Y‖_F.
/// Shapes: X_q Tq × d_model, X_kv Tk × kdim (self-attention: X_q = X_kv = X) → n_heads entries.
/// Edge cases: ‖Y‖_F = 0 gives 0 where Y_{−h} = Y as well, +∞ otherwise.
/// Throws: as `MultiHeadAttention::forward`. Complexity: n_heads + 1 forward passes and n_heads copies of the
/// weights. Thread safety: const on the module.
/// Source: seed 002 §4.3; Michel, Levy & Neubig 2019 (the importance of a head = the loss change when it is masked).
template <class Scalar, class DQ, class DKV>
std::vector<double> head_ablation(const MultiHeadAttention<Scalar>& mha, const Eigen::MatrixBase<DQ>& X_q,
                                  const Eigen::MatrixBase<DKV>& X_kv,
                                  const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) {
  const Matrix<double> Y = mha.forward(X_q, X_kv, options).template cast<double>();
  const double reference = Y.norm();
  std::vector<double> change(static_cast<std::size_t>(mha.n_heads()));
  for (Index h = 0; h < mha.n_heads(); ++h) {
    const Matrix<double> Y_h = ablate_head(mha, h).forward(X_q, X_kv, options).template cast<double>();
    change[static_cast<std::size_t>(h)] = detail::relative_norm((Y - Y_h).norm(), reference);
  }
  return change;
}

/// The seed's key ablation (seed 000 §2.4.7, check ①: "把该位置的键值屏蔽，看输出是否真的变化"): for each key j,
/// hide key j from every query (in every head) and measure how much each query's output row changes:
///
///     E(i, j) = ‖Y_i − Y_i^{(−j)}‖₂ / ‖Y_i‖₂,   Y = mha.forward(X_q, X_kv, options).
///
/// Compare a column of E with the weights on key j: a large weight with a small E(i, j) is the seed's "weight is not
/// contribution" (e.g. 例 2.4.1: query 1's output does not depend on how the weight is split between keys 0 and 2).
/// The mask is combined with `options.allowed` (both must allow) and the other options apply unchanged.
/// Shapes: X_q Tq × d_model, X_kv Tk × kdim → Tq × Tk in double.
/// Edge cases: a key already hidden (padding, causal) gives E = 0; ‖Y_i‖ = 0 gives 0 or +∞ as `head_ablation`; hiding
/// the last visible key of a row makes its attention output zero (Y_i = b_o).
/// Throws: shape_error when varlen options are set (`allowed` does not combine with them), or as `forward`.
/// Complexity: Tk + 1 forward passes; allocates O(Hq·Tq·Tk) booleans at most. Thread safety: const on the module.
/// Source: seed 000 §2.4.7; Jain & Wallace 2019 (weights versus the effect of removing inputs).
template <class Scalar, class DQ, class DKV>
Matrix<double> key_ablation(const MultiHeadAttention<Scalar>& mha, const Eigen::MatrixBase<DQ>& X_q,
                            const Eigen::MatrixBase<DKV>& X_kv,
                            const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) {
  const char* function = "qkv::key_ablation";
  detail::check_shape(options.cu_seqlens_q.empty() && options.cu_seqlens_k.empty(), function,
                      ": varlen options (cu_seqlens_q has ", options.cu_seqlens_q.size(), " entries, cu_seqlens_k ",
                      options.cu_seqlens_k.size(),
                      ") do not combine with the mask this ablation adds; run one "
                      "sequence at a time");
  const Matrix<double> Y = mha.forward(X_q, X_kv, options).template cast<double>();  // validates options.allowed
  const Index Tq = X_q.rows(), Tk = X_kv.rows();
  // The ablation mask keeps the extents of options.allowed ([1, Hq or 1, Tq or 1, Tk]) or is one row [1, 1, 1, Tk].
  const TensorView4<const bool>& user = options.allowed;
  const Index mask_heads = user.empty() ? 1 : user.extent(1), mask_rows = user.empty() ? 1 : user.extent(2);
  std::unique_ptr<bool[]> mask(new bool[static_cast<std::size_t>(mask_heads * mask_rows * Tk)]);
  for (Index h = 0; h < mask_heads; ++h)
    for (Index i = 0; i < mask_rows; ++i)
      for (Index j = 0; j < Tk; ++j)
        mask[static_cast<std::size_t>((h * mask_rows + i) * Tk + j)] = user.empty() || user(0, h, i, j);
  AttentionOptions<Scalar> ablated = options;
  ablated.allowed = TensorView4<const bool>(mask.get(), {1, mask_heads, mask_rows, Tk});
  Matrix<double> E = Matrix<double>::Zero(Tq, Tk);
  std::vector<bool> saved(static_cast<std::size_t>(mask_heads * mask_rows));
  for (Index j = 0; j < Tk; ++j) {
    for (Index r = 0; r < mask_heads * mask_rows; ++r) {
      saved[static_cast<std::size_t>(r)] = mask[static_cast<std::size_t>(r * Tk + j)];
      mask[static_cast<std::size_t>(r * Tk + j)] = false;
    }
    const Matrix<double> Y_j = mha.forward(X_q, X_kv, ablated).template cast<double>();
    for (Index i = 0; i < Tq; ++i) E(i, j) = detail::relative_norm((Y.row(i) - Y_j.row(i)).norm(), Y.row(i).norm());
    for (Index r = 0; r < mask_heads * mask_rows; ++r)
      mask[static_cast<std::size_t>(r * Tk + j)] = saved[static_cast<std::size_t>(r)];
  }
  return E;
}

namespace detail {

/// The d_model-vector `direction` of a gradient × input attribution, checked, as a row of the module's scalar type.
template <class Scalar, class DU>
Eigen::Matrix<Scalar, 1, Eigen::Dynamic> attribution_direction(const char* function, const Eigen::MatrixBase<DU>& u,
                                                               Index d_model) {
  static_assert(std::is_same_v<typename DU::Scalar, Scalar>,
                "qkv::gradient_input_attribution: the direction must have the module's scalar type");
  check_shape(u.size() == d_model && (u.rows() == 1 || u.cols() == 1), function, ": direction is ", u.rows(), " × ",
              u.cols(), ", expected a vector of d_model = ", d_model, " entries");
  return u.derived().reshaped().transpose();
}

}  // namespace detail

/// Gradient × input attribution of one output row in one direction (Simonyan, Vedaldi & Zisserman 2014; Shrikumar et
/// al. 2016; Ancona et al. 2018, "gradient * input"): for the scalar u·Y_i, the share of input token j is
///
///     a_j = Σ_c X_jc · ∂(u·Y_i)/∂X_jc,   Y = mha.forward(X, options),
///
/// the first-order effect of scaling token j: a_j = d/dα (u·Y_i)(X with row j multiplied by α) at α = 1. Unlike a
/// weight, a_j accounts for the value row, W_o and the softmax's competition (seed 000 §2.4.7: "a weight is not a
/// contribution"); unlike `key_ablation`, it is a local, signed, first-order measure (one backward pass instead of
/// T + 1 forward passes), and it covers every path of token j: as a key and value for every j, and, for j = i, also
/// as the query. Σ_j a_j = d/dα (u·Y_i)(α·X) at α = 1, which equals u·Y_i only when the layer is homogeneous of degree
/// 1 in X (it is not: softmax, biases); gradient × input is a linearization, not a decomposition of u·Y_i.
///
/// Shapes: X T × d_model (self-attention: X is the query, key and value input; kdim = vdim = d_model); row in [0, T);
/// direction a vector of d_model entries (e.g. Y_i/‖Y_i‖ to attribute the row's size, or a readout vector such as a
/// class's row of the layer that follows) → T entries in double (computed in Scalar, the module's type).
/// Options: every option of `MultiHeadAttention::backward` (masks, varlen, RoPE through Config::rope; dropout with
/// the forward call's seed and offset).
/// Edge cases: a token hidden from query i (padding, causal) gets 0 unless it is i itself; T = 0 has no row to ask.
/// Throws: shape_error for a row outside [0, T), a direction of the wrong size, or as `MultiHeadAttention::backward`.
/// Complexity: one backward pass of the module (about three forward passes), O(T·d_model) more; allocates as
/// `backward`. Thread safety: const on the module.
/// Example (tests/test_inspect.cpp prints it beside `key_ablation` on the PP-OCRv4 layer):
///
///     const Eigen::VectorXd a = qkv::gradient_input_attribution(mha, X, i, Y.row(i).normalized());
///
/// Source: Simonyan et al. 2014 (saliency: the gradient of the output with respect to the input); Shrikumar et al.
/// 2016 and Ancona et al. 2018 (gradient * input, summed over a token's features); seed 000 §2.4.7 (compare weights
/// with gradient attributions).
template <class Scalar, class DX, class DU>
Eigen::VectorXd gradient_input_attribution(const MultiHeadAttention<Scalar>& mha, const Eigen::MatrixBase<DX>& X,
                                           Index row, const Eigen::MatrixBase<DU>& direction,
                                           const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) {
  const char* function = "qkv::gradient_input_attribution";
  detail::check_shape(row >= 0 && row < X.rows(), function, ": row is ", row, ", expected an index in [0, ", X.rows(),
                      ") (the rows of X)");
  Matrix<Scalar> dY = Matrix<Scalar>::Zero(X.rows(), mha.d_model());
  dY.row(row) = detail::attribution_direction<Scalar>(function, direction, mha.d_model());
  const typename MultiHeadAttention<Scalar>::Gradients g = mha.backward(X, dY, options);
  return (X.derived().template cast<double>().cwiseProduct(g.dX.template cast<double>())).rowwise().sum();
}

/// Gradient × input attribution for cross-attention `mha.forward(X_q, X_kv, options)`: the share of key/value token j
/// (a row of X_kv) in u·Y_i,
///
///     a_j = Σ_c X_kv,jc · ∂(u·Y_i)/∂X_kv,jc,
///
/// over both of its paths (as key and as value), the columns `key_ablation(mha, X_q, X_kv)` measures by hiding. The
/// query token's own share, X_q,i·∂(u·Y_i)/∂X_q,i, is not part of it (Y_i depends on X_q through row i only); it is
/// `X_q.row(i).dot(g.dX_q.row(i))` with g = mha.backward(X_q, X_kv, dY) and dY zero but row i = u.
/// Shapes: X_q Tq × d_model, X_kv Tk × kdim (kdim = vdim), row in [0, Tq), direction d_model entries → Tk entries.
/// Throws: as the self-attention form, or as `MultiHeadAttention::backward(X_q, X_kv, dY, options)`.
/// Complexity, thread safety and source as the self-attention form.
template <class Scalar, class DQ, class DKV, class DU>
Eigen::VectorXd gradient_input_attribution(const MultiHeadAttention<Scalar>& mha, const Eigen::MatrixBase<DQ>& X_q,
                                           const Eigen::MatrixBase<DKV>& X_kv, Index row,
                                           const Eigen::MatrixBase<DU>& direction,
                                           const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) {
  const char* function = "qkv::gradient_input_attribution";
  detail::check_shape(row >= 0 && row < X_q.rows(), function, ": row is ", row, ", expected an index in [0, ",
                      X_q.rows(), ") (the rows of X_q)");
  Matrix<Scalar> dY = Matrix<Scalar>::Zero(X_q.rows(), mha.d_model());
  dY.row(row) = detail::attribution_direction<Scalar>(function, direction, mha.d_model());
  const typename MultiHeadAttention<Scalar>::Gradients g = mha.backward(X_q, X_kv, dY, options);
  return (X_kv.derived().template cast<double>().cwiseProduct(g.dX_kv.template cast<double>())).rowwise().sum();
}

}  // namespace qkv
