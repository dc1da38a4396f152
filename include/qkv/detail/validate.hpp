// qkv/detail/validate.hpp — the checks every entry point makes at the boundary (internal).
//
// `validate` checks a core call (views, extents, overlaps, options, varlen offsets) and returns its
// `AttentionShape`; `qkv::attention` and the Eigen entry points call it once, in every build, and the backends
// below assume what it checked (STYLE.md: validate at the boundary, assume inside). The smaller checks here are
// shared: `merge_attention_states` checks its views with them, the module (multi_head.hpp) checks its varlen
// offsets with `check_cu_seqlens` before it projects, and the Eigen entry points (sdpa.hpp) and the module check
// their scalar type with `check_scalar_type` and view packed-heads matrices with `packed_heads_view`. Every failure
// throws shape_error (aborts without exceptions) with the function, argument, axis and both sizes in the message.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/errors.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {

/// The scalar types qkv computes in; checked at compile time by every entry point that deduces its scalar type.
template <class Scalar>
constexpr void check_scalar_type() {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "qkv: the scalar type must be float or double");
}

/// A packed-heads matrix as a zero-copy [1, H, T, D] view: T rows, head h in columns [h·D, (h+1)·D), row-major
/// with `row_stride` elements from one row to the next (its column count H·D when dense). This is how the Eigen
/// entry points and the module hand Q = X·W_q, K, V and the output to the core: the G query heads of a group read
/// the same K/V memory, nothing is copied.
template <class T>
TensorView4<T> packed_heads_view(T* data, Index rows, Index heads, Index head_dim, Index row_stride) {
  return TensorView4<T>(data, {1, heads, rows, head_dim}, {rows * row_stride, head_dim, row_stride, 1});
}

/// Checks what every view must satisfy: non-negative extents and strides, data where there are elements,
/// innermost stride 1 (where the innermost extent exceeds 1).
template <class T, int Rank>
void check_view(const char* function, const char* argument, const TensorView<T, Rank>& view, const char* const* names) {
  for (int axis = 0; axis < Rank; ++axis) {
    check_shape(view.extent(axis) >= 0, function, ": ", argument, " axis ", axis, " (", names[axis],
                ") has negative extent ", view.extent(axis));
  }
  for (int axis = 0; axis < Rank; ++axis) {
    check_shape(view.stride(axis) >= 0, function, ": ", argument, " axis ", axis, " (", names[axis],
                ") has negative stride ", view.stride(axis), "; reverse the data instead");
  }
  check_shape(view.size() == 0 || view.data() != nullptr, function, ": ", argument, " has ", view.size(),
              " elements but null data");
  check_shape(view.extent(Rank - 1) <= 1 || view.stride(Rank - 1) == 1, function, ": ", argument, " axis ", Rank - 1,
              " (", names[Rank - 1], ") has stride ", view.stride(Rank - 1),
              ", expected 1 (the innermost axis must be contiguous)");
}

template <class T, int Rank>
void check_extent(const char* function, const char* argument, const TensorView<T, Rank>& view, int axis,
                  const char* const* names, Index expected, const char* expected_from) {
  check_shape(view.extent(axis) == expected, function, ": ", argument, " axis ", axis, " (", names[axis],
              ") has extent ", view.extent(axis), ", expected ", expected, " (", expected_from, ")");
}

/// [first byte, one past the last byte] that a view may touch; {0, 0} when it has no element.
template <class T, int Rank>
std::array<std::uintptr_t, 2> byte_span(const TensorView<T, Rank>& view) {
  if (view.size() == 0) return {0, 0};
  Index last = 0;
  for (int axis = 0; axis < Rank; ++axis) last += (view.extent(axis) - 1) * view.stride(axis);
  const auto begin = reinterpret_cast<std::uintptr_t>(view.data());
  return {begin, begin + static_cast<std::uintptr_t>(last + 1) * sizeof(T)};
}

/// "extents [2, 4, 3, 3], strides [36, 9, 3, 1]": how a view lays out its elements, for error messages; written only
/// when streamed (a `Deferred` part: check_shape on success builds nothing). `view` must outlive the returned part.
template <class T, int Rank>
auto describe_layout(const TensorView<T, Rank>& view) {
  return deferred([&view](std::ostream& stream) {
    stream << "extents [";
    for (int axis = 0; axis < Rank; ++axis) stream << (axis ? ", " : "") << view.extent(axis);
    stream << "], strides [";
    for (int axis = 0; axis < Rank; ++axis) stream << (axis ? ", " : "") << view.stride(axis);
    stream << "]";
  });
}

/// "q (384 bytes) starts 20 bytes after the start of k (384 bytes)": where two overlapping views lie, for error
/// messages; written only when streamed, like describe_layout. The views must outlive the returned part.
template <class A, int RankA, class B, int RankB>
auto describe_overlap(const char* a_name, const TensorView<A, RankA>& a, const char* b_name,
                      const TensorView<B, RankB>& b) {
  return deferred([a_name, &a, b_name, &b](std::ostream& stream) {
    const auto sa = byte_span(a), sb = byte_span(b);
    const bool after = sa[0] >= sb[0];
    stream << a_name << " (" << sa[1] - sa[0] << " bytes) starts " << (after ? sa[0] - sb[0] : sb[0] - sa[0])
           << " bytes " << (after ? "after" : "before") << " the start of " << b_name << " (" << sb[1] - sb[0]
           << " bytes)";
  });
}

template <class A, int RankA, class B, int RankB>
bool overlaps(const TensorView<A, RankA>& a, const TensorView<B, RankB>& b) {
  const auto sa = byte_span(a), sb = byte_span(b);
  return sa[0] < sa[1] && sb[0] < sb[1] && sa[0] < sb[1] && sb[0] < sa[1];
}

/// Whether distinct indices of a view address distinct elements (checked on outputs). Sufficient test:
/// sorted by stride, each axis of extent > 1 steps over the whole span of the axes inside it.
template <class T, int Rank>
bool self_overlap_free(const TensorView<T, Rank>& view) {
  if (view.size() == 0) return true;
  std::array<int, Rank> order;
  int n = 0;
  for (int axis = 0; axis < Rank; ++axis) {
    if (view.extent(axis) > 1) order[n++] = axis;
  }
  for (int r = 1; r < n; ++r) {  // insertion sort by stride (at most Rank elements)
    for (int t = r; t > 0 && view.stride(order[t]) < view.stride(order[t - 1]); --t) std::swap(order[t], order[t - 1]);
  }
  Index span = 1;
  for (int r = 0; r < n; ++r) {
    if (view.stride(order[r]) < span) return false;
    span = view.stride(order[r]) * (view.extent(order[r]) - 1) + span;
  }
  return true;
}

template <class M, class T>
void check_mask_view(const char* function, const char* argument, const TensorView4<M>& view, Index B, Index Hq,
                     Index Sq, Index Skv) {
  static const char* const names[] = {"B", "Hq", "Sq", "Skv"};
  check_view(function, argument, view, names);
  const Index expected[] = {B, Hq, Sq};
  for (int axis = 0; axis < 3; ++axis) {
    check_shape(view.extent(axis) == expected[axis] || view.extent(axis) == 1, function, ": ", argument, " axis ", axis,
                " (", names[axis], ") has extent ", view.extent(axis), ", expected ", expected[axis],
                " or 1 (broadcast)");
  }
  check_extent(function, argument, view, 3, names, Skv, "the extent of k axis 2");
  (void)sizeof(T);
}

template <class T>
bool is_set(const TensorView4<T>& view) {
  if (view.data() != nullptr) return true;
  for (Index e : view.extents()) {
    if (e != 0) return true;
  }
  return false;
}

/// Validates the varlen offsets `cu` of one side ("options.cu_seqlens_q" over the q rows, "options.cu_seqlens_k"
/// over k/v): B+1 entries, cu[0] = 0, non-decreasing (empty sequences allowed), last = `rows`. `rows_from` names
/// those rows in the message: "the row count of the view" for the core; the module checks its inputs' rows with
/// "the rows of ", "X" before it projects them.
template <class... RowsFrom>
void check_cu_seqlens(const char* function, const char* name, const std::vector<Index>& cu, Index rows,
                      const RowsFrom&... rows_from) {
  check_shape(!cu.empty(), function, ": ", name, " is empty, expected B+1 offsets");
  check_shape(cu.front() == 0, function, ": ", name, "[0] is ", cu.front(), ", expected 0");
  for (std::size_t b = 1; b < cu.size(); ++b) {
    check_shape(cu[b] >= cu[b - 1], function, ": ", name, " decreases at ", b, ": ", name, "[", b - 1,
                "] = ", cu[b - 1], " > ", name, "[", b, "] = ", cu[b]);
  }
  check_shape(cu.back() == rows, function, ": ", name, " ends at ", cu.back(), ", expected ", rows, " (", rows_from...,
              ")");
}

/// Validates q, k, the options and (when given) v, out and lse; returns the call's shape. Throws shape_error.
template <class T, class S = T>
AttentionShape validate(const char* function, const TensorView4<const T>& q, const TensorView4<const S>& k,
                        const non_deduced_t<TensorView4<const S>>* v, const TensorView4<T>* out, const TensorView3<T>* lse,
                        const AttentionOptions<T>& options) {
  static const char* const q_names[] = {"B", "Hq", "Sq", "D"};
  static const char* const k_names[] = {"B", "Hkv", "Skv", "D"};
  static const char* const v_names[] = {"B", "Hkv", "Skv", "Dv"};
  static const char* const out_names[] = {"B", "Hq", "Sq", "Dv"};
  static const char* const lse_names[] = {"B", "Hq", "Sq"};
  check_view(function, "q", q, q_names);
  check_view(function, "k", k, k_names);
  const Index B = q.extent(0), Hq = q.extent(1), Sq = q.extent(2), D = q.extent(3);
  const Index Hkv = k.extent(1), Skv = k.extent(2);
  check_extent(function, "k", k, 0, k_names, B, "the extent of q axis 0");
  check_extent(function, "k", k, 3, k_names, D, "the extent of q axis 3");
  check_shape(D >= 1, function, ": q axis 3 (D) has extent 0, expected at least 1");
  check_shape(Hkv >= 1 || Hq == 0, function, ": k axis 1 (Hkv) has extent 0 but q has ", Hq, " heads");
  check_shape(Hkv == 0 || Hq % Hkv == 0, function, ": q axis 1 (Hq) has extent ", Hq,
              ", not a multiple of k axis 1 (Hkv) extent ", Hkv, " (GQA needs Hq % Hkv == 0)");
  Index Dv = 0;
  if (v != nullptr) {
    check_view(function, "v", *v, v_names);
    check_extent(function, "v", *v, 0, v_names, B, "the extent of q axis 0");
    check_extent(function, "v", *v, 1, v_names, Hkv, "the extent of k axis 1");
    check_extent(function, "v", *v, 2, v_names, Skv, "the extent of k axis 2");
    Dv = v->extent(3);
  }
  if (out != nullptr) {
    check_view(function, "out", *out, out_names);
    const Index expected[] = {B, Hq, Sq, Dv};
    const char* const from[] = {"the extent of q axis 0", "the extent of q axis 1", "the extent of q axis 2",
                                "the extent of v axis 3"};
    for (int axis = 0; axis < 4; ++axis)
      check_extent(function, "out", *out, axis, out_names, expected[axis], from[axis]);
    check_shape(self_overlap_free(*out), function, ": out has strides whose elements overlap (", describe_layout(*out),
                "): distinct indices would write the same element");
    const auto check_input = [&](const char* name, const auto& input) {
      check_shape(!overlaps(*out, input), function, ": out overlaps an input (", name, "): ",
                  describe_overlap("out", *out, name, input), "; outputs must not alias inputs");
    };
    check_input("q", q);
    check_input("k", k);
    if (v != nullptr) check_input("v", *v);
  }
  if (lse != nullptr) {
    check_view(function, "lse", *lse, lse_names);
    const Index expected[] = {B, Hq, Sq};
    for (int axis = 0; axis < 3; ++axis)
      check_extent(function, "lse", *lse, axis, lse_names, expected[axis], "the extents of q axes 0-2");
    check_shape(self_overlap_free(*lse), function, ": lse has strides whose elements overlap (", describe_layout(*lse),
                "): distinct indices would write the same element");
    const auto check_input = [&](const char* name, const auto& input) {
      check_shape(!overlaps(*lse, input), function, ": lse overlaps an input (", name, "): ",
                  describe_overlap("lse", *lse, name, input));
    };
    check_input("q", q);
    check_input("k", k);
    if (v != nullptr) check_input("v", *v);
    if (out != nullptr) {
      check_shape(!overlaps(*lse, *out), function, ": lse overlaps out: ", describe_overlap("lse", *lse, "out", *out));
    }
  }

  // Options.
  if (options.scale) {
    check_shape(std::isfinite(*options.scale), function, ": options.scale is ", *options.scale,
                ", expected a finite number");
  }
  check_shape(std::isfinite(options.softcap) && options.softcap >= T(0), function, ": options.softcap is ",
              options.softcap, ", expected 0 (off) or a finite positive number");
  check_shape(options.window_left >= -1, function, ": options.window_left is ", options.window_left,
              ", expected -1 (unbounded) or at least 0");
  check_shape(options.window_right >= -1, function, ": options.window_right is ", options.window_right,
              ", expected -1 (unbounded) or at least 0");
  check_shape(options.global_tokens >= 0, function, ": options.global_tokens is ", options.global_tokens,
              ", expected at least 0");
  if (!options.alibi_slopes.empty()) {
    check_shape(static_cast<Index>(options.alibi_slopes.size()) == Hq, function, ": options.alibi_slopes has ",
                options.alibi_slopes.size(), " entries, expected ", Hq, " (one per query head, q axis 1)");
    for (std::size_t h = 0; h < options.alibi_slopes.size(); ++h) {
      check_shape(std::isfinite(options.alibi_slopes[h]), function, ": options.alibi_slopes[", h, "] is ",
                  options.alibi_slopes[h], ", expected a finite number");
    }
  }
  if (!options.sinks.empty()) {
    check_shape(static_cast<Index>(options.sinks.size()) == Hq, function, ": options.sinks has ", options.sinks.size(),
                " entries, expected ", Hq, " (one per query head, q axis 1)");
    for (std::size_t h = 0; h < options.sinks.size(); ++h) {
      const T sink = options.sinks[h];
      check_shape(!std::isnan(sink) && sink != std::numeric_limits<T>::infinity(), function, ": options.sinks[", h,
                  "] is ", sink, ", expected a finite number or -inf");
    }
  }

  // Dropout (options.hpp, dropout.hpp): a probability; NaN fails both comparisons.
  check_shape(options.dropout_p >= T(0) && options.dropout_p <= T(1), function, ": options.dropout_p is ",
              options.dropout_p, ", expected a probability in [0, 1]");

  // Global positions: the call's rows are a shard of a longer sequence (options.hpp, GlobalPositions).
  Index key_length_bound = Skv;  // key lengths are counted in the view's keys, or in the global ones
  Index k_begin = 0;
  if (options.global_positions) {
    const GlobalPositions& g = *options.global_positions;
    check_shape(g.q_begin >= 0 && g.k_begin >= 0 && g.sq >= 0 && g.skv >= 0, function,
                ": options.global_positions is {q_begin ", g.q_begin, ", k_begin ", g.k_begin, ", sq ", g.sq, ", skv ",
                g.skv, "}, expected no negative field");
    // Written without q_begin + Sq, which could overflow for absurd positions.
    check_shape(Sq <= g.sq && g.q_begin <= g.sq - Sq, function, ": options.global_positions puts q's ", Sq,
                " rows (q axis 2, Sq) from global row ", g.q_begin, ", past the global Sq ", g.sq,
                " (expected q_begin + Sq <= sq)");
    check_shape(Skv <= g.skv && g.k_begin <= g.skv - Skv, function, ": options.global_positions puts k's ", Skv,
                " rows (k axis 2, Skv) from global row ", g.k_begin, ", past the global Skv ", g.skv,
                " (expected k_begin + Skv <= skv)");
    check_shape(options.cu_seqlens_q.empty() && options.cu_seqlens_k.empty(), function,
                ": options.global_positions cannot be combined with cu_seqlens (cu_seqlens_q has ",
                options.cu_seqlens_q.size(), " entries, cu_seqlens_k ", options.cu_seqlens_k.size(), ")");
    key_length_bound = g.skv;
    k_begin = g.k_begin;
  }

  AttentionShape shape;
  shape.Hq = Hq;
  shape.Hkv = Hkv;
  shape.group = Hkv > 0 ? Hq / Hkv : 1;
  shape.D = D;
  shape.Dv = Dv;
  const bool has_allowed = is_set(options.allowed), has_bias = is_set(options.bias);
  shape.varlen = !options.cu_seqlens_q.empty() || !options.cu_seqlens_k.empty();
  if (shape.varlen) {
    check_shape(B == 1, function, ": q axis 0 (B) has extent ", B, ", expected 1 with cu_seqlens (varlen)");
    check_cu_seqlens(function, "options.cu_seqlens_q", options.cu_seqlens_q, Sq, "the row count of the view");
    check_cu_seqlens(function, "options.cu_seqlens_k", options.cu_seqlens_k, Skv, "the row count of the view");
    check_shape(options.cu_seqlens_q.size() == options.cu_seqlens_k.size(), function, ": options.cu_seqlens_q has ",
                options.cu_seqlens_q.size(), " entries and options.cu_seqlens_k ", options.cu_seqlens_k.size(),
                ", expected the same (B+1)");
    const std::size_t n_cu = options.cu_seqlens_q.size();
    check_shape(options.key_lengths.empty(), function,
                ": options.key_lengths cannot be combined with cu_seqlens (it has ", options.key_lengths.size(),
                " entries, cu_seqlens_q ", n_cu, "): varlen sequences end where cu_seqlens_k says");
    check_shape(!has_allowed, function, ": options.allowed cannot be combined with cu_seqlens (it has ",
                describe_layout(options.allowed), "; cu_seqlens_q has ", n_cu, " entries)");
    check_shape(!has_bias, function, ": options.bias cannot be combined with cu_seqlens (it has ",
                describe_layout(options.bias), "; cu_seqlens_q has ", n_cu, " entries)");
    shape.n_sequences = static_cast<Index>(options.cu_seqlens_q.size()) - 1;
    for (Index b = 0; b < shape.n_sequences; ++b) {
      const std::size_t s = static_cast<std::size_t>(b);
      shape.q_rows.push_back({options.cu_seqlens_q[s], options.cu_seqlens_q[s + 1] - options.cu_seqlens_q[s]});
      shape.kv_rows.push_back({options.cu_seqlens_k[s], options.cu_seqlens_k[s + 1] - options.cu_seqlens_k[s]});
      shape.key_counts.push_back(shape.kv_rows.back().length);
    }
    return shape;
  }
  if (!options.key_lengths.empty()) {
    check_shape(static_cast<Index>(options.key_lengths.size()) == B, function, ": options.key_lengths has ",
                options.key_lengths.size(), " entries, expected ", B, " (one per batch entry, q axis 0)");
    for (std::size_t b = 0; b < options.key_lengths.size(); ++b) {
      check_shape(options.key_lengths[b] >= 0 && options.key_lengths[b] <= key_length_bound, function,
                  ": options.key_lengths[", b, "] is ", options.key_lengths[b], ", expected a length in [0, ",
                  key_length_bound, "] (", options.global_positions ? "options.global_positions.skv" : "k axis 2, Skv",
                  ")");
    }
  }
  if (has_allowed) check_mask_view<const bool, T>(function, "options.allowed", options.allowed, B, Hq, Sq, Skv);
  if (has_bias) check_mask_view<const T, T>(function, "options.bias", options.bias, B, Hq, Sq, Skv);
  shape.n_sequences = B;
  for (Index b = 0; b < B; ++b) {
    shape.q_rows.push_back({0, Sq});
    shape.kv_rows.push_back({0, Skv});
    // Skv_b counted in this view's keys: the keys before the (global) length that the view holds.
    const Index length =
        options.key_lengths.empty() ? key_length_bound : options.key_lengths[static_cast<std::size_t>(b)];
    shape.key_counts.push_back(std::clamp<Index>(length - k_begin, 0, Skv));
  }
  return shape;
}

}  // namespace detail
}  // namespace qkv
