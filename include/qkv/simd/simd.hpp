// qkv/simd/simd.hpp — the SIMD seam: includes every tag the build compiles a kernel for (config.hpp) and names the
// best one the flags enable.
//
// Internal. Ops are overloaded free functions taking a tag (Highway style): zero, set1, load, store,
// load_partial / store_partial (tails), add, sub, mul, fmadd(a, b, c) = a·b + c, max, reduce_max,
// reduce_sum, reduce_sum4 (four lane sums at once), exp, exp2; and prefetch (no tag: a hint with no result).
// Everything sits in qkv::simd's ISA-named inline namespace (config.hpp), so translation units built with different
// flags never share a definition.
#pragma once

#include "qkv/config.hpp"
#include "qkv/simd/avx2.hpp"
#include "qkv/simd/avx512.hpp"
#include "qkv/simd/scalar.hpp"

namespace qkv {
namespace simd {
inline namespace QKV_ISA_NAME {

/// Hints that the 64-byte line holding p will be read soon (a software prefetch into all cache levels). It never
/// faults and has no effect on results; a no-op where the compiler offers no prefetch builtin.
inline void prefetch(const float* p) noexcept {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

/// The best tag the build's flags enable, for code compiled with those flags that calls the ops directly (the ops'
/// tests, the benchmarks' FMA peak). The fused kernel does not use it: it runs the tag isa.hpp picks at run time.
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
