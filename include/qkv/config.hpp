// qkv/config.hpp — build configuration shared by every qkv header.
//
// Owns: the single wrapped include of Eigen, `QKV_ASSERT`, `non_deduced_t`, the compile-time ISA detection, the
// ISA-named inline namespace, which kernels are compiled for runtime dispatch and the target regions they are
// compiled in, and the `Matrix<Scalar>` alias. `qkv::isa_name()` is in isa.hpp. Every other qkv header includes this one
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

// The best instruction set the compiler flags enable: the build's baseline. QKV_ISA_NAME is the inline namespace that
// holds every function whose body depends on the flags, so that two translation units built with different -march
// flags cannot silently share one definition (ODR; docs/design.md, "Runtime dispatch").
// The AVX2 and AVX-512 kernels also take F16C (vcvtph2ps: 16-bit keys and values converted in registers), which every
// CPU with AVX2 and FMA has in practice but the flags do not imply. MSVC defines __AVX2__ and __AVX512*__ for
// /arch:AVX2 and /arch:AVX512 but never __FMA__ or __F16C__, which both imply.
#if defined(_MSC_VER) && !defined(__clang__) && defined(__AVX2__)
#define QKV_HAS_FMA_ 1
#define QKV_HAS_F16C_ 1
#else
#if defined(__FMA__)
#define QKV_HAS_FMA_ 1
#endif
#if defined(__F16C__)
#define QKV_HAS_F16C_ 1
#endif
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(QKV_HAS_FMA_) && defined(QKV_HAS_F16C_)
#define QKV_ISA_AVX512 1
#elif defined(__AVX2__) && defined(QKV_HAS_FMA_) && defined(QKV_HAS_F16C_)
#define QKV_ISA_AVX2 1
#else
#define QKV_ISA_SCALAR 1
#endif

// Runtime dispatch (isa.hpp, detail/dispatch.hpp): the fused kernel is compiled once per instruction set, each copy
// under its own function-level target (GCC and Clang `#pragma GCC target` / `#pragma clang attribute`), and the best
// one the CPU runs is picked once per process. Which kernels a translation unit compiles:
//   - flags without AVX2 (a plain build, -march=x86-64): scalar, AVX2 and AVX-512, chosen by CPUID;
//   - flags with AVX2 or AVX-512 (-march=x86-64-v3, -march=native): scalar and every ISA up to the flags' own, which
//     are all the binary can run (its other code may use the flags' instructions anywhere);
//   - QKV_DISPATCH=0 (CMake: -DQKV_DISPATCH=OFF), or a compiler without target attributes: the flags' ISA alone.
// The scalar kernel is always there, so QKV_ISA=scalar can pin it for testing (valgrind, the scalar CI stage).
#ifndef QKV_DISPATCH
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define QKV_DISPATCH 1
#else
#define QKV_DISPATCH 0
#endif
#endif

#if QKV_DISPATCH
#if defined(QKV_ISA_SCALAR) || defined(QKV_ISA_AVX512)
#define QKV_KERNEL_AVX2 1
#define QKV_KERNEL_AVX512 1
#else
#define QKV_KERNEL_AVX2 1
#endif
#elif defined(QKV_ISA_AVX512)
#define QKV_KERNEL_AVX512 1
#elif defined(QKV_ISA_AVX2)
#define QKV_KERNEL_AVX2 1
#endif
// With dispatch off, the flags' ISA alone: the scalar kernel only when it is the flags' best.
#if QKV_DISPATCH || defined(QKV_ISA_SCALAR)
#define QKV_KERNEL_SCALAR 1
#endif

// The inline namespace names what decides every kernel's code and behaviour: the flags' ISA, whether they dispatch,
// and whether OpenMP is on (qkv::qkv and qkv::qkv_serial linked into one program must not share a definition):
// isa_avx2, isa_avx2_static, isa_avx2_serial, isa_avx2_static_serial, ...
#if defined(QKV_ISA_AVX512)
#define QKV_ISA_BASE_ isa_avx512
#elif defined(QKV_ISA_AVX2)
#define QKV_ISA_BASE_ isa_avx2
#else
#define QKV_ISA_BASE_ isa_scalar
#endif
#if QKV_DISPATCH
#define QKV_ISA_DISPATCH_
#else
#define QKV_ISA_DISPATCH_ _static
#endif
#if defined(_OPENMP)
#define QKV_ISA_THREADS_
#else
#define QKV_ISA_THREADS_ _serial
#endif
#define QKV_ISA_CAT3_(a, b, c) a##b##c
#define QKV_ISA_CAT_(a, b, c) QKV_ISA_CAT3_(a, b, c)
#define QKV_ISA_NAME QKV_ISA_CAT_(QKV_ISA_BASE_, QKV_ISA_DISPATCH_, QKV_ISA_THREADS_)

// Function-level targets: code between QKV_BEGIN_TARGET_AVX2 (or _AVX512) and QKV_END_TARGET is compiled for that
// instruction set whatever the flags, so that intrinsics can be used there and inline into each other. Include every
// standard and Eigen header before such a region: a declaration inside it takes the target too.
#if defined(__clang__)
#define QKV_BEGIN_TARGET_AVX2 \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define QKV_BEGIN_TARGET_AVX512                                                                                       \
  _Pragma(                                                                                                            \
      "clang attribute push(__attribute__((target(\"avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl\"))), apply_to = function)")
#define QKV_END_TARGET _Pragma("clang attribute pop")
#elif defined(__GNUC__)
#define QKV_BEGIN_TARGET_AVX2 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define QKV_BEGIN_TARGET_AVX512            \
  _Pragma("GCC push_options") _Pragma(     \
      "GCC target(\"avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl\")")
#define QKV_END_TARGET _Pragma("GCC pop_options")
#else
#define QKV_BEGIN_TARGET_AVX2
#define QKV_BEGIN_TARGET_AVX512
#define QKV_END_TARGET
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

/// Makes a function or a lambda's call operator inline wherever it is called (after a lambda's parameter list): the
/// column loops of the decoding micro-kernels, whose lambda bodies hold their accumulators in registers only when
/// inlined.
#if defined(__GNUC__)
#define QKV_ALWAYS_INLINE __attribute__((always_inline))
#else
#define QKV_ALWAYS_INLINE
#endif

/// Keeps a function out of line: the token-major decoding P·V (decode_kernels.hpp, pv_paced), whose unrolled bodies,
/// inlined into the decoding task, changed how the compilers inline the head-major one.
#if defined(__GNUC__)
#define QKV_NOINLINE __attribute__((noinline))
#else
#define QKV_NOINLINE
#endif

/// Asks the compiler not to unroll the next loop: a loop of prefetches a few iterations long, which clang++ 14 at -O3
/// unrolls eightfold behind a remainder loop (g++ does not unroll without -funroll-loops).
#if defined(__clang__)
#define QKV_NO_UNROLL _Pragma("nounroll")
#else
#define QKV_NO_UNROLL
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

}  // namespace qkv
