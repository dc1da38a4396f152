// qkv/isa.hpp — which instruction set the fused kernel runs on: the CPU's best, found once per process, or a pin.
//
// A build compiles the fused kernel once per instruction set (config.hpp says which; detail/dispatch.hpp holds the
// copies) and every call runs the one chosen here:
//
//   1. the pin, if the environment variable QKV_ISA (read once, at the first call) or, where it is unset, the macro
//      QKV_ISA_DEFAULT (CMake: -DQKV_ISA=..., for qkv's own tests and benchmarks) names one: `scalar`, `avx2` or
//      `avx512`; `best` or empty means no pin. A pin the build did not compile or the CPU cannot run is reported
//      once on stderr and the best kernel runs instead (isa_name() then tells which);
//   2. otherwise the best compiled kernel the CPU and the operating system support: AVX-512 (F, BW, DQ, VL, with the
//      OS saving the ZMM state), AVX2 with FMA, scalar.
//
// The choice is the same for every thread and never changes after the first call. It is made once per set of build
// flags: a program whose translation units were all built with the same flags (the usual case) chooses once; units
// built with different -march, QKV_DISPATCH or OpenMP settings each choose for themselves (config.hpp, ODR), from the
// same CPU and pin. QKV_ISA_DEFAULT is for qkv's own tests: give every unit of a program the same value. Eigen's own code (the reference
// backend, the Eigen products of the module and the classic scores) is not dispatched: it follows the build's flags.
// Source: the dynamic dispatch of Highway (HWY_DYNAMIC_DISPATCH) and OpenBLAS's DYNAMIC_ARCH.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "qkv/config.hpp"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#endif

namespace qkv {
namespace detail {

/// The instruction sets the fused kernel exists for, worst to best.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

/// The name isa_name() reports for an instruction set: "scalar", "avx2" or "avx512".
constexpr const char* isa_string(Isa isa) noexcept {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar";
}

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
/// Whether CPUID reports F16C (leaf 1, ECX bit 29): Clang 14's __builtin_cpu_supports does not know "f16c".
inline bool cpu_has_f16c() noexcept {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}
#endif

/// Whether this CPU, and the OS's saving of its registers, support an instruction set (AVX2 and AVX-512 with FMA and
/// F16C). GCC's and Clang's `__builtin_cpu_supports` read CPUID and check XGETBV for the AVX and AVX-512 state.
/// Complexity: O(1).
inline bool cpu_supports(Isa isa) noexcept {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();  // needed before __builtin_cpu_supports when called before static constructors have run
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case Isa::avx512:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c() &&
             __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return isa == Isa::scalar;
#endif
}

/// What a pin string asks for: `found` is false for an unknown name; `pinned` is false for "", "best" and null.
struct IsaRequest {
  bool found = true;
  bool pinned = false;
  Isa isa = Isa::scalar;
};

/// Parses the value of QKV_ISA. Complexity: O(length).
inline IsaRequest parse_isa(const char* text) noexcept {
  IsaRequest request;
  if (text == nullptr || *text == '\0' || std::strcmp(text, "best") == 0) return request;
  request.pinned = true;
  if (std::strcmp(text, "scalar") == 0) {
    request.isa = Isa::scalar;
  } else if (std::strcmp(text, "avx2") == 0) {
    request.isa = Isa::avx2;
  } else if (std::strcmp(text, "avx512") == 0) {
    request.isa = Isa::avx512;
  } else {
    request.found = false;
  }
  return request;
}

/// The kernel a build runs, from what it compiled (`compiled[isa]`), what the CPU supports and the pin text: the pin
/// when it is compiled and supported, else the best compiled and supported one (else the lowest compiled one, which
/// the caller must refuse to run). `why_not`, when the pin cannot be
/// honoured, is set to a reason for the caller to report. Pure; the tests call it with every combination.
inline Isa choose_isa(const bool (&compiled)[3], const bool (&supported)[3], const char* pin,
                      const char** why_not) noexcept {
  *why_not = nullptr;
  const IsaRequest request = parse_isa(pin);
  if (request.pinned) {
    const int n = static_cast<int>(request.isa);
    if (!request.found) {
      *why_not = "is not one of scalar, avx2, avx512, best";
    } else if (!compiled[n]) {
      *why_not = "names a kernel this build did not compile (config.hpp says which a build compiles)";
    } else if (!supported[n]) {
      *why_not = "names an instruction set this CPU does not support";
    } else {
      return request.isa;
    }
  }
  for (int n = 2; n >= 0; --n) {
    if (compiled[n] && supported[n]) return static_cast<Isa>(n);
  }
  // Nothing compiled runs here: only a build whose flags this CPU lacks (QKV_DISPATCH=0), which cannot run at all.
  return compiled[0] ? Isa::scalar : compiled[1] ? Isa::avx2 : Isa::avx512;
}

inline namespace QKV_ISA_NAME {  // the compiled set depends on the flags (config.hpp)

/// The kernel this build's calls run, chosen at the first call (see the file comment) and cached.
inline Isa active_isa() noexcept {
  static const Isa chosen = [] {
    const bool compiled[3] = {
#if defined(QKV_KERNEL_SCALAR)
        true,
#else
        false,
#endif
#if defined(QKV_KERNEL_AVX2)
        true,
#else
        false,
#endif
#if defined(QKV_KERNEL_AVX512)
        true,
#else
        false,
#endif
    };
    const bool supported[3] = {true, cpu_supports(Isa::avx2), cpu_supports(Isa::avx512)};
    const char* pin = std::getenv("QKV_ISA");
#if defined(QKV_ISA_DEFAULT)
    if (pin == nullptr) pin = QKV_ISA_DEFAULT;
#endif
    const char* why_not = nullptr;
    const Isa isa = choose_isa(compiled, supported, pin, &why_not);
    if (!supported[static_cast<int>(isa)]) {  // a QKV_DISPATCH=0 build whose flags this CPU lacks
      std::fprintf(stderr,
                   "qkv: this build compiled only the %s kernel (QKV_DISPATCH=0 and -march flags), which this CPU "
                   "does not support; rebuild with dispatch on or with flags this CPU has\n",
                   isa_string(isa));
      std::abort();
    }
    if (why_not != nullptr) {
      std::fprintf(stderr, "qkv: QKV_ISA=%s %s; running the %s kernel\n", pin, why_not, isa_string(isa));
    }
    return isa;
  }();
  return chosen;
}

}  // namespace QKV_ISA_NAME
}  // namespace detail

inline namespace QKV_ISA_NAME {

/// The instruction set of the fused kernel this program's calls run: "avx512", "avx2" or "scalar" — the best the
/// CPU supports among those the build compiled, or the QKV_ISA pin (see the file comment). Decided at the first call
/// of this function or of a fused attention call, then fixed for the process. Thread-safe. Complexity: O(1) after
/// the first call. Source: Highway's dynamic dispatch.
inline const char* isa_name() noexcept { return detail::isa_string(detail::active_isa()); }

}  // namespace QKV_ISA_NAME
}  // namespace qkv
