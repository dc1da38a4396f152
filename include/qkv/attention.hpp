// qkv/attention.hpp — the core entry point over views: validation, GQA grouping, varlen, threading, backend.
//
// Every other entry point (the Eigen functions of sdpa.hpp, the module of multi_head.hpp) ends here. Shapes
// are checked once, at this boundary, in every build; the backends below assume them.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/fused_attention.hpp"
#include "qkv/detail/threads.hpp"
#include "qkv/errors.hpp"
#include "qkv/mask.hpp"
#include "qkv/options.hpp"
#include "qkv/reference.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {

/// Checks what every view must satisfy: non-negative extents and strides, data where there are elements,
/// innermost stride 1 (where the innermost extent exceeds 1).
template <class T, int Rank>
void check_view(const char* function, const char* argument, const TensorView<T, Rank>& view,
                const char* const* names) {
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
  check_shape(view.extent(Rank - 1) <= 1 || view.stride(Rank - 1) == 1, function, ": ", argument, " axis ",
              Rank - 1, " (", names[Rank - 1], ") has stride ", view.stride(Rank - 1),
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

/// "extents [2, 4, 3, 3], strides [36, 9, 3, 1]": how a view lays out its elements, for error messages.
template <class T, int Rank>
std::string layout_string(const TensorView<T, Rank>& view) {
  std::string text = "extents [";
  for (int axis = 0; axis < Rank; ++axis) text += (axis ? ", " : "") + std::to_string(view.extent(axis));
  text += "], strides [";
  for (int axis = 0; axis < Rank; ++axis) text += (axis ? ", " : "") + std::to_string(view.stride(axis));
  return text + "]";
}

/// "starts 20 bytes after q, which spans 384 bytes": where two overlapping views lie, for error messages.
template <class A, int RankA, class B, int RankB>
std::string overlap_string(const char* a_name, const TensorView<A, RankA>& a, const char* b_name,
                           const TensorView<B, RankB>& b) {
  const auto sa = byte_span(a), sb = byte_span(b);
  const bool after = sa[0] >= sb[0];
  return concat(a_name, " (", sa[1] - sa[0], " bytes) starts ", after ? sa[0] - sb[0] : sb[0] - sa[0], " bytes ",
                after ? "after" : "before", " the start of ", b_name, " (", sb[1] - sb[0], " bytes)");
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
    check_shape(view.extent(axis) == expected[axis] || view.extent(axis) == 1, function, ": ", argument, " axis ",
                axis, " (", names[axis], ") has extent ", view.extent(axis), ", expected ", expected[axis],
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

/// Validates the varlen offsets `cu` of one side ("cu_seqlens_q" over the q rows, "cu_seqlens_k" over k/v).
inline void check_cu_seqlens(const char* function, const char* name, const std::vector<Index>& cu, Index rows) {
  check_shape(!cu.empty(), function, ": ", name, " is empty, expected B+1 offsets");
  check_shape(cu.front() == 0, function, ": ", name, "[0] is ", cu.front(), ", expected 0");
  for (std::size_t b = 1; b < cu.size(); ++b) {
    check_shape(cu[b] >= cu[b - 1], function, ": ", name, " decreases at ", b, ": ", name, "[", b - 1,
                "] = ", cu[b - 1], " > ", name, "[", b, "] = ", cu[b]);
  }
  check_shape(cu.back() == rows, function, ": ", name, " ends at ", cu.back(), ", expected ", rows,
              " (the row count of the view)");
}

/// Validates q, k, the options and (when given) v, out and lse; returns the call's shape. Throws shape_error.
template <class T>
AttentionShape validate(const char* function, const TensorView4<const T>& q, const TensorView4<const T>& k,
                        const TensorView4<const T>* v, const TensorView4<T>* out, const TensorView3<T>* lse,
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
    for (int axis = 0; axis < 4; ++axis) check_extent(function, "out", *out, axis, out_names, expected[axis], from[axis]);
    check_shape(self_overlap_free(*out), function, ": out has strides whose elements overlap (", layout_string(*out),
                "): distinct indices would write the same element");
    const TensorView4<const T>* inputs[] = {&q, &k, v};
    const char* const input_names[] = {"q", "k", "v"};
    for (int n = 0; n < 3; ++n) {
      check_shape(!overlaps(*out, *inputs[n]), function, ": out overlaps an input (", input_names[n], "): ",
                  overlap_string("out", *out, input_names[n], *inputs[n]), "; outputs must not alias inputs");
    }
  }
  if (lse != nullptr) {
    check_view(function, "lse", *lse, lse_names);
    const Index expected[] = {B, Hq, Sq};
    for (int axis = 0; axis < 3; ++axis)
      check_extent(function, "lse", *lse, axis, lse_names, expected[axis], "the extents of q axes 0-2");
    check_shape(self_overlap_free(*lse), function, ": lse has strides whose elements overlap (", layout_string(*lse),
                "): distinct indices would write the same element");
    const TensorView4<const T>* inputs[] = {&q, &k, v};
    const char* const input_names[] = {"q", "k", "v"};
    for (int n = 0; n < 3; ++n) {
      check_shape(inputs[n] == nullptr || !overlaps(*lse, *inputs[n]), function, ": lse overlaps an input (",
                  input_names[n], "): ", overlap_string("lse", *lse, input_names[n], *inputs[n]));
    }
    check_shape(out == nullptr || !overlaps(*lse, *out), function, ": lse overlaps out: ",
                out == nullptr ? std::string() : overlap_string("lse", *lse, "out", *out));
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
    check_shape(static_cast<Index>(options.sinks.size()) == Hq, function, ": options.sinks has ",
                options.sinks.size(), " entries, expected ", Hq, " (one per query head, q axis 1)");
    for (std::size_t h = 0; h < options.sinks.size(); ++h) {
      const T sink = options.sinks[h];
      check_shape(!std::isnan(sink) && sink != std::numeric_limits<T>::infinity(), function, ": options.sinks[", h,
                  "] is ", sink, ", expected a finite number or -inf");
    }
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
    check_cu_seqlens(function, "options.cu_seqlens_q", options.cu_seqlens_q, Sq);
    check_cu_seqlens(function, "options.cu_seqlens_k", options.cu_seqlens_k, Skv);
    check_shape(options.cu_seqlens_q.size() == options.cu_seqlens_k.size(), function, ": options.cu_seqlens_q has ",
                options.cu_seqlens_q.size(), " entries and options.cu_seqlens_k ", options.cu_seqlens_k.size(),
                ", expected the same (B+1)");
    const std::size_t n_cu = options.cu_seqlens_q.size();
    check_shape(options.key_lengths.empty(), function, ": options.key_lengths cannot be combined with cu_seqlens (it has ",
                options.key_lengths.size(), " entries, cu_seqlens_q ", n_cu,
                "): varlen sequences end where cu_seqlens_k says");
    check_shape(!has_allowed, function, ": options.allowed cannot be combined with cu_seqlens (it has ",
                layout_string(options.allowed), "; cu_seqlens_q has ", n_cu, " entries)");
    check_shape(!has_bias, function, ": options.bias cannot be combined with cu_seqlens (it has ",
                layout_string(options.bias), "; cu_seqlens_q has ", n_cu, " entries)");
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
      check_shape(options.key_lengths[b] >= 0 && options.key_lengths[b] <= Skv, function, ": options.key_lengths[",
                  b, "] is ", options.key_lengths[b], ", expected a length in [0, ", Skv, "] (k axis 2, Skv)");
    }
  }
  if (has_allowed) check_mask_view<const bool, T>(function, "options.allowed", options.allowed, B, Hq, Sq, Skv);
  if (has_bias) check_mask_view<const T, T>(function, "options.bias", options.bias, B, Hq, Sq, Skv);
  shape.n_sequences = B;
  for (Index b = 0; b < B; ++b) {
    shape.q_rows.push_back({0, Sq});
    shape.kv_rows.push_back({0, Skv});
    shape.key_counts.push_back(options.key_lengths.empty() ? Skv : options.key_lengths[static_cast<std::size_t>(b)]);
  }
  return shape;
}

/// Rows [rows.begin, rows.begin + rows.length) of the (b, h) slice of a [B, H, S, D] view, as an Eigen map.
/// A view without elements may have null data (out with Dv = 0): its rows then start at 0, since offsetting a
/// null pointer is undefined behaviour (found by fuzz/fuzz_attention.cpp: varlen, Dv = 0, reference backend).
template <class T>
auto rows_of(const TensorView4<T>& view, Index b, Index h, SequenceRows rows) {
  return slice(view, b, h).middleRows(view.data() == nullptr ? 0 : rows.begin, rows.length);
}

/// Whether the fused kernel serves this call: `automatic` picks it for float, `fused` demands it (and throws
/// unsupported_error for a scalar type without one: double stays on the reference path), `reference` never.
template <class T>
bool use_fused(const char* function, const AttentionOptions<T>& options) {
  constexpr bool kHasFused = std::is_same_v<T, float>;
  if (options.backend == Backend::fused && !kHasFused) {
    raise<unsupported_error>(concat(function, ": Backend::fused exists for float only; double runs on "
                                              "Backend::reference (or Backend::automatic)"));
  }
  return kHasFused && options.backend != Backend::reference;
}

/// The reference backend over every (sequence, query head).
template <class T>
void run_reference(const AttentionShape& shape, const TensorView4<const T>& q, const TensorView4<const T>& k,
                   const TensorView4<const T>& v, const TensorView4<T>& out, const TensorView3<T>* lse,
                   const AttentionOptions<T>& options) {
  const Index tasks = shape.n_sequences * shape.Hq;
#if defined(_OPENMP)
#pragma omp parallel if (tasks > 1 && q.size() * k.extent(2) > (Index(1) << 16) && may_open_team())
#endif
  {
    observe_team();
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index task = 0; task < tasks; ++task) {
      const Index b = task / shape.Hq, h = task % shape.Hq, h_kv = h / shape.group;
      const Index view_b = shape.varlen ? 0 : b;
      const SequenceRows q_rows = shape.q_rows[static_cast<std::size_t>(b)];
      const SequenceRows kv_rows = shape.kv_rows[static_cast<std::size_t>(b)];
      const Index skv = shape.key_counts[static_cast<std::size_t>(b)];
      const HeadMask<T> mask = HeadMask<T>::make(options, view_b, h, q_rows.length, skv, shape.D);
      const double sink = options.sinks.empty() ? -std::numeric_limits<double>::infinity()
                                                : static_cast<double>(options.sinks[static_cast<std::size_t>(h)]);
      T* lse_data = nullptr;
      Index lse_stride = 0;
      if (lse != nullptr && q_rows.length > 0) {
        lse_data = &(*lse)(view_b, h, q_rows.begin);
        lse_stride = lse->stride(2);
      }
      reference::head_attention(rows_of(q, view_b, h, q_rows), rows_of(k, view_b, h_kv, kv_rows),
                                rows_of(v, view_b, h_kv, kv_rows), mask, sink, rows_of(out, view_b, h, q_rows),
                                lse_data, lse_stride);
    }
  }
}

inline namespace QKV_ISA_NAME {

/// Validates, picks the backend and runs the call. In the ISA-named inline namespace: its body depends on the
/// build's ISA through the fused kernel (STYLE.md, ODR safety).
template <class T>
void attention_impl(const char* function, const TensorView4<const T>& q, const TensorView4<const T>& k,
                    const TensorView4<const T>& v, const TensorView4<T>& out, const TensorView3<T>* lse,
                    const AttentionOptions<T>& options) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "qkv: the scalar type must be float or double");
  const AttentionShape shape = validate(function, q, k, &v, &out, lse, options);
  if constexpr (std::is_same_v<T, float>) {
    if (use_fused(function, options)) {
      FusedAttention<simd::BestTag>(shape, q, k, v, out, lse, options).run();
      return;
    }
  } else {
    (void)use_fused(function, options);
  }
  run_reference(shape, q, k, v, out, lse, options);
}

}  // namespace QKV_ISA_NAME
}  // namespace detail

inline namespace QKV_ISA_NAME {

/// Scaled dot-product attention over strided views, all heads and batch entries at once.
///
///     out[b, h, i, :] = Σ_j softmax_j(s_ij) · v[b, h / G, j, :],   s_ij = softcap(q_i·k_j·scale) + bias_ij + alibi_ij
///
/// Shapes (axes in this order, any strides with innermost stride 1):
///   q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] → out [B, Hq, Sq, Dv] (caller-owned, written, never
///   read). With varlen (`options.cu_seqlens_q/k`) B = 1 and sequence b owns rows [cu[b], cu[b+1]).
/// GQA: query head h reads key/value head h / G, G = Hq / Hkv (contiguous groups, as Llama and PyTorch's
///   `enable_gqa`); Hkv = Hq is multi-head attention, Hkv = 1 multi-query attention. Example: Hq = 6, Hkv = 2 →
///   query heads 0, 1, 2 read kv head 0 and 3, 4, 5 read kv head 1.
/// Masks: see `AttentionOptions` (causal alignment, window, key padding, `allowed`, `bias`); the default causal
///   alignment is bottom-right, unlike PyTorch's `is_causal` (top-left).
/// Edge cases: a query that sees no key gets zeros (lse −∞); Skv = 0 gives zeros; Sq = 0 writes nothing; dv may
///   differ from dk; NaN or ∞ in hidden K/V slots never reaches the output; NaN in a visible q, k or v makes
///   only the rows it touches NaN.
/// Throws: `shape_error` for any bad extent, stride, overlap or option (the message names the function, the
///   argument, the axis and both sizes); `unsupported_error` for `Backend::fused` where it does not exist.
///   Nothing is read or written when it throws.
/// Backends: `automatic` runs the fused kernel (detail/fused_attention.hpp, FlashAttention-2 on the CPU) for
///   float and the reference path (float64 accumulation, reference.hpp) for double; `fused` for double throws.
///   The fused float output is within 2 × the error of a plain float implementation + 1e-6·max(1, max|V|) of
///   float64; the reference path within 1e-6·max(1, max|V|).
/// Complexity: O(B·Hq·Sq·Skv·(D + Dv)) time, about half that with causal masking and O(Sq·w) per head with a
///   window of w keys on the fused path (hidden key tiles are never visited). Memory: the fused kernel allocates
///   the size of K and V (both packed once per call, except when decoding; V's rows rounded up to a multiple of
///   2 × the vector width, 16 floats with AVX2) and a few hundred KiB of scratch per thread (bench_attention's
///   alloc_MiB: 64.4 MiB at B = 1, H = 8, T = 16384, D = 64, inputs 128 MiB),
///   nothing of size Sq × Skv; the reference backend allocates O(Sq·Skv) per (sequence, head) in flight.
/// Threads (OpenMP builds): a call large enough to pay for a team (about 2^20 multiply-adds on the fused path)
///   shares its work over (sequence, kv head, query tile, key chunk) among omp_get_max_threads() threads, the
///   calling thread's own setting (OMP_NUM_THREADS for all threads, omp_set_num_threads(n) for the thread that
///   calls it). Called inside an active `#pragma omp parallel` region (omp_in_parallel()), it runs on the calling
///   thread alone and never opens a nested team, whatever omp_get_max_active_levels() allows. Each std::thread
///   that calls at the same time opens its own team: N callers use up to N × omp_get_max_threads() threads, so
///   call omp_set_num_threads(1) in each caller (or set OMP_NUM_THREADS=1) to keep one thread per caller.
///   Results are bit-identical for any number of threads, inside or outside a parallel region.
/// Thread safety: concurrent calls from any threads (std::thread or OpenMP) are safe if their outputs do not
///   overlap each other or another call's inputs; inputs and options may be shared.
/// Example: examples/worked_example.cpp (through the Eigen entry points), tests/test_reference.cpp.
/// Source: Vaswani et al. 2017, seed 000 定义 2.4.1; masks and varlen as FlashAttention 2.
template <class T>
void attention(non_deduced_t<TensorView4<const T>> q, non_deduced_t<TensorView4<const T>> k,
               non_deduced_t<TensorView4<const T>> v, TensorView4<T> out,
               const AttentionOptions<T>& options = AttentionOptions<T>()) {
  detail::attention_impl<T>("qkv::attention", q, k, v, out, nullptr, options);
}

/// As above, and also writes lse [B, Hq, Sq]: the natural log of each row's softmax denominator,
/// log(Σ_visible exp(s_ij) + exp(sink)), scale and bias included; −∞ for a row that sees no key (FlashAttention
/// reports +∞ there; we report the mathematical log 0), or the sink logit when `sinks` is set. `lse` must not
/// overlap q, k, v or out. Use it to combine partial results with `merge_attention_states`.
template <class T>
void attention(non_deduced_t<TensorView4<const T>> q, non_deduced_t<TensorView4<const T>> k,
               non_deduced_t<TensorView4<const T>> v, TensorView4<T> out, TensorView3<T> lse,
               const AttentionOptions<T>& options = AttentionOptions<T>()) {
  detail::attention_impl<T>("qkv::attention", q, k, v, out, &lse, options);
}

}  // namespace QKV_ISA_NAME

/// Combines attention computed over disjoint key sets of the same queries (split-K, key shards, ring
/// attention), row by row:
///
///     lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a − lse)·out_a + exp(lse_b − lse)·out_b
///
/// Shapes: out_a, out_b, out [B, H, S, Dv]; lse_a, lse_b, lse [B, H, S] (any strides, innermost stride 1).
/// Exact up to rounding. A state with lse = −∞ contributes nothing (its out is not read); two such states
/// give zeros and −∞. `out` and `lse` may be the same memory as `out_a` and `lse_a` (identical views: in-place
/// accumulation); no other overlap is allowed.
/// Throws: `shape_error` for mismatched extents, bad strides or a forbidden overlap.
/// Complexity: O(B·H·S·Dv), no allocation. Thread safety: as `attention`.
/// Source: the split-KV combine of FlashAttention 2 and ggml (merging partials by their log-sum-exp).
template <class T>
void merge_attention_states(non_deduced_t<TensorView4<const T>> out_a, non_deduced_t<TensorView3<const T>> lse_a,
                            non_deduced_t<TensorView4<const T>> out_b, non_deduced_t<TensorView3<const T>> lse_b,
                            TensorView4<T> out, TensorView3<T> lse) {
  const char* function = "qkv::merge_attention_states";
  static const char* const out_names[] = {"B", "H", "S", "Dv"};
  static const char* const lse_names[] = {"B", "H", "S"};
  detail::check_view(function, "out_a", out_a, out_names);
  detail::check_view(function, "out_b", out_b, out_names);
  detail::check_view(function, "out", out, out_names);
  detail::check_view(function, "lse_a", lse_a, lse_names);
  detail::check_view(function, "lse_b", lse_b, lse_names);
  detail::check_view(function, "lse", lse, lse_names);
  for (int axis = 0; axis < 4; ++axis) {
    detail::check_extent(function, "out_b", out_b, axis, out_names, out_a.extent(axis), "the extent of out_a");
    detail::check_extent(function, "out", out, axis, out_names, out_a.extent(axis), "the extent of out_a");
  }
  for (int axis = 0; axis < 3; ++axis) {
    detail::check_extent(function, "lse_a", lse_a, axis, lse_names, out_a.extent(axis), "the extent of out_a");
    detail::check_extent(function, "lse_b", lse_b, axis, lse_names, out_a.extent(axis), "the extent of out_a");
    detail::check_extent(function, "lse", lse, axis, lse_names, out_a.extent(axis), "the extent of out_a");
  }
  const TensorView4<const T> out_view = out;
  const TensorView3<const T> lse_view = lse;
  const bool out_in_place = out.data() == out_a.data() && out.strides() == out_a.strides();
  const bool lse_in_place = lse.data() == lse_a.data() && lse.strides() == lse_a.strides();
  detail::check_shape(detail::self_overlap_free(out), function, ": out has strides whose elements overlap (",
                      detail::layout_string(out), "): distinct indices would write the same element");
  detail::check_shape(detail::self_overlap_free(lse), function, ": lse has strides whose elements overlap (",
                      detail::layout_string(lse), "): distinct indices would write the same element");
  detail::check_shape(out_in_place || !detail::overlaps(out_view, out_a), function,
                      ": out overlaps out_a without being the same view (only exact in-place use is allowed): ",
                      detail::overlap_string("out", out_view, "out_a", out_a));
  detail::check_shape(lse_in_place || !detail::overlaps(lse_view, lse_a), function,
                      ": lse overlaps lse_a without being the same view (only exact in-place use is allowed): ",
                      detail::overlap_string("lse", lse_view, "lse_a", lse_a));
  const auto check_apart = [function](const char* a_name, const auto& a, const char* b_name, const auto& b) {
    detail::check_shape(!detail::overlaps(a, b), function, ": ", a_name, " overlaps ", b_name, ": ",
                        detail::overlap_string(a_name, a, b_name, b));
  };
  check_apart("out", out_view, "out_b", out_b);
  check_apart("out", out_view, "lse_a", lse_a);
  check_apart("out", out_view, "lse_b", lse_b);
  check_apart("out", out_view, "lse", lse_view);
  check_apart("lse", lse_view, "lse_b", lse_b);
  check_apart("lse", lse_view, "out_a", out_a);
  check_apart("lse", lse_view, "out_b", out_b);
  const Index Dv = out_a.extent(3);
  for (Index b = 0; b < out_a.extent(0); ++b) {
    for (Index h = 0; h < out_a.extent(1); ++h) {
      for (Index i = 0; i < out_a.extent(2); ++i) {
        T merged_lse;
        const T* a = Dv > 0 ? &out_a(b, h, i, 0) : nullptr;
        const T* bb = Dv > 0 ? &out_b(b, h, i, 0) : nullptr;
        T* o = Dv > 0 ? &out(b, h, i, 0) : nullptr;
        detail::merge_state(a, lse_a(b, h, i), bb, lse_b(b, h, i), o, merged_lse, Dv);
        lse(b, h, i) = merged_lse;
      }
    }
  }
}

}  // namespace qkv
