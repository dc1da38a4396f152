// qkv/config.hpp — build configuration shared by every qkv header.
//
// Owns: the single wrapped include of Eigen, `QKV_ASSERT`, `non_deduced_t`, the compile-time ISA detection
// and the ISA-named inline namespace, and the `Matrix<Scalar>` alias. Every other qkv header includes this one
// (directly or through errors.hpp) and never includes Eigen itself.
#pragma once

#include <cassert>
#include <cstddef>
#include <type_traits>

// GCC 12 reports false -Wuninitialized / -Wmaybe-uninitialized inside AVX-512 intrinsics (GCC bug 105593),
// in Eigen's own AVX-512 packet code as much as anywhere; and Eigen 3.4.0's AVX packet math declares an
// unused variable (F32ToBf16) that -Wall reports, and a compound literal (Half.h) that clang's -Wpedantic
// reports, when Eigen's directory is not a system include. Eigen is
// included here, once, with those warnings silenced for this include only, so that -Werror holds with
// -march=native whichever way the include path reaches the compiler.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wunused-variable"
#elif defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wunused-variable"
#pragma clang diagnostic ignored "-Wc99-extensions"
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#elif defined(__clang__)
#pragma clang diagnostic pop
#endif

/// Debug-only check of an internal invariant (view indexing, kernel preconditions). Define QKV_ASSERT before
/// including qkv to route it elsewhere (a test harness, a logger). It is compiled out with NDEBUG. Public
/// functions never rely on it to reject user input: they throw `qkv::shape_error` in every build.
#ifndef QKV_ASSERT
#define QKV_ASSERT(condition) assert(condition)
#endif

// The best instruction set the compiler flags enable, chosen at compile time (no runtime dispatch).
// QKV_ISA_NAME is the inline namespace that holds every function whose body depends on it, so that two
// translation units built with different -march flags cannot silently share one definition (ODR).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__FMA__)
#define QKV_ISA_AVX512 1
#define QKV_ISA_NAME isa_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define QKV_ISA_AVX2 1
#define QKV_ISA_NAME isa_avx2
#else
#define QKV_ISA_SCALAR 1
#define QKV_ISA_NAME isa_scalar
#endif

/// Asks the compiler to unroll the next loop completely (a micro-kernel's row loop, so that its accumulators
/// stay in registers; GCC 12 at -O2 otherwise keeps them on the stack).
#if defined(__clang__)
#define QKV_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define QKV_UNROLL _Pragma("GCC unroll 16")
#else
#define QKV_UNROLL
#endif

// Exceptions may be disabled (-fno-exceptions): public functions then print their message and abort.
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
#define QKV_HAS_EXCEPTIONS 1
#else
#define QKV_HAS_EXCEPTIONS 0
#endif

namespace qkv {

/// Dimension and index type: Eigen's signed index (std::ptrdiff_t).
using Index = Eigen::Index;

/// The dense matrix type of the Eigen entry points: rows are tokens, row-major so that one token's features
/// are contiguous and a packed-heads matrix is a zero-copy [T, H, D] view.
template <class Scalar>
using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// C++17 stand-in for C++20's std::type_identity_t: a parameter of this type takes no part in template
/// argument deduction, so `attention(q, k, v, out)` deduces T from `out` alone and q, k, v convert.
template <class T>
struct type_identity {
  using type = T;
};
template <class T>
using non_deduced_t = typename type_identity<T>::type;

/// Name of the instruction set this translation unit's kernels use: "avx512", "avx2" or "scalar".
constexpr const char* isa_name() noexcept {
#if defined(QKV_ISA_AVX512)
  return "avx512";
#elif defined(QKV_ISA_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace qkv
