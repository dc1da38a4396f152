// docs/design.md's NaN/Inf policy ("Semantics every path shares"), one test per statement, each run on the reference
// and fused backends in float and on the reference backend in double (the fused kernel exists for float only), with GQA
// (Hq = 4, Hkv = 2) throughout and varlen where it matters.
//
// Expected values: the float64 brute force of tests/brute_force.hpp on the same (rounded) inputs, or values known by
// construction (zeros, −∞, the sink logit, a one-hot row). "No other row changes" is checked exactly: the rows a
// poisoned input does not touch must be bit-identical to the same call with the poison replaced by finite values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "support/problem.hpp"

namespace {

using brute::flat;
using qkv_test::Output;
using qkv_test::Problem;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();

/// Random normal q, k, v for the given extents (GQA by default: Hq = 4, Hkv = 2); support/problem.hpp has the rest:
/// rounded (the inputs as qkv sees them in T) and run (qkv::attention in T, outputs starting as NaN).
Problem make_problem(long B, long Sq, long Skv, std::uint64_t seed, long Hq = 4, long Hkv = 2, long D = 8,
                     long Dv = 5) {
  return qkv_test::make_problem({B, Hq, Hkv, Sq, Skv, D, Dv}, seed);
}

// docs/design.md's bound for the reference path, 1e-6·max(1, max|V|) in float (1e-12 in double), over the finite values
// of v. The fused float path is held to the same bound here (tighter than its own: 2× a plain float implementation).
template <class T>
double tolerance(const Problem& pr) {
  double max_v = 0;
  for (double x : pr.v)
    if (std::isfinite(x)) max_v = std::max(max_v, std::abs(x));
  return (std::is_same_v<T, double> ? 1e-12 : 1e-6) * std::max(1.0, max_v);
}

/// Runs `check(T{}, backend, name)` for float on the reference and fused backends and for double on the reference.
template <class F>
void for_each_backend(F check) {
  check(float{}, qkv::Backend::reference, "float, reference");
  check(float{}, qkv::Backend::fused, "float, fused");
  check(double{}, qkv::Backend::reference, "double, reference");
}

/// (sequence or batch entry, query head, query row within it) of every output row, in the views' row order.
struct RowId {
  long b, h, i;
};
using Touched = std::function<bool(const RowId&)>;
const Touched kNoRow = [](const RowId&) { return false; };

bool same(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

/// The policy's core check. `poisoned` is `clean` with NaN or ±∞ written somewhere; `touched` says which rows that
/// poison may affect. For every row it does not touch: out and lse bit-identical to the clean call, and within the
/// reference bound of the float64 brute force on the poisoned inputs (which never reads hidden keys), never NaN.
/// For touched rows with `nan_in_touched`: at least one NaN in the output row (NaN propagates).
void check_rows(const Problem& poisoned, const Problem& clean, const Touched& touched, bool nan_in_touched) {
  for_each_backend([&](auto tag, qkv::Backend backend, const char* name) {
    using T = decltype(tag);
    SCOPED_TRACE(name);
    const Problem pr = qkv_test::rounded<T>(poisoned), cl = qkv_test::rounded<T>(clean);
    const brute::Params& p = pr.p;
    const brute::Result want = brute::attention(pr.q, pr.k, pr.v, p);
    const Output got = qkv_test::run<T>(pr, backend), reference = qkv_test::run<T>(cl, backend);
    const double tol = tolerance<T>(cl), eps = std::is_same_v<T, double> ? 1e-12 : 1e-6;
    const bool varlen = !p.cu_seqlens_q.empty();
    const long sequences = varlen ? static_cast<long>(p.cu_seqlens_q.size()) - 1 : p.B;
    long checked_rows = 0, touched_rows = 0;
    for (long s = 0; s < sequences; ++s) {
      const long b = varlen ? 0 : s, row0 = varlen ? p.cu_seqlens_q[static_cast<std::size_t>(s)] : 0;
      const long rows = varlen ? p.cu_seqlens_q[static_cast<std::size_t>(s) + 1] - row0 : p.Sq;
      for (long h = 0; h < p.Hq; ++h)
        for (long i = 0; i < rows; ++i) {
          const std::size_t lse_at = flat(p.Hq, p.Sq, 1, b, h, row0 + i, 0);
          const std::string where =
              "sequence " + std::to_string(s) + " head " + std::to_string(h) + " row " + std::to_string(i);
          if (touched({s, h, i})) {
            ++touched_rows;
            if (!nan_in_touched) continue;
            bool any_nan = false;
            for (long d = 0; d < p.Dv; ++d) any_nan |= std::isnan(got.out[flat(p.Hq, p.Sq, p.Dv, b, h, row0 + i, d)]);
            EXPECT_TRUE(any_nan) << where << ": NaN in what this row reads did not propagate";
            continue;
          }
          ++checked_rows;
          EXPECT_TRUE(same(got.lse[lse_at], reference.lse[lse_at]))
              << where << ": lse " << got.lse[lse_at] << ", without the poison " << reference.lse[lse_at];
          if (std::isinf(want.lse[lse_at])) {
            EXPECT_EQ(got.lse[lse_at], want.lse[lse_at]) << where;
          } else {
            EXPECT_NEAR(got.lse[lse_at], want.lse[lse_at], eps * std::max(1.0, std::abs(want.lse[lse_at]))) << where;
          }
          for (long d = 0; d < p.Dv; ++d) {
            const std::size_t at = flat(p.Hq, p.Sq, p.Dv, b, h, row0 + i, d);
            EXPECT_TRUE(same(got.out[at], reference.out[at]))
                << where << " d " << d << ": out " << got.out[at] << ", without the poison " << reference.out[at];
            EXPECT_NEAR(got.out[at], want.out[at], tol) << where << " d " << d;  // NaN never passes
          }
        }
    }
    EXPECT_GT(checked_rows, 0) << "the case checks no row";
    if (nan_in_touched) {
      EXPECT_GT(touched_rows, 0) << "the case touches no row";
    }
  });
}

/// Writes `value` into every feature of key j of kv head h_kv of batch entry b, in k and in v.
void poison_key(Problem& pr, long b, long h_kv, long j, double value) {
  for (long d = 0; d < pr.p.D; ++d) pr.k_at(b, h_kv, j, d) = value;
  for (long d = 0; d < pr.p.Dv; ++d) pr.v_at(b, h_kv, j, d) = value;
}

/// Poisons key j of every kv head and batch entry with NaN, +∞ and −∞ in turn (k and v of one key get one value;
/// three keys are used when available so each value is present).
Problem poison_keys(Problem pr, const std::vector<long>& keys) {
  const double values[] = {kNaN, kInf, -kInf};
  for (long b = 0; b < pr.p.B; ++b)
    for (long h = 0; h < pr.p.Hkv; ++h)
      for (std::size_t n = 0; n < keys.size(); ++n) poison_key(pr, b, h, keys[n], values[n % 3]);
  return pr;
}

// ---- hidden keys are never read ------------------------------------------------------------------------------------

TEST(NanPolicy, HiddenKeysPastKeyLengthsAreNeverRead) {
  // Prefill (Sq 7) and decoding (Sq 1, 300 keys: the fused kernel's split-KV path), GQA, causal and not.
  for (bool causal : {false, true}) {
    Problem clean = make_problem(2, 7, 11, 1);
    clean.p.key_lengths = {8, 5};
    clean.p.causal = causal;
    Problem poisoned = clean;
    for (long h = 0; h < 2; ++h) {
      for (long j = 8; j < 11; ++j) poison_key(poisoned, 0, h, j, j % 2 ? kNaN : kInf);
      for (long j = 5; j < 11; ++j) poison_key(poisoned, 1, h, j, j % 2 ? -kInf : kNaN);
    }
    SCOPED_TRACE(causal ? "prefill, causal" : "prefill");
    check_rows(poisoned, clean, kNoRow, false);
  }
  Problem clean = make_problem(2, 1, 300, 2);
  clean.p.key_lengths = {300, 170};
  Problem poisoned = clean;
  for (long h = 0; h < 2; ++h)
    for (long j = 170; j < 300; ++j) poison_key(poisoned, 1, h, j, j % 3 ? kNaN : kInf);
  SCOPED_TRACE("decoding");
  check_rows(poisoned, clean, kNoRow, false);
}

TEST(NanPolicy, HiddenKeysUnderAllowedFalseAreNeverRead) {
  Problem clean = make_problem(2, 6, 9, 3);
  brute::Broadcast4<char> allowed;
  allowed.extents = {1, 1, 1, 9};  // keys 2, 5, 7 hidden for every query (broadcast)
  allowed.data = {1, 1, 0, 1, 1, 0, 1, 0, 1};
  clean.p.allowed = allowed;
  check_rows(poison_keys(clean, {2, 5, 7}), clean, kNoRow, false);
}

TEST(NanPolicy, HiddenKeysBeyondTheCausalDiagonalAreNeverRead) {
  // top_left, Sq 4 < Skv 10: diag(i) = i, so keys 4..9 are after every query's diagonal.
  Problem clean = make_problem(2, 4, 10, 4);
  clean.p.causal = true;
  clean.p.alignment = brute::Alignment::top_left;
  check_rows(poison_keys(clean, {4, 5, 6, 7, 8, 9}), clean, kNoRow, false);
}

TEST(NanPolicy, HiddenKeysOutsideTheWindowAreNeverRead) {
  // bottom_right, Sq 3, Skv 12, window [diag − 2, diag + 0]: diag(i) = i + 9, so keys 0..6 are left of every window.
  Problem clean = make_problem(2, 3, 12, 5);
  clean.p.window_left = 2;
  clean.p.window_right = 0;
  check_rows(poison_keys(clean, {0, 1, 2, 3, 4, 5, 6}), clean, kNoRow, false);
}

TEST(NanPolicy, HiddenKeysOutsideTheWindowAreNeverReadWithAGlobalKeyAndEveryScoreOption) {
  // The window above with one global key (key 0 stays visible to every query) and the options that change scores:
  // scale, softcap and ALiBi (passed on by support/options.hpp; this file's former converter dropped them).
  Problem clean = make_problem(2, 3, 12, 5);
  clean.p.window_left = 2;
  clean.p.window_right = 0;
  clean.p.global_tokens = 1;
  clean.p.scale = 0.5;
  clean.p.softcap = 4.0;
  clean.p.alibi_slopes = {0.5, 0.25, 0.125, 0.0625};
  check_rows(poison_keys(clean, {1, 2, 3, 4, 5, 6}), clean, kNoRow, false);
}

TEST(NanPolicy, MinusInfinityBiasHidesEvenWithNaNInK) {
  Problem clean = make_problem(2, 5, 8, 6);
  brute::Broadcast4<double> bias;
  bias.extents = {2, 4, 5, 8};  // full extents: −∞ in columns 1 and 6 of every row, finite elsewhere
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  bias.data.resize(2 * 4 * 5 * 8);
  for (std::size_t n = 0; n < bias.data.size(); ++n) bias.data[n] = (n % 8 == 1 || n % 8 == 6) ? -kInf : normal(rng);
  clean.p.bias = bias;
  Problem poisoned = clean;
  for (long b = 0; b < 2; ++b)
    for (long h = 0; h < 2; ++h) {
      poison_key(poisoned, b, h, 1, kNaN);
      poison_key(poisoned, b, h, 6, kNaN);
    }
  check_rows(poisoned, clean, kNoRow, false);
}

// ---- rows that see no key -----------------------------------------------------------------------------------------

/// Every (b, h, i) row that the brute force finds fully hidden gets exactly zeros and lse = `empty_lse(h)`.
template <class EmptyLse>
void check_fully_hidden_rows(const Problem& problem, EmptyLse empty_lse, long expected_hidden_rows) {
  for_each_backend([&](auto tag, qkv::Backend backend, const char* name) {
    using T = decltype(tag);
    SCOPED_TRACE(name);
    const Problem pr = qkv_test::rounded<T>(problem);
    const brute::Params& p = pr.p;
    const brute::Result want = brute::attention(pr.q, pr.k, pr.v, p);
    const Output got = qkv_test::run<T>(pr, backend);
    const double tol = tolerance<T>(pr);
    long hidden_rows = 0;
    brute::for_each_row(p, [&](long b, long h, long i) {
      const bool hidden = brute::row_weight_sum(want, p, b, h, i) == 0;
      hidden_rows += hidden;
      if (hidden) {
        EXPECT_EQ(got.lse[flat(p.Hq, p.Sq, 1, b, h, i, 0)], empty_lse(h)) << "b " << b << " h " << h << " i " << i;
      }
      for (long d = 0; d < p.Dv; ++d) {
        const std::size_t at = flat(p.Hq, p.Sq, p.Dv, b, h, i, d);
        if (hidden) {
          EXPECT_EQ(got.out[at], 0.0) << "b " << b << " h " << h << " i " << i << " d " << d;
        } else {
          EXPECT_NEAR(got.out[at], want.out[at], tol) << "b " << b << " h " << h << " i " << i << " d " << d;
        }
      }
    });
    EXPECT_EQ(hidden_rows, expected_hidden_rows);
  });
}

/// Batch entry 1 has key_lengths 0; in batch entry 0, bottom-right causal with Sq 6 > Skv 4 hides rows 0 and 1
/// (diag(i) = i − 2), and `allowed` hides every key of row 4 in every head: 4·6 + 4·2 + 4·1 fully hidden rows.
Problem fully_hidden_problem() {
  Problem pr = make_problem(2, 6, 4, 8);
  pr.p.causal = true;
  pr.p.key_lengths = {4, 0};
  brute::Broadcast4<char> allowed;
  allowed.extents = {1, 1, 6, 4};
  allowed.data.assign(24, 1);
  for (long j = 0; j < 4; ++j) allowed.data[static_cast<std::size_t>(4 * 4 + j)] = 0;
  pr.p.allowed = allowed;
  return pr;
}

TEST(NanPolicy, FullyHiddenRowsGiveZerosAndMinusInfinityLse) {
  check_fully_hidden_rows(
      fully_hidden_problem(), [](long) { return -kInf; }, 4 * 6 + 4 * 2 + 4 * 1);
}

TEST(NanPolicy, FullyHiddenRowsWithSinksGiveZerosAndTheSinkLogit) {
  Problem pr = fully_hidden_problem();
  pr.p.sinks = {0.5, -1.25, 2.0, -kInf};  // exact in float; −∞ = no sink for head 3
  check_fully_hidden_rows(
      pr, [&](long h) { return pr.p.sinks[static_cast<std::size_t>(h)]; }, 4 * 6 + 4 * 2 + 4 * 1);
}

// ---- poison in what a row reads affects that row only ------------------------------------------------------------

TEST(NanPolicy, NaNInAVisibleQueryAffectsOnlyItsRow) {
  const Problem clean = make_problem(2, 5, 7, 9);
  Problem poisoned = clean;
  poisoned.q_at(1, 2, 3, 4) = kNaN;
  check_rows(
      poisoned, clean, [](const RowId& r) { return r.b == 1 && r.h == 2 && r.i == 3; }, true);
  for (double inf : {kInf, -kInf}) {  // ±∞ in q: the row may change (no claim on its value), no other row does
    Problem infinite = clean;
    infinite.q_at(0, 1, 2, 0) = inf;
    check_rows(
        infinite, clean, [](const RowId& r) { return r.b == 0 && r.h == 1 && r.i == 2; }, false);
  }
}

/// Causal (Sq = Skv = 6): key 3 of kv head 1 in batch entry 0 is read by rows i ≥ 3 of query heads 2 and 3 only.
bool reads_key_3_of_kv_head_1(const RowId& r) { return r.b == 0 && (r.h == 2 || r.h == 3) && r.i >= 3; }

/// Writes NaN, then +∞, then −∞ into feature d of that key, in k or in v (`at`): NaN reaches the rows that read it,
/// ±∞ may change them (no claim on their value), no other row changes.
void check_key_3_of_kv_head_1_poisoned(double& (Problem::*at)(long, long, long, long), long d, std::uint64_t seed) {
  Problem clean = make_problem(2, 6, 6, seed);
  clean.p.causal = true;
  for (double value : {kNaN, kInf, -kInf}) {
    Problem poisoned = clean;
    (poisoned.*at)(0, 1, 3, d) = value;
    check_rows(poisoned, clean, reads_key_3_of_kv_head_1, std::isnan(value));
  }
}

TEST(NanPolicy, NaNInAVisibleKeyAffectsOnlyTheRowsThatSeeIt) {
  check_key_3_of_kv_head_1_poisoned(&Problem::k_at, 5, 10);
}

TEST(NanPolicy, NaNInAVisibleValueAffectsOnlyTheRowsThatSeeIt) {
  check_key_3_of_kv_head_1_poisoned(&Problem::v_at, 2, 11);
}

TEST(NanPolicy, PlusInfinityOrNaNInBiasAffectsOnlyItsRow) {
  Problem clean = make_problem(2, 4, 6, 12);
  brute::Broadcast4<double> bias;
  bias.extents = {2, 4, 4, 6};
  bias.data.assign(2 * 4 * 4 * 6, 0.25);
  clean.p.bias = bias;
  for (double value : {kNaN, kInf}) {
    Problem poisoned = clean;
    poisoned.p.bias->data[flat(4, 4, 6, 1, 3, 2, 4)] = value;  // (b 1, h 3, i 2, j 4)
    check_rows(
        poisoned, clean, [](const RowId& r) { return r.b == 1 && r.h == 3 && r.i == 2; }, std::isnan(value));
  }
}

TEST(NanPolicy, VarlenNaNStaysInItsSequence) {
  // Sequences of 3, 0 and 4 queries over 5, 2 and 6 keys; NaN in key 2 of sequence 2 (row 9 of k) of kv head 0:
  // only sequence 2's rows of query heads 0 and 1 read it.
  Problem clean = make_problem(1, 7, 13, 13);
  clean.p.cu_seqlens_q = {0, 3, 3, 7};
  clean.p.cu_seqlens_k = {0, 5, 7, 13};
  Problem poisoned = clean;
  poisoned.k_at(0, 0, 9, 1) = kNaN;
  check_rows(
      poisoned, clean, [](const RowId& r) { return r.b == 2 && r.h <= 1; }, true);
  Problem value = clean;
  value.v_at(0, 1, 1, 0) = kNaN;  // key 1 of sequence 0, kv head 1: sequence 0's rows of query heads 2 and 3
  check_rows(
      value, clean, [](const RowId& r) { return r.b == 0 && r.h >= 2; }, true);
}

// ---- scores -------------------------------------------------------------------------------------------------------

/// Masks key 2 of a six-key problem out with `allowed` (broadcast over batch, heads and queries).
void hide_key_2(Problem& pr) {
  brute::Broadcast4<char> allowed;
  allowed.extents = {1, 1, 1, 6};
  allowed.data = {1, 1, 0, 1, 1, 1};
  pr.p.allowed = allowed;
}

TEST(NanPolicy, MinusInfinityScoreHidesTheKey) {
  // q > 0 everywhere and k = −∞ in every feature of key 2: q·k = −∞ for every query, so key 2 is hidden; the rows
  // equal the same call with key 2 masked out by `allowed` (and the brute force, which drops −∞ scores).
  Problem masked = make_problem(2, 4, 6, 14);
  for (double& x : masked.q) x = 0.25 + std::abs(x);
  hide_key_2(masked);
  Problem minus_inf_scores = masked;
  minus_inf_scores.p.allowed.reset();
  for (long b = 0; b < 2; ++b)
    for (long h = 0; h < 2; ++h)
      for (long d = 0; d < masked.p.D; ++d) minus_inf_scores.k_at(b, h, 2, d) = -kInf;
  check_rows(minus_inf_scores, masked, kNoRow, false);
}

TEST(NanPolicy, MinusInfinityScoreFromADenormalQueryHidesTheKey) {
  // Found by fuzz/fuzz_attention: q_0 = the smallest float denormal, k_0 = −∞ at key 2, so q·k = −∞ and key 2 is
  // hidden. With D = 9 (scale 1/3) the fused kernel's pre-scaled q_0·factor (scale, or scale·log2 e when
  // prefilling) rounds to 0 in float, and 0·∞ made the score NaN (the row NaN instead of hiding the key). Same
  // check as above: the rows equal the call with key 2 masked out by `allowed`. Sq = 5 with 2 query heads per kv
  // head is 10 stacked rows (the decoding path), Sq = 9 is 18 (the prefill path).
  for (const long sq : {5L, 9L}) {
    SCOPED_TRACE("Sq " + std::to_string(sq));
    Problem masked = make_problem(1, sq, 6, 21, 4, 2, 9, 4);
    for (long h = 0; h < 4; ++h)
      for (long i = 0; i < sq; ++i)
        masked.q_at(0, h, i, 0) = static_cast<double>(std::numeric_limits<float>::denorm_min());
    hide_key_2(masked);
    Problem minus_inf_scores = masked;
    minus_inf_scores.p.allowed.reset();
    for (long h = 0; h < 2; ++h) minus_inf_scores.k_at(0, h, 2, 0) = -kInf;
    check_rows(minus_inf_scores, masked, kNoRow, false);
  }
}

/// Runs attention on B = 1, one head, Sq copies of the query `q` (D = q.size()) against two keys k (2·D values, key
/// after key) and values v (Dv = 1) with the given scale, and, if `bias` is given, the additive bias bias[j] on key j
/// of every row; returns out and lse of every row.
Output run_two_keys(qkv::Backend backend, long sq, const std::vector<float>& q, const std::vector<float>& k,
                    const float (&v)[2], float scale, const float* bias = nullptr) {
  const long D = static_cast<long>(q.size());
  std::vector<float> qs;
  for (long i = 0; i < sq; ++i) qs.insert(qs.end(), q.begin(), q.end());
  std::vector<float> out(static_cast<std::size_t>(sq), kNaNf), lse(static_cast<std::size_t>(sq), kNaNf);
  qkv::AttentionOptions<float> options;
  options.scale = scale;
  options.backend = backend;
  if (bias != nullptr) options.bias = qkv::TensorView4<const float>(bias, {1, 1, 1, 2});  // broadcast over rows
  qkv::attention<float>(qkv::view_bhsd(qs.data(), 1, 1, sq, D), qkv::view_bhsd(k.data(), 1, 1, 2, D),
                        qkv::view_bhsd(v, 1, 1, 2, 1), qkv::view_bhsd(out.data(), 1, 1, sq, 1),
                        qkv::TensorView3<float>(lse.data(), {1, 1, sq}), options);
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

/// Runs `run(backend, sq)` on the decoding (Sq = 1) and prefill (Sq = 20) paths of both backends and expects every
/// row to be `expected`: out exactly (or within `out_tolerance` when it is not 0), lse within 1e-6·|lse| (the
/// reference path computes it in double).
template <class Run>
void expect_every_row(const Output& expected, double out_tolerance, const std::string& trace, Run run) {
  for (const long sq : {1L, 20L}) {
    for (const qkv::Backend backend : {qkv::Backend::reference, qkv::Backend::fused}) {
      SCOPED_TRACE(std::string(backend == qkv::Backend::fused ? "fused" : "reference") + ", Sq " + std::to_string(sq) +
                   trace);
      const Output got = run(backend, sq);
      for (std::size_t i = 0; i < static_cast<std::size_t>(sq); ++i) {
        if (out_tolerance == 0) {
          EXPECT_EQ(got.out[i], expected.out[0]) << "row " << i;
        } else {
          EXPECT_NEAR(got.out[i], expected.out[0], out_tolerance) << "row " << i;
        }
        EXPECT_NEAR(got.lse[i], expected.lse[0], 1e-6 * std::fabs(expected.lse[0])) << "row " << i;
      }
    }
  }
}

TEST(NanPolicy, QueryTooLargeToPrescaleScoresExactly) {
  // q = (1e38, 1), scale 10, k_a = (1e-30, 0), k_b = (0, 5e7): the scores 1e9 and 5e8 fit in float, but the fused
  // kernel's pre-scaled q_0·scale (·log2 e) does not. It must neither give NaN (∞·0) nor saturate q_0 (FLT_MAX·1e-30
  // would score key a at 3.4e8, below key b): Q is used unscaled and the scores scaled afterwards. Key a takes all
  // the weight, out = v_a exactly, lse = 1e9 within float rounding (the reference path computes it in double).
  const std::vector<float> q = {1e38f, 1.0f}, k = {1e-30f, 0.0f, 0.0f, 5e7f};
  const float v[2] = {1.5f, -2.0f};
  expect_every_row({{1.5}, {1e9}}, 0, "",
                   [&](qkv::Backend backend, long sq) { return run_two_keys(backend, sq, q, k, v, 10.0f); });
}

TEST(NanPolicy, ScaleBeyondTheRangeOfScaleTimesLog2eScoresExactly) {
  // scale = 3e38 is finite, but scale·log2 e is not: pre-scaling would make q_0 = 0 into 0·∞ = NaN. q = (0, 1e-38),
  // k_a = (5, 1), k_b = (1, 0): scores 3 and 0 (in double: (0·5 + 1e-38·1)·3e38 = 3.0000000…), so out =
  // (e^3·v_a + v_b) / (e^3 + 1) and lse = log(e^3 + 1), as the float64 brute force computes them.
  const std::vector<float> q = {0.0f, 1e-38f}, k = {5.0f, 1.0f, 1.0f, 0.0f};
  const float v[2] = {1.5f, -2.0f};
  const double s_a = (0.0 * 5.0 + double(1e-38f) * 1.0) * double(3e38f), s_b = 0.0;
  const double lse = std::log(std::exp(s_a) + std::exp(s_b));  // 3.05: 1e-6·|lse| = 1e-6·max(1, lse)
  const double out = (std::exp(s_a - lse) * 1.5 + std::exp(s_b - lse) * -2.0);
  expect_every_row({{out}, {lse}}, 1e-6 * 2.0, "",
                   [&](qkv::Backend backend, long sq) { return run_two_keys(backend, sq, q, k, v, 3e38f); });
}

/// out and lse of softmax(s)·v for two keys, by a float64 loop: the expected values of the tests below.
Output two_key_softmax(double s_a, double s_b, double v_a, double v_b) {
  const double m = std::max(s_a, s_b);
  const double w_a = std::exp(s_a - m), w_b = std::exp(s_b - m);
  return {{(w_a * v_a + w_b * v_b) / (w_a + w_b)}, {m + std::log(w_a + w_b)}};
}

TEST(NanPolicy, ScoresBeyondFltMaxOverLog2eStayExact) {
  // Finite scores between FLT_MAX / log2 e ≈ 2.36e38 and FLT_MAX: q = (1.8e19, 1), k = (±1.8e19, 0) and
  // (±1.7e19, 0), scale 1, so the scores are ±3.24e38 and ±3.06e38 in float. The fused prefill softmax works in base 2
  // (scores times log2 e), where they would be ±∞: +∞ made the rows NaN, −∞ hid both keys (zeros, lse −∞). Its task
  // must see that from max |k| and Σ |q| and run in base e. The expected values come from a float64 loop: the
  // weights are one-hot (e^(−1.8e37) is 0), out is v of the larger score exactly, lse the larger score.
  const float v[2] = {1.5f, -2.0f};
  for (const float sign : {1.0f, -1.0f}) {
    const std::vector<float> q = {1.8e19f, 1.0f}, k = {sign * 1.8e19f, 0.0f, sign * 1.7e19f, 0.0f};
    const double s_a = double(q[0]) * double(k[0]), s_b = double(q[0]) * double(k[2]);
    expect_every_row(two_key_softmax(s_a, s_b, v[0], v[1]), 0, ", sign " + std::to_string(sign),
                     [&](qkv::Backend backend, long sq) { return run_two_keys(backend, sq, q, k, v, 1.0f); });
  }
}

TEST(NanPolicy, ScoresBeyondFltMaxOverLog2eFromTheScaleStayExact) {
  // The same range reached through `scale`: scale = 3e38, q = (1, 0), k = (1, 0) and (0.5, 0): scores 3e38 and
  // 1.5e38. scale·log2 e overflows, so the prefill task keeps Q unscaled and scales the scores after Q·Kᵀ
  // (post-scale), where q·k = 1 is small: the base-2 check must count the post-scale factor to see the overflow.
  const std::vector<float> q = {1.0f, 0.0f}, k = {1.0f, 0.0f, 0.5f, 0.0f};
  const float v[2] = {1.5f, -2.0f};
  const double scale = double(3e38f);
  expect_every_row(two_key_softmax(scale * double(k[0]), scale * double(k[2]), v[0], v[1]), 0, "",
                   [&](qkv::Backend backend, long sq) { return run_two_keys(backend, sq, q, k, v, 3e38f); });
}

TEST(NanPolicy, ScoresWithinRoundingOfFltMaxInBase2StayExact) {
  // Found in review: the bound Σ|q'|·max|k| can sit just below FLT_MAX while the rounded FMA sum of Q·Kᵀ reaches ∞.
  // D = 4, scale = 0.69314718 (scale·log2 e rounds to 1, so q' = q), every k_a component 1.3403708648589361e19:
  // Σ q'_d·k_a,d = 3.4028e38 in base 2 is within a few ulp of FLT_MAX (the bound is 7e-10 below it), a finite
  // 2.36e38 in base e. k_b = k_a / 2. The check's rounding margin must send the task to base e. Expected values
  // from a float64 loop on the float inputs: one-hot on key a.
  constexpr long D = 4;
  const std::vector<float> q = {5.591816521950167e18f, 5.87067521074253e18f, 7.06363818005391e18f,
                                6.86104876458967e18f};
  const float k_a = 1.3403708648589361e19f, k_b = k_a / 2, scale = 0.69314718f;
  const float v[2] = {1.5f, -2.0f};
  double dot = 0;
  for (long d = 0; d < D; ++d) dot += double(q[static_cast<std::size_t>(d)]);
  const Output expected =
      two_key_softmax(dot * double(k_a) * double(scale), dot * double(k_b) * double(scale), v[0], v[1]);
  std::vector<float> k(2 * D, k_a);
  std::fill(k.begin() + D, k.end(), k_b);
  expect_every_row(expected, 0, "",
                   [&](qkv::Backend backend, long sq) { return run_two_keys(backend, sq, q, k, v, scale); });
}

TEST(NanPolicy, BiasBeyondFltMaxOverLog2eStaysExact) {
  // The same range reached through `bias`: q = (1, 2), k_a = (1, 0), k_b = (0, 1), scale 1 (scores 1 and 2), bias
  // ±3e38 on key a and ±2.9e38 on key b. The fused prefill path finishes such scores in base e and multiplies them
  // by log2 e, which overflows: the task must run in base e instead. Expected values from a float64 loop on the
  // float sums (each score + bias rounds to the bias in float: the ulp of 3e38 is 2e31).
  const std::vector<float> q = {1.0f, 2.0f}, k = {1.0f, 0.0f, 0.0f, 1.0f};
  const float v[2] = {1.5f, -2.0f};
  for (const float sign : {1.0f, -1.0f}) {
    const float bias[2] = {sign * 3e38f, sign * 2.9e38f};
    const double s_a = double(1.0f + bias[0]), s_b = double(2.0f + bias[1]);
    expect_every_row(two_key_softmax(s_a, s_b, v[0], v[1]), 0, ", sign " + std::to_string(sign),
                     [&](qkv::Backend backend, long sq) { return run_two_keys(backend, sq, q, k, v, 1.0f, bias); });
  }
}

TEST(NanPolicy, FiniteScoresOfAnyMagnitudeGiveFiniteWeights) {
  // Scores far beyond exp's range (q·k·scale ~ 1e29 in float, 1e299 in double) with a unique maximum per row: the
  // weights are one-hot, so each output row is exactly the value row of that key (by construction).
  for_each_backend([&](auto tag, qkv::Backend backend, const char* name) {
    using T = decltype(tag);
    SCOPED_TRACE(name);
    const double magnitude = std::is_same_v<T, float> ? 1e15 : 1e150;
    Problem pr = make_problem(1, 3, 5, 15, 4, 2, 2, 3);
    for (long h = 0; h < 2; ++h)
      for (long j = 0; j < 5; ++j) {
        pr.k_at(0, h, j, 0) = magnitude * static_cast<double>(j + 1);  // key j scores (j + 1)·q_0 + …
        pr.k_at(0, h, j, 1) = -magnitude;
      }
    for (long h = 0; h < 4; ++h)
      for (long i = 0; i < 3; ++i) {
        pr.q_at(0, h, i, 0) = (i % 2 ? -magnitude : magnitude);  // odd rows favour key 0, even rows key 4
        pr.q_at(0, h, i, 1) = magnitude * 0.5;
      }
    const Problem r = qkv_test::rounded<T>(pr);
    const Output got = qkv_test::run<T>(r, backend);
    for (long h = 0; h < 4; ++h)
      for (long i = 0; i < 3; ++i) {
        EXPECT_TRUE(std::isfinite(got.lse[flat(4, 3, 1, 0, h, i, 0)])) << "h " << h << " i " << i;
        const long winner = i % 2 ? 0 : 4;
        for (long d = 0; d < 3; ++d)
          EXPECT_EQ(got.out[flat(4, 3, 3, 0, h, i, d)],
                    static_cast<double>(static_cast<T>(r.v[flat(2, 5, 3, 0, h / 2, winner, d)])))
              << "h " << h << " i " << i << " d " << d;
      }
  });
}

// ---- empty extents -------------------------------------------------------------------------------------------------

TEST(NanPolicy, NoKeysGiveZerosAndMinusInfinityLse) {
  for (bool with_sinks : {false, true}) {
    Problem pr = make_problem(2, 3, 0, 16);
    if (with_sinks) pr.p.sinks = {1.5, -0.5, 0.0, 3.0};
    for_each_backend([&](auto tag, qkv::Backend backend, const char* name) {
      using T = decltype(tag);
      SCOPED_TRACE(std::string(name) + (with_sinks ? ", sinks" : ""));
      const Output got = qkv_test::run<T>(qkv_test::rounded<T>(pr), backend);
      for (double x : got.out) EXPECT_EQ(x, 0.0);
      for (std::size_t n = 0; n < got.lse.size(); ++n)
        EXPECT_EQ(got.lse[n], with_sinks ? pr.p.sinks[(n / 3) % 4] : -kInf) << "row " << n;
    });
  }
}

TEST(NanPolicy, NoQueriesWriteNothing) {
  for_each_backend([&](auto tag, qkv::Backend backend, const char* name) {
    using T = decltype(tag);
    SCOPED_TRACE(name);
    const std::vector<T> q(8, T(1)), k(2 * 2 * 5 * 4, T(1)), v(2 * 2 * 5 * 3, T(1));
    std::vector<T> out(16, T(7)), lse(16, T(7));  // Sq = 0: views of size 0 over sentinel buffers
    qkv::AttentionOptions<T> options;
    options.backend = backend;
    qkv::attention(qkv::TensorView4<const T>(q.data(), {2, 4, 0, 4}), qkv::TensorView4<const T>(k.data(), {2, 2, 5, 4}),
                   qkv::TensorView4<const T>(v.data(), {2, 2, 5, 3}), qkv::TensorView4<T>(out.data(), {2, 4, 0, 3}),
                   qkv::TensorView3<T>(lse.data(), {2, 4, 0}), options);
    for (T x : out) EXPECT_EQ(x, T(7));
    for (T x : lse) EXPECT_EQ(x, T(7));
  });
}

}  // namespace
