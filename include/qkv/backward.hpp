// qkv/backward.hpp — the backward pass of attention over views: validation, the float64 reference backward, the
// gradients of the sinks and of the bias, and the backend choice.
//
// Given the forward's out and lse and the loss's gradient d_out, `attention_backward` writes the gradients of q, k
// and v. The reference backward below is the specification: per (sequence, query head) it recomputes the weights P
// from q and k with reference::head_weights (the forward's own mask and score rules), materializes dP and dS in
// double and accumulates every gradient in double. Float calls without a requested bias gradient run the fused
// backward (detail/dispatch.hpp, run_fused_backward: FlashAttention-2's backward on the CPU, no Sq × Skv buffer).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/config.hpp"
#include "qkv/detail/attention_params.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/dispatch.hpp"
#include "qkv/detail/threads.hpp"
#include "qkv/detail/validate.hpp"
#include "qkv/errors.hpp"
#include "qkv/isa.hpp"
#include "qkv/mask.hpp"
#include "qkv/options.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

/// The optional gradients of `attention_backward`; an empty view (the default) is not computed.
///
///   d_bias  the gradient of options.bias, with exactly the extents of options.bias ([B or 1, Hq or 1, Sq or 1, Skv]):
///           dL/dbias_ij = dS_ij, summed over the axes the bias broadcasts (extent 1). Requesting it runs the
///           reference backward (the gradient is Sq × Skv by nature).
///   d_sinks the gradient of options.sinks, one entry per query head (Hq).
template <class T>
struct AttentionGradientExtras {
  TensorView4<T> d_bias;
  TensorView<T, 1> d_sinks;
};

namespace detail {

/// Whether an optional output view is requested: non-null data or a non-zero extent (an empty view is neither).
template <class T, int Rank>
bool is_requested(const TensorView<T, Rank>& view) {
  if (view.data() != nullptr) return true;
  for (Index e : view.extents()) {
    if (e != 0) return true;
  }
  return false;
}

/// Validates a backward call: q, k, v and the options as the forward (validate), then out, lse, d_out, the outputs
/// and the extras; returns the call's shape. Throws shape_error (the message names the function, the argument, the
/// axis and both sizes); nothing is read or written before it returns.
template <class T>
AttentionShape validate_backward(const char* function, const TensorView4<const T>& q, const TensorView4<const T>& k,
                                 const TensorView4<const T>& v, const TensorView4<const T>& out,
                                 const TensorView3<const T>& lse, const TensorView4<const T>& d_out,
                                 const TensorView4<T>& d_q, const TensorView4<T>& d_k, const TensorView4<T>& d_v,
                                 const AttentionOptions<T>& options, const AttentionGradientExtras<T>& extras) {
  static const char* const q_names[] = {"B", "Hq", "Sq", "D"};
  static const char* const k_names[] = {"B", "Hkv", "Skv", "D"};
  static const char* const v_names[] = {"B", "Hkv", "Skv", "Dv"};
  static const char* const out_names[] = {"B", "Hq", "Sq", "Dv"};
  static const char* const lse_names[] = {"B", "Hq", "Sq"};
  static const char* const bias_names[] = {"B", "Hq", "Sq", "Skv"};
  static const char* const sinks_names[] = {"Hq"};
  const AttentionShape shape = validate<T, T>(function, q, k, &v, nullptr, nullptr, options);
  const Index B = q.extent(0), Hq = q.extent(1), Sq = q.extent(2), D = q.extent(3);
  const Index Hkv = k.extent(1), Skv = k.extent(2), Dv = v.extent(3);

  const auto check_extents = [function](const char* name, const auto& view, const char* const* names,
                                        std::initializer_list<Index> expected, const char* const* from) {
    check_view(function, name, view, names);
    int axis = 0;
    for (Index e : expected) {
      check_extent(function, name, view, axis, names, e, from[axis]);
      ++axis;
    }
  };
  static const char* const from_out[] = {"the extent of q axis 0", "the extent of q axis 1", "the extent of q axis 2",
                                         "the extent of v axis 3"};
  static const char* const from_lse[] = {"the extent of q axis 0", "the extent of q axis 1", "the extent of q axis 2"};
  static const char* const from_q[] = {"the extent of q axis 0", "the extent of q axis 1", "the extent of q axis 2",
                                       "the extent of q axis 3"};
  static const char* const from_k[] = {"the extent of k axis 0", "the extent of k axis 1", "the extent of k axis 2",
                                       "the extent of k axis 3"};
  static const char* const from_v[] = {"the extent of v axis 0", "the extent of v axis 1", "the extent of v axis 2",
                                       "the extent of v axis 3"};
  check_extents("out", out, out_names, {B, Hq, Sq, Dv}, from_out);
  check_extents("lse", lse, lse_names, {B, Hq, Sq}, from_lse);
  check_extents("d_out", d_out, out_names, {B, Hq, Sq, Dv}, from_out);
  check_extents("d_q", d_q, q_names, {B, Hq, Sq, D}, from_q);
  check_extents("d_k", d_k, k_names, {B, Hkv, Skv, D}, from_k);
  check_extents("d_v", d_v, v_names, {B, Hkv, Skv, Dv}, from_v);

  const bool wants_bias = is_requested(extras.d_bias), wants_sinks = is_requested(extras.d_sinks);
  if (wants_bias) {
    check_shape(is_set(options.bias), function, ": extras.d_bias is requested (", describe_layout(extras.d_bias),
                ") but options.bias is not set: there is no bias to differentiate");
    check_view(function, "extras.d_bias", extras.d_bias, bias_names);
    for (int axis = 0; axis < 4; ++axis) {
      check_extent(function, "extras.d_bias", extras.d_bias, axis, bias_names, options.bias.extent(axis),
                   "the extent of options.bias");
    }
  }
  if (wants_sinks) {
    check_shape(!options.sinks.empty(), function, ": extras.d_sinks is requested (", extras.d_sinks.extent(0),
                " entries) but options.sinks is empty: there are no sinks to differentiate");
    check_view(function, "extras.d_sinks", extras.d_sinks, sinks_names);
    check_extent(function, "extras.d_sinks", extras.d_sinks, 0, sinks_names, Hq, "the extent of q axis 1");
  }

  // Outputs: no two indices of one output share an element, and no output overlaps an input or another output.
  const auto check_self = [function](const char* name, const auto& view) {
    check_shape(self_overlap_free(view), function, ": ", name, " has strides whose elements overlap (",
                describe_layout(view), "): distinct indices would write the same element");
  };
  check_self("d_q", d_q);
  check_self("d_k", d_k);
  check_self("d_v", d_v);
  if (wants_bias) check_self("extras.d_bias", extras.d_bias);
  if (wants_sinks) check_self("extras.d_sinks", extras.d_sinks);

  const TensorView<const T, 1> sinks(options.sinks.data(), {static_cast<Index>(options.sinks.size())});
  const TensorView<const T, 1> alibi(options.alibi_slopes.data(), {static_cast<Index>(options.alibi_slopes.size())});
  const auto check_output = [&](const char* name, const auto& output) {
    if (!is_requested(output)) return;
    const auto check_input = [&](const char* input_name, const auto& input) {
      check_shape(!overlaps(output, input), function, ": ", name, " overlaps an input (", input_name,
                  "): ", describe_overlap(name, output, input_name, input), "; outputs must not alias inputs");
    };
    check_input("q", q);
    check_input("k", k);
    check_input("v", v);
    check_input("out", out);
    check_input("lse", lse);
    check_input("d_out", d_out);
    check_input("options.bias", options.bias);
    check_input("options.allowed", options.allowed);
    check_input("options.sinks", sinks);
    check_input("options.alibi_slopes", alibi);
  };
  check_output("d_q", d_q);
  check_output("d_k", d_k);
  check_output("d_v", d_v);
  check_output("extras.d_bias", extras.d_bias);
  check_output("extras.d_sinks", extras.d_sinks);
  const auto check_apart = [function](const char* a_name, const auto& a, const char* b_name, const auto& b) {
    check_shape(!overlaps(a, b), function, ": ", a_name, " overlaps ", b_name, ": ",
                describe_overlap(a_name, a, b_name, b), "; outputs must not alias each other");
  };
  check_apart("d_q", d_q, "d_k", d_k);
  check_apart("d_q", d_q, "d_v", d_v);
  check_apart("d_k", d_k, "d_v", d_v);
  if (wants_bias) {
    check_apart("extras.d_bias", extras.d_bias, "d_q", d_q);
    check_apart("extras.d_bias", extras.d_bias, "d_k", d_k);
    check_apart("extras.d_bias", extras.d_bias, "d_v", d_v);
  }
  if (wants_sinks) {
    check_apart("extras.d_sinks", extras.d_sinks, "d_q", d_q);
    check_apart("extras.d_sinks", extras.d_sinks, "d_k", d_k);
    check_apart("extras.d_sinks", extras.d_sinks, "d_v", d_v);
    if (wants_bias) check_apart("extras.d_sinks", extras.d_sinks, "extras.d_bias", extras.d_bias);
  }
  return shape;
}

// From here on every function reads AttentionParams (ISA-named: mask.hpp) or runs the fused kernel.
inline namespace QKV_ISA_NAME {

/// The bias gradient of a reference backward, accumulated in double over the bias's own extents
/// [Bb, Hb, Sqb, Skv] (dense, row-major): the dS of (b, h, i, j) adds to element (b or 0, h or 0, i or 0, j), 0 on
/// each axis the bias broadcasts.
struct BiasGradientSum {
  std::vector<double> sum;
  std::array<Index, 4> extents{};

  double& at(Index b, Index h, Index i, Index j) {
    const Index b_ = extents[0] > 1 ? b : 0, h_ = extents[1] > 1 ? h : 0, i_ = extents[2] > 1 ? i : 0;
    return sum[static_cast<std::size_t>(((b_ * extents[1] + h_) * extents[2] + i_) * extents[3] + j)];
  }
};

/// The reference backward of one (sequence b, kv head h_kv): the query heads of its group, in order, each
/// materialized (Sq_b × Skv_b weights in double). Writes d_q of those query heads and d_k, d_v of the kv head over the
/// sequence's rows entirely (zeros where no gradient); adds dS to `bias_sum` when given.
///
///     dV_j = Σ_i Z_ij·P_ij·dO_i        dP_ij = Z_ij·(dO_i·v_j)        D_i = Σ_j P_ij·dP_ij
///     dS_ij = P_ij·(dP_ij − D_i)       g_ij = dS_ij·scale·sech²(x_ij·scale/softcap),   x_ij = q_i·k_j
///     dQ_i = Σ_j g_ij·k_j              dK_j = Σ_i g_ij·q_i
///
/// sech² = 1 − tanh², computed as 1/cosh² (no cancellation); the factor is 1 without softcap. Z is the dropout mask
/// scaled by 1/(1 − p) (1 without dropout). The lse this computes is not the forward's: P is recomputed in double from
/// q and k, and out and lse are not read. Every product c·x of a coefficient c (P_ij, Z_ij·P_ij, g_ij) and an input
/// vector x is skipped where c is exactly 0 (hidden or dropped pairs, weights that underflowed, scale 0): a NaN or ∞
/// in x then reaches nothing through that term. Keys past Skv_b are never read. Complexity O(G·Sq_b·Skv_b·(D + Dv));
/// allocates the weights, copies of the slices in double and the accumulators.
template <class T>
void reference_backward_task(const AttentionShape& shape, Index b, Index h_kv, const TensorView4<const T>& q,
                             const TensorView4<const T>& k, const TensorView4<const T>& v,
                             const TensorView4<const T>& d_out, const TensorView4<T>& d_q, const TensorView4<T>& d_k,
                             const TensorView4<T>& d_v, const AttentionParams<T>& params, BiasGradientSum* bias_sum) {
  using reference::AccMatrix;
  using reference::AccVector;
  const Index view_b = shape.view_batch(b);
  const SequenceRows q_rows = shape.q_rows[static_cast<std::size_t>(b)];
  const SequenceRows kv_rows = shape.kv_rows[static_cast<std::size_t>(b)];
  const Index sq = q_rows.length, skv = shape.key_counts[static_cast<std::size_t>(b)];
  const auto k_rows = rows_of(k, view_b, h_kv, kv_rows);
  const AccMatrix keys = k_rows.topRows(skv).template cast<double>();
  const AccMatrix values = rows_of(v, view_b, h_kv, kv_rows).topRows(skv).template cast<double>();
  AccMatrix d_keys = AccMatrix::Zero(kv_rows.length, shape.D);
  AccMatrix d_values = AccMatrix::Zero(kv_rows.length, shape.Dv);
  const double scale = static_cast<double>(params.rules.scale);
  const double softcap = static_cast<double>(params.rules.softcap);
  const bool dropout = params.dropout.active();
  AccMatrix weights;
  AccVector row_lse;
  AccVector d_weights(skv), keep(skv);  // dP_ij of row i; Z_ij of row i (1/(1 − p) in double, or 0)
  for (Index h = h_kv * shape.group; h < (h_kv + 1) * shape.group; ++h) {
    const HeadMask<T> mask = params.head_mask(view_b, h, sq, skv);
    const auto q_head = rows_of(q, view_b, h, q_rows);
    reference::head_weights(q_head, k_rows, mask, static_cast<double>(params.sink(h)), weights, row_lse);
    const AccMatrix queries = q_head.template cast<double>();
    const AccMatrix d_outputs = rows_of(d_out, view_b, h, q_rows).template cast<double>();
    AccMatrix d_queries = AccMatrix::Zero(sq, shape.D);
    for (Index i = 0; i < sq; ++i) {
      if (dropout) {  // the forward's mask: the same pure function of (seed, offset, sequence, h, i, j)
        keep.setOnes();
        params.dropout.apply_row(b, h, params.dropout_q_begin + i, params.dropout_k_begin, skv, keep.data());
      }
      // dP_ij and D_i over the pairs with a non-zero weight (a NaN weight included: an undefined row stays so).
      double row_sum = 0;  // D_i
      for (Index j = 0; j < skv; ++j) {
        const double weight = weights(i, j);
        if (weight == 0.0) continue;
        double d_weight = 0.0;  // dP_ij: 0 for a dropped weight, whose value v_j is not read
        const double z = dropout ? keep(j) : 1.0;
        if (z != 0.0) {
          d_weight = z * d_outputs.row(i).dot(values.row(j));
          d_values.row(j) += (z * weight) * d_outputs.row(i);
        }
        d_weights(j) = d_weight;
        row_sum += weight * d_weight;
      }
      for (Index j = 0; j < skv; ++j) {
        const double weight = weights(i, j);
        if (weight == 0.0) continue;
        const double d_score = weight * (d_weights(j) - row_sum);  // dS_ij
        if (bias_sum != nullptr) bias_sum->at(view_b, h, q_rows.begin + i, kv_rows.begin + j) += d_score;
        double slope = scale;  // d s_ij / d x_ij
        if (softcap > 0.0) {
          const double c = std::cosh(queries.row(i).dot(keys.row(j)) * scale / softcap);
          slope = scale / (c * c);  // scale·(1 − tanh²): the same, without the cancellation of 1 − tanh²
        }
        if (slope == 0.0) continue;  // scale 0, or a saturated softcap: q_i and k_j do not move s_ij (NaN rule)
        const double g = d_score * slope;
        if (g == 0.0) continue;
        d_queries.row(i) += g * keys.row(j);
        d_keys.row(j) += g * queries.row(i);
      }
    }
    rows_of(d_q, view_b, h, q_rows) = d_queries.template cast<T>();
  }
  rows_of(d_k, view_b, h_kv, kv_rows) = d_keys.template cast<T>();
  rows_of(d_v, view_b, h_kv, kv_rows) = d_values.template cast<T>();
}

/// The reference backward over every (sequence, kv head) task; writes d_q, d_k, d_v entirely and, when `d_bias` is
/// requested, d_bias (accumulated in double over the bias's extents, rounded once). Tasks own disjoint rows of d_q,
/// d_k and d_v, so they run on threads (OpenMP) with bit-identical results for any thread count; when d_bias is
/// requested and two tasks would add to the same bias element (the bias broadcasts over sequences while B > 1, or over
/// heads while Hkv > 1), the tasks run in order on the calling thread.
template <class T>
void run_reference_backward(const AttentionShape& shape, const TensorView4<const T>& q, const TensorView4<const T>& k,
                            const TensorView4<const T>& v, const TensorView4<const T>& d_out, const TensorView4<T>& d_q,
                            const TensorView4<T>& d_k, const TensorView4<T>& d_v, const AttentionParams<T>& params,
                            const TensorView4<T>& d_bias) {
  const bool wants_bias = is_requested(d_bias);
  BiasGradientSum bias_sum;
  bool tasks_apart = true;  // whether no two tasks add to the same bias element
  if (wants_bias) {
    for (int axis = 0; axis < 4; ++axis) bias_sum.extents[static_cast<std::size_t>(axis)] = d_bias.extent(axis);
    bias_sum.sum.assign(static_cast<std::size_t>(d_bias.size()), 0.0);
    tasks_apart = (d_bias.extent(0) > 1 || shape.n_sequences <= 1) && (d_bias.extent(1) > 1 || shape.Hkv <= 1);
  }
  const Index tasks = shape.n_sequences * shape.Hkv;
  const bool team = tasks > 1 && tasks_apart && q.size() * k.extent(2) > (Index(1) << 16) && may_open_team();
  (void)team;  // read only by the OpenMP pragma
#if defined(_OPENMP)
#pragma omp parallel if (team)
#endif
  {
    observe_team();
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index task = 0; task < tasks; ++task) {
      reference_backward_task(shape, task / shape.Hkv, task % shape.Hkv, q, k, v, d_out, d_q, d_k, d_v, params,
                              wants_bias ? &bias_sum : nullptr);
    }
  }
  if (wants_bias) {
    for (Index b = 0; b < d_bias.extent(0); ++b)
      for (Index h = 0; h < d_bias.extent(1); ++h)
        for (Index i = 0; i < d_bias.extent(2); ++i)
          for (Index j = 0; j < d_bias.extent(3); ++j) d_bias(b, h, i, j) = static_cast<T>(bias_sum.at(b, h, i, j));
  }
}

/// d_sinks[h] = −Σ_{b,i} exp(sink_h − lse_bhi)·D_bhi with D_bhi = Σ_d d_out_bhid·out_bhid, accumulated in double and
/// rounded once; a head without a sink (−∞) gets 0. A term whose coefficient is exactly 0 (exp(sink − lse) = 0, or
/// out_bhid = 0, e.g. a row that sees no key) is skipped, so a NaN in d_out reaches only the heads it depends on.
template <class T>
void sink_gradients(const TensorView4<const T>& out, const TensorView3<const T>& lse, const TensorView4<const T>& d_out,
                    const AttentionParams<T>& params, const TensorView<T, 1>& d_sinks) {
  const Index B = out.extent(0), Hq = out.extent(1), Sq = out.extent(2), Dv = out.extent(3);
  for (Index h = 0; h < Hq; ++h) {
    const double sink = static_cast<double>(params.sink(h));
    double sum = 0.0;
    if (sink != -std::numeric_limits<double>::infinity()) {
      for (Index b = 0; b < B; ++b) {
        for (Index i = 0; i < Sq; ++i) {
          const double sink_weight = std::exp(sink - static_cast<double>(lse(b, h, i)));
          if (sink_weight == 0.0) continue;
          double row_sum = 0.0;  // D_bhi
          for (Index d = 0; d < Dv; ++d) {
            const double o = static_cast<double>(out(b, h, i, d));
            if (o != 0.0) row_sum += static_cast<double>(d_out(b, h, i, d)) * o;
          }
          sum -= sink_weight * row_sum;
        }
      }
    }
    d_sinks(h) = static_cast<T>(sum);
  }
}

/// Validates, picks the backend and runs a backward call (see qkv::attention_backward).
template <class T>
void attention_backward_impl(const char* function, const TensorView4<const T>& q, const TensorView4<const T>& k,
                             const TensorView4<const T>& v, const TensorView4<const T>& out,
                             const TensorView3<const T>& lse, const TensorView4<const T>& d_out,
                             const TensorView4<T>& d_q, const TensorView4<T>& d_k, const TensorView4<T>& d_v,
                             const AttentionOptions<T>& options, const AttentionGradientExtras<T>& extras) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "qkv: the scalar type must be float or double");
  const AttentionShape shape = validate_backward(function, q, k, v, out, lse, d_out, d_q, d_k, d_v, options, extras);
  const AttentionParams<T> params = resolve_params(options, shape.D);
  bool done = false;
  if constexpr (std::is_same_v<T, float>) {
    if (use_fused(function, options) && !is_requested(extras.d_bias)) {
      run_fused_backward(shape, q, k, v, out, lse, d_out, d_q, d_k, d_v, params);  // dispatch.hpp
      done = true;
    }
  } else {
    (void)use_fused(function, options);
  }
  if (!done) run_reference_backward(shape, q, k, v, d_out, d_q, d_k, d_v, params, extras.d_bias);
  if (is_requested(extras.d_sinks)) sink_gradients(out, lse, d_out, params, extras.d_sinks);
}

// Separate compilation: as QKV_ATTENTION_INSTANTIATIONS (attention.hpp), for the backward.
#define QKV_BACKWARD_INSTANTIATIONS(PREFIX)                                                                            \
  PREFIX void attention_backward_impl<float>(                                                                          \
      const char*, const TensorView4<const float>&, const TensorView4<const float>&, const TensorView4<const float>&,  \
      const TensorView4<const float>&, const TensorView3<const float>&, const TensorView4<const float>&,               \
      const TensorView4<float>&, const TensorView4<float>&, const TensorView4<float>&, const AttentionOptions<float>&, \
      const AttentionGradientExtras<float>&);                                                                          \
  PREFIX void attention_backward_impl<double>(                                                                         \
      const char*, const TensorView4<const double>&, const TensorView4<const double>&,                                 \
      const TensorView4<const double>&, const TensorView4<const double>&, const TensorView3<const double>&,            \
      const TensorView4<const double>&, const TensorView4<double>&, const TensorView4<double>&,                        \
      const TensorView4<double>&, const AttentionOptions<double>&, const AttentionGradientExtras<double>&);
#ifdef QKV_SEPARATE_COMPILATION
QKV_BACKWARD_INSTANTIATIONS(extern template)
#endif

}  // namespace QKV_ISA_NAME
}  // namespace detail

inline namespace QKV_ISA_NAME {

/// The backward pass of `attention`: the gradients of a scalar loss L with respect to q, k and v, given the forward's
/// out and lse and dL/dout.
///
///     dV_j = Σ_i Z_ij·P_ij·dO_i,   dS_ij = P_ij·(Z_ij·dO_i·v_j − D_i),   D_i = dO_i·out_i = Σ_j P_ij·Z_ij·dO_i·v_j,
///     dQ_i = Σ_j dS_ij·s'_ij·k_j,   dK_j = Σ_i dS_ij·s'_ij·q_i,   s'_ij = ∂s_ij/∂(q_i·k_j)
///
/// with P the forward's weights, Z the dropout mask scaled by 1/(1 − p) (1 without dropout) and s_ij =
/// softcap(q_i·k_j·scale) + bias_ij + alibi_ij (AttentionOptions), so s'_ij = scale·(1 − tanh²(q_i·k_j·scale/softcap))
/// with softcap and scale without.
///
/// Shapes (axes in this order, any strides with innermost stride 1): q [B, Hq, Sq, D], k [B, Hkv, Skv, D],
///   v [B, Hkv, Skv, Dv], out and d_out [B, Hq, Sq, Dv], lse [B, Hq, Sq] (the natural-log lse the forward writes);
///   d_q like q, d_k like k, d_v like v (caller-owned, written entirely, never read). `extras.d_bias` (if requested)
///   has exactly the extents of options.bias, `extras.d_sinks` (if requested) Hq entries.
/// Mapping: GQA as the forward (query head h reads kv head h / G): d_k and d_v of a kv head sum over its G query heads;
///   d_bias sums over the axes the bias broadcasts. Varlen, causal alignment, window, global tokens, key_lengths,
///   `allowed`, global positions: exactly as the forward decides visibility.
/// Preconditions: out and lse are the forward's for the same q, k, v and options (the fused backend reads them; the
///   reference backend recomputes the weights from q and k and reads out and lse only for d_sinks).
/// Parameters: options are the forward's, every option differentiated as the forward applies it: scale (an explicit 0
///   gives zero d_q and d_k), softcap (its tanh derivative), bias, ALiBi (no gradient: the slopes are constants),
///   sinks (d_sink_h = −Σ_{b,i} exp(sink_h − lse_bhi)·D_bhi), dropout (the same mask as the forward, from
///   dropout_seed, dropout_offset and the positions).
/// Edge cases: a key no query sees (hidden by any rule, padding included) gets exactly zero d_k and d_v, and its
///   values never enter the arithmetic (keys past the padding are never read; the fused kernel's finiteness scan reads
///   the others, so a NaN or ∞ stored in a hidden slot only moves its task to the exact, scalar path); a query that
///   sees no key (lse −∞, or its sink logit) gets zero d_q and contributes nothing; Sq = 0 or Skv = 0 give zeros. NaN
///   rule: a NaN or ∞ in a visible input reaches exactly the gradients that depend on it mathematically, and nothing
///   else: a term whose coefficient is exactly 0 (a hidden or dropped pair, a weight that is exactly 0, scale 0) is
///   skipped, never multiplied. So a NaN in k_j reaches d_q of the rows that see key j and d_k, d_v of every key those
///   rows see (and d_k_j); in v_j, d_q of the rows that see j (and keep it) and d_k of every key those rows see, but no
///   d_v; in q_i or d_out_i, d_q_i and d_k, d_v of every key row i sees; in a hidden key's k or v, nothing.
/// Throws: `shape_error` for any bad extent, stride or option (as the forward), an output that overlaps an input or
///   another output, extras.d_bias without options.bias or with other extents, extras.d_sinks without options.sinks
///   or without Hq entries; `unsupported_error` for `Backend::fused` with double. Nothing is written when it throws.
/// Backends: float with `automatic` or `fused` and no d_bias runs the fused backward (FlashAttention-2's: D_i =
///   rowsum(dO ∘ O), P recomputed tile by tile from lse, no Sq × Skv buffer), within 2 × the error of a plain float
///   backward + 1e-6·max(1, max|float64 gradient|) of float64; double, `reference`, or a requested d_bias run the
///   reference backward (every weight recomputed and every gradient accumulated in double, rounded once). d_sinks is
///   computed beside either, in double.
/// Complexity: O(B·Hq·Sq·Skv·(D + Dv)) time. The reference allocates O(Sq_b·Skv_b) per (sequence, kv head) in flight
///   and O(size of the bias) for d_bias; the fused backward, per thread, its task's K, V, Q and dO packed once and its
///   d_q rows (O((Skv_b + G·Sq_b)·(D + Dv)) floats) and 64-row × 128-key tiles, nothing of size Sq × Skv
///   (detail/fused_backward.hpp), all in one buffer that the calling thread keeps for its next calls, as the forward
///   keeps its packed K and V, until `qkv::release_workspace()` (attention.hpp).
/// Threads (OpenMP): work is shared over (sequence, kv head) tasks, each owning its d_k, d_v and its query heads'
///   rows of d_q, so results are bit-identical for any number of threads (a d_bias that two tasks would share runs
///   the tasks in order). The team rules are qkv::attention's.
/// Thread safety: as qkv::attention.
/// Example: tests/test_backward.cpp (finite differences of L = Σ d_out ∘ out).
/// Source: the backward of softmax attention as FlashAttention 2 (Dao 2023, Algorithm 2) writes it; the sink's
///   gradient from gpt-oss's sinks; seed 000 §2.4 (定理 2.4.1: why the 1/√D scale keeps the gradients alive).
template <class T>
void attention_backward(non_deduced_t<TensorView4<const T>> q, non_deduced_t<TensorView4<const T>> k,
                        non_deduced_t<TensorView4<const T>> v, non_deduced_t<TensorView4<const T>> out,
                        non_deduced_t<TensorView3<const T>> lse, non_deduced_t<TensorView4<const T>> d_out,
                        TensorView4<T> d_q, TensorView4<T> d_k, TensorView4<T> d_v,
                        const AttentionOptions<T>& options = AttentionOptions<T>(),
                        const AttentionGradientExtras<T>& extras = AttentionGradientExtras<T>()) {
  detail::attention_backward_impl<T>("qkv::attention_backward", q, k, v, out, lse, d_out, d_q, d_k, d_v, options,
                                     extras);
}

}  // namespace QKV_ISA_NAME
}  // namespace qkv
