// qkv/detail/dispatch.hpp — the fused kernel compiled once per instruction set, and the call that picks one.
//
// The kernel's rooms (fused_attention.hpp and the files it includes) are written once, against a SIMD tag. This file
// includes them once per kernel the build compiles (config.hpp: QKV_KERNEL_SCALAR, _AVX2, _AVX512), each time in a
// namespace of its own (kernel_scalar, kernel_avx2, kernel_avx512) and, for the SIMD ones, inside a target region, so
// that every function of the AVX2 copy is compiled for AVX2 (intrinsics need it, and the ops inline into the
// micro-kernels) while the rest of the program keeps the build's flags — the scheme of Highway's foreach_target.h.
// `run_fused` then calls the copy isa.hpp chose. Tile shapes are per-tag constants (fused_tiles.hpp), so a binary
// gives the same bits for any thread count on one CPU; across ISAs the results agree within the accuracy rule.
//
// Every header a room includes that is not a room is included here first, outside any target region: a declaration
// inside a region takes its target (Eigen's, the standard library's), which would make it uncallable from the rest.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/aligned_buffer.hpp"
#include "qkv/detail/attention_params.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/threads.hpp"
#include "qkv/isa.hpp"
#include "qkv/mask.hpp"
#include "qkv/simd/exp_constants.hpp"
#include "qkv/simd/simd.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"

// ---- one pass per compiled kernel; QKV_PASS_TOGGLE flips between passes (the rooms' include guards follow it) ----

#if defined(QKV_KERNEL_SCALAR)
#define QKV_PASS_NAME kernel_scalar
#define QKV_PASS_TAG ::qkv::simd::ScalarTag
#include "qkv/detail/fused_attention.hpp"
#include "qkv/detail/fused_backward.hpp"
#undef QKV_PASS_NAME
#undef QKV_PASS_TAG
#ifdef QKV_PASS_TOGGLE
#undef QKV_PASS_TOGGLE
#else
#define QKV_PASS_TOGGLE
#endif
#endif

#if defined(QKV_KERNEL_AVX2)
#define QKV_PASS_NAME kernel_avx2
#define QKV_PASS_TAG ::qkv::simd::Avx2Tag
QKV_BEGIN_TARGET_AVX2
#include "qkv/detail/fused_attention.hpp"
#include "qkv/detail/fused_backward.hpp"
QKV_END_TARGET
#undef QKV_PASS_NAME
#undef QKV_PASS_TAG
#ifdef QKV_PASS_TOGGLE
#undef QKV_PASS_TOGGLE
#else
#define QKV_PASS_TOGGLE
#endif
#endif

#if defined(QKV_KERNEL_AVX512)
#if defined(__GNUC__) && !defined(__clang__)  // GCC bug 105593, as in simd/avx512.hpp
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define QKV_PASS_NAME kernel_avx512
#define QKV_PASS_TAG ::qkv::simd::Avx512Tag
QKV_BEGIN_TARGET_AVX512
#include "qkv/detail/fused_attention.hpp"
#include "qkv/detail/fused_backward.hpp"
QKV_END_TARGET
#undef QKV_PASS_NAME
#undef QKV_PASS_TAG
#ifdef QKV_PASS_TOGGLE
#undef QKV_PASS_TOGGLE
#else
#define QKV_PASS_TOGGLE
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {

// run_fused_as(tag, ...): the kernel copy of a tag, by overload, one from each pass. Tests run every compiled copy
// side by side (a copy the CPU cannot run must not be called: cpu_supports(Tag::kIsa)).
#if defined(QKV_KERNEL_SCALAR)
using kernel_scalar::run_fused_as;
using kernel_scalar::run_fused_backward_as;
#endif
#if defined(QKV_KERNEL_AVX2)
using kernel_avx2::run_fused_as;
using kernel_avx2::run_fused_backward_as;
#endif
#if defined(QKV_KERNEL_AVX512)
using kernel_avx512::run_fused_as;
using kernel_avx512::run_fused_backward_as;
#endif

/// The fused kernel over validated views and resolved parameters, on the instruction set isa.hpp chose; K and V
/// stored as S (float, Eigen::half or Eigen::bfloat16).
template <class S>
void run_fused(const AttentionShape& shape, const TensorView4<const float>& q, const TensorView4<const S>& k,
               const TensorView4<const S>& v, const TensorView4<float>& out, const TensorView3<float>* lse,
               const AttentionParams<float>& params) {
  switch (active_isa()) {
#if defined(QKV_KERNEL_AVX512)
    case Isa::avx512:
      run_fused_as(simd::Avx512Tag(), shape, q, k, v, out, lse, params);
      return;
#endif
#if defined(QKV_KERNEL_AVX2)
    case Isa::avx2:
      run_fused_as(simd::Avx2Tag(), shape, q, k, v, out, lse, params);
      return;
#endif
    default:
      break;
  }
#if defined(QKV_KERNEL_SCALAR)
  run_fused_as(simd::ScalarTag(), shape, q, k, v, out, lse, params);
#endif
}

/// The fused backward (fused_backward.hpp) over validated views and resolved parameters, on the instruction set
/// isa.hpp chose: writes d_q, d_k and d_v entirely (zeros where no gradient); d_sinks and d_bias are the entry
/// point's (backward.hpp).
inline void run_fused_backward(const AttentionShape& shape, const TensorView4<const float>& q,
                               const TensorView4<const float>& k, const TensorView4<const float>& v,
                               const TensorView4<const float>& out, const TensorView3<const float>& lse,
                               const TensorView4<const float>& d_out, const TensorView4<float>& d_q,
                               const TensorView4<float>& d_k, const TensorView4<float>& d_v,
                               const AttentionParams<float>& params) {
  switch (active_isa()) {
#if defined(QKV_KERNEL_AVX512)
    case Isa::avx512:
      run_fused_backward_as(simd::Avx512Tag(), shape, q, k, v, out, lse, d_out, d_q, d_k, d_v, params);
      return;
#endif
#if defined(QKV_KERNEL_AVX2)
    case Isa::avx2:
      run_fused_backward_as(simd::Avx2Tag(), shape, q, k, v, out, lse, d_out, d_q, d_k, d_v, params);
      return;
#endif
    default:
      break;
  }
#if defined(QKV_KERNEL_SCALAR)
  run_fused_backward_as(simd::ScalarTag(), shape, q, k, v, out, lse, d_out, d_q, d_k, d_v, params);
#endif
}

}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv
