// tests/support/emulated_tag.hpp — Emulated16Tag: a SIMD tag of sixteen float lanes in plain C++, so that the fused
// kernel's 16-lane instantiation (AVX-512's tile shapes: fused_tiles.hpp picks them by Tag::kLanes) runs on any CPU.
//
// The ops are those of include/qkv/simd/avx512.hpp, lane by lane:
//   - load_partial / store_partial touch lanes [0, n) only (0 ≤ n ≤ 16, asserted): nothing at or past p + n is read
//     or written, so ASan checks the 16-lane kernel's accesses; the other lanes load as 0;
//   - fmadd rounds once (std::fma, or its exact emulation in double where the flags lack FMA); max is maxps (b where
//     either is NaN, b for equal operands);
//   - reduce_sum and reduce_max pair lanes as GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps do (i + 8, i + 4, then
//     lanes 0, 2 and 1, 3, then 0, 1; Clang's reduce_add pairs the same way); reduce_sum4 as avx512.hpp's (the two
//     halves added, then the hadd tree), and reduce_sum16 as four of them (avx512.hpp's pairs the same way);
//   - exp and exp2 by the polynomials and range handling of exp_constants.hpp, in scalar code with that fma, each step
//     the lane's instruction of avx512.hpp: exp scales by 2^n as vscalefps does (std::ldexp: one rounding, denormal
//     results), exp2 takes r from vreduceps and scales by vscalefps too, zeroed below −126; NaN → NaN.
//     (Against avx2.hpp's exp and exp2, which compute the same values for −126 ≤ x < 127.5, the bits were
//     equal on 3.3 million points of [−200, 200] and the edge values, before exp2 moved to vreduceps/vscalefps.)
// So every op gives the AVX-512 op's bits, except NaN payloads and, with Clang, reduce_max where NaN or zeros of both
// signs meet (Clang's _mm512_reduce_max_ps may pair lanes otherwise). test_fused's
// FusedEmulated16.BitIdenticalToTheAvx512Kernel compares the kernel's out and lse on an AVX-512 CPU, in builds with
// FMA in the flags: without it the emulated copy's scalar code (score finishing, lse) does not fuse the multiply-adds
// the AVX-512 copy fuses, and its last bits may differ.
//
// How the kernel finds the ops: the kernel calls every op unqualified (`using namespace simd;`; the online softmax's
// exp and exp2 too), and argument-dependent lookup finds these in qkv_test, the namespace of Vec16 and of the tag,
// at instantiation, wherever this header is included. Every op is also declared in qkv::simd (using-declarations at the
// end), for test_simd's qualified calls qkv::simd::op(Tag(), ...). The tests include this header (through
// support/run_fused_with.hpp) before the qkv headers, a rule from when the online softmax called simd::exp2
// qualified; it no longer matters (test_fused, test_backward, test_dropout and test_kv16 compiled with it after the
// qkv headers, clang++ 14 and g++ 12, 2026-12-04).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "qkv/config.hpp"
#include "qkv/isa.hpp"
#include "qkv/simd/exp_constants.hpp"

// The ops are kept out of line: inlined, each a loop over 16 lanes in the fully unrolled micro-kernels, they made
// test_fused take 18 s more CPU time to compile (g++ 12 -O2), out of line 7 s; the emulated kernel's run time stays
// small beside that of the float64 and plain float results the tests compare it with.
#if defined(__GNUC__)
#define QKV_EMULATED_OP inline __attribute__((noinline))
#else
#define QKV_EMULATED_OP inline
#endif

namespace qkv_test {
// The ops are compiled with this unit's flags and are not inlined: in the ISA-named namespace, so that units built
// with different flags never share one (docs/design.md, ODR).
inline namespace QKV_ISA_NAME {

/// Sixteen float lanes, lane 0 at the lowest address (as __m512).
struct Vec16 {
  float lane[16];
};

/// The emulated AVX-512 tag: 16 lanes in plain C++, run wherever the scalar kernel runs.
struct Emulated16Tag {
  using Vec = Vec16;
  static constexpr int kLanes = 16;
  static constexpr const char* kName = "emulated16";
  static constexpr qkv::detail::Isa kIsa = qkv::detail::Isa::scalar;
};

namespace emulated {
/// maxps and minps on one lane: the second operand where either is NaN or both are equal.
inline float max_lane(float a, float b) noexcept { return a > b ? a : b; }
inline float min_lane(float a, float b) noexcept { return a < b ? a : b; }
inline float from_bits(std::uint32_t bits) noexcept {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
/// a·b + c rounded once (vfmadd). std::fma where the flags have FMA; without it std::fma is a library call per lane,
/// so in double instead: the product is exact, the sum is rounded to odd (its rounding error found by TwoSum), and
/// that rounds to float as the exact sum would (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums:
/// proved algorithms using rounding to odd", 2008).
inline float fused_multiply_add(float a, float b, float c) noexcept {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  const double product = double(a) * double(b);  // exact: 48 significant bits at most
  const double sum = product + double(c);
  if (!std::isfinite(sum)) return static_cast<float>(sum);  // ±∞ and NaN as the fused operation gives them
  const double b_part = sum - product;
  const double error = (product - (sum - b_part)) + (double(c) - b_part);  // product + c = sum + error, exactly
  std::uint64_t bits;
  std::memcpy(&bits, &sum, sizeof bits);
  if (error != 0.0 && (bits & 1u) == 0) {  // inexact with an even significand: the odd neighbour toward the exact sum
    bits = (error > 0.0) == (sum > 0.0) ? bits + 1 : bits - 1;
    double odd;
    std::memcpy(&odd, &bits, sizeof odd);
    return static_cast<float>(odd);
  }
  return static_cast<float>(sum);
#endif
}
}  // namespace emulated

QKV_EMULATED_OP Vec16 zero(Emulated16Tag) noexcept { return Vec16{}; }
QKV_EMULATED_OP Vec16 set1(Emulated16Tag, float x) noexcept {
  Vec16 v;
  for (float& lane : v.lane) lane = x;
  return v;
}
QKV_EMULATED_OP Vec16 load(Emulated16Tag, const float* p) noexcept {
  Vec16 v;
  std::memcpy(v.lane, p, sizeof v.lane);
  return v;
}
QKV_EMULATED_OP void store(Emulated16Tag, float* p, Vec16 v) noexcept { std::memcpy(p, v.lane, sizeof v.lane); }
/// Loads the first n floats (0 ≤ n ≤ 16, asserted; with NDEBUG, n is clamped to that range) and zeros the rest;
/// memory at and past p + n is not read (a masked load).
QKV_EMULATED_OP Vec16 load_partial(Emulated16Tag, const float* p, int n) noexcept {
  QKV_ASSERT(n >= 0 && n <= 16);
  Vec16 v{};
  for (int i = 0; i < n && i < 16; ++i) v.lane[i] = p[i];
  return v;
}
/// Stores the first n lanes (0 ≤ n ≤ 16, as load_partial); memory at and past p + n is not written (a masked store).
QKV_EMULATED_OP void store_partial(Emulated16Tag, float* p, Vec16 v, int n) noexcept {
  QKV_ASSERT(n >= 0 && n <= 16);
  for (int i = 0; i < n && i < 16; ++i) p[i] = v.lane[i];
}
QKV_EMULATED_OP Vec16 add(Vec16 a, Vec16 b) noexcept {
  for (int i = 0; i < 16; ++i) a.lane[i] += b.lane[i];
  return a;
}
QKV_EMULATED_OP Vec16 sub(Vec16 a, Vec16 b) noexcept {
  for (int i = 0; i < 16; ++i) a.lane[i] -= b.lane[i];
  return a;
}
QKV_EMULATED_OP Vec16 mul(Vec16 a, Vec16 b) noexcept {
  for (int i = 0; i < 16; ++i) a.lane[i] *= b.lane[i];
  return a;
}
/// fmadd(a, b, c) = a·b + c, rounded once.
QKV_EMULATED_OP Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) noexcept {
  for (int i = 0; i < 16; ++i) c.lane[i] = emulated::fused_multiply_add(a.lane[i], b.lane[i], c.lane[i]);
  return c;
}
/// Lane-wise max; b where either is NaN (maxps semantics).
QKV_EMULATED_OP Vec16 max(Vec16 a, Vec16 b) noexcept {
  for (int i = 0; i < 16; ++i) a.lane[i] = emulated::max_lane(a.lane[i], b.lane[i]);
  return a;
}
/// The largest lane, paired as GCC's _mm512_reduce_max_ps: max(high half, low half), then of the 128-bit halves,
/// then lanes 0, 2 and 1, 3, then 0, 1.
QKV_EMULATED_OP float reduce_max(Emulated16Tag, Vec16 v) noexcept {
  using emulated::max_lane;
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = max_lane(v.lane[i + 8], v.lane[i]);
  for (int i = 0; i < 4; ++i) t[i] = max_lane(t[i + 4], t[i]);
  return max_lane(max_lane(t[0], t[2]), max_lane(t[1], t[3]));
}
/// The sum of the lanes, paired as GCC's _mm512_reduce_add_ps (and Clang's): lane i + lane i + 8, then i + 4, then
/// (0 + 2) + (1 + 3).
QKV_EMULATED_OP float reduce_sum(Emulated16Tag, Vec16 v) noexcept {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = v.lane[i + 8] + v.lane[i];
  for (int i = 0; i < 4; ++i) t[i] = t[i + 4] + t[i];
  return (t[0] + t[2]) + (t[1] + t[3]);
}
/// out[0..4) = the lane sums of a, b, c, d, each paired as avx512.hpp's reduce_sum4: h_i = lane i + lane i + 8, then
/// ((h0 + h1) + (h2 + h3)) + ((h4 + h5) + (h6 + h7)) (its two hadds and the final add of the 128-bit halves).
QKV_EMULATED_OP void reduce_sum4(Emulated16Tag, Vec16 a, Vec16 b, Vec16 c, Vec16 d, float* out) noexcept {
  const Vec16* vectors[4] = {&a, &b, &c, &d};
  for (int m = 0; m < 4; ++m) {
    const float* x = vectors[m]->lane;
    float h[8];
    for (int i = 0; i < 8; ++i) h[i] = x[i] + x[i + 8];
    out[m] = ((h[0] + h[1]) + (h[2] + h[3])) + ((h[4] + h[5]) + (h[6] + h[7]));
  }
}

/// out[0..16) = the lane sums of v[0..16), paired as reduce_sum4 (avx512.hpp's reduce_sum16 keeps that pairing).
QKV_EMULATED_OP void reduce_sum16(Emulated16Tag, const Vec16* v, float* out) noexcept {
  for (int m = 0; m < 16; m += 4) reduce_sum4(Emulated16Tag(), v[m], v[m + 1], v[m + 2], v[m + 3], out + m);
}

/// e^x lane-wise, avx512.hpp's exp step by step: clamp, n = round(x·log2 e), r by Cody–Waite, the polynomial, then
/// p·2^n as vscalefps computes it (std::ldexp: exact scaling, one rounding, denormal results); x < kMin gives 0,
/// x > kMax gives +∞, NaN gives x.
QKV_EMULATED_OP Vec16 exp(Emulated16Tag, Vec16 x) noexcept {
  namespace c = qkv::simd::exp_constants;
  using namespace emulated;
  Vec16 y;
  for (int i = 0; i < 16; ++i) {
    const float xi = x.lane[i];
    const float clamped = min_lane(max_lane(xi, c::kMin), c::kMax);
    // vrndscaleps, to nearest even: std::nearbyint, not the 1.5·2^23 shift (a multiply feeding an add may be fused).
    const float n = std::nearbyint(clamped * c::kLog2e);
    float r = fused_multiply_add(-n, c::kLn2Hi, clamped);
    r = fused_multiply_add(-n, c::kLn2Lo, r);
    float p = c::kP0;
    p = fused_multiply_add(p, r, c::kP1);
    p = fused_multiply_add(p, r, c::kP2);
    p = fused_multiply_add(p, r, c::kP3);
    p = fused_multiply_add(p, r, c::kP4);
    p = fused_multiply_add(p, r, c::kP5);
    const float r2 = r * r, r1 = r + 1.0f;
    p = fused_multiply_add(p, r2, r1);
    float result = std::ldexp(p, static_cast<int>(n));
    if (xi < c::kMin) result = 0.0f;
    if (xi > c::kMax) result = std::numeric_limits<float>::infinity();
    y.lane[i] = std::isnan(xi) ? xi : result;
  }
  return y;
}

/// 2^x lane-wise, avx512.hpp's exp2 step by step: r = x − round(x) as vreduceps gives it (0 for ±∞, NaN for NaN),
/// n = x − r, the polynomial in r, then p·2^n as vscalefps computes it (std::ldexp: exact, one rounding; n = +∞ gives
/// +∞) under the zeroing mask x ≥ −126 or NaN (below −126: 0).
QKV_EMULATED_OP Vec16 exp2(Emulated16Tag, Vec16 x) noexcept {
  namespace c = qkv::simd::exp2_constants;
  using namespace emulated;
  Vec16 y;
  for (int i = 0; i < 16; ++i) {
    const float xi = x.lane[i];
    const float r = std::isinf(xi) ? 0.0f : xi - std::nearbyint(xi);
    const float n = xi - r;
    float p = c::kQ0;
    p = fused_multiply_add(p, r, c::kQ1);
    p = fused_multiply_add(p, r, c::kQ2);
    p = fused_multiply_add(p, r, c::kQ3);
    p = fused_multiply_add(p, r, c::kQ4);
    p = fused_multiply_add(p, r, c::kQ5);
    p = fused_multiply_add(p, r, 1.0f);
    if (std::isnan(xi)) {
      y.lane[i] = xi;
    } else if (xi < -126.0f) {
      y.lane[i] = 0.0f;
    } else if (std::isinf(n)) {
      y.lane[i] = std::numeric_limits<float>::infinity();
    } else {
      y.lane[i] = std::ldexp(p, static_cast<int>(std::min(n, 1000.0f)));
    }
  }
  return y;
}

}  // namespace QKV_ISA_NAME
}  // namespace qkv_test

#undef QKV_EMULATED_OP

// The ops in qkv::simd as well (see the header comment): for the kernel's qualified calls, and for test_simd's.
namespace qkv {
namespace simd {
inline namespace QKV_ISA_NAME {
using qkv_test::add;
using qkv_test::exp;
using qkv_test::exp2;
using qkv_test::fmadd;
using qkv_test::load;
using qkv_test::load_partial;
using qkv_test::max;
using qkv_test::mul;
using qkv_test::reduce_max;
using qkv_test::reduce_sum;
using qkv_test::reduce_sum16;
using qkv_test::reduce_sum4;
using qkv_test::set1;
using qkv_test::store;
using qkv_test::store_partial;
using qkv_test::sub;
using qkv_test::zero;
}  // namespace QKV_ISA_NAME
}  // namespace simd
}  // namespace qkv
