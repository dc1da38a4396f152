// qkv/simd/simd.hpp — the SIMD seam: includes every tag the build's flags enable and names the best one.
//
// Internal. Ops are overloaded free functions taking a tag (Highway style): zero, set1, load, store,
// load_partial / store_partial (tails), add, sub, mul, fmadd(a, b, c) = a·b + c, max, reduce_max,
// reduce_sum, exp, exp2. Everything sits in qkv::simd's ISA-named inline namespace (config.hpp), so translation units
// built with different flags never share a definition.
#pragma once

#include "qkv/config.hpp"
#include "qkv/simd/avx2.hpp"
#include "qkv/simd/avx512.hpp"
#include "qkv/simd/scalar.hpp"

namespace qkv {
namespace simd {
inline namespace QKV_ISA_NAME {

#if defined(QKV_ISA_AVX512)
using BestTag = Avx512Tag;
#elif defined(QKV_ISA_AVX2)
using BestTag = Avx2Tag;
#else
using BestTag = ScalarTag;
#endif

}  // namespace QKV_ISA_NAME
}  // namespace simd
}  // namespace qkv
