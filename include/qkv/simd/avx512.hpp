// qkv/simd/avx512.hpp — AVX-512 (F, BW, DQ, VL): sixteen float lanes (__m512).
//
// Defined whenever the build compiles the AVX-512 kernel (config.hpp), inside an AVX-512 target region: a caller
// must be compiled for AVX-512 too (the kernel's AVX-512 copy, or code built with -march=x86-64-v4 or better).
//
// GCC 12 reports false -Wuninitialized / -Wmaybe-uninitialized inside AVX-512 intrinsics (GCC bug 105593):
// this header silences them for itself only, so that -Werror holds with -march=native on g++.
#pragma once

#include "qkv/config.hpp"

#if defined(QKV_KERNEL_AVX512)

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include "qkv/isa.hpp"
#include "qkv/simd/exp_constants.hpp"

QKV_BEGIN_TARGET_AVX512
namespace qkv {
namespace simd {
inline namespace QKV_ISA_NAME {

struct Avx512Tag {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  static constexpr const char* kName = "avx512";
  static constexpr detail::Isa kIsa = detail::Isa::avx512;
};

inline __m512 zero(Avx512Tag) noexcept { return _mm512_setzero_ps(); }
inline __m512 set1(Avx512Tag, float x) noexcept { return _mm512_set1_ps(x); }
inline __m512 load(Avx512Tag, const float* p) noexcept { return _mm512_loadu_ps(p); }
inline void store(Avx512Tag, float* p, __m512 v) noexcept { _mm512_storeu_ps(p, v); }
/// Loads the first n floats (0 ≤ n ≤ 16) with a masked load and zeros the rest; memory past p + n is not touched.
inline __m512 load_partial(Avx512Tag, const float* p, int n) noexcept {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline void store_partial(Avx512Tag, float* p, __m512 v, int n) noexcept {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
}
/// Sixteen stored 16-bit keys or values as floats, converted exactly in registers: IEEE half by vcvtph2ps, bfloat16
/// by moving its bits to the top half of each float lane; the partial forms load the first n (0 ≤ n ≤ 16) with a
/// masked 16-bit load (AVX512BW + VL) and zero the other lanes, touching nothing past p + n.
inline __m512 load_kv(Avx512Tag tag, const float* p) noexcept { return load(tag, p); }
inline __m512 load_kv_partial(Avx512Tag tag, const float* p, int n) noexcept { return load_partial(tag, p, n); }
inline __m512 load_kv(Avx512Tag, const Eigen::half* p) noexcept {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_kv(Avx512Tag, const Eigen::bfloat16* p) noexcept {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load_kv_partial(Avx512Tag, const Eigen::half* p, int n) noexcept {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p));
}
inline __m512 load_kv_partial(Avx512Tag, const Eigen::bfloat16* p, int n) noexcept {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512 add(__m512 a, __m512 b) noexcept { return _mm512_add_ps(a, b); }
inline __m512 sub(__m512 a, __m512 b) noexcept { return _mm512_sub_ps(a, b); }
inline __m512 mul(__m512 a, __m512 b) noexcept { return _mm512_mul_ps(a, b); }
/// fmadd(a, b, c) = a·b + c, rounded once.
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) noexcept { return _mm512_fmadd_ps(a, b, c); }
/// Lane-wise max; b where either is NaN (maxps semantics).
inline __m512 max(__m512 a, __m512 b) noexcept { return _mm512_max_ps(a, b); }
inline float reduce_max(Avx512Tag, __m512 v) noexcept { return _mm512_reduce_max_ps(v); }
inline float reduce_sum(Avx512Tag, __m512 v) noexcept { return _mm512_reduce_add_ps(v); }

/// The sum of a vector's two 256-bit halves. (A named function, not a lambda: GCC compiles a captureless lambda's
/// function-pointer thunk without the region's target.)
inline __m256 sum_halves(__m512 x) noexcept {
  return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}

/// out[0..4) = the lane sums of a, b, c, d (halves added, then a transposing reduction of the 256-bit sums).
inline void reduce_sum4(Avx512Tag, __m512 a, __m512 b, __m512 c, __m512 d, float* out) noexcept {
  const auto half = sum_halves;
  const __m256 ab = _mm256_hadd_ps(half(a), half(b)), cd = _mm256_hadd_ps(half(c), half(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

/// Keeps v in a register for its uses that follow (an empty asm that claims to change it, so no later use can be a
/// load folded into the instruction). g++ 12 folded the K vector of the decoding Q·Kᵀ step into each of its four FMAs:
/// four loads where one will do, above two 512-bit loads a cycle (P·V's V vectors and Q·Kᵀ's q vectors, folded into
/// four FMAs each as well, get the same hint; the q hint took g++'s head-major decode 0.983 of its time). clang++ loads
/// each once anyway. Given an element of an array (decode_kernels.hpp's kv[c] and x[n]), g++ 12 keeps that array on
/// the stack and stores each vector there as well (dead stores, four per P·V column); a plain local instead removed
/// them and measured no faster (bench/README.md, "g++ decode from L3"), so the call sites stay as they are.
inline void keep_in_register(Avx512Tag, __m512& v) noexcept {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("" : "+v"(v));
#else
  (void)v;
#endif
}

/// Adjacent pairs within each 128-bit lane, as a 512-bit hadd: [x0 + x1, x2 + x3, y0 + y1, y2 + y3, x4 + x5, …].
/// (A function, not a lambda: GCC does not carry the target region into a lambda's vector return.)
inline __m512 hadd_pairs(Avx512Tag, __m512 x, __m512 y) noexcept {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

/// out[0..16) = the lane sums of v[0..16), each paired exactly as reduce_sum4 pairs it (so the same bits): h_i = lane
/// i + lane i + 8, then ((h0 + h1) + (h2 + h3)) + ((h4 + h5) + (h6 + h7)); computed for all sixteen at once by a
/// transposing tree whose every level adds two vectors of partial sums (45 shuffles and adds, a permute and one
/// store, where four reduce_sum4 take 4 × 20 operations). The decoding Q·Kᵀ reduces 4 rows × 4 keys (or 8 × 2) this
/// way.
inline void reduce_sum16(Avx512Tag tag, const __m512* v, float* out) noexcept {
  // Level 1: lanes i and i + 8 of two vectors, side by side: [h of v[2k] | h of v[2k + 1]].
  __m512 h[8];
  for (int k = 0; k < 8; ++k) {
    h[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  // Levels 2 and 3: adjacent pairs within each 128-bit lane.
  const __m512 t0 = hadd_pairs(tag, h[0], h[1]), t1 = hadd_pairs(tag, h[2], h[3]), t2 = hadd_pairs(tag, h[4], h[5]),
               t3 = hadd_pairs(tag, h[6], h[7]);
  const __m512 u0 = hadd_pairs(tag, t0, t1), u1 = hadd_pairs(tag, t2, t3);
  // Level 4: the two 128-bit lanes of each vector's last pair; the sums land in the order 0 2 4 6 1 3 5 7 8 10 …
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
}

/// Transposes the 16 × 16 block held in rows[0..16): lane j of rows[i] becomes lane i of rows[j] (packing Kᵀ panels,
/// pack.hpp). Pairs of rows interleaved, then pairs of pairs (each 128-bit lane then holds one d of four rows), then
/// the 128-bit lanes gathered in two rounds: 64 shuffles.
inline void transpose(Avx512Tag, __m512* rows) noexcept {
  __m512 t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(rows[2 * k], rows[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(rows[2 * k], rows[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + e], 128-bit lane l: d = 4l + e of rows 4k … 4k + 3
    u[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 even0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88),
                 even1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 odd0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD),
                 odd1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    rows[e] = _mm512_shuffle_f32x4(even0, even1, 0x88);
    rows[8 + e] = _mm512_shuffle_f32x4(even0, even1, 0xDD);
    rows[4 + e] = _mm512_shuffle_f32x4(odd0, odd1, 0x88);
    rows[12 + e] = _mm512_shuffle_f32x4(odd0, odd1, 0xDD);
  }
}

/// e^x lane-wise; see exp_constants.hpp. 2^n is applied with vscalefps, which also handles the range ends.
inline __m512 exp(Avx512Tag, __m512 x) noexcept {
  namespace c = exp_constants;
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(c::kMin)), _mm512_set1_ps(c::kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(c::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::kLn2Hi), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(c::kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 result = _mm512_scalef_ps(p, n);
  result = _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, _mm512_set1_ps(c::kMin), _CMP_LT_OQ), _mm512_setzero_ps());
  result = _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, _mm512_set1_ps(c::kMax), _CMP_GT_OQ),
                              _mm512_set1_ps(__builtin_huge_valf()));
  return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);  // NaN stays NaN
}

/// 2^x lane-wise; see exp2_constants in exp_constants.hpp. r = x − round(x) comes from one vreduceps and 2^n is
/// applied by vscalefps (AVX512DQ and F), which also give the range ends: x = ±∞ has r = 0 and 2^±∞ = +∞ or 0 exactly,
/// 2^x above FLT_MAX is +∞, NaN stays NaN. The same polynomial on the same r as AVX2, scaled exactly: the same
/// values as AVX2 for −126 ≤ x < 127.5 (AVX2 gives +∞ from 127.5, this the finite 2^x up to 128; the softmax only
/// takes x ≤ 0). Below −126 the result is 0 (the zeroing mask of vscalefps), never a subnormal: a subnormal weight
/// costs Intel cores a microcode assist in the P·V FMAs. A weight below 2^−126 beside its row's maximum (weight 1)
/// changes the output only where |v| is near FLT_MAX, or turns ∞·(tiny) into 0·∞ = NaN where V holds ±∞ and no
/// key is hidden (AVX2 does so from −126.5, this from −126).
inline __m512 exp2(Avx512Tag, __m512 x) noexcept {
  namespace c = exp2_constants;
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(x, r);
  __m512 p = _mm512_set1_ps(c::kQ0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kQ1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kQ2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kQ3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kQ4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kQ5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);  // x ≥ −126 or NaN
  return _mm512_maskz_scalef_ps(normal, p, n);
}

}  // namespace QKV_ISA_NAME
}  // namespace simd
}  // namespace qkv
QKV_END_TARGET

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif
