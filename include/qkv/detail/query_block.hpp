// qkv/detail/query_block.hpp — a task's Q block, pre-scaled so that Q·Kᵀ gives the scores directly, and the check
// that decides the softmax's base.
//
// The prefill softmax works in base 2: Q is multiplied by scale·log2 e once, so that exp2 of a score difference is
// exp of the true one. Base 2 holds a score only up to FLT_MAX / log2 e ≈ 2.4e38; `base2_fits` bounds the task's
// scores before it starts, and a task that could pass that bound runs in base e (fused_attention.hpp, run_group).
// Pre-scaling must not change which scores are infinite: a q that underflows keeps its sign (underflowed_product),
// and where the factor or a finite q·factor overflows, Q stays unscaled and the scores are scaled after Q·Kᵀ.
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/query_block.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_QUERY_BLOCK_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_QUERY_BLOCK_HPP
#undef QKV_DETAIL_QUERY_BLOCK_HPP
#else
#define QKV_DETAIL_QUERY_BLOCK_HPP
#endif

#include <algorithm>
#include <cmath>
#include <limits>

#include "qkv/config.hpp"
#include "qkv/simd/simd.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// The pre-scaled q·factor of a nonzero q that underflowed to 0: the smallest denormal of the product's sign, so
/// that q·(±∞) stays ±∞ (a −∞ score hides its key; 0·∞ would make it NaN). Its finite terms change by at most
/// denorm_min·|k| (below 5e-7 for any float k), as the rounding to 0 already did. fuzz/README.md, finding 4.
inline float underflowed_product(float q, float factor) noexcept {
  const float tiny = std::numeric_limits<float>::denorm_min();
  return (q < 0.0f) != (factor < 0.0f) ? -tiny : tiny;
}

/// How a task's Q block was scaled. Normally Q carries the whole factor (post_scale false); when it could not,
/// Q is unscaled and every score is multiplied by score_scale, then by score_base, after Q·Kᵀ (each step overflows
/// only where the score itself does).
struct QueryScale {
  bool post_scale = false;
  float score_scale = 1.0f;  ///< the call's scale
  float score_base = 1.0f;   ///< log2 e for a base-2 softmax on raw scores, else 1
};

/// Copies the query rows [row_first, row_first + rows) of query heads h_first … h_first + G − 1 of batch entry vb
/// into q_block, g-major (block row g·rows + ii), each multiplied by `factor` = scale·base. O(G·rows·D).
inline QueryScale load_query_block(const TensorView4<const float>& q, Index vb, Index h_first, Index G, Index row_first,
                                   Index rows, Index D, float factor, float scale, float base,
                                   float* q_block) noexcept {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  bool overflow = !std::isfinite(factor);
  for (Index g = 0; g < G && !overflow; ++g) {
    for (Index ii = 0; ii < rows; ++ii) {
      const float* src = &q(vb, h_first + g, row_first + ii, 0);
      float* dst = q_block + (g * rows + ii) * D;
      for (Index d = 0; d < D; ++d) dst[d] = src[d] * factor;
      if (factor == 0.0f) continue;  // scale 0: every q·factor is 0 (or NaN), as q·k·0 is
      // A screen without branches, which the compiler vectorizes: does any nonzero q underflow, or a finite q
      // overflow? Only a row where one does is taken again element by element (NaN is neither).
      int edge = 0;
      for (Index d = 0; d < D; ++d) {
        const float a = std::fabs(src[d]), p = std::fabs(dst[d]);
        edge |= static_cast<int>(p == 0.0f) & static_cast<int>(a != 0.0f);
        edge |= static_cast<int>(p == kInf) & static_cast<int>(a != kInf);
      }
      if (edge == 0) continue;
      for (Index d = 0; d < D; ++d) {
        if (dst[d] == 0.0f && src[d] != 0.0f) dst[d] = underflowed_product(src[d], factor);
        if (std::isinf(dst[d]) && std::isfinite(src[d])) overflow = true;
      }
    }
  }
  if (overflow) {
    for (Index g = 0; g < G; ++g) {
      for (Index ii = 0; ii < rows; ++ii) {
        const float* src = &q(vb, h_first + g, row_first + ii, 0);
        std::copy(src, src + D, q_block + (g * rows + ii) * D);
      }
    }
  }
  QueryScale result;
  result.post_scale = overflow;
  result.score_scale = scale;
  result.score_base = base;
  return result;
}

/// max |x| over `rows` rows of n floats, `ld` apart, by vector maxes of max(x, −x): ±∞ counts, NaN is left out
/// (maxps returns its second operand where either is NaN). 0 for no elements.
template <class Tag>
float abs_max(const float* x, Index ld, Index rows, Index n) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  const Index full = n / L * L;
  const int tail = static_cast<int>(n - full);
  auto vmax = zero(Tag());
  for (Index j = 0; j < rows; ++j) {
    const float* row = x + j * ld;
    for (Index d = 0; d < full; d += L) {
      const auto v = load(Tag(), row + d);
      vmax = max(max(v, sub(zero(Tag()), v)), vmax);
    }
    if (tail > 0) {
      const auto v = load_partial(Tag(), row + full, tail);
      vmax = max(max(v, sub(zero(Tag()), v)), vmax);
    }
  }
  return reduce_max(Tag(), vmax);
}

/// The largest finite |x| over `rows` rows of n floats, `ld` apart (±∞ and NaN left out): abs_max, and where a ±∞
/// entered it, the rows scanned again one element at a time (rare: a key holding ±∞). The key bound of base2_fits.
template <class Tag>
float finite_abs_max(const float* x, Index ld, Index rows, Index n) noexcept {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float result = abs_max<Tag>(x, ld, rows, n);
  if (result < kInf) return result;
  float finite = 0.0f;
  for (Index j = 0; j < rows; ++j) {
    for (Index d = 0; d < n; ++d) {
      const float a = std::fabs(x[j * ld + d]);
      finite = std::max(finite, a < kInf ? a : 0.0f);
    }
  }
  return finite;
}

/// Whether every score of a task stays finite in base 2. The finite part of a score q'·k (q' a row of the M × D
/// `q_block` as load_query_block left it) is at most Σ_d |q'_d| · max |k| over the finite terms; the check asks that
/// bound, times the post-scale factors if any (each of q·k, q·k·scale and q·k·scale·log2 e must stay finite) and a
/// margin for the rounding of the D + 2 operations (e^((D + 3)·2⁻²³) ≥ (1 + 2⁻²⁴)^(D + 3)), to stay below FLT_MAX.
/// ±∞ and NaN terms are left out: their scores are ±∞ or NaN in any base, and where an infinite term meets a finite
/// part that base 2 would overflow, that finite part fails the check. So a key holding ±∞ or NaN does not change the
/// base, and a call equals, bit for bit, the same call with that key finite and masked out. A huge finite k moves
/// the whole (sequence, kv head) to base e even where it is hidden: the results differ by rounding only.
/// `key_abs_max`: the largest finite |k| of the (sequence, kv head) (pack.hpp). O(M·D).
/// A vector screen decides first: Σ_d |q'_d| ≤ D · max |q'| (the max over every term, ±∞ among them, NaN left out by
/// maxps), and where that bound is below FLT_MAX / 2 the exact sum's bound is too (the sums in double round by far
/// less than 2×), so the answer is the same; otherwise the exact sums run. The sums in double, a chain of dependent
/// adds, cost a causal prefill at T = 1024 about 5 % of its time on a Zen 5; the screen, a few vector maxes per row.
template <class Tag>
inline bool base2_fits(const float* q_block, Index M, Index D, float key_abs_max, const QueryScale& scaled) noexcept {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double scale = std::fabs(double(scaled.score_scale));
  const double factor = scaled.post_scale ? std::max({1.0, scale, scale * double(scaled.score_base)}) : 1.0;
  const double rounding = std::exp(double(D + 3) * 0x1p-23);
  const double q_max = abs_max<Tag>(q_block, 0, 1, M * D);
  const double screen = double(D) * q_max * double(key_abs_max) * factor * rounding;
  if (screen < 0.5 * double(std::numeric_limits<float>::max())) return true;
  double l1_max = 0.0;
  for (Index r = 0; r < M; ++r) {
    double l1 = 0.0;
    for (Index d = 0; d < D; ++d) {
      const double a = std::fabs(double(q_block[r * D + d]));
      l1 += a < kInf ? a : 0.0;
    }
    l1_max = std::max(l1_max, l1);
  }
  const double bound = l1_max * double(key_abs_max) * factor * rounding;
  return bound < double(std::numeric_limits<float>::max());
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_QUERY_BLOCK_HPP, per pass
