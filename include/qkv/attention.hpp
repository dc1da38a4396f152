// qkv/attention.hpp — the core entry point over views: validation, GQA grouping, varlen, threading, backend.
//
// Every other entry point (the Eigen functions of sdpa.hpp, the module of multi_head.hpp) ends here. Shapes
// are checked once, at this boundary, in every build; the backends below assume them.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

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
#include "qkv/simd/exp_constants.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {

/// Rows [rows.begin, rows.begin + rows.length) of the (b, h) slice of a [B, H, S, D] view, as an Eigen map.
/// A view without elements may have null data (out with Dv = 0): its rows then start at 0, since offsetting a
/// null pointer is undefined behaviour (fuzz/README.md, finding 3).
template <class T>
auto rows_of(const TensorView4<T>& view, Index b, Index h, SequenceRows rows) {
  return slice(view, b, h).middleRows(view.data() == nullptr ? 0 : rows.begin, rows.length);
}

/// Whether S is a 16-bit storage type for keys and values: Eigen::half (IEEE binary16) or Eigen::bfloat16.
template <class S>
inline constexpr bool is_kv16_v = std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>;

/// Whether the fused kernel serves this call: `automatic` picks it for float, `fused` demands it (and throws
/// unsupported_error for a scalar type without one: double stays on the reference path), `reference` never.
template <class T>
bool use_fused(const char* function, const AttentionOptions<T>& options) {
  constexpr bool kHasFused = std::is_same_v<T, float>;
  if (options.backend == Backend::fused && !kHasFused) {
    raise<unsupported_error>(concat(function,
                                    ": Backend::fused exists for float only; double runs on "
                                    "Backend::reference (or Backend::automatic)"));
  }
  return kHasFused && options.backend != Backend::reference;
}

// From here on every function reads AttentionParams (ISA-named: mask.hpp) or runs the fused kernel.
inline namespace QKV_ISA_NAME {

/// The call's parameters, resolved once from its validated options (attention_params.hpp): both backends read
/// these, never the options.
template <class T>
AttentionParams<T> resolve_params(const AttentionOptions<T>& options, Index D) noexcept {
  AttentionParams<T> params;
  params.rules = MaskRules<T>::of(options, D);
  params.scale_log2e = params.rules.scale * static_cast<T>(simd::exp_constants::kLog2e);
  params.sinks = options.sinks.empty() ? nullptr : options.sinks.data();
  params.dropout = DropoutRule<T>::make(options.dropout_p, options.dropout_seed, options.dropout_offset);
  if (options.global_positions) {
    params.dropout_q_begin = options.global_positions->q_begin;
    params.dropout_k_begin = options.global_positions->k_begin;
  }
  return params;
}

/// The reference backend over every (sequence, query head); K and V stored as S (T, or a 16-bit type whose values
/// convert exactly to the accumulation type). Dropout keys on the sequence index b (batch entry or varlen sequence)
/// and on positions in the sequence (global ones with global positions).
template <class T, class S>
void run_reference(const AttentionShape& shape, const TensorView4<const T>& q, const TensorView4<const S>& k,
                   const TensorView4<const S>& v, const TensorView4<T>& out, const TensorView3<T>* lse,
                   const AttentionParams<T>& params) {
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
      const HeadMask<T> mask = params.head_mask(view_b, h, q_rows.length, skv);
      const double sink = static_cast<double>(params.sink(h));
      T* lse_data = nullptr;
      Index lse_stride = 0;
      if (lse != nullptr && q_rows.length > 0) {
        lse_data = &(*lse)(view_b, h, q_rows.begin);
        lse_stride = lse->stride(2);
      }
      const reference::HeadDropout<T> dropout{&params.dropout, b, h, params.dropout_q_begin, params.dropout_k_begin};
      reference::head_attention(rows_of(q, view_b, h, q_rows), rows_of(k, view_b, h_kv, kv_rows),
                                rows_of(v, view_b, h_kv, kv_rows), mask, sink, rows_of(out, view_b, h, q_rows),
                                lse_data, lse_stride, dropout);
    }
  }
}

/// Validates, picks the backend and runs the call. In the ISA-named inline namespace: its body depends on the
/// build's ISA through the fused kernel (docs/design.md, ODR safety). K and V are stored as S: T, or (T = float) a
/// 16-bit type.
template <class T, class S = T>
void attention_impl(const char* function, const TensorView4<const T>& q, const TensorView4<const S>& k,
                    const TensorView4<const S>& v, const TensorView4<T>& out, const TensorView3<T>* lse,
                    const AttentionOptions<T>& options) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "qkv: the scalar type must be float or double");
  static_assert(std::is_same_v<S, T> || (std::is_same_v<T, float> && is_kv16_v<S>),
                "qkv: 16-bit keys and values (Eigen::half, Eigen::bfloat16) go with a float query and output");
  const AttentionShape shape = validate(function, q, k, &v, &out, lse, options);
  const AttentionParams<T> params = resolve_params(options, shape.D);
  if constexpr (std::is_same_v<T, float>) {
    if (use_fused(function, options)) {
      run_fused(shape, q, k, v, out, lse, params);  // on the ISA isa.hpp chose (dispatch.hpp)
      return;
    }
  } else {
    (void)use_fused(function, options);
  }
  run_reference(shape, q, k, v, out, lse, params);
}

// Separate compilation (docs/design.md, "Separate compilation"): with QKV_SEPARATE_COMPILATION defined, a translation
// unit only declares these instantiations of the entry points' bodies (the kernel copies, the reference, validation),
// and the one unit that includes <qkv/instantiate.hpp> defines them.
#define QKV_ATTENTION_INSTANTIATIONS(PREFIX)                                                                          \
  PREFIX void attention_impl<float, float>(                                                                           \
      const char*, const TensorView4<const float>&, const TensorView4<const float>&, const TensorView4<const float>&, \
      const TensorView4<float>&, const TensorView3<float>*, const AttentionOptions<float>&);                          \
  PREFIX void attention_impl<double, double>(const char*, const TensorView4<const double>&,                           \
                                             const TensorView4<const double>&, const TensorView4<const double>&,      \
                                             const TensorView4<double>&, const TensorView3<double>*,                  \
                                             const AttentionOptions<double>&);                                        \
  PREFIX void attention_impl<float, Eigen::half>(const char*, const TensorView4<const float>&,                        \
                                                 const TensorView4<const Eigen::half>&,                               \
                                                 const TensorView4<const Eigen::half>&, const TensorView4<float>&,    \
                                                 const TensorView3<float>*, const AttentionOptions<float>&);          \
  PREFIX void attention_impl<float, Eigen::bfloat16>(                                                                 \
      const char*, const TensorView4<const float>&, const TensorView4<const Eigen::bfloat16>&,                        \
      const TensorView4<const Eigen::bfloat16>&, const TensorView4<float>&, const TensorView3<float>*,                \
      const AttentionOptions<float>&);
#ifdef QKV_SEPARATE_COMPILATION
QKV_ATTENTION_INSTANTIATIONS(extern template)
#endif

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
///   window of w keys on the fused path (hidden key tiles are never visited). Memory: the fused kernel needs
///   the size of K and V with a team of threads, of one (sequence, kv head)'s K and V on one thread (packed once
///   per call, except when decoding; V's rows rounded up to whole vectors, 8 floats with AVX2 and 16 with AVX-512;
///   V not copied where its rows are float, abut and are at most 16 floats wide with AVX2 or 64 with AVX-512, whole
///   vectors: that is already the packed layout), kept on the calling thread for its next calls until
///   `release_workspace()`, and a few hundred KiB of scratch per thread (bench_attention's alloc_MiB, one thread:
///   4.8 MiB at B = 1, H = 8, T = 16384, D = 64, where V is read in place, inputs 128 MiB, measured before the
///   prefill groups), plus, where a prefill's K and V exceed 4 MiB per kv head, the states of eight query tiles
///   (about 0.8 MiB at D = Dv = 128), nothing of size Sq × Skv; the reference backend allocates O(Sq·Skv) per
///   (sequence, head) in flight.
/// Threads (OpenMP builds): a call large enough to pay for a team (about 2^20 multiply-adds on the fused path)
///   shares its work over (sequence, kv head, query tile, key chunk), a long prefill's query tiles in groups, among
///   omp_get_max_threads() threads, the calling thread's own setting (OMP_NUM_THREADS for all threads,
///   omp_set_num_threads(n) for the thread that calls it). Called inside an active `#pragma omp parallel` region
///   (omp_in_parallel()), it runs on the calling thread alone and never opens a nested team, whatever
///   omp_get_max_active_levels() allows. Each std::thread that calls at the same time opens its own team: N callers use
///   up to N × omp_get_max_threads() threads, so call omp_set_num_threads(1) in each caller (or set OMP_NUM_THREADS=1)
///   to keep one thread per caller. Results are bit-identical for any number of threads, inside or outside a parallel
///   region.
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

/// Attention with keys and values stored in 16 bits: Eigen::half (IEEE binary16) or Eigen::bfloat16 (a KV cache's
/// usual storage: half the bytes of float, which is half the time of decoding, bound by reading the cache), with a
/// float query and output. Same shapes, options, masks, GQA, varlen, threads and NaN rules as the float call, all
/// on the stored values converted exactly to float: a stored ±∞ or NaN behaves as it would in float, and nothing is
/// computed or accumulated in 16 bits (q is never rounded). k and v share one storage type; T is deduced from out
/// and must be float (a static_assert says so).
/// Storage: round float data with Eigen (`.cast<Eigen::half>()`, or `Eigen::half(x)` per element: round to
///   nearest even). A float above 65504 in magnitude becomes ±∞ in half (bfloat16 keeps float's range with 8 bits of
///   precision), so scale such data before storing it.
/// Backends: the fused kernel converts K and V where it reads them (while packing them for prefill, in registers
///   when decoding: vcvtph2ps for half, a 16-bit shift for bfloat16); the reference path converts every stored
///   value exactly to double. Accuracy: as the float call, measured against float64 on the same stored values.
/// Memory: prefill packs K and V in float (the float size of K and V, as the float call); decoding reads them in
///   place, two bytes per element, and allocates nothing of their size.
/// Throws: as the float call. Complexity: as the float call.
/// Source: llama.cpp's f16 KV cache, FlashAttention's and PyTorch's f16/bf16 K/V (exact widening to float, float
///   accumulation).
template <class T, class KE, class VE,
          std::enable_if_t<std::is_same_v<std::remove_const_t<KE>, std::remove_const_t<VE>> &&
                               detail::is_kv16_v<std::remove_const_t<KE>>,
                           int> = 0>
void attention(non_deduced_t<TensorView4<const T>> q, TensorView4<KE> k, TensorView4<VE> v, TensorView4<T> out,
               const AttentionOptions<T>& options = AttentionOptions<T>()) {
  static_assert(std::is_same_v<T, float>, "qkv: 16-bit keys and values go with a float query and output (T = float)");
  using S = std::remove_const_t<KE>;
  detail::attention_impl<T, S>("qkv::attention", q, TensorView4<const S>(k), TensorView4<const S>(v), out, nullptr,
                               options);
}

/// As above, and also writes lse [B, Hq, Sq] (natural log, as the float call).
template <class T, class KE, class VE,
          std::enable_if_t<std::is_same_v<std::remove_const_t<KE>, std::remove_const_t<VE>> &&
                               detail::is_kv16_v<std::remove_const_t<KE>>,
                           int> = 0>
void attention(non_deduced_t<TensorView4<const T>> q, TensorView4<KE> k, TensorView4<VE> v, TensorView4<T> out,
               TensorView3<T> lse, const AttentionOptions<T>& options = AttentionOptions<T>()) {
  static_assert(std::is_same_v<T, float>, "qkv: 16-bit keys and values go with a float query and output (T = float)");
  using S = std::remove_const_t<KE>;
  detail::attention_impl<T, S>("qkv::attention", q, TensorView4<const S>(k), TensorView4<const S>(v), out, &lse,
                               options);
}

/// Frees the memory the fused kernels keep on the calling thread between calls (its workspace: a buffer of packed K
/// and one of packed V, each as large as the largest the thread's prefills have needed, together about the float
/// size of the largest call's K and V, or of its largest (sequence, kv head)'s where one thread ran the call,
/// decoding packing nothing; the first of them also holds the scratch of
/// `attention_backward`'s team, O((Skv + G·Sq)·(D + Dv)) floats per thread). The next call allocates them again.
/// Keeping them spares each call the page faults of fresh memory, as PyTorch's caching allocator and oneDNN's
/// scratchpad do; call this after a large call whose memory should go back (`torch.cuda.empty_cache()` is PyTorch's
/// counterpart). Frees the calling thread's workspace only, of this qkv build (the QKV_ISA_NAME of config.hpp: a
/// unit built with other flags has its own); a thread that never calls it keeps its workspace until it ends (the
/// workers of an OpenMP pool that make calls never end). Does nothing while a call on this thread holds the
/// workspace. Not to be called from static destructors after the thread's workspace is gone (as for any
/// thread_local). Throws nothing. Complexity: O(1) (two frees).
inline void release_workspace() noexcept {
  detail::Workspace& workspace = detail::Workspace::of_this_thread();
  if (workspace.lent) return;
  workspace.first.release();
  workspace.second.release();
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
                      detail::describe_layout(out), "): distinct indices would write the same element");
  detail::check_shape(detail::self_overlap_free(lse), function, ": lse has strides whose elements overlap (",
                      detail::describe_layout(lse), "): distinct indices would write the same element");
  detail::check_shape(out_in_place || !detail::overlaps(out_view, out_a), function,
                      ": out overlaps out_a without being the same view (only exact in-place use is allowed): ",
                      detail::describe_overlap("out", out_view, "out_a", out_a));
  detail::check_shape(lse_in_place || !detail::overlaps(lse_view, lse_a), function,
                      ": lse overlaps lse_a without being the same view (only exact in-place use is allowed): ",
                      detail::describe_overlap("lse", lse_view, "lse_a", lse_a));
  const auto check_apart = [function](const char* a_name, const auto& a, const char* b_name, const auto& b) {
    detail::check_shape(!detail::overlaps(a, b), function, ": ", a_name, " overlaps ", b_name, ": ",
                        detail::describe_overlap(a_name, a, b_name, b));
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
