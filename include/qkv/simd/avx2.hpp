// qkv/simd/avx2.hpp — AVX2 + FMA: eight float lanes (__m256).
//
// Defined whenever the build compiles the AVX2 kernel (config.hpp), inside an AVX2 target region: a caller must be
// compiled for AVX2 too (the kernel's AVX2 copy, or code built with -march=x86-64-v3 or better).
#pragma once

#include "qkv/config.hpp"

#if defined(QKV_KERNEL_AVX2)

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qkv/isa.hpp"
#include "qkv/simd/exp_constants.hpp"

QKV_BEGIN_TARGET_AVX2
namespace qkv {
namespace simd {
inline namespace QKV_ISA_NAME {

struct Avx2Tag {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  static constexpr const char* kName = "avx2";
  static constexpr detail::Isa kIsa = detail::Isa::avx2;
};

inline __m256 zero(Avx2Tag) noexcept { return _mm256_setzero_ps(); }
inline __m256 set1(Avx2Tag, float x) noexcept { return _mm256_set1_ps(x); }
inline __m256 load(Avx2Tag, const float* p) noexcept { return _mm256_loadu_ps(p); }
inline void store(Avx2Tag, float* p, __m256 v) noexcept { _mm256_storeu_ps(p, v); }

/// Mask whose first n lanes are set (0 ≤ n ≤ 8).
inline __m256i first_lanes(Avx2Tag, int n) noexcept {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/// Loads the first n floats (0 ≤ n ≤ 8) and zeros the rest; memory past p + n is not touched.
inline __m256 load_partial(Avx2Tag tag, const float* p, int n) noexcept {
  return _mm256_maskload_ps(p, first_lanes(tag, n));
}
inline void store_partial(Avx2Tag tag, float* p, __m256 v, int n) noexcept {
  _mm256_maskstore_ps(p, first_lanes(tag, n), v);
}
/// Eight stored keys or values as floats: float loaded, 16-bit converted exactly in registers (IEEE half by
/// vcvtph2ps, F16C; bfloat16 by moving its bits to the top half of each float lane).
inline __m256 load_kv(Avx2Tag tag, const float* p) noexcept { return load(tag, p); }
inline __m256 load_kv_partial(Avx2Tag tag, const float* p, int n) noexcept { return load_partial(tag, p, n); }
inline __m256 load_kv(Avx2Tag, const Eigen::half* p) noexcept {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_kv(Avx2Tag, const Eigen::bfloat16* p) noexcept {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
/// The first n (0 ≤ n ≤ 8) of them, the other lanes zero (AVX2 has no 16-bit masked load: n elements are copied
/// to a zeroed buffer first, so nothing past p + n is read).
template <class S, class = std::enable_if_t<std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>>>
inline __m256 load_kv_partial(Avx2Tag tag, const S* p, int n) noexcept {
  S lanes[8] = {};
  std::memcpy(lanes, p, sizeof(S) * static_cast<std::size_t>(n));
  return load_kv(tag, lanes);
}

inline __m256 add(__m256 a, __m256 b) noexcept { return _mm256_add_ps(a, b); }
inline __m256 sub(__m256 a, __m256 b) noexcept { return _mm256_sub_ps(a, b); }
inline __m256 mul(__m256 a, __m256 b) noexcept { return _mm256_mul_ps(a, b); }
/// fmadd(a, b, c) = a·b + c, rounded once.
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) noexcept { return _mm256_fmadd_ps(a, b, c); }
/// Lane-wise max; b where either is NaN (maxps semantics).
inline __m256 max(__m256 a, __m256 b) noexcept { return _mm256_max_ps(a, b); }

inline float reduce_max(Avx2Tag, __m256 v) noexcept {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float reduce_sum(Avx2Tag, __m256 v) noexcept {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// out[0..4) = the lane sums of a, b, c, d (a transposing reduction: three hadds and one add for four sums).
inline void reduce_sum4(Avx2Tag, __m256 a, __m256 b, __m256 c, __m256 d, float* out) noexcept {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [Σa₀₋₃ Σb₀₋₃ Σc₀₋₃ Σd₀₋₃ | Σa₄₋₇ Σb₄₋₇ Σc₄₋₇ Σd₄₋₇]
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

/// Transposes the 8 × 8 block held in rows[0..8): lane j of rows[i] becomes lane i of rows[j] (packing Kᵀ panels,
/// pack.hpp). Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves exchanged: 24 shuffles.
inline void transpose(Avx2Tag, __m256* rows) noexcept {
  __m256 t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(rows[2 * k], rows[2 * k + 1]);      // rows 2k, 2k + 1 at d 0 1 | 4 5
    t[2 * k + 1] = _mm256_unpackhi_ps(rows[2 * k], rows[2 * k + 1]);  // … at d 2 3 | 6 7
  }
  for (int k = 0; k < 2; ++k) {  // u[4k + e]: d = e and 4 + e of rows 4k … 4k + 3
    u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    rows[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    rows[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

/// e^x lane-wise; see exp_constants.hpp for the method and the error bound.
inline __m256 exp(Avx2Tag, __m256 x) noexcept {
  namespace c = exp_constants;
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(c::kMin)), _mm256_set1_ps(c::kMax));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(c::kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(c::kLn2Hi), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(c::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(c::kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  result = _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(c::kMin), _CMP_LT_OQ));
  result = _mm256_blendv_ps(result, _mm256_set1_ps(__builtin_huge_valf()),
                            _mm256_cmp_ps(x, _mm256_set1_ps(c::kMax), _CMP_GT_OQ));
  return _mm256_blendv_ps(result, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays NaN
}

/// 2^x lane-wise; see exp2_constants in exp_constants.hpp for the method, the range and the error bound.
/// The clamps take x second (max/min return their second operand when either is NaN), so NaN passes through.
inline __m256 exp2(Avx2Tag, __m256 x) noexcept {
  namespace c = exp2_constants;
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(c::kMax), _mm256_max_ps(_mm256_set1_ps(c::kMin), x));
  const __m256 n = _mm256_round_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(clamped, n);
  __m256 p = _mm256_set1_ps(c::kQ0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kQ1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kQ2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kQ3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kQ4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kQ5));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

}  // namespace QKV_ISA_NAME
}  // namespace simd
}  // namespace qkv
QKV_END_TARGET

#endif
