// Tests of dropout on the attention weights (qkv/dropout.hpp; AttentionOptions::dropout_p, dropout_seed,
// dropout_offset; applied in reference.hpp, detail/fused_attention.hpp and sdpa.hpp's attention_weights).
//
// What is independent of what: Philox against Random123's published known answers, and its 32-counter batch
// (detail::philox4x32_10_lanes) against it lane by lane; DropoutRule::apply_row against keep() one weight at a time,
// and bit for bit against dropout.hpp's keying comment evaluated here with philox4x32_10 alone (random positions up to
// 2^62, every row length 0 … 200 at every alignment, NaN and ±∞ in the rows); the forward against a float64 expectation
// built here from brute_force.hpp's (undropped) weights and DropoutRule::keep, and the fused kernels against it by
// docs/design.md's accuracy rule, with a plain float implementation with dropout (written below on brute_force.hpp's
// visibility and scores) as the yardstick. The mask's independence of tiles, threads, kernels and varlen packing is
// checked on the mask itself: with V the identity (Dv = Skv), out is the dropped weight matrix, so its zeros are the
// mask, compared exactly. Statistics with fixed seeds: the kept fraction over ≥ 10^6 weights within 4σ of 1 − p, E[out]
// over offsets within 4σ of the undropped out (σ from the samples).
#include "support/run_fused_with.hpp"  // the emulated 16-lane tag (its place here: support/emulated_tag.hpp)
// The line above stays apart from the headers below.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "qkv/dropout.hpp"
#include "qkv/sdpa.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using qkv::Index;
using qkv::detail::DropoutRule;
using Word4 = std::array<std::uint32_t, 4>;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// QKV_SKIP_EMULATED=1 leaves the emulated 16-lane kernel out (as in test_fused).
bool skip_emulated() { return std::getenv("QKV_SKIP_EMULATED") != nullptr; }

template <class T>
bool bits_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// ---- Philox 4×32-10 ------------------------------------------------------------------------------------------------

TEST(Philox, MatchesRandom123KnownAnswers) {
  struct Known {
    Word4 counter;
    std::array<std::uint32_t, 2> key;
    Word4 expected;
  };
  // Random123's tests/kat_vectors, rows "philox4x32 10" (counter words 0-3, key words 0-1, expected words 0-3).
  const Known published[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
      // Random123's longer table (examples/kat_vectors): single words set, which pin the order of the counter and key
      // words.
      {{1, 0, 0, 0}, {1, 0}, {0xac08141b, 0xdfc5ccbe, 0x79c07a47, 0xa7f66093}},
      {{0, 0, 0, 1}, {0, 0xffffffff}, {0x5c4ecd0c, 0x64c12cf9, 0x8f9fb4c8, 0x40c4a01f}},
  };
  for (const Known& k : published) {
    EXPECT_EQ(qkv::philox4x32_10(k.counter, k.key), k.expected)
        << std::hex << "counter " << k.counter[0] << " " << k.counter[1] << " " << k.counter[2] << " " << k.counter[3]
        << ", key " << k.key[0] << " " << k.key[1];
  }
}

// ---- DropoutRule ---------------------------------------------------------------------------------------------------

template <class T>
struct DropoutRuleTyped : ::testing::Test {};
TYPED_TEST_SUITE(DropoutRuleTyped, qkv_test::Scalars, );

TYPED_TEST(DropoutRuleTyped, ApplyRowIsKeepAtEveryAlignment) {
  using T = TypeParam;
  const auto rule = DropoutRule<T>::make(T(0.375), 0x0123456789abcdefULL, 77);
  for (Index j_begin = 0; j_begin < 9; ++j_begin) {
    for (Index n : {Index(1), Index(3), Index(4), Index(5), Index(13), Index(64)}) {
      std::vector<T> row(static_cast<std::size_t>(n));
      for (Index t = 0; t < n; ++t) row[static_cast<std::size_t>(t)] = T(1) + T(t);
      rule.apply_row(2, 5, 1000 + j_begin, j_begin, n, row.data());
      for (Index t = 0; t < n; ++t) {
        const T expected = rule.keep(2, 5, 1000 + j_begin, j_begin + t) ? (T(1) + T(t)) * rule.keep_scale : T(0);
        ASSERT_EQ(row[static_cast<std::size_t>(t)], expected) << "j_begin " << j_begin << ", n " << n << ", t " << t;
      }
    }
  }
  // A dropped NaN or ∞ becomes 0 (selected, not multiplied); a kept one stays.
  std::vector<T> poisoned(64, std::numeric_limits<T>::quiet_NaN());
  rule.apply_row(0, 0, 3, 0, 64, poisoned.data());
  for (Index j = 0; j < 64; ++j) {
    EXPECT_EQ(std::isnan(poisoned[static_cast<std::size_t>(j)]), rule.keep(0, 0, 3, j)) << j;
    if (!rule.keep(0, 0, 3, j)) {
      EXPECT_EQ(poisoned[static_cast<std::size_t>(j)], T(0));
    }
  }
  // p = 1 keeps nothing.
  const auto all = DropoutRule<T>::make(T(1), 5, 6);
  std::vector<T> ones(37, T(1));
  all.apply_row(1, 1, 1, 3, 37, ones.data());
  for (T x : ones) EXPECT_EQ(x, T(0));
}

TEST(Philox, LanesAreTheScalarFunctionLaneByLane) {
  // detail::philox4x32_10_lanes: words[4·l + w] = word w of philox4x32_10((first[0] + l mod 2^32, first[1 … 3]), key),
  // also where word 0 wraps past 2^32 − 1 inside the batch.
  std::mt19937_64 rng(20);
  std::array<std::uint32_t, 4 * qkv::detail::kPhiloxLanes> words;
  for (const std::uint32_t first0 : {0u, 1u, 0x7fffffffu, 0xffffffffu - 5u, 0xffffffffu, 0x9e3779b9u}) {
    const Word4 first{first0, static_cast<std::uint32_t>(rng()), static_cast<std::uint32_t>(rng()),
                      static_cast<std::uint32_t>(rng())};
    const std::array<std::uint32_t, 2> key{static_cast<std::uint32_t>(rng()), static_cast<std::uint32_t>(rng())};
    qkv::detail::philox4x32_10_lanes(first, key, words);
    for (std::size_t l = 0; l < qkv::detail::kPhiloxLanes; ++l) {
      const Word4 expected =
          qkv::philox4x32_10({first0 + static_cast<std::uint32_t>(l), first[1], first[2], first[3]}, key);
      for (std::size_t w = 0; w < 4; ++w)
        ASSERT_EQ(words[4 * l + w], expected[w]) << "first[0] " << first0 << ", lane " << l;
    }
  }
}

/// lo32 / hi32 of dropout.hpp's keying comment.
std::uint32_t lo32(std::uint64_t x) { return static_cast<std::uint32_t>(x); }
std::uint32_t hi32(std::uint64_t x) { return static_cast<std::uint32_t>(x >> 32); }

/// One row of apply_row's arguments.
struct RowCall {
  double p;  // as T rounds it
  std::uint64_t seed, offset;
  Index sequence, h, i, j_begin, n;
};

/// apply_row's result on `row`, one weight at a time, straight from dropout.hpp's keying comment with
/// qkv::philox4x32_10 (neither DropoutRule::keep nor its counter): stream key (s0, s1) = words 0–1 of
/// philox((lo32 offset, hi32 offset, 0, 0), (lo32 seed, hi32 seed)); u = word (j mod 4) of
/// philox((lo32(j / 4), lo32 i, lo32 h, lo32 sequence), (s0, s1)); kept iff u < round((1 − p)·2^32), then
/// row[t]·scale, else +0. scale = 1/(1 − p) rounded to T when U = T, computed in U = double otherwise.
template <class T, class U>
std::vector<U> documented_apply_row(const RowCall& c, std::vector<U> row) {
  const Word4 stream = qkv::philox4x32_10({lo32(c.offset), hi32(c.offset), 0u, 0u}, {lo32(c.seed), hi32(c.seed)});
  const std::uint64_t threshold = static_cast<std::uint64_t>(std::llround((1.0 - c.p) * 4294967296.0));
  const T p = static_cast<T>(c.p);
  const U scale = !(p < T(1))            ? U(1)
                  : std::is_same_v<U, T> ? static_cast<U>(T(1) / (T(1) - p))
                                         : U(1) / (U(1) - static_cast<U>(p));
  for (Index t = 0; t < c.n; ++t) {
    const std::uint64_t j = static_cast<std::uint64_t>(c.j_begin) + static_cast<std::uint64_t>(t);
    const Word4 words =
        qkv::philox4x32_10({lo32(j / 4), lo32(static_cast<std::uint64_t>(c.i)), lo32(static_cast<std::uint64_t>(c.h)),
                            lo32(static_cast<std::uint64_t>(c.sequence))},
                           {stream[0], stream[1]});
    U& x = row[static_cast<std::size_t>(t)];
    x = words[j % 4] < threshold ? x * scale : U(0);
  }
  return row;
}

/// A row of n values of U, with NaN, ±∞, ±0 and subnormals among finite ones, and 3 sentinels past the end.
template <class U>
std::vector<U> poisoned_row(Index n, std::mt19937_64& rng) {
  std::vector<U> row(static_cast<std::size_t>(n) + 3);
  for (U& x : row) {
    switch (rng() % 12) {
      case 0:
        x = std::numeric_limits<U>::quiet_NaN();
        break;
      case 1:
        x = std::numeric_limits<U>::infinity();
        break;
      case 2:
        x = -std::numeric_limits<U>::infinity();
        break;
      case 3:
        x = U(-0.0);
        break;
      case 4:
        x = std::numeric_limits<U>::denorm_min() * U(rng() % 1000);
        break;
      default:
        x = static_cast<U>(std::ldexp(static_cast<double>(rng() % 2000001) - 1000000.0, -17));
    }
  }
  return row;
}

/// Calls `rule.apply_row` on a poisoned row, and its two-row form on that row and a second one, and compares every
/// element, bit for bit (a dropped NaN must be +0, a kept NaN the product's NaN), with documented_apply_row; the
/// sentinels past n must stay. Returns whether all agree.
template <class T, class U>
bool apply_row_matches_documented(const RowCall& c, std::mt19937_64& rng) {
  // The one-row form on `input`, and the two-row form on `input` and `second` (the backward's P̃ and dP).
  const std::vector<U> input = poisoned_row<U>(c.n, rng), second = poisoned_row<U>(c.n, rng);
  const auto rule = DropoutRule<T>::make(static_cast<T>(c.p), c.seed, c.offset);
  std::vector<U> alone = input, first_of_two = input, second_of_two = second;
  rule.apply_row(c.sequence, c.h, c.i, c.j_begin, c.n, alone.data());
  rule.apply_row(c.sequence, c.h, c.i, c.j_begin, c.n, first_of_two.data(), second_of_two.data());
  const auto matches = [&](const char* form, const std::vector<U>& in, const std::vector<U>& actual) {
    const std::vector<U> expected = documented_apply_row<T>(c, in);
    for (std::size_t t = 0; t < actual.size(); ++t) {
      if (std::memcmp(&actual[t], &expected[t], sizeof(U)) != 0) {
        ADD_FAILURE() << form << ", " << (sizeof(T) == 4 ? "float" : "double") << " rule, "
                      << (sizeof(U) == 4 ? "float" : "double") << " row: p " << c.p << ", seed " << c.seed
                      << ", offset " << c.offset << ", sequence " << c.sequence << ", h " << c.h << ", i " << c.i
                      << ", j_begin " << c.j_begin << ", n " << c.n << ": element " << t << " is " << actual[t]
                      << ", expected " << expected[t] << " (input " << in[t] << ")";
        return false;
      }
    }
    return true;
  };
  return matches("one row", input, alone) && matches("first of two rows", input, first_of_two) &&
         matches("second of two rows", second, second_of_two);
}

TYPED_TEST(DropoutRuleTyped, ApplyRowIsTheDocumentedKeyingBitForBit) {
  // apply_row, on one row and on two rows at once (a scalar call for the unaligned head, batches of 32 counters for
  // chunks of up to 128 keys, scalar calls for a short tail) against the keying comment evaluated one weight at a time.
  // Every n in 0 … 200 at every j_begin mod 8 exercises each chunk length and alignment; random calls add large
  // positions: j_begin just below a multiple of 2^34 (word 0 of the counter, lo32(j / 4), wraps inside a batch), near
  // 2^32, and anywhere below 2^62, with 64-bit seeds, offsets, sequences, heads and queries. Float rules on float and
  // double rows (the reference path's), double rules on double rows.
  using T = TypeParam;
  std::mt19937_64 rng(sizeof(T) == 4 ? 41 : 42);
  const double probabilities[] = {0.0, 1e-12, 0.1, 0.375, 0.5, 0.9, 1.0};  // 1e-12: threshold 2^32, all kept
  const auto random_call = [&](Index j_begin, Index n) {
    RowCall c;
    c.p = static_cast<double>(static_cast<T>(probabilities[rng() % 7]));
    c.seed = rng();
    c.offset = rng() % 2 ? rng() % 16 : rng();
    c.sequence = static_cast<Index>(rng() % 2 ? rng() % 8 : rng() >> 2);
    c.h = static_cast<Index>(rng() % 2 ? rng() % 64 : rng() >> 2);
    c.i = static_cast<Index>(rng() % 2 ? rng() % 100000 : rng() >> 2);
    c.j_begin = j_begin;
    c.n = n;
    return c;
  };
  const auto check = [&](const RowCall& c) {
    bool ok = apply_row_matches_documented<T, T>(c, rng);
    if constexpr (std::is_same_v<T, float>) ok = apply_row_matches_documented<T, double>(c, rng) && ok;
    return ok;
  };
  for (Index j_begin = 0; j_begin < 8; ++j_begin)
    for (Index n = 0; n <= 200; ++n) ASSERT_TRUE(check(random_call(j_begin, n)));
  for (int trial = 0; trial < 3000; ++trial) {
    Index j_begin = 0;
    switch (trial % 4) {
      case 0:
        j_begin = static_cast<Index>(rng() % 8);
        break;
      case 1:
        j_begin = static_cast<Index>((std::uint64_t(1) << 34) * (1 + rng() % 8) - rng() % 600);
        break;
      case 2:
        j_begin = static_cast<Index>((std::uint64_t(1) << 32) - 300 + rng() % 600);
        break;
      default:
        j_begin = static_cast<Index>(rng() >> 2);
        break;
    }
    ASSERT_TRUE(check(random_call(j_begin, static_cast<Index>(rng() % 201))));
  }
}

/// The kept fraction of 4 sequences × 4 heads × 256 queries × 256 keys = 2^20 weights.
template <class T>
double kept_fraction(const DropoutRule<T>& rule) {
  std::vector<T> row(256);
  double kept = 0;
  for (Index b = 0; b < 4; ++b)
    for (Index h = 0; h < 4; ++h)
      for (Index i = 0; i < 256; ++i) {
        std::fill(row.begin(), row.end(), T(1));
        rule.apply_row(b, h, i, 0, 256, row.data());
        for (T x : row) kept += x != T(0);
      }
  return kept / double(1 << 20);
}

TYPED_TEST(DropoutRuleTyped, KeptFractionIsOneMinusPWithinFourSigma) {
  using T = TypeParam;
  constexpr double kN = double(1 << 20);
  for (const T p : {T(0.1), T(0.5)}) {
    for (std::uint64_t seed : {std::uint64_t(0), std::uint64_t(0x9e3779b97f4a7c15ULL)}) {
      const double keep = 1.0 - static_cast<double>(p), sigma = std::sqrt(keep * (1 - keep) / kN);
      const double fraction = kept_fraction(DropoutRule<T>::make(p, seed, 3));
      EXPECT_LE(std::fabs(fraction - keep), 4 * sigma) << "p " << p << ", seed " << seed << ": kept " << fraction;
    }
  }
}

TYPED_TEST(DropoutRuleTyped, OffsetsAndSeedsGiveUnrelatedMasks) {
  // Two independent masks of keep probability k agree on a fraction k² + (1 − k)² of the weights; the same mask on
  // all of them. Successive offsets, and seeds, must look independent (within 4σ over 2^18 weights).
  using T = TypeParam;
  const T p = T(0.5);
  const double agree_independent = 0.5, sigma = std::sqrt(0.25 / double(1 << 18));
  const auto agreement = [](const DropoutRule<T>& a, const DropoutRule<T>& b) {
    double same = 0;
    for (Index h = 0; h < 4; ++h)
      for (Index i = 0; i < 256; ++i)
        for (Index j = 0; j < 256; ++j) same += a.keep(0, h, i, j) == b.keep(0, h, i, j);
    return same / double(1 << 18);
  };
  const auto base = DropoutRule<T>::make(p, 42, 7);
  EXPECT_EQ(agreement(base, DropoutRule<T>::make(p, 42, 7)), 1.0);
  for (const auto& other :
       {DropoutRule<T>::make(p, 42, 8), DropoutRule<T>::make(p, 42, 6), DropoutRule<T>::make(p, 43, 7),
        DropoutRule<T>::make(p, 42 + (1ULL << 32), 7), DropoutRule<T>::make(p, 42, 7 + (1ULL << 32))}) {
    EXPECT_LE(std::fabs(agreement(base, other) - agree_independent), 4 * sigma)
        << "seed " << other.seed << ", offset " << other.offset;
  }
  // Neighbouring sequences, heads, queries and keys are not shifted copies of each other's masks.
  double shifted = 0;
  for (Index i = 0; i < 512; ++i)
    for (Index j = 0; j < 512; ++j) shifted += base.keep(0, 0, i, j) == base.keep(0, 0, i + 1, j + 4);
  EXPECT_LE(std::fabs(shifted / double(1 << 18) - agree_independent), 4 * sigma);
}

// ---- The forward: expectations ------------------------------------------------------------------------------------

/// The dropout of a call: probability, seed, offset.
struct Drop {
  double p = 0;
  std::uint64_t seed = 0, offset = 0;
};

template <class T>
void set_dropout(qkv::AttentionOptions<T>& options, const Drop& drop) {
  options.dropout_p = static_cast<T>(drop.p);
  options.dropout_seed = drop.seed;
  options.dropout_offset = drop.offset;
}

/// Global position of query row 0 and key row 0 of the views.
std::array<long, 2> position_offsets(const brute::Params& p) {
  if (!p.global_positions) return {0, 0};
  return {p.global_positions->q_begin, p.global_positions->k_begin};
}

/// The call `pr` describes with dropout, in float64: brute_force.hpp's undropped weights, each non-zero one kept and
/// divided by 1 − p or set to 0 as DropoutRule<double>::keep(sequence n, h, position of the query, of the key) says
/// (n = the index of the sequence in brute::sequences: the batch entry, or the varlen sequence; positions in the
/// sequence, global ones with global positions); rows whose lse is NaN keep their NaN weights. out = P·V over the
/// non-zero weights (a dropped or hidden value slot is never read); lse is brute's (dropout leaves it). `p` is the
/// call's probability as T rounds it.
brute::Result expected_with_dropout(const qkv_test::Problem& pr, const Drop& drop) {
  const brute::Params& P = pr.p;
  brute::Result r = brute::attention(pr.q, pr.k, pr.v, P);
  const auto rule = DropoutRule<double>::make(drop.p, drop.seed, drop.offset);
  const auto [q_begin, k_begin] = position_offsets(P);
  const std::vector<brute::Sequence> sequences = brute::sequences(P);
  std::fill(r.out.begin(), r.out.end(), 0.0);
  for (std::size_t n = 0; n < sequences.size(); ++n) {
    const brute::Sequence& s = sequences[n];
    for (long h = 0; h < P.Hq; ++h) {
      const long h_kv = h / (P.Hq / P.Hkv);
      for (long i = 0; i < s.sq; ++i) {
        const long row = s.q0 + i;
        const bool undefined = std::isnan(r.lse[brute::flat(P.Hq, P.Sq, 1, s.b, h, row, 0)]);
        for (long j = 0; j < s.skv; ++j) {
          double& w = r.weights[brute::flat(P.Hq, P.Sq, P.Skv, s.b, h, row, s.k0 + j)];
          if (!undefined && w != 0) {
            w = rule.keep(static_cast<Index>(n), h, q_begin + i, k_begin + j) ? w / (1 - drop.p) : 0.0;
          }
          if (w == 0) continue;
          for (long d = 0; d < P.Dv; ++d) {
            r.out[brute::flat(P.Hq, P.Sq, P.Dv, s.b, h, row, d)] +=
                w * pr.v[brute::flat(P.Hkv, P.Skv, P.Dv, s.b, h_kv, s.k0 + j, d)];
          }
        }
      }
    }
  }
  return r;
}

/// The plain float yardstick of the accuracy rule (tests/support/plain_float.hpp's arithmetic: scores, max, weights
/// exp(s − m), their sum and P·V, all in float, one row at a time) with dropout: each weight kept and multiplied by
/// the float 1/(1 − p) or set to 0, as DropoutRule<float>::keep says, between the sum and P·V. Inputs are `pr`'s
/// values rounded to float.
std::vector<double> plain_float_with_dropout(const qkv_test::Problem& pr, const Drop& drop) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const brute::Params& P = pr.p;
  const auto rule = DropoutRule<float>::make(static_cast<float>(drop.p), drop.seed, drop.offset);
  const auto [q_begin, k_begin] = position_offsets(P);
  const float scale = P.scale ? static_cast<float>(*P.scale) : 1.0f / std::sqrt(static_cast<float>(P.D));
  std::vector<double> out(static_cast<std::size_t>(P.B * P.Hq * P.Sq * P.Dv), 0.0);
  const std::vector<brute::Sequence> sequences = brute::sequences(P);
  for (std::size_t n = 0; n < sequences.size(); ++n) {
    const brute::Sequence& s = sequences[n];
    std::vector<float> weight(static_cast<std::size_t>(s.skv));
    for (long h = 0; h < P.Hq; ++h) {
      const long h_kv = h / (P.Hq / P.Hkv);
      const float sink = P.sinks.empty() ? kNegInf : static_cast<float>(P.sinks[static_cast<std::size_t>(h)]);
      for (long i = 0; i < s.sq; ++i) {
        const long row = s.q0 + i;
        float m = sink;
        bool undefined = false;  // a NaN among the visible scores (std::max would drop it): the row is NaN
        for (long j = 0; j < s.skv; ++j) {
          float score = kNegInf;
          if (brute::visible(P, s, h, i, j)) {
            float dot = 0;
            for (long d = 0; d < P.D; ++d) {
              dot += static_cast<float>(pr.q[brute::flat(P.Hq, P.Sq, P.D, s.b, h, row, d)]) *
                     static_cast<float>(pr.k[brute::flat(P.Hkv, P.Skv, P.D, s.b, h_kv, s.k0 + j, d)]);
            }
            score = brute::finish_score(P, s, h, i, j, dot * scale);
          }
          weight[static_cast<std::size_t>(j)] = score;
          undefined |= std::isnan(score);
          m = std::max(m, score);
        }
        if (undefined) {
          for (long d = 0; d < P.Dv; ++d) out[brute::flat(P.Hq, P.Sq, P.Dv, s.b, h, row, d)] = kNaN;
          continue;
        }
        float denominator = P.sinks.empty() || m == kNegInf ? 0.0f : std::exp(sink - m);
        for (long j = 0; j < s.skv; ++j) {
          float& w = weight[static_cast<std::size_t>(j)];
          denominator += (w = (w == kNegInf ? 0.0f : std::exp(w - m)));
        }
        for (long j = 0; j < s.skv; ++j) {
          float& w = weight[static_cast<std::size_t>(j)];
          if (w != 0.0f) w = rule.keep(static_cast<Index>(n), h, q_begin + i, k_begin + j) ? w * rule.keep_scale : 0.0f;
        }
        for (long d = 0; d < P.Dv; ++d) {
          float sum = 0;
          for (long j = 0; j < s.skv; ++j) {
            const float w = weight[static_cast<std::size_t>(j)];
            if (w != 0.0f) sum += w * static_cast<float>(pr.v[brute::flat(P.Hkv, P.Skv, P.Dv, s.b, h_kv, s.k0 + j, d)]);
          }
          out[brute::flat(P.Hq, P.Sq, P.Dv, s.b, h, row, d)] = denominator > 0 ? sum / denominator : 0.0f;
        }
      }
    }
  }
  return out;
}

/// out and lse of one call in T, as written (both start as NaN, so an element left unwritten shows).
template <class T>
struct Output {
  std::vector<T> out, lse;
};

/// `run(q, k, v, out, lse, options)` on the problem's inputs in T with `options` = the problem's options with `drop`.
template <class T, class Run>
Output<T> run_problem(const qkv_test::Problem& pr, const Drop& drop, qkv::Backend backend, Run run) {
  const brute::Params& p = pr.p;
  qkv_test::Inputs<T> in(pr, backend);
  set_dropout(in.options, drop);
  Output<T> o{std::vector<T>(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Dv), std::numeric_limits<T>::quiet_NaN()),
              std::vector<T>(static_cast<std::size_t>(p.B * p.Hq * p.Sq), std::numeric_limits<T>::quiet_NaN())};
  run(in.q_view(), in.k_view(), in.v_view(), qkv::TensorView4<T>(o.out.data(), {p.B, p.Hq, p.Sq, p.Dv}),
      qkv::TensorView3<T>(o.lse.data(), {p.B, p.Hq, p.Sq}), in.options);
  return o;
}

/// qkv::attention with lse on the problem in T.
template <class T>
Output<T> run_attention(const qkv_test::Problem& pr, const Drop& drop, qkv::Backend backend) {
  return run_problem<T>(pr, drop, backend, [](auto q, auto k, auto v, auto out, auto lse, const auto& options) {
    qkv::attention(q, k, v, out, lse, options);
  });
}

/// The largest |actual − expected| where expected is finite; NaN must meet NaN exactly and a finite value never NaN.
template <class T>
double max_error(const std::vector<T>& actual, const std::vector<double>& expected, const std::string& what) {
  EXPECT_EQ(actual.size(), expected.size()) << what;
  double error = 0;
  for (std::size_t n = 0; n < std::min(actual.size(), expected.size()); ++n) {
    const double a = static_cast<double>(actual[n]);
    if (std::isnan(expected[n]) || std::isinf(expected[n])) {
      EXPECT_TRUE(std::isnan(expected[n]) ? std::isnan(a) : a == expected[n])
          << what << " element " << n << ": " << a << ", expected " << expected[n];
      continue;
    }
    EXPECT_FALSE(std::isnan(a)) << what << " element " << n << " (expected " << expected[n] << ")";
    error = std::max(error, std::fabs(a - expected[n]));
  }
  return error;
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double value : x)
    if (std::isfinite(value)) m = std::max(m, std::fabs(value));
  return m;
}

/// The problems of the forward tests: prefill and decoding, split-K, GQA, causal, window, key padding, sinks,
/// softcap (the base-e prefill), varlen and global positions, each with its dropout.
struct DropoutCase {
  std::string name;
  qkv_test::Problem problem;
  Drop drop;
};

std::vector<DropoutCase> dropout_cases() {
  std::vector<DropoutCase> cases;
  const auto add = [&cases](std::string name, const brute::Shape& shape, std::uint64_t seed, Drop drop,
                            const std::function<void(brute::Params&)>& options) {
    qkv_test::Problem pr = qkv_test::make_problem(shape, seed);
    options(pr.p);
    drop.p = static_cast<double>(static_cast<float>(drop.p));  // the float calls' probability (exact in double)
    cases.push_back({std::move(name), qkv_test::rounded<float>(std::move(pr)), drop});
  };
  add("prefill, GQA, causal, key padding", {2, 4, 2, 70, 300, 33, 17}, 1, {0.25, 11, 0}, [](brute::Params& p) {
    p.causal = true;
    p.key_lengths = {300, 251};
  });
  add("prefill, softcap (base e), window", {1, 6, 3, 40, 530, 64, 64}, 2, {0.1, 12, 5}, [](brute::Params& p) {
    p.softcap = 4.0;
    p.window_left = 100;
    p.window_right = 20;
  });
  add("prefill, narrow causal window: strips start past their tile", {1, 2, 2, 200, 200, 16, 16}, 7, {0.25, 17, 3},
      [](brute::Params& p) {
        p.causal = true;
        p.window_left = 50;
      });
  add("decoding, split-K, sinks", {1, 8, 2, 1, 2500, 64, 40}, 3, {0.5, 13, 1},
      [](brute::Params& p) { p.sinks = {0.5, -1.0, 2.0, 0.0, -3.0, 1.0, 0.25, -0.5}; });
  add("decoding two queries, causal window", {2, 4, 1, 2, 700, 16, 16}, 4, {0.3, 14, 9}, [](brute::Params& p) {
    p.causal = true;
    p.window_left = 300;
  });
  add("varlen: prefill, decode, prefill", {1, 4, 2, 91, 760, 32, 24}, 5, {0.25, 15, 2}, [](brute::Params& p) {
    p.causal = true;
    p.cu_seqlens_q = {0, 40, 41, 91};
    p.cu_seqlens_k = {0, 60, 700, 760};
  });
  add("global positions, causal", {1, 2, 2, 50, 80, 16, 8}, 6, {0.25, 16, 4}, [](brute::Params& p) {
    p.causal = true;
    p.global_positions = brute::Params::GlobalPositions{130, 100, 200, 400};
  });
  return cases;
}

// ---- The forward: reference and fused against the expectation -----------------------------------------------------

TEST(DropoutForward, ReferenceMatchesTheFloat64Expectation) {
  for (const DropoutCase& c : dropout_cases()) {
    SCOPED_TRACE(c.name);
    const brute::Result expected = expected_with_dropout(c.problem, c.drop);
    const double bound = std::max(1.0, max_abs(c.problem.v));
    // Double: the same float64 arithmetic up to its order. Float: the reference's own rule, 1e-6·max(1, max|V|).
    const Output<double> o64 = run_attention<double>(c.problem, c.drop, qkv::Backend::reference);
    EXPECT_LE(max_error(o64.out, expected.out, "double out"), 1e-12 * bound);
    EXPECT_LE(max_error(o64.lse, expected.lse, "double lse"), 1e-12 * std::max(1.0, max_abs(expected.lse)));
    const Output<float> o32 = run_attention<float>(c.problem, c.drop, qkv::Backend::reference);
    EXPECT_LE(max_error(o32.out, expected.out, "float out"), 1e-6 * bound);
    // lse is the undropped softmax's: the bits of the call without dropout.
    EXPECT_TRUE(bits_equal(o64.lse, run_attention<double>(c.problem, Drop{}, qkv::Backend::reference).lse));
    EXPECT_TRUE(bits_equal(o32.lse, run_attention<float>(c.problem, Drop{}, qkv::Backend::reference).lse));
  }
}

template <class Tag>
struct DropoutFusedPerTag : ::testing::Test {};
TYPED_TEST_SUITE(DropoutFusedPerTag, qkv_test::KernelTags, );

/// The fused kernel of `tag` (qkv_test::fused_attention_with) on the problem in float.
template <class Tag>
Output<float> fused(Tag tag, const qkv_test::Problem& pr, const Drop& drop) {
  return run_problem<float>(pr, drop, qkv::Backend::fused,
                            [tag](auto q, auto k, auto v, auto out, auto lse, const auto& options) {
                              qkv_test::fused_attention_with(tag, q, k, v, out, &lse, options);
                            });
}

TYPED_TEST(DropoutFusedPerTag, MatchesTheExpectationWithinTheAccuracyRule) {
  if (!qkv_test::cpu_runs<TypeParam>()) GTEST_SKIP() << "this CPU cannot run the " << TypeParam::kName << " kernel";
  if (std::is_same_v<TypeParam, qkv_test::Emulated16Tag> && skip_emulated()) GTEST_SKIP() << "QKV_SKIP_EMULATED";
  for (const DropoutCase& c : dropout_cases()) {
    SCOPED_TRACE(c.name);
    const brute::Result expected = expected_with_dropout(c.problem, c.drop);
    const Output<float> o = fused(TypeParam(), c.problem, c.drop);
    const double error = max_error(o.out, expected.out, "fused out");
    const double plain_error = max_error(plain_float_with_dropout(c.problem, c.drop), expected.out, "plain float out");
    EXPECT_LE(error, 2 * plain_error + 1e-6 * std::max(1.0, max_abs(c.problem.v)))
        << "plain float error " << plain_error;
    // Dropout leaves lse: the bits of the same kernel without dropout.
    EXPECT_TRUE(bits_equal(o.lse, fused(TypeParam(), c.problem, Drop{}).lse));
  }
}

// ---- The mask: the same on every path ------------------------------------------------------------------------------

/// A problem whose V is the identity (Dv = Skv): out[b, h, i, :] is then row i of the dropped weights of head h, and
/// its zeros are exactly the hidden and dropped keys (visible weights of these inputs are far from underflow).
qkv_test::Problem one_hot_problem(const brute::Shape& shape, std::uint64_t seed) {
  qkv_test::Problem pr =
      qkv_test::make_problem({shape.B, shape.Hq, shape.Hkv, shape.Sq, shape.Skv, shape.D, shape.Skv}, seed);
  std::fill(pr.v.begin(), pr.v.end(), 0.0);
  for (long b = 0; b < shape.B; ++b)
    for (long h = 0; h < shape.Hkv; ++h)
      for (long j = 0; j < shape.Skv; ++j) pr.v_at(b, h, j, j) = 1.0;
  return qkv_test::rounded<float>(std::move(pr));
}

/// Whether each element is zero.
template <class T>
std::vector<char> zeros_of(const std::vector<T>& x) {
  std::vector<char> z(x.size());
  for (std::size_t n = 0; n < x.size(); ++n) z[n] = x[n] == T(0);
  return z;
}

TYPED_TEST(DropoutFusedPerTag, PrefillAndOneQueryAtATimeDrawTheSameMask) {
  // One call of 12 queries × 2 heads (prefill, split into two key chunks: 2100 keys) against the same rows computed
  // one query at a time (decoding: Sq·G = 2 rows, global positions placing each query), both against the mask that
  // brute_force.hpp's visibility and DropoutRule::keep give. Key tiles of 256 or 512 (prefill), decoding blocks of
  // 1024 and split-K chunks of 2048 keys all cut the rows at different places.
  if (!qkv_test::cpu_runs<TypeParam>()) GTEST_SKIP() << "this CPU cannot run the " << TypeParam::kName << " kernel";
  if (std::is_same_v<TypeParam, qkv_test::Emulated16Tag> && skip_emulated()) GTEST_SKIP() << "QKV_SKIP_EMULATED";
  const Index Hq = 2, Hkv = 1, Sq = 12, Skv = 2100;
  qkv_test::Problem pr = one_hot_problem({1, Hq, Hkv, Sq, Skv, 16, Skv}, 21);
  pr.p.causal = true;
  pr.p.window_left = 1500;
  const Drop drop{0.5, 1234, 56};
  const auto rule = DropoutRule<double>::make(drop.p, drop.seed, drop.offset);
  const brute::Sequence sequence = brute::sequences(pr.p)[0];
  std::vector<char> expected(static_cast<std::size_t>(Hq * Sq * Skv));
  double visible = 0, kept = 0;
  for (Index h = 0; h < Hq; ++h)
    for (Index i = 0; i < Sq; ++i)
      for (Index j = 0; j < Skv; ++j) {
        const bool seen = brute::visible(pr.p, sequence, h, i, j), keep = seen && rule.keep(0, h, i, j);
        expected[static_cast<std::size_t>((h * Sq + i) * Skv + j)] = !keep;
        visible += seen;
        kept += keep;
      }
  EXPECT_GT(kept, 0.45 * visible);  // the mask is not trivial: about half the visible weights are kept
  EXPECT_LT(kept, 0.55 * visible);

  // The float inputs once; each single query is a strided view into them, its output a view into `by_query`.
  const std::vector<float> q(pr.q.begin(), pr.q.end()), k(pr.k.begin(), pr.k.end()), v(pr.v.begin(), pr.v.end());
  const Index D = pr.p.D;
  const qkv::TensorView4<const float> k_view(k.data(), {1, Hkv, Skv, D}), v_view(v.data(), {1, Hkv, Skv, Skv});
  qkv::AttentionOptions<float> options;
  options.causal = true;
  options.window_left = pr.p.window_left;
  options.backend = qkv::Backend::fused;
  set_dropout(options, drop);
  std::vector<float> whole(expected.size()), by_query(expected.size());
  qkv_test::fused_attention_with(TypeParam(), qkv::TensorView4<const float>(q.data(), {1, Hq, Sq, D}), k_view, v_view,
                                 qkv::TensorView4<float>(whole.data(), {1, Hq, Sq, Skv}), nullptr, options);
  EXPECT_EQ(zeros_of(whole), expected) << "prefill";
  for (Index i = 0; i < Sq; ++i) {
    options.global_positions = qkv::GlobalPositions{i, 0, Sq, Skv};
    const qkv::TensorView4<const float> q_row(q.data() + i * D, {1, Hq, 1, D}, {Hq * Sq * D, Sq * D, D, 1});
    const qkv::TensorView4<float> out_row(by_query.data() + i * Skv, {1, Hq, 1, Skv},
                                          {Hq * Sq * Skv, Sq * Skv, Skv, 1});
    qkv_test::fused_attention_with(TypeParam(), q_row, k_view, v_view, out_row, nullptr, options);
  }
  EXPECT_EQ(zeros_of(by_query), expected) << "one query at a time";
}

TEST(DropoutMask, AttentionWeightsAreZeroExactlyWhereHiddenOrDropped) {
  // attention_weights (float and double, packed GQA heads, causal) against a brute-force loop over keep(), and against
  // the undropped weights scaled by 1/(1 − p); the output is those weights times V.
  const Index Tq = 37, Tk = 53, Hq = 4, Hkv = 2, dk = 8, dv = 5;
  const qkv::Matrix<double> Q = qkv_test::random_matrix<double>(Tq, Hq * dk, 1),
                            K = qkv_test::random_matrix<double>(Tk, Hkv * dk, 2),
                            V = qkv_test::random_matrix<double>(Tk, Hkv * dv, 3);
  const auto check = [&](auto scalar) {
    using T = decltype(scalar);
    qkv::AttentionOptions<T> options;
    options.causal = true;
    options.backend = qkv::Backend::reference;  // out = P·V in double, rounded once: comparable to the rounded weights
    const qkv::Matrix<T> Qt = Q.cast<T>(), Kt = K.cast<T>(), Vt = V.cast<T>();
    qkv::AttentionOptions<T> dropped = options;
    dropped.dropout_p = T(0.3);
    dropped.dropout_seed = 99;
    dropped.dropout_offset = 1;
    const auto rule = DropoutRule<T>::make(dropped.dropout_p, 99, 1);
    const double inverse_keep = 1.0 / (1.0 - static_cast<double>(dropped.dropout_p));
    const qkv::Matrix<T> out = qkv::scaled_dot_product_attention(Qt, Kt, Vt, qkv::Heads{Hq, Hkv}, dropped);
    for (Index h = 0; h < Hq; ++h) {
      const qkv::Matrix<T> W0 = qkv::attention_weights(Qt, Kt, qkv::Heads{Hq, Hkv}, h, options);
      const qkv::Matrix<T> W = qkv::attention_weights(Qt, Kt, qkv::Heads{Hq, Hkv}, h, dropped);
      for (Index i = 0; i < Tq; ++i)
        for (Index j = 0; j < Tk; ++j) {
          const bool kept = W0(i, j) != T(0) && rule.keep(0, h, i, j);
          ASSERT_EQ(W(i, j) != T(0), kept) << "head " << h << ", query " << i << ", key " << j;
          EXPECT_NEAR(static_cast<double>(W(i, j)), kept ? static_cast<double>(W0(i, j)) * inverse_keep : 0.0,
                      4 * std::numeric_limits<T>::epsilon() * static_cast<double>(std::fabs(W(i, j))));
        }
      // out and W are the same float64 products rounded once to T: |W·V − out| ≤ ε·max|V|·Σ_j W_ij + ε·|out| with
      // Σ_j W_ij ≤ 1/(1 − p) (every kept weight scaled), so within 2ε·max(1, max|V|)/(1 − p).
      const qkv::Matrix<double> values = Vt.middleCols((h / (Hq / Hkv)) * dv, dv).template cast<double>();
      const qkv::Matrix<double> expected_out = W.template cast<double>() * values;
      const double error = (out.middleCols(h * dv, dv).template cast<double>() - expected_out).cwiseAbs().maxCoeff();
      EXPECT_LE(error,
                2 * std::numeric_limits<T>::epsilon() * std::max(1.0, values.cwiseAbs().maxCoeff()) * inverse_keep)
          << "head " << h;
    }
  };
  check(0.0f);
  check(0.0);
}

TEST(DropoutMask, VarlenSequenceGetsTheMaskOfTheBatchEntry) {
  // A varlen batch of two sequences: sequence 0 is the B = 1 call on its rows; sequence 1 is batch entry 1 of a
  // padded B = 2 call (key padding to its own length). Both backends, outputs compared bit for bit.
  const Index Hq = 4, Hkv = 2, D = 16, Dv = 8, Sq = 30, Skv0 = 200, Skv1 = 90;
  qkv_test::Problem padded = qkv_test::make_problem({2, Hq, Hkv, Sq, Skv0, D, Dv}, 31);
  padded.p.causal = true;
  padded.p.key_lengths = {Skv0, Skv1};
  padded = qkv_test::rounded<float>(std::move(padded));
  // The varlen batch: sequence b = rows of batch entry b (its first Skv_b keys).
  qkv_test::Problem varlen;
  varlen.p = padded.p;
  varlen.p.B = 1;
  varlen.p.Sq = 2 * Sq;
  varlen.p.Skv = Skv0 + Skv1;
  varlen.p.key_lengths.clear();
  varlen.p.cu_seqlens_q = {0, Sq, 2 * Sq};
  varlen.p.cu_seqlens_k = {0, Skv0, Skv0 + Skv1};
  const std::array<Index, 2> key_count{Skv0, Skv1};
  for (Index h = 0; h < Hq; ++h)
    for (Index b = 0; b < 2; ++b)
      for (Index i = 0; i < Sq; ++i)
        for (Index d = 0; d < D; ++d) varlen.q.push_back(padded.q_at(b, h, i, d));
  for (Index h = 0; h < Hkv; ++h)
    for (Index b = 0; b < 2; ++b)
      for (Index j = 0; j < key_count[static_cast<std::size_t>(b)]; ++j) {
        for (Index d = 0; d < D; ++d) varlen.k.push_back(padded.k_at(b, h, j, d));
        for (Index d = 0; d < Dv; ++d) varlen.v.push_back(padded.v_at(b, h, j, d));
      }
  // Sequence 0 alone, as a B = 1 call.
  qkv_test::Problem first;
  first.p = padded.p;
  first.p.B = 1;
  first.p.key_lengths.clear();
  first.q.assign(padded.q.begin(), padded.q.begin() + Hq * Sq * D);
  first.k.assign(padded.k.begin(), padded.k.begin() + Hkv * Skv0 * D);
  first.v.assign(padded.v.begin(), padded.v.begin() + Hkv * Skv0 * Dv);

  const Drop drop{0.4, 77, 3};
  /// Rows of sequence b of a [1, Hq, 2·Sq, Dv] varlen output, and of batch entry b of a [B, Hq, Sq, Dv] one.
  const auto varlen_rows = [&](const auto& out, Index b) {
    std::vector<std::decay_t<decltype(out[0])>> rows;
    for (Index h = 0; h < Hq; ++h)
      rows.insert(rows.end(), out.begin() + (h * 2 * Sq + b * Sq) * Dv, out.begin() + (h * 2 * Sq + b * Sq + Sq) * Dv);
    return rows;
  };
  const auto batch_rows = [&](const auto& out, Index b) {
    return std::vector<std::decay_t<decltype(out[0])>>(out.begin() + b * Hq * Sq * Dv,
                                                       out.begin() + (b + 1) * Hq * Sq * Dv);
  };
  const auto check = [&](auto scalar, qkv::Backend backend, const char* what) {
    using T = decltype(scalar);
    SCOPED_TRACE(what);
    const Output<T> v = run_attention<T>(varlen, drop, backend);
    EXPECT_TRUE(bits_equal(varlen_rows(v.out, 0), run_attention<T>(first, drop, backend).out)) << "sequence 0";
    const Output<T> p = run_attention<T>(padded, drop, backend);
    EXPECT_TRUE(bits_equal(varlen_rows(v.out, 1), batch_rows(p.out, 1))) << "sequence 1";
    EXPECT_FALSE(bits_equal(varlen_rows(v.out, 0), run_attention<T>(first, Drop{}, backend).out)) << "dropout acted";
  };
  check(0.0f, qkv::Backend::fused, "fused float");
  check(0.0f, qkv::Backend::reference, "reference float");
  check(0.0, qkv::Backend::reference, "reference double");
  // And both against the expectation, which keys sequence b of the varlen batch as b.
  const brute::Result expected = expected_with_dropout(varlen, drop);
  EXPECT_LE(max_error(run_attention<double>(varlen, drop, qkv::Backend::reference).out, expected.out, "varlen"),
            1e-12 * std::max(1.0, max_abs(varlen.v)));
}

#if defined(_OPENMP)
TEST(DropoutMask, FusedOutputIsBitIdenticalForOneAndTwoThreads) {
  // A prefill call and a split-K decoding call, each large enough to open a team.
  const int saved = omp_get_max_threads();
  const Drop drop{0.2, 5, 8};
  std::vector<qkv_test::Problem> problems;
  problems.push_back(qkv_test::make_problem({1, 8, 2, 300, 700, 64, 64}, 41));
  problems.back().p.causal = true;
  problems.push_back(qkv_test::make_problem({1, 8, 2, 1, 4500, 64, 64}, 42));
  for (const qkv_test::Problem& pr : problems) {
    omp_set_num_threads(1);
    const Output<float> one = run_attention<float>(pr, drop, qkv::Backend::fused);
    omp_set_num_threads(2);
    const Output<float> two = run_attention<float>(pr, drop, qkv::Backend::fused);
    EXPECT_TRUE(bits_equal(one.out, two.out)) << "Sq " << pr.p.Sq;
    EXPECT_TRUE(bits_equal(one.lse, two.lse)) << "Sq " << pr.p.Sq;
    EXPECT_FALSE(bits_equal(one.out, run_attention<float>(pr, Drop{}, qkv::Backend::fused).out)) << "dropout acted";
  }
  omp_set_num_threads(saved);
}
#endif

// ---- p = 0, p = 1, NaN ---------------------------------------------------------------------------------------------

template <class T>
struct DropoutEdges : ::testing::Test {};
TYPED_TEST_SUITE(DropoutEdges, qkv_test::Scalars, );

/// A prefill and a decoding problem with causal masking and sinks.
std::vector<qkv_test::Problem> edge_problems() {
  std::vector<qkv_test::Problem> problems;
  for (const brute::Shape& shape : {brute::Shape{2, 4, 2, 45, 130, 24, 12}, brute::Shape{1, 4, 1, 2, 300, 24, 12}}) {
    qkv_test::Problem pr = qkv_test::make_problem(shape, 51 + static_cast<std::uint64_t>(shape.Sq));
    pr.p.causal = true;
    pr.p.sinks = {0.5, -0.5, 1.0, -1.0};
    problems.push_back(qkv_test::rounded<float>(std::move(pr)));
  }
  return problems;
}

/// The backends of T: fused and reference for float, reference for double.
template <class T>
std::vector<qkv::Backend> backends() {
  if (std::is_same_v<T, float>) return {qkv::Backend::fused, qkv::Backend::reference};
  return {qkv::Backend::reference};
}

TYPED_TEST(DropoutEdges, ZeroProbabilityIsBitIdenticalToNoDropout) {
  using T = TypeParam;
  for (const qkv_test::Problem& pr : edge_problems()) {
    for (qkv::Backend backend : backends<T>()) {
      const Output<T> none = run_attention<T>(pr, Drop{}, backend);
      const Output<T> zero = run_attention<T>(pr, Drop{0.0, 123, 456}, backend);
      EXPECT_TRUE(bits_equal(none.out, zero.out)) << "Sq " << pr.p.Sq;
      EXPECT_TRUE(bits_equal(none.lse, zero.lse)) << "Sq " << pr.p.Sq;
    }
  }
  const qkv::Matrix<T> Q = qkv_test::random_matrix<T>(9, 8, 1), K = qkv_test::random_matrix<T>(11, 8, 2);
  qkv::AttentionOptions<T> zero;
  zero.dropout_seed = 3;
  zero.dropout_offset = 4;
  const qkv::Matrix<T> W0 = qkv::attention_weights(Q, K), W = qkv::attention_weights(Q, K, zero);
  EXPECT_EQ(std::memcmp(W0.data(), W.data(), sizeof(T) * static_cast<std::size_t>(W.size())), 0);
}

TYPED_TEST(DropoutEdges, ProbabilityOneGivesZerosAndTheUndroppedLse) {
  using T = TypeParam;
  for (const qkv_test::Problem& pr : edge_problems()) {
    for (qkv::Backend backend : backends<T>()) {
      const Output<T> none = run_attention<T>(pr, Drop{}, backend);
      const Output<T> all = run_attention<T>(pr, Drop{1.0, 7, 0}, backend);
      for (T x : all.out) ASSERT_EQ(x, T(0)) << "Sq " << pr.p.Sq;
      EXPECT_TRUE(bits_equal(none.lse, all.lse)) << "Sq " << pr.p.Sq;
    }
  }
  const qkv::Matrix<T> Q = qkv_test::random_matrix<T>(9, 8, 1), K = qkv_test::random_matrix<T>(11, 8, 2);
  qkv::AttentionOptions<T> all;
  all.dropout_p = T(1);
  EXPECT_EQ(qkv::attention_weights(Q, K, all).cwiseAbs().maxCoeff(), T(0));
}

TYPED_TEST(DropoutEdges, NaNInADroppedValueSlotIsNeverRead) {
  // NaN in v of key 5 (kv head 0): a row that keeps key 5 is NaN, a row that drops it (or cannot see it) is finite and
  // within the accuracy rule of the expectation, which never reads a dropped slot. A row with NaN in q stays NaN even
  // with p = 1.
  using T = TypeParam;
  for (qkv_test::Problem pr : edge_problems()) {
    for (long b = 0; b < pr.p.B; ++b)
      for (long d = 0; d < pr.p.Dv; ++d) pr.v_at(b, 0, 5, d) = kNaN;
    for (long d = 0; d < pr.p.D; ++d) pr.q_at(0, 1, pr.p.Sq - 1, d) = kNaN;
    const Drop drop{0.5, 17, 2};
    const brute::Result expected = expected_with_dropout(pr, drop);
    long nan_rows = 0, finite_rows_seeing_key = 0;
    for (long h = 0; h < pr.p.Hq / pr.p.Hkv; ++h)
      for (long i = 0; i < pr.p.Sq; ++i) {
        const std::size_t at = brute::flat(pr.p.Hq, pr.p.Sq, pr.p.Dv, 0, h, i, 0);
        nan_rows += std::isnan(expected.out[at]);
        finite_rows_seeing_key +=
            !std::isnan(expected.out[at]) && brute::visible(pr.p, brute::sequences(pr.p)[0], h, i, 5);
      }
    EXPECT_GT(nan_rows, 1);                // kept by some rows …
    EXPECT_GT(finite_rows_seeing_key, 0);  // … and dropped by others that see it
    for (qkv::Backend backend : backends<T>()) {
      const Output<T> o = run_attention<T>(pr, drop, backend);
      const double error = max_error(o.out, expected.out, "out");
      if (backend == qkv::Backend::fused) {
        EXPECT_LE(error, 2 * max_error(plain_float_with_dropout(pr, drop), expected.out, "plain") +
                             1e-6 * std::max(1.0, max_abs(pr.v)));
      } else {
        EXPECT_LE(error, (std::is_same_v<T, float> ? 1e-6 : 1e-12) * std::max(1.0, max_abs(pr.v)));
      }
      const Output<T> all = run_attention<T>(pr, Drop{1.0, 17, 2}, backend);
      for (long d = 0; d < pr.p.Dv; ++d) {
        EXPECT_TRUE(std::isnan(all.out[brute::flat(pr.p.Hq, pr.p.Sq, pr.p.Dv, 0, 1, pr.p.Sq - 1, d)]));
        EXPECT_EQ(all.out[brute::flat(pr.p.Hq, pr.p.Sq, pr.p.Dv, 0, 0, pr.p.Sq - 1, d)], T(0));
      }
    }
  }
}

// ---- E[out] -------------------------------------------------------------------------------------------------------

TYPED_TEST(DropoutEdges, MeanOverOffsetsIsTheUndroppedOutputWithinFourSigma) {
  // For each output element, the mean over N offsets against the output without dropout: |mean − out| ≤ 4σ/√N with σ
  // the samples' standard deviation (the mean of N independent masks; dropout is unbiased). Float on the fused kernel
  // (a prefill and a decoding shape), double on the reference.
  using T = TypeParam;
  constexpr int kN = 1500;
  for (const brute::Shape& shape : {brute::Shape{1, 4, 1, 12, 24, 8, 4}, brute::Shape{1, 2, 1, 6, 24, 8, 4}}) {
    qkv_test::Problem pr = qkv_test::rounded<float>(qkv_test::make_problem(shape, 61));
    pr.p.causal = true;
    for (const double p : {0.1, 0.5}) {
      const qkv::Backend backend = std::is_same_v<T, float> ? qkv::Backend::fused : qkv::Backend::reference;
      const Output<T> none = run_attention<T>(pr, Drop{}, backend);
      std::vector<double> sum(none.out.size(), 0.0), sum_squares(none.out.size(), 0.0);
      for (int n = 0; n < kN; ++n) {
        const Output<T> o = run_attention<T>(pr, Drop{p, 2024, static_cast<std::uint64_t>(n)}, backend);
        for (std::size_t e = 0; e < o.out.size(); ++e) {
          sum[e] += static_cast<double>(o.out[e]);
          sum_squares[e] += static_cast<double>(o.out[e]) * static_cast<double>(o.out[e]);
        }
      }
      for (std::size_t e = 0; e < sum.size(); ++e) {
        const double mean = sum[e] / kN;
        const double sigma = std::sqrt(std::max(0.0, (sum_squares[e] - kN * mean * mean) / (kN - 1)));
        // + 1e-6: the rounding of the float outputs (|out| < 4 here), far below 4σ/√N.
        EXPECT_LE(std::fabs(mean - static_cast<double>(none.out[e])), 4 * sigma / std::sqrt(double(kN)) + 1e-6)
            << "Sq " << shape.Sq << ", p " << p << ", element " << e << " (σ " << sigma << ")";
      }
    }
  }
}

}  // namespace
