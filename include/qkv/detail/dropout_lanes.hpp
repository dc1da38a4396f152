// qkv/detail/dropout_lanes.hpp — dropout's vectorized generator and select, compiled once per kernel ISA.
//
// philox4x32_10_lanes (32 Philox counters at a time) and dropout_select are plain loops that the compilers vectorize
// for the instructions they are compiled for. dropout.hpp includes this file once, outside any kernel pass, into
// qkv::detail (the translation unit's own flags: the reference path and direct callers of DropoutRule::apply_row);
// the kernel's rooms include it again in each pass (detail/dispatch.hpp), inside that ISA's target region, so that a
// build without -march (runtime dispatch) runs the AVX2 or AVX-512 form in the AVX2 or AVX-512 kernel. Every copy
// gives the same bits (integer arithmetic, and the select's one multiplication per weight). DropoutLanes bundles the
// two as DropoutRule::apply_row's policy; a kernel passes its own pass's. Outside a pass, only dropout.hpp includes
// this file (after kPhiloxLanes, before DropoutRule); a pass finds dropout.hpp included already (dispatch.hpp).
#if defined(QKV_PASS_NAME)
#if defined(QKV_DETAIL_DROPOUT_LANES_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_DROPOUT_LANES_HPP
#undef QKV_DETAIL_DROPOUT_LANES_HPP
#else
#define QKV_DETAIL_DROPOUT_LANES_HPP
#endif
#define QKV_DETAIL_DROPOUT_LANES_BODY
#endif
#elif !defined(QKV_DETAIL_DROPOUT_LANES_ONCE)
#define QKV_DETAIL_DROPOUT_LANES_ONCE
#define QKV_DETAIL_DROPOUT_LANES_BODY
#endif

#ifdef QKV_DETAIL_DROPOUT_LANES_BODY
#undef QKV_DETAIL_DROPOUT_LANES_BODY

#include <array>
#include <cstddef>
#include <cstdint>

namespace qkv {
namespace detail {
#if defined(QKV_PASS_NAME)
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512
#endif

/// Philox 4×32-10 of kPhiloxLanes counters that differ only in word 0, run through the ten rounds together:
///
///     words[4·l + w] = word w of philox4x32_10((first[0] + l mod 2^32, first[1], first[2], first[3]), key)
///
/// for lane l in [0, kPhiloxLanes) and w in [0, 4): the words of the 4·kPhiloxLanes keys of a row from key
/// 4·first[0] on, in key order (DropoutRule's keying). Bit for bit the scalar function's, lane by lane.
/// How: the state is four arrays of uint32 (word n of every lane in array n), each round one plain loop over the
/// lanes, the high words from 64-bit products of 32-bit operands, so that compilers vectorize the rounds: no
/// intrinsics, nothing ISA-specific, the same bits whatever the flags. Checked in the assembly: g++ 12 and clang++ 14,
/// -O2 and -O3, -march=x86-64, x86-64-v3 and x86-64-v4 all vectorize the round loop, with (v)pmuludq for the high
/// words (g++ at x86-64-v4 zero-extends to 64-bit lanes and uses vpmullq instead). The low word is written as the
/// 32-bit product (equal to the low half of the 64-bit one): one vpmulld from SSE4.1 on (SSE2 builds it from two
/// pmuludq), where re-packing the 64-bit products costs several shuffles. With the select of `DropoutRule::apply_row`
/// on rows of 256 keys, measured on an AMD EPYC (Zen 3) against one scalar call per 4 keys: 2.7–3.7× (g++ 12) and
/// 3.7–6.5× (clang++ 14) faster at -march=x86-64-v3, 1.1–2× at -march=x86-64 (-O2 and -O3).
/// Complexity: 20·kPhiloxLanes 32 × 32-bit multiplications (the scalar function's per counter), 512 bytes of state on
/// the stack; no allocation; thread-safe (a pure function). Throws nothing.
inline void philox4x32_10_lanes(const std::array<std::uint32_t, 4>& first, const std::array<std::uint32_t, 2>& key,
                                std::array<std::uint32_t, 4 * kPhiloxLanes>& words) noexcept {
  constexpr std::uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  constexpr std::size_t kLanes = kPhiloxLanes;
  std::uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  for (std::size_t l = 0; l < kLanes; ++l) {
    c0[l] = first[0] + static_cast<std::uint32_t>(l);
    c1[l] = first[1];
    c2[l] = first[2];
    c3[l] = first[3];
  }
  std::uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    for (std::size_t l = 0; l < kLanes; ++l) {
      const std::uint32_t a = c0[l], b = c2[l];
      c0[l] = static_cast<std::uint32_t>((std::uint64_t(kMultiplier1) * b) >> 32) ^ c1[l] ^ k0;
      c1[l] = kMultiplier1 * b;
      c2[l] = static_cast<std::uint32_t>((std::uint64_t(kMultiplier0) * a) >> 32) ^ c3[l] ^ k1;
      c3[l] = kMultiplier0 * a;
    }
    k0 += kWeyl0;  // the key of the next round (after the last round: unused)
    k1 += kWeyl1;
  }
  for (std::size_t l = 0; l < kLanes; ++l) {
    words[4 * l] = c0[l];
    words[4 * l + 1] = c1[l];
    words[4 * l + 2] = c2[l];
    words[4 * l + 3] = c3[l];
  }
}

/// chunk[e] ← words[e] ≤ last_kept ? chunk[e]·scale : 0 for e in [0, m): scaled, then selected, in two loops (g++
/// does not if-convert a multiplication inside the select; a dropped NaN or ∞ must become 0, not NaN·0). Complexity:
/// O(m); throws nothing.
template <class U>
inline void dropout_select(U* chunk, const std::uint32_t* words, std::size_t m, U scale,
                           std::uint32_t last_kept) noexcept {
  for (std::size_t e = 0; e < m; ++e) chunk[e] *= scale;
  for (std::size_t e = 0; e < m; ++e) chunk[e] = words[e] <= last_kept ? chunk[e] : U(0);
}

/// The generator and the select of this copy, as DropoutRule::apply_row's policy (`apply_row<DropoutLanes>`).
struct DropoutLanes {
  static void lanes(const std::array<std::uint32_t, 4>& first, const std::array<std::uint32_t, 2>& key,
                    std::array<std::uint32_t, 4 * kPhiloxLanes>& words) noexcept {
    philox4x32_10_lanes(first, key, words);
  }
  template <class U>
  static void select(U* chunk, const std::uint32_t* words, std::size_t m, U scale, std::uint32_t last_kept) noexcept {
    dropout_select(chunk, words, m, scale, last_kept);
  }
};

#if defined(QKV_PASS_NAME)
}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
#endif
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_DROPOUT_LANES_BODY
