// qkv/simd/simd.hpp — the SIMD seam: includes every tag the build compiles a kernel for (config.hpp) and names the
// best one the flags enable.
//
// Internal. Ops are overloaded free functions taking a tag (Highway style): zero, set1, load, store,
// load_partial / store_partial (tails), add, sub, mul, fmadd(a, b, c) = a·b + c, max, reduce_max,
// reduce_sum, reduce_sum4 (four lane sums at once; reduce_sum16, sixteen, on 16-lane tags), exp, exp2, transpose (of
// a kLanes × kLanes block); load_kv / load_kv_partial (stored keys or values: float, or Eigen::half /
// Eigen::bfloat16 converted exactly to float); and
// keep_in_register (a codegen hint); prefetch / prefetch_row (no tag: hints, no result).
// Everything sits in qkv::simd's ISA-named inline namespace (config.hpp), so translation units built with different
// flags never share a definition.
#pragma once

#include <cstring>
#include <type_traits>

#include "qkv/config.hpp"
#include "qkv/simd/avx2.hpp"
#include "qkv/simd/avx512.hpp"
#include "qkv/simd/scalar.hpp"

namespace qkv {
namespace simd {
inline namespace QKV_ISA_NAME {

/// Hints that the 64-byte line holding p will be read soon: a software prefetch into every cache level
/// (kLocality = 3, x86's `prefetcht0`, the default) or into L2 and beyond, not L1 (kLocality = 2, `prefetcht1`):
/// `__builtin_prefetch`'s locality. It never faults and has no effect on results; a no-op where the compiler offers
/// no prefetch builtin. Always inlined: g++ 12 left it out of line in the unrolled decoding steps, and then deleted the
/// calls (a function without side effects), so that their 32 prefetches per step were never issued.
template <int kLocality = 3>
QKV_ALWAYS_INLINE inline void prefetch(const void* p) noexcept {
  static_assert(kLocality == 2 || kLocality == 3, "qkv: prefetch into every level (3) or into L2 and beyond (2)");
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, kLocality);
#else
  (void)p;
#endif
}

/// Hints that the first n elements of row p will be read soon: prefetch<kLocality>() once per 64-byte line.
template <int kLocality = 3, class S>
inline void prefetch_row(const S* p, Index n) noexcept {
  constexpr Index kPerLine = 64 / static_cast<Index>(sizeof(S));
  // g++ keeps this a loop of one prefetch per pass; unrolled (as clang++ does by itself), its head-major decode from
  // DRAM took 0.85 of the time on Zen 5 (bench/README.md, "2026-12-03, sixteenth session").
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 8
#endif
  for (Index d = 0; d < n; d += kPerLine) prefetch<kLocality>(p + d);
}

/// The float value of a stored key or value, exact for every storage type (Eigen's conversions: a 16-bit ±∞ or NaN
/// stays ±∞ or NaN, a subnormal half becomes the same number).
template <class S>
inline float to_float(S x) noexcept {
  return static_cast<float>(x);
}

/// A vector of kLanes stored keys or values as floats, for a tag without load_kv overloads of its own (the tests'
/// emulated one): float loads directly, a 16-bit type converts element by element. The scalar, AVX2 and AVX-512 tags
/// define their own (inside their target regions: a template defined out here would be instantiated without the
/// target, which breaks the vector ABI), and overload resolution prefers them.
template <class Tag, class S>
inline typename Tag::Vec load_kv(Tag tag, const S* p) noexcept {
  if constexpr (std::is_same_v<S, float>) {
    return load(tag, p);
  } else {
    float lanes[Tag::kLanes];
    for (int i = 0; i < Tag::kLanes; ++i) lanes[i] = to_float(p[i]);
    return load(tag, lanes);
  }
}
/// The first n (0 ≤ n ≤ kLanes) stored keys or values as floats, the other lanes zero; nothing past p + n is read.
template <class Tag, class S>
inline typename Tag::Vec load_kv_partial(Tag tag, const S* p, int n) noexcept {
  if constexpr (std::is_same_v<S, float>) {
    return load_partial(tag, p, n);
  } else {
    float lanes[Tag::kLanes] = {};
    for (int i = 0; i < n; ++i) lanes[i] = to_float(p[i]);
    return load(tag, lanes);
  }
}

/// Transposes the kLanes × kLanes block held in rows[0..kLanes) (lane j of rows[i] becomes lane i of rows[j]), for a
/// tag without a transpose of its own (the tests' emulated one), through memory. The scalar, AVX2 and AVX-512 tags
/// define theirs, in registers.
template <class Tag>
inline void transpose(Tag tag, typename Tag::Vec* rows) noexcept {
  static_assert(std::is_class_v<typename Tag::Vec>,
                "qkv: a tag whose vector is a register type (float, __m256, __m512) defines its own transpose");
  constexpr int L = Tag::kLanes;
  float block[L * L];
  for (int i = 0; i < L; ++i) store(tag, block + i * L, rows[i]);
  for (int i = 0; i < L; ++i) {
    float column[L];
    for (int j = 0; j < L; ++j) column[j] = block[j * L + i];
    rows[i] = load(tag, column);
  }
}

/// Keeps a loaded vector in a register for its uses that follow: a no-op, except on AVX-512 with g++ (avx512.hpp),
/// which otherwise folds one load into every FMA that uses the vector.
template <class Tag, class V>
inline void keep_in_register(Tag, V&) noexcept {}

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
