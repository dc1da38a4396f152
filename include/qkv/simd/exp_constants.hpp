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
}  // namespace simd
}  // namespace qkv
