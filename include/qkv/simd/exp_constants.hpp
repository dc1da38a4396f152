// qkv/simd/exp_constants.hpp — constants of the vectorized exp shared by every vector tag.
//
// e^x = 2^n · e^r with n = round(x·log2 e) and r = x − n·ln 2 (ln 2 split in a high part exact in float and a
// low part, Cody–Waite), |r| ≤ ln2/2; e^r = 1 + r + r²·P(r) with the degree-5 minimax polynomial P of Cephes'
// expf. Measured error (tests/test_simd.cpp, dense sweep of [−87.3, 0] against double exp): ≤ 2 ulp.
// Inputs below kExpMin give 0 (a value in [0, FLT_MIN]); −∞ gives exactly 0; NaN gives NaN.
#pragma once

namespace qkv {
namespace simd {
namespace exp_constants {
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kMax = 88.3762626647949f;   // e^kMax < FLT_MAX
constexpr float kMin = -87.3365447505531f;  // e^kMin ≈ FLT_MIN; below it the result is 0
constexpr float kP0 = 1.9875691500e-4f;
constexpr float kP1 = 1.3981999507e-3f;
constexpr float kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f;
constexpr float kP4 = 1.6666665459e-1f;
constexpr float kP5 = 5.0000001201e-1f;
}  // namespace exp_constants

// 2^x = 2^n · 2^r with n = round(x) and r = x − n (exact), |r| ≤ 1/2; 2^r = 1 + r·Q(r) with the degree-5
// polynomial Q of Cephes' exp2f (its stated relative error on [−0.5, 0.5]: 1.7e-7). 2^n is built in the exponent
// field, so the result below 2^−126 is 0 (x is clamped to kMin = −127: every x < −126.5, and −∞, give exactly 0)
// and x ≥ 127.5 gives +∞ (n = 128: the exponent field of ∞). NaN stays NaN (the clamps pass it through).
// Measured error (tests/test_simd.cpp, dense sweep of [−126, 127] against double exp2): ≤ 0.91 ulp (bound 2 ulp).
// That is the AVX2 tag's range handling; the AVX-512 tag (avx512.hpp) takes the same polynomial on the same r but
// scales with vscalefps under a mask: 0 for every x < −126, finite up to x < 128, no clamps.
namespace exp2_constants {
constexpr float kMax = 128.0f;
constexpr float kMin = -127.0f;
constexpr float kQ0 = 1.535336188319500e-4f;
constexpr float kQ1 = 1.339887440266574e-3f;
constexpr float kQ2 = 9.618437357674640e-3f;
constexpr float kQ3 = 5.550332471162809e-2f;
constexpr float kQ4 = 2.402264791363012e-1f;
constexpr float kQ5 = 6.931472028550421e-1f;
}  // namespace exp2_constants
}  // namespace simd
}  // namespace qkv
