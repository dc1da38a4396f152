// qkv/simd/scalar.hpp — the scalar "vector" of one lane: the definition every SIMD op must agree with.
//
// Internal (STYLE.md, One SIMD seam): kernels are written once against a tag; `ScalarTag` makes them plain C++.
// Every build has it, so tests compare the vector tags against it in one binary.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "qkv/config.hpp"
#include "qkv/isa.hpp"

namespace qkv {
namespace simd {
inline namespace QKV_ISA_NAME {

/// One float lane. `Vec` is the register type, `kLanes` its float count.
struct ScalarTag {
  using Vec = float;
  static constexpr int kLanes = 1;
  static constexpr const char* kName = "scalar";
  static constexpr detail::Isa kIsa = detail::Isa::scalar;
};

inline float zero(ScalarTag) noexcept { return 0.0f; }
inline float set1(ScalarTag, float x) noexcept { return x; }
inline float load(ScalarTag, const float* p) noexcept { return *p; }
inline void store(ScalarTag, float* p, float v) noexcept { *p = v; }
/// Loads the first n (< kLanes) floats and zeros the rest; with one lane, n is 0 (nothing is read).
inline float load_partial(ScalarTag, const float* p, int n) noexcept { return n > 0 ? *p : 0.0f; }
inline void store_partial(ScalarTag, float* p, float v, int n) noexcept {
  if (n > 0) *p = v;
}
/// A stored key or value (float, Eigen::half, Eigen::bfloat16) as a float, exactly; the partial form reads it only
/// when n > 0.
template <class S>
inline float load_kv(ScalarTag, const S* p) noexcept {
  return static_cast<float>(*p);
}
template <class S>
inline float load_kv_partial(ScalarTag, const S* p, int n) noexcept {
  return n > 0 ? static_cast<float>(*p) : 0.0f;
}
inline float add(float a, float b) noexcept { return a + b; }
inline float sub(float a, float b) noexcept { return a - b; }
inline float mul(float a, float b) noexcept { return a * b; }
/// fmadd(a, b, c) = a·b + c (fused where the hardware has it: std::fma rounds once).
inline float fmadd(float a, float b, float c) noexcept { return std::fma(a, b, c); }
/// max(a, b): b when either is NaN, as x86's maxps (callers that must propagate NaN test for it apart).
inline float max(float a, float b) noexcept { return a > b ? a : b; }
inline float reduce_max(ScalarTag, float v) noexcept { return v; }
inline float reduce_sum(ScalarTag, float v) noexcept { return v; }
/// out[0..4) = the lane sums of a, b, c, d (with one lane, the values themselves).
inline void reduce_sum4(ScalarTag, float a, float b, float c, float d, float* out) noexcept {
  out[0] = a, out[1] = b, out[2] = c, out[3] = d;
}
/// The 1 × 1 block's transpose: itself.
inline void transpose(ScalarTag, float*) noexcept {}
/// e^x with the C library's accuracy (≤ 1 ulp in glibc); 0 for −∞, NaN for NaN.
inline float exp(ScalarTag, float x) noexcept { return std::exp(x); }
/// 2^x with the C library's accuracy; 0 for −∞, NaN for NaN.
inline float exp2(ScalarTag, float x) noexcept { return std::exp2(x); }

}  // namespace QKV_ISA_NAME
}  // namespace simd
}  // namespace qkv
