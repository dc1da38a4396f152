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
// same CPU and pin. QKV_ISA_DEFAULT is for qkv's own tests: give every unit of a program the same value. Eigen's own
// code (the reference backend, the Eigen products of the module and the classic scores) is not dispatched: it follows
// the build's flags. Source: the dynamic dispatch of Highway (HWY_DYNAMIC_DISPATCH) and OpenBLAS's DYNAMIC_ARCH.
//
// Also chosen here, once per process: the cache level of the decoding kernels' software prefetches, L2 on AMD Zen 4 and
// L1 elsewhere, or the QKV_DECODE_PREFETCH pin (decode_prefetch_level). It also sets one step size (a token-major
// decoding task's float P·V takes four keys per step in the L2 copy on AVX-512, kPvGroupedKeysPerStep); no result
// depends on it.
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

/// Where the decoding kernels' software prefetches put K and V lines (simd::prefetch's locality): into every level,
/// L1 included (`prefetcht0`), or into L2 and beyond (`prefetcht1`). A hint only: no result depends on it.
enum class PrefetchLevel : int { l1 = 0, l2 = 1 };

/// What a QKV_DECODE_PREFETCH text asks for: `pinned` is false for null, "" and "auto"; `found` false for an unknown
/// name. Complexity: O(length).
struct PrefetchRequest {
  bool found = true;
  bool pinned = false;
  PrefetchLevel level = PrefetchLevel::l1;
};
inline PrefetchRequest parse_prefetch_level(const char* text) noexcept {
  PrefetchRequest request;
  if (text == nullptr || *text == '\0' || std::strcmp(text, "auto") == 0) return request;
  request.pinned = true;
  if (std::strcmp(text, "l1") == 0) {
    request.level = PrefetchLevel::l1;
  } else if (std::strcmp(text, "l2") == 0) {
    request.level = PrefetchLevel::l2;
  } else {
    request.found = false;
  }
  return request;
}

/// The decoding kernels' prefetch level for a CPU (`amd`: CPUID's vendor is AuthenticAMD; `family`: CPUID's display
/// family; `avx512`: cpu_supports(Isa::avx512)), unless `pin` names one (parse_prefetch_level). L2 on AMD family 0x19
/// with AVX-512 (Zen 4), L1 elsewhere. Measured on Zen 4 (EPYC, family 0x19 model 0x11; Sq = 1, Hq = 32, Hkv = 8,
/// D = 128, one thread, paired), prefetching into L2 took decode from DRAM 0.60–0.69 of the time (head-major and
/// token-major, float and f16), from L3 0.76–0.85: an L1 prefetch holds one of the L1's few miss buffers for the whole
/// trip to DRAM, so that the stream waits on them (a loop of Q·Kᵀ steps read at 9.3–10.7 GB/s with `prefetcht0` at any
/// distance, 10.8 without, 21.8 with `prefetcht1` 32 rows ahead). On Zen 5 (family 0x1A) every head-major prefetch
/// into L2 took 1.20 (L3) and 1.26 (DRAM) of the time, and a token-major task's cursor lines alone into L2 1.01–1.10
/// from DRAM; the whole L2 copy as it is now, 1.00–1.13 from DRAM (bench/README.md, "2026-12-06, thirty-second
/// session"), so Zen 5 keeps L1; on Zen 3 (family 0x19 without AVX-512) token-major decode from DRAM took 1.06 (float)
/// and 0.97 (f16) with L2, and it keeps L1; Intel CPUs were not measured and keep L1, what every CPU ran before
/// (bench/README.md, "2026-12-05, twenty-sixth session"). `why_not`, for a pin that names no level, is set to a reason
/// for the caller to report. Pure.
inline PrefetchLevel choose_prefetch_level(bool amd, unsigned family, bool avx512, const char* pin,
                                           const char** why_not) noexcept {
  *why_not = nullptr;
  const PrefetchRequest request = parse_prefetch_level(pin);
  if (request.pinned && request.found) return request.level;
  if (request.pinned) *why_not = "is not one of l1, l2, auto";
  return amd && family == 0x19 && avx512 ? PrefetchLevel::l2 : PrefetchLevel::l1;
}

/// CPUID's vendor (`amd`) and display family (base family, plus the extended family where the base is 0xF).
inline void cpu_vendor_family(bool* amd, unsigned* family) noexcept {
  *amd = false;
  *family = 0;
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return;
  *amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "Auth" "enti" "cAMD"
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return;
  const unsigned base = (eax >> 8) & 0xFu;
  *family = base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base;
#endif
}

/// The decoding kernels' prefetch level for this process: the environment variable QKV_DECODE_PREFETCH (`l1`, `l2`,
/// or `auto`/unset: by CPU), read once at the first decoding call, else choose_prefetch_level's rule; an unknown value
/// is reported once on stderr and the CPU's level is used. The same for every thread; never changes after the first
/// call. The scalar kernel prefetches into L1 whatever this says (FusedTiles::kDecodePrefetchL2). Complexity: O(1)
/// after the first call.
inline PrefetchLevel decode_prefetch_level() noexcept {
  static const PrefetchLevel chosen = [] {
    bool amd = false;
    unsigned family = 0;
    cpu_vendor_family(&amd, &family);
    const char* pin = std::getenv("QKV_DECODE_PREFETCH");
    const char* why_not = nullptr;
    const PrefetchLevel level = choose_prefetch_level(amd, family, cpu_supports(Isa::avx512), pin, &why_not);
    if (why_not != nullptr) {
      std::fprintf(stderr, "qkv: QKV_DECODE_PREFETCH=%s %s; prefetching into %s\n", pin, why_not,
                   level == PrefetchLevel::l2 ? "l2" : "l1");
    }
    return level;
  }();
  return chosen;
}

}  // namespace detail

inline namespace QKV_ISA_NAME {

/// The instruction set of the fused kernel this program's calls run: "avx512", "avx2" or "scalar" — the best the
/// CPU supports among those the build compiled, or the QKV_ISA pin (see the file comment). Decided at the first call
/// of this function or of a fused attention call, then fixed for the process. Thread-safe. Complexity: O(1) after
/// the first call. Source: Highway's dynamic dispatch.
inline const char* isa_name() noexcept { return detail::isa_string(detail::active_isa()); }

}  // namespace QKV_ISA_NAME
}  // namespace qkv
