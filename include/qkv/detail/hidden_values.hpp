// qkv/detail/hidden_values.hpp — P·V where a hidden key's value may hold NaN or ∞.
//
// The fused kernel multiplies a hidden key's weight, exactly 0, by its value only where the tile's values are all
// finite (all_finite; the prefill asks PackedKV::values_finite, counts kept while packing V); otherwise it skips the
// zero weights (pv_skip_zero_weights), so a NaN or ∞ stored in a hidden slot never reaches the output (docs/design.md:
// select, never multiply by zero).
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/hidden_values.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_HIDDEN_VALUES_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_HIDDEN_VALUES_HPP
#undef QKV_DETAIL_HIDDEN_VALUES_HPP
#else
#define QKV_DETAIL_HIDDEN_VALUES_HPP
#endif

#include <cmath>

#include "qkv/config.hpp"
#include "qkv/simd/simd.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// acc_o[r][0 .. Dv) += Σ_j p[r][j] · v[j][0 .. Dv) for `n_rows` rows over the keys of non-zero weight only: the
/// P·V of a tile whose values hold NaN or ∞ where some key may be hidden, so that a hidden slot (weight 0) is never
/// read into the arithmetic (docs/design.md: select, never multiply by zero). Scalar: such tiles are rare. One fused
/// multiply-add per key, in key order, as the vector kernels do, so the rows a poisoned slot cannot reach get the same
/// bits as without the poison in every build (a plain `+= a·b` is contracted to an FMA or not depending on -march).
/// V is stored as S (float, Eigen::half, Eigen::bfloat16), each value converted exactly.
template <class S>
inline void pv_skip_zero_weights(const float* p, Index ldp, const S* v, Index ldv, Index keys, float* o, Index ldo,
                                 Index Dv, Index n_rows) noexcept {
  for (Index r = 0; r < n_rows; ++r) {
    const float* weights = p + r * ldp;
    float* out = o + r * ldo;
    for (Index j = 0; j < keys; ++j) {
      if (weights[j] == 0.0f) continue;
      const S* value = v + j * ldv;
      for (Index d = 0; d < Dv; ++d) out[d] = std::fma(weights[j], simd::to_float(value[d]), out[d]);
    }
  }
}

/// Whether the first n elements of `rows` rows (`ld` apart, stored as S) are all finite: Σ x·0 is 0 for finite x
/// and NaN otherwise. Vectorized; reads exactly those elements.
template <class Tag, class S>
inline bool all_finite(const S* rows, Index n_rows, Index n, Index ld) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  const auto zero_vector = zero(Tag());
  auto acc = zero(Tag());
  const Index full = n / L * L;
  for (Index r = 0; r < n_rows; ++r) {
    const S* row = rows + r * ld;
    for (Index d = 0; d < full; d += L) acc = add(acc, mul(load_kv(Tag(), row + d), zero_vector));
    if (full < n) acc = add(acc, mul(load_kv_partial(Tag(), row + full, static_cast<int>(n - full)), zero_vector));
  }
  return reduce_sum(Tag(), acc) == 0.0f;
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_HIDDEN_VALUES_HPP, per pass
