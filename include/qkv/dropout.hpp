// qkv/dropout.hpp — dropout on the attention weights: the Philox 4×32-10 counter-based generator and the rule that
// decides, from the call's seed and offset alone, which weight of (sequence, query head, query, key) is kept.
//
// Nothing is stored: every path (the reference, the fused prefill and decoding kernels, split-K chunks,
// `attention_weights`, a backward pass) asks the same pure function of (seed, offset, sequence, h, i, j), so the mask
// is the same whatever the tiles, threads, kernels or varlen packing, and forward and backward agree.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "qkv/config.hpp"

namespace qkv {

/// Philox 4×32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
/// Random123 library's `philox4x32_10`, the generator of FlashAttention's dropout and of PyTorch's CUDA generator):
/// a bijection of the 128-bit counter for each 64-bit key, ten rounds of
///
///     (hi0, lo0) = 0xD2511F53 · c0,   (hi1, lo1) = 0xCD9E8D57 · c2        (32 × 32 → 64-bit products)
///     c ← (hi1 ⊕ c1 ⊕ k0, lo1, hi0 ⊕ c3 ⊕ k1, lo0)
///
/// with the key bumped by the Weyl constants (k0 += 0x9E3779B9, k1 += 0xBB67AE85) between rounds.
/// Returns the four output words, word n at index n (Random123's word order). Deterministic and exact: the same
/// bits on every platform, compiler and flag. Known answers (Random123's tests/kat_vectors, tested in
/// tests/test_dropout.cpp): counter {0, 0, 0, 0}, key {0, 0} → {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}.
/// Complexity: 20 integer multiplications; no allocation; thread-safe (a pure function). Throws nothing.
inline std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> counter,
                                                  std::array<std::uint32_t, 2> key) noexcept {
  constexpr std::uint64_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  std::uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  std::uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    const std::uint64_t product0 = kMultiplier0 * c0, product1 = kMultiplier1 * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(product0 >> 32), lo0 = static_cast<std::uint32_t>(product0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(product1 >> 32), lo1 = static_cast<std::uint32_t>(product1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return {c0, c1, c2, c3};
}

namespace detail {

/// Counters per call of `philox4x32_10_lanes`: 32, the 128 consecutive keys 4·g … 4·g + 127 of a row. Not 8 or 16:
/// g++ 12 -O3 unrolls a lane loop that short completely and leaves it scalar (slower than the scalar function at
/// -march=x86-64-v3), and clang++ 14 -O3 vectorizes 8 lanes only in part; 32 lanes vectorize under both.
inline constexpr std::size_t kPhiloxLanes = 32;

/// Fewest keys of a row's last chunk that DropoutRule::apply_row draws with `philox4x32_10_lanes` (all 128 keys'
/// words computed) rather than with one scalar call per 4 keys. Measured on an AMD EPYC (Zen 3): a 128-key batch and
/// its select cost as much as the scalar path on about 24 keys (clang++ 14, -march=x86-64-v3), 32 (g++ 12,
/// x86-64-v3) and 50 … 70 (either, -march=x86-64); 32 favours the AVX2 and AVX-512 builds.
inline constexpr std::size_t kMinBatchKeys = 32;

}  // namespace detail
}  // namespace qkv

// The vectorized generator and select, in qkv::detail for this translation unit's flags (the kernels get copies of
// their own ISA: detail/dropout_lanes.hpp).
#include "qkv/detail/dropout_lanes.hpp"

namespace qkv {
namespace detail {

/// The dropout of one call on its attention weights, resolved once from the options (attention.hpp, resolve_params):
/// weight p_ij of query i and key j of query head h of sequence `sequence` is kept with probability 1 − p and then
/// scaled by 1/(1 − p), or dropped (exactly 0). The decision depends on (seed, offset, sequence, h, i, j) only.
///
/// Keying, exactly (lo32 / hi32 = the low / high 32 bits of a 64-bit value; Index values taken modulo 2^64):
///
///     stream key  (s0, s1) = words 0 and 1 of philox4x32_10(counter = (lo32(offset), hi32(offset), 0, 0),
///                                                           key     = (lo32(seed),   hi32(seed)))
///     u_ij        = word (j mod 4) of philox4x32_10(counter = (lo32(j / 4), lo32(i), lo32(h), lo32(sequence)),
///                                                   key     = (s0, s1))
///     keep_ij     = u_ij < round((1 − p) · 2^32)          (computed in double; p = 1 keeps nothing)
///
/// So one generator call serves 4 consecutive keys of a row, and the (seed, offset) pair selects an independent
/// stream: successive offsets give unrelated masks (each offset's stream key is 64 bits of a Philox output, so two
/// offsets share a key with probability 2^-64). `sequence` is the batch index (the view's batch entry), or the varlen
/// sequence index with cu_seqlens; i and j are positions in that sequence (with `global_positions`, the global
/// positions: the caller adds q_begin and k_begin); h is the query head, 0 … Hq − 1. Distinct (i, h, sequence) below
/// 2^32 and keys below 2^34 give distinct counters; past that the counters wrap.
/// Probability: keep_ij holds for a fraction round((1 − p)·2^32) / 2^32 of the 2^32 words, 1 − p within 2^-33.
/// Source: the counter-based dropout of FlashAttention (Philox keyed by the seed, counters from the offset and the
/// element's position), so the mask is recomputed, never stored, and a backward pass sees the forward's mask.
template <class T>
struct DropoutRule {
  /// The stream key of (seed, offset) and the keep threshold round((1 − p)·2^32), both in the documented keying.
  struct Stream {
    std::array<std::uint32_t, 2> key;
    std::uint64_t threshold;
  };

  // The fields are read, not written: stream_ is derived from them once (make()); a new p, seed or offset is a
  // new rule.
  T p = T(0);           ///< drop probability, in [0, 1] (validated at the boundary)
  T keep_scale = T(1);  ///< 1/(1 − p) rounded to T (unused when p == 1)
  std::uint64_t seed = 0, offset = 0;

  /// The rule that drops nothing (p = 0, seed 0, offset 0).
  DropoutRule() noexcept : DropoutRule(T(0), 0, 0) {}

  /// The rule of drop probability p (in [0, 1]) with this seed and offset: keep_scale = 1/(1 − p), or 1 for p = 1.
  /// Its stream (one generator call) is computed here once, not per row: a rule is made, then only read (a changed
  /// p, seed or offset wants a new rule).
  static DropoutRule make(T p, std::uint64_t seed, std::uint64_t offset) noexcept {
    return DropoutRule(p, seed, offset);
  }

  /// Whether any weight can be dropped: p > 0. With p = 0 no dropout code runs at all.
  bool active() const noexcept { return p > T(0); }

  /// The stream of this rule's (seed, offset) and p, as make() computed it.
  Stream stream() const noexcept { return stream_; }

  /// The stream of (p, seed, offset): words 0 and 1 of philox4x32_10((lo32(offset), hi32(offset), 0, 0),
  /// (lo32(seed), hi32(seed))) and round((1 − p)·2^32). Complexity: one generator call.
  static Stream stream_of(T p, std::uint64_t seed, std::uint64_t offset) noexcept {
    const std::array<std::uint32_t, 4> words =
        philox4x32_10({static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32), 0u, 0u},
                      {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
    const double keep_probability = 1.0 - static_cast<double>(p);
    // keep_probability·2^32 is exact in double; llround rounds it to the nearest integer in [0, 2^32].
    return {{words[0], words[1]}, static_cast<std::uint64_t>(std::llround(keep_probability * 4294967296.0))};
  }

  /// The counter of the 4 keys 4·(j / 4) … 4·(j / 4) + 3 of query i of head h of `sequence`.
  static std::array<std::uint32_t, 4> counter(Index sequence, Index h, Index i, Index j) noexcept {
    return {static_cast<std::uint32_t>(static_cast<std::uint64_t>(j) / 4u),
            static_cast<std::uint32_t>(static_cast<std::uint64_t>(i)),
            static_cast<std::uint32_t>(static_cast<std::uint64_t>(h)),
            static_cast<std::uint32_t>(static_cast<std::uint64_t>(sequence))};
  }

  /// Whether the weight of (sequence, query head h, query position i, key position j) is kept; positions are
  /// positions in the sequence (GLOBAL positions when options.global_positions is set: the caller adds q_begin and
  /// k_begin). i, j ≥ 0. One generator call (the stream key is the rule's); `apply_row` is the fast form for a row.
  bool keep(Index sequence, Index h, Index i, Index j) const noexcept {
    const Stream s = stream();
    const std::array<std::uint32_t, 4> words = philox4x32_10(counter(sequence, h, i, j), s.key);
    return words[static_cast<std::size_t>(static_cast<std::uint64_t>(j) % 4u)] < s.threshold;
  }

  /// row[t] ← keep(sequence, h, i, j_begin + t) ? row[t]·keep_scale : 0 (selected, not multiplied: a dropped NaN or
  /// ∞ becomes 0), t in [0, n). U is T, or double (the reference path): then the scale is 1/(1 − p) computed in
  /// double. The mask is `keep`'s, bit for bit, whatever n and the alignment of j_begin (tests/test_dropout.cpp
  /// checks it against the keying above, evaluated one weight at a time).
  /// How: the keys before the first multiple of 4 (j_begin mod 4 ≠ 0) from one scalar generator call; then chunks of
  /// 128 keys, each from one `philox4x32_10_lanes` call (32 counters together, vectorized) and a select loop; a last
  /// chunk of kMinBatchKeys … 127 keys the same way (the surplus words unused), a shorter one from one scalar call per
  /// 4 keys. p = 1 writes zeros without drawing. Lanes supplies the 32-counter generator and the select: by default
  /// detail::DropoutLanes, compiled with this translation unit's flags; a kernel passes its own ISA's copy
  /// (detail/dropout_lanes.hpp). Every Lanes gives the same bits.
  /// Complexity: O(n): the multiplications of one generator call per 4 keys (for a last chunk of kMinBatchKeys … 127
  /// keys, of 32 calls); about 1 KiB of stack, no allocation; thread-safe (reads the rule only). Throws nothing.
  template <class Lanes = DropoutLanes, class U>
  void apply_row(Index sequence, Index h, Index i, Index j_begin, Index n, U* row) const noexcept {
    apply_row<Lanes>(sequence, h, i, j_begin, n, row, static_cast<U*>(nullptr));
  }

  /// apply_row on two rows of the same (sequence, h, i, j_begin, n) at once: `row` and `other` (n weights each, not
  /// overlapping, or `other` null) get the same mask and scale, from one pass of the generator. The backward's use:
  /// P̃ = Z ∘ P and Z ∘ dP of one query row. Each row's result is apply_row's on it alone, bit for bit. Complexity:
  /// apply_row's generator work once, and a select per row. Throws nothing.
  template <class Lanes = DropoutLanes, class U>
  void apply_row(Index sequence, Index h, Index i, Index j_begin, Index n, U* row, U* other) const noexcept {
    if (n <= 0) return;
    QKV_ASSERT(other == nullptr || other + n <= row || row + n <= other);
    const Stream s = stream();
    const U scale =
        std::is_same_v<U, T> || !(p < T(1)) ? static_cast<U>(keep_scale) : U(1) / (U(1) - static_cast<U>(p));
    if (s.threshold == 0) {  // p = 1: every weight dropped, NaN and ∞ too
      std::fill_n(row, n, U(0));
      if (other != nullptr) std::fill_n(other, n, U(0));
      return;
    }
    // u < threshold ⇔ u ≤ threshold − 1 for threshold in [1, 2^32]: a 32-bit compare, which vectorizes.
    const std::uint32_t last_kept = static_cast<std::uint32_t>(s.threshold - 1);
    const std::uint64_t j0 = static_cast<std::uint64_t>(j_begin);  // key j0 + t is row[t]; counters modulo 2^32
    const std::size_t count = static_cast<std::size_t>(n);
    std::array<std::uint32_t, 4> group_counter = counter(sequence, h, i, j_begin);  // word 0 = the group of row[t]
    const auto set_group = [&](std::size_t t) { group_counter[0] = static_cast<std::uint32_t>((j0 + t) / 4u); };
    // Keys t … (the end of t's group of 4, or n) from one scalar call; returns the next t.
    const auto scalar_group = [&](std::size_t t) {
      set_group(t);
      const std::array<std::uint32_t, 4> words = philox4x32_10(group_counter, s.key);
      const std::size_t end = std::min(count, t + 4 - static_cast<std::size_t>((j0 + t) % 4u));
      for (; t < end; ++t) {
        const bool keep = words[static_cast<std::size_t>((j0 + t) % 4u)] <= last_kept;
        const U kept = row[t] * scale;
        row[t] = keep ? kept : U(0);
        if (other != nullptr) {
          const U other_kept = other[t] * scale;
          other[t] = keep ? other_kept : U(0);
        }
      }
      return t;
    };
    // row[t … t + m) (and other's) from words[0 … m), m ≤ 128 (Lanes::select).
    std::array<std::uint32_t, 4 * kPhiloxLanes> words;
    const auto select = [&](std::size_t t, std::size_t m) {
      Lanes::select(row + t, words.data(), m, scale, last_kept);
      if (other != nullptr) Lanes::select(other + t, words.data(), m, scale, last_kept);
    };
    std::size_t t = 0;
    if (j0 % 4u != 0) t = scalar_group(0);
    for (; count - t >= words.size(); t += words.size()) {  // whole chunks of 128 keys
      set_group(t);
      Lanes::lanes(group_counter, s.key, words);
      select(t, words.size());
    }
    if (count - t >= kMinBatchKeys) {
      set_group(t);
      Lanes::lanes(group_counter, s.key, words);
      select(t, count - t);
      return;
    }
    while (t < count) t = scalar_group(t);
  }

 private:
  DropoutRule(T p_, std::uint64_t seed_, std::uint64_t offset_) noexcept
      : p(p_),
        keep_scale(p_ < T(1) ? T(1) / (T(1) - p_) : T(1)),
        seed(seed_),
        offset(offset_),
        stream_(stream_of(p_, seed_, offset_)) {}

  Stream stream_;  ///< stream_of(p, seed, offset), computed once
};

}  // namespace detail
}  // namespace qkv
