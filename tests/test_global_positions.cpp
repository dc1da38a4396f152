// Tests of AttentionOptions::global_positions (options.hpp, GlobalPositions; resolved in mask.hpp,
// MaskRules::geometry): a call that sees global queries [q_begin, q_begin + Sq) and keys [k_begin, k_begin + Skv) of a
// longer sequence computes the whole call's attention of those queries restricted to those keys, with causal (both
// alignments), window, global tokens, ALiBi and key_lengths decided on global positions, on both backends.
//
// Expected values: the float64 brute force (brute_force.hpp) of the WHOLE call, with every key outside the shard
// hidden through the brute force's `allowed` mask, rows [q_begin, q_end) taken out. No global-position arithmetic is
// on the expected side. Accuracy: double (reference) within 1e-12·max(1, max|V|); float within docs/design.md's rule,
// 2 × the error of a plain float implementation of the same shard call (tests/support/plain_float.hpp) +
// 1e-6·max(1, max|V|). Merging the key shards of a query shard with merge_attention_states gives the whole call's rows
// (float: within 3 × the plain float error of the whole call + 2e-6·max(1, max|V|): the merge order is not the
// kernel's).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "support/expect_shape_error.hpp"
#include "support/max_error.hpp"
#include "support/options.hpp"
#include "support/plain_float.hpp"
#include "support/problem.hpp"

namespace {

using qkv::Index;
constexpr double kInf = std::numeric_limits<double>::infinity();

/// One mask kind: the shape, the options (set on brute::Params, converted to qkv's by support/options.hpp) and where
/// the query and key axes are cut into shards (cuts include 0 and the length).
struct MaskCase {
  std::string name;
  brute::Shape shape;
  std::function<void(brute::Params&)> set;
  std::vector<Index> q_cuts, k_cuts;
};

/// A dense row-major [B, H, S, D] buffer seen from row `row0` on, `rows` rows (the shard of a whole tensor).
template <class T>
qkv::TensorView4<const T> rows_view(const std::vector<T>& data, Index B, Index H, Index S, Index D, Index row0,
                                    Index rows) {
  return qkv::TensorView4<const T>(data.data() + row0 * D, {B, H, rows, D}, {H * S * D, S * D, D, 1});
}

/// The brute force's whole call with the keys outside [k_begin, k_end) hidden (through `allowed`, and-ed with the
/// call's own `allowed` when it has one).
brute::Result restricted_brute(const qkv_test::Problem& pr, Index k_begin, Index k_end) {
  brute::Params p = pr.p;
  brute::Broadcast4<char> allowed;
  allowed.extents = p.allowed ? p.allowed->extents : std::array<long, 4>{1, 1, 1, p.Skv};
  const auto& e = allowed.extents;
  for (long b = 0; b < e[0]; ++b)
    for (long h = 0; h < e[1]; ++h)
      for (long i = 0; i < e[2]; ++i)
        for (long j = 0; j < e[3]; ++j) {
          const bool own = !p.allowed || p.allowed->at(b, h, i, j);
          allowed.data.push_back(own && j >= k_begin && j < k_end ? 1 : 0);
        }
  p.allowed = allowed;
  return brute::attention(pr.q, pr.k, pr.v, p);
}

/// Rows [q_begin, q_end) and keys [k_begin, k_end) of a broadcast mask or bias (an extent-1 Sq axis stays 1): what a
/// shard call passes, in the call's own rows and keys.
template <class D>
brute::Broadcast4<D> slice_mask(const brute::Broadcast4<D>& whole, Index q_begin, Index q_end, Index k_begin,
                                Index k_end) {
  brute::Broadcast4<D> part;
  const bool rows_broadcast = whole.extents[2] == 1;
  part.extents = {whole.extents[0], whole.extents[1], rows_broadcast ? 1 : q_end - q_begin, k_end - k_begin};
  for (long b = 0; b < part.extents[0]; ++b)
    for (long h = 0; h < part.extents[1]; ++h)
      for (long i = 0; i < part.extents[2]; ++i)
        for (long j = 0; j < part.extents[3]; ++j)
          part.data.push_back(whole.at(b, h, rows_broadcast ? 0 : q_begin + i, k_begin + j));
  return part;
}

/// The view of rows [q_begin, q_end) and keys [k_begin, k_end) of a dense broadcast mask or bias of `extents` stored at
/// `data` (strided: no copy).
template <class E>
qkv::TensorView4<const E> slice_view(const E* data, const std::array<long, 4>& e, Index q_begin, Index q_end,
                                     Index k_begin, Index k_end) {
  const bool rows_broadcast = e[2] == 1;
  return qkv::TensorView4<const E>(data + (rows_broadcast ? 0 : q_begin * e[3]) + k_begin,
                                   {e[0], e[1], rows_broadcast ? 1 : q_end - q_begin, k_end - k_begin},
                                   {e[1] * e[2] * e[3], e[2] * e[3], e[3], 1});
}

/// Rows [q_begin, q_end) of a dense [B, H, Sq, W] result (W = Dv for out, 1 for lse).
std::vector<double> take_rows(const std::vector<double>& whole, Index B, Index H, Index Sq, Index W, Index q_begin,
                              Index q_end) {
  std::vector<double> part;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index i = q_begin; i < q_end; ++i)
        for (Index w = 0; w < W; ++w) part.push_back(whole[static_cast<std::size_t>(((b * H + h) * Sq + i) * W + w)]);
  return part;
}

/// The output of one call in double.
struct State {
  std::vector<double> out, lse;
};

/// qkv::attention in T on backend `backend` over query rows [q_begin, q_end) and key rows [k_begin, k_end) of the
/// problem, with global positions; the outputs start as NaN so that an unwritten element shows.
template <class T>
State run_shard(const qkv_test::Problem& pr, qkv::Backend backend, Index q_begin, Index q_end, Index k_begin,
                Index k_end, bool set_positions = true, bool with_sinks = true) {
  const brute::Params& p = pr.p;
  qkv_test::Inputs<T> in(pr, backend);
  if (!with_sinks) in.options.sinks.clear();
  if (set_positions) in.options.global_positions = qkv::GlobalPositions{q_begin, k_begin, p.Sq, p.Skv};
  const Index rows = q_end - q_begin, keys = k_end - k_begin;
  // `allowed` and `bias` keep the call's own extents: the shard's rows and keys of the whole call's.
  if (p.bias) in.options.bias = slice_view(in.bias.data(), p.bias->extents, q_begin, q_end, k_begin, k_end);
  if (p.allowed) {
    in.options.allowed = slice_view<bool>(in.allowed.get(), p.allowed->extents, q_begin, q_end, k_begin, k_end);
  }
  std::vector<T> out(static_cast<std::size_t>(p.B * p.Hq * rows * p.Dv), std::numeric_limits<T>::quiet_NaN());
  std::vector<T> lse(static_cast<std::size_t>(p.B * p.Hq * rows), std::numeric_limits<T>::quiet_NaN());
  qkv::attention(
      rows_view(in.q, p.B, p.Hq, p.Sq, p.D, q_begin, rows), rows_view(in.k, p.B, p.Hkv, p.Skv, p.D, k_begin, keys),
      rows_view(in.v, p.B, p.Hkv, p.Skv, p.Dv, k_begin, keys), qkv::TensorView4<T>(out.data(), {p.B, p.Hq, rows, p.Dv}),
      qkv::TensorView3<T>(lse.data(), {p.B, p.Hq, rows}), in.options);
  return {{out.begin(), out.end()}, {lse.begin(), lse.end()}};
}

/// The plain float implementation of the same shard call (its options through brute::Params' global positions).
State plain_shard(const qkv_test::Problem& pr, Index q_begin, Index q_end, Index k_begin, Index k_end) {
  const brute::Params& p = pr.p;
  const std::vector<float> q(pr.q.begin(), pr.q.end()), k(pr.k.begin(), pr.k.end()), v(pr.v.begin(), pr.v.end());
  const Index rows = q_end - q_begin, keys = k_end - k_begin;
  brute::Params call = p;
  call.Sq = rows;
  call.Skv = keys;
  call.global_positions = brute::Params::GlobalPositions{q_begin, k_begin, p.Sq, p.Skv};
  if (p.bias) call.bias = slice_mask(*p.bias, q_begin, q_end, k_begin, k_end);
  if (p.allowed) call.allowed = slice_mask(*p.allowed, q_begin, q_end, k_begin, k_end);
  std::vector<float> out(static_cast<std::size_t>(p.B * p.Hq * rows * p.Dv)),
      lse(static_cast<std::size_t>(p.B * p.Hq * rows));
  qkv_test::plain_float(rows_view(q, p.B, p.Hq, p.Sq, p.D, q_begin, rows),
                        rows_view(k, p.B, p.Hkv, p.Skv, p.D, k_begin, keys),
                        rows_view(v, p.B, p.Hkv, p.Skv, p.Dv, k_begin, keys), call,
                        qkv::TensorView4<float>(out.data(), {p.B, p.Hq, rows, p.Dv}),
                        qkv::TensorView3<float>(lse.data(), {p.B, p.Hq, rows}));
  return {{out.begin(), out.end()}, {lse.begin(), lse.end()}};
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double value : x) m = std::max(m, std::fabs(value));
  return m;
}

/// Merges `part` into `acc` with merge_attention_states (in place), in double.
void merge_into(State& acc, const State& part, const brute::Params& p, Index rows) {
  const qkv::TensorView4<const double> out_b(part.out.data(), {p.B, p.Hq, rows, p.Dv});
  const qkv::TensorView3<const double> lse_b(part.lse.data(), {p.B, p.Hq, rows});
  const qkv::TensorView4<double> out(acc.out.data(), {p.B, p.Hq, rows, p.Dv});
  const qkv::TensorView3<double> lse(acc.lse.data(), {p.B, p.Hq, rows});
  qkv::merge_attention_states(out, lse, out_b, lse_b, out, lse);
}

std::vector<MaskCase> mask_cases() {
  const brute::Shape square{2, 4, 2, 37, 37, 16, 12}, tall{2, 4, 2, 23, 41, 16, 12};
  const std::vector<Index> q37 = {0, 1, 9, 20, 37}, q23 = {0, 1, 9, 23};
  const std::vector<Index> k37 = {0, 9, 20, 37}, k41 = {0, 14, 29, 41};
  std::vector<MaskCase> cases;
  cases.push_back({"none", square, [](brute::Params&) {}, q37, k37});
  cases.push_back({"causal_square", square, [](brute::Params& p) { p.causal = true; }, q37, k37});
  cases.push_back({"causal_bottom_right", tall, [](brute::Params& p) { p.causal = true; }, q23, k41});
  cases.push_back({"causal_top_left", tall,
                   [](brute::Params& p) {
                     p.causal = true;
                     p.alignment = brute::Alignment::top_left;
                   },
                   q23, k41});
  cases.push_back({"window_bottom_right", tall,
                   [](brute::Params& p) {
                     p.window_left = 6;
                     p.window_right = 4;
                   },
                   q23, k41});
  cases.push_back({"causal_window_global_tokens_top_left", square,
                   [](brute::Params& p) {
                     p.causal = true;
                     p.alignment = brute::Alignment::top_left;
                     p.window_left = 4;
                     p.global_tokens = 13;  // spans the first two key shards
                   },
                   q37, k37});
  cases.push_back({"key_lengths_causal", tall,
                   [](brute::Params& p) {
                     p.causal = true;
                     p.key_lengths = {30, 17};  // global: the last key shard [29, 41) holds one key of entry 0
                   },
                   q23, k41});
  cases.push_back({"key_lengths_window_top_left", tall,
                   [](brute::Params& p) {
                     p.alignment = brute::Alignment::top_left;
                     p.window_left = 3;
                     p.window_right = 9;
                     p.key_lengths = {41, 10};
                   },
                   q23, k41});
  cases.push_back({"alibi_causal", square,
                   [](brute::Params& p) {
                     p.causal = true;
                     p.alibi_slopes = {0.5, 0.25, 0.125, 0.0625};
                   },
                   q37, k37});
  cases.push_back({"alibi_bottom_right_window", tall,
                   [](brute::Params& p) {
                     p.window_left = 8;
                     p.alibi_slopes = {0.5, 0.25, 0.125, 0.0625};
                   },
                   q23, k41});
  cases.push_back({"softcap_scale_sinks", tall,
                   [](brute::Params& p) {
                     p.softcap = 5;
                     p.scale = 0.3;
                     p.sinks = {1.5, -kInf, -0.5, 3.0};
                     p.causal = true;
                   },
                   q23, k41});
  cases.push_back({"bias_and_allowed_in_the_shards_own_extents", tall,
                   [](brute::Params& p) {
                     p.causal = true;
                     brute::Broadcast4<double> bias;  // [1, Hq, Sq, Skv], some keys hidden by −∞
                     bias.extents = {1, 4, 23, 41};
                     brute::Broadcast4<char> allowed;  // [B, 1, 1, Skv]
                     allowed.extents = {2, 1, 1, 41};
                     for (long n = 0; n < 4 * 23 * 41; ++n)
                       bias.data.push_back(n % 11 == 3 ? -kInf : 0.1 * (n % 7) - 0.3);
                     for (long n = 0; n < 2 * 41; ++n) allowed.data.push_back(n % 5 == 2 ? 0 : 1);
                     p.bias = bias;
                     p.allowed = allowed;
                   },
                   q23, k41});
  cases.push_back({"mqa_window_right_top_left",
                   {2, 4, 1, 37, 37, 16, 12},
                   [](brute::Params& p) {
                     p.alignment = brute::Alignment::top_left;
                     p.window_left = 7;
                     p.window_right = 3;
                   },
                   q37,
                   k37});
  // Long enough for whole key tiles: tiles skipped, full and partial, in prefill and decode (the first q shard holds
  // one row: Sq·G = 2 decodes).
  // Sanitizer and valgrind runs (QKV_REDUCED_GRID=1, their test presets) take half the length: still several key
  // tiles per shard.
  const Index L = std::getenv("QKV_REDUCED_GRID") != nullptr ? 150 : 300;
  cases.push_back({"long_causal_window_global",
                   {1, 2, 1, L, L, 32, 32},
                   [L](brute::Params& p) {
                     p.causal = true;
                     p.window_left = L / 3;
                     p.global_tokens = 4;
                   },
                   {0, 1, L / 2, L},
                   {0, L / 4, L / 2, 3 * L / 4, L}});
  cases.push_back({"long_bottom_right_decode",
                   {1, 8, 2, 5, 4 * L / 3, 32, 32},
                   [L](brute::Params& p) {
                     p.causal = true;
                     p.window_left = L / 2;
                   },
                   {0, 2, 5},
                   {0, 130 * L / 300, 260 * L / 300, 4 * L / 3}});
  return cases;
}

/// GoogleTest prints a failing parameter with this (instead of its bytes).
[[maybe_unused]] void PrintTo(const MaskCase& c, std::ostream* os) { *os << c.name; }

class GlobalPositionsByMask : public ::testing::TestWithParam<MaskCase> {};

/// Runs every (query shard, key shard) call of the case in T on `backend` and checks each against the restricted brute
/// force, then the merge of each query shard's key shards against the whole call.
template <class T>
void check_shards(const MaskCase& c, qkv::Backend backend, const char* label) {
  qkv_test::Problem pr = qkv_test::make_problem(c.shape, 18);
  c.set(pr.p);
  pr = qkv_test::rounded<float>(pr);  // one set of inputs for float and double
  const brute::Params& p = pr.p;
  const double v_scale = std::max(1.0, max_abs(pr.v));
  const brute::Result whole = brute::attention(pr.q, pr.k, pr.v, p);
  for (const auto& k_cuts : {std::vector<Index>{0, p.Skv}, c.k_cuts}) {
    std::vector<brute::Result> expected_by_key_shard;
    for (std::size_t kc = 0; kc + 1 < k_cuts.size(); ++kc)
      expected_by_key_shard.push_back(restricted_brute(pr, k_cuts[kc], k_cuts[kc + 1]));
    for (std::size_t qc = 0; qc + 1 < c.q_cuts.size(); ++qc) {
      const Index qa = c.q_cuts[qc], qb = c.q_cuts[qc + 1], rows = qb - qa;
      State merged;
      for (std::size_t kc = 0; kc + 1 < k_cuts.size(); ++kc) {
        const Index ka = k_cuts[kc], kb = k_cuts[kc + 1];
        const std::string what = std::string(label) + " " + c.name + " q [" + std::to_string(qa) + ", " +
                                 std::to_string(qb) + ") k [" + std::to_string(ka) + ", " + std::to_string(kb) + ")";
        const State actual = run_shard<T>(pr, backend, qa, qb, ka, kb);
        const std::vector<double> expected_out =
            take_rows(expected_by_key_shard[kc].out, p.B, p.Hq, p.Sq, p.Dv, qa, qb);
        const std::vector<double> expected_lse = take_rows(expected_by_key_shard[kc].lse, p.B, p.Hq, p.Sq, 1, qa, qb);
        const double out_error = qkv_test::max_error(actual.out, expected_out, what + " out");
        const double lse_error = qkv_test::max_error(actual.lse, expected_lse, what + " lse");
        if constexpr (std::is_same_v<T, double>) {
          EXPECT_LE(out_error, 1e-12 * v_scale) << what;
          EXPECT_LE(lse_error, 1e-12 * std::max(1.0, qkv_test::max_finite_abs(expected_lse))) << what;
        } else {
          const State plain = plain_shard(pr, qa, qb, ka, kb);
          const double plain_error = qkv_test::max_error(plain.out, expected_out, what + " plain float out");
          EXPECT_LE(out_error, 2 * plain_error + 1e-6 * v_scale)
              << what << " (plain float error " << plain_error << ")";
          for (std::size_t n = 0; n < expected_lse.size(); ++n) {
            if (!std::isinf(expected_lse[n])) {
              EXPECT_NEAR(actual.lse[n], expected_lse[n], 1e-4 * std::max(1.0, std::fabs(expected_lse[n])))
                  << what << " lse " << n;
            }
          }
        }
        // A sink joins the denominator of every call it is passed to: merged key shards count it once, so it goes
        // to the first shard only.
        if (kc == 0) {
          merged = actual;
        } else {
          merge_into(merged, p.sinks.empty() ? actual : run_shard<T>(pr, backend, qa, qb, ka, kb, true, false), p,
                     rows);
        }
      }
      // The key shards merged: the whole call's rows.
      const std::string what = std::string(label) + " " + c.name + " merged q [" + std::to_string(qa) + ", " +
                               std::to_string(qb) + ") over " + std::to_string(k_cuts.size() - 1) + " key shards";
      const std::vector<double> whole_out = take_rows(whole.out, p.B, p.Hq, p.Sq, p.Dv, qa, qb);
      const double merged_error = qkv_test::max_error(merged.out, whole_out, what);
      (void)qkv_test::max_error(merged.lse, take_rows(whole.lse, p.B, p.Hq, p.Sq, 1, qa, qb), what + " lse");
      if constexpr (std::is_same_v<T, double>) {
        EXPECT_LE(merged_error, 1e-12 * v_scale) << what;
      } else {
        const State plain = plain_shard(pr, qa, qb, 0, p.Skv);
        const double plain_error = qkv_test::max_error(plain.out, whole_out, what + " plain float");
        EXPECT_LE(merged_error, 3 * plain_error + 2e-6 * v_scale)
            << what << " (plain float error " << plain_error << ")";
      }
    }
  }
}

TEST_P(GlobalPositionsByMask, FusedFloatShardsEqualTheWholeCallRestricted) {
  check_shards<float>(GetParam(), qkv::Backend::fused, "fused float");
}

TEST_P(GlobalPositionsByMask, ReferenceFloatShardsEqualTheWholeCallRestricted) {
  check_shards<float>(GetParam(), qkv::Backend::reference, "reference float");
}

TEST_P(GlobalPositionsByMask, ReferenceDoubleShardsEqualTheWholeCallRestricted) {
  check_shards<double>(GetParam(), qkv::Backend::reference, "reference double");
}

TEST_P(GlobalPositionsByMask, BruteForceGlobalPositionsAgreeWithTheRestrictedWholeCall) {
  // The plain float yardstick reads global positions through brute_force.hpp's own rule (Sequence::diag_offset); that
  // rule, run in double, must give the restricted whole call too.
  const MaskCase& c = GetParam();
  qkv_test::Problem pr = qkv_test::make_problem(c.shape, 18);
  c.set(pr.p);
  const brute::Params& p = pr.p;
  for (std::size_t kc = 0; kc + 1 < c.k_cuts.size(); ++kc) {
    const Index ka = c.k_cuts[kc], kb = c.k_cuts[kc + 1];
    const brute::Result restricted = restricted_brute(pr, ka, kb);
    for (std::size_t qc = 0; qc + 1 < c.q_cuts.size(); ++qc) {
      const Index qa = c.q_cuts[qc], qb = c.q_cuts[qc + 1];
      qkv_test::Problem shard;
      shard.p = p;
      shard.p.Sq = qb - qa;
      shard.p.Skv = kb - ka;
      shard.p.global_positions = brute::Params::GlobalPositions{qa, ka, p.Sq, p.Skv};
      if (p.bias) shard.p.bias = slice_mask(*p.bias, qa, qb, ka, kb);
      if (p.allowed) shard.p.allowed = slice_mask(*p.allowed, qa, qb, ka, kb);
      shard.q = take_rows(pr.q, p.B, p.Hq, p.Sq, p.D, qa, qb);
      shard.k = take_rows(pr.k, p.B, p.Hkv, p.Skv, p.D, ka, kb);
      shard.v = take_rows(pr.v, p.B, p.Hkv, p.Skv, p.Dv, ka, kb);
      const brute::Result r = brute::attention(shard.q, shard.k, shard.v, shard.p);
      const std::string what = c.name + " q [" + std::to_string(qa) + ", " + std::to_string(qb) + ") k [" +
                               std::to_string(ka) + ", " + std::to_string(kb) + ")";
      EXPECT_LE(qkv_test::max_error(r.out, take_rows(restricted.out, p.B, p.Hq, p.Sq, p.Dv, qa, qb), what), 1e-13) << what;
      EXPECT_LE(qkv_test::max_error(r.lse, take_rows(restricted.lse, p.B, p.Hq, p.Sq, 1, qa, qb), what + " lse"), 1e-12) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(MaskKinds, GlobalPositionsByMask, ::testing::ValuesIn(mask_cases()),
                         [](const ::testing::TestParamInfo<MaskCase>& info) { return info.param.name; });

TEST(GlobalPositions, TheWholeSequenceAsItsOwnShardGivesTheSameBitsAsUnset) {
  // {0, 0, Sq, Skv} is the same call as no global positions, bit for bit, on both backends and with key padding.
  for (const MaskCase& c : mask_cases()) {
    qkv_test::Problem pr = qkv_test::make_problem(c.shape, 5);
    c.set(pr.p);
    for (qkv::Backend backend : {qkv::Backend::fused, qkv::Backend::reference}) {
      const State with = run_shard<float>(pr, backend, 0, pr.p.Sq, 0, pr.p.Skv, true);
      const State without = run_shard<float>(pr, backend, 0, pr.p.Sq, 0, pr.p.Skv, false);
      for (std::size_t n = 0; n < with.out.size(); ++n) ASSERT_EQ(with.out[n], without.out[n]) << c.name << " " << n;
      for (std::size_t n = 0; n < with.lse.size(); ++n) ASSERT_EQ(with.lse[n], without.lse[n]) << c.name << " " << n;
    }
  }
}

TEST(GlobalPositions, WorkedExampleOfTheDocComment) {
  // options.hpp's example: a causal sequence of 8 split in two shards of 4; queries 0..3 over keys 4..7 see nothing,
  // queries 4..7 over keys 0..3 see every key; with bottom_right, sq = 2 over skv = 8, query 0 over keys 4..7
  // sees 4..6.
  qkv_test::Problem pr = qkv_test::make_problem({1, 1, 1, 8, 8, 4, 4}, 3);
  pr.p.causal = true;
  const State upper = run_shard<double>(pr, qkv::Backend::reference, 0, 4, 4, 8);
  for (double lse : upper.lse) EXPECT_EQ(lse, -kInf);
  for (double x : upper.out) EXPECT_EQ(x, 0.0);
  const State lower = run_shard<double>(pr, qkv::Backend::reference, 4, 8, 0, 4);
  const brute::Result all_four = restricted_brute(pr, 0, 4);  // every query i >= 4 sees keys 0..3 alike: compare
  EXPECT_LE(qkv_test::max_error(lower.out, take_rows(all_four.out, 1, 1, 8, 4, 4, 8), "lower"), 1e-12);
  // Row 4's restricted brute force over keys 0..3 is unmasked: its lse is the log-sum-exp of all four scores.
  double sum = 0;
  for (Index j = 0; j < 4; ++j) {
    double dot = 0;
    for (Index d = 0; d < 4; ++d)
      dot += pr.q[static_cast<std::size_t>(4 * 4 + d)] * pr.k[static_cast<std::size_t>(j * 4 + d)];
    sum += std::exp(dot / 2.0);
  }
  EXPECT_NEAR(lower.lse[0], std::log(sum), 1e-12);

  qkv_test::Problem decode = qkv_test::make_problem({1, 1, 1, 2, 8, 4, 4}, 4);
  decode.p.causal = true;
  const State two = run_shard<double>(decode, qkv::Backend::reference, 0, 2, 4, 8);
  // Query 0 (global diag 6) over keys 4..7 sees 4, 5, 6: its lse is the log-sum-exp of those three scores.
  sum = 0;
  for (Index j = 4; j < 7; ++j) {
    double dot = 0;
    for (Index d = 0; d < 4; ++d)
      dot += decode.q[static_cast<std::size_t>(d)] * decode.k[static_cast<std::size_t>(j * 4 + d)];
    sum += std::exp(dot / 2.0);
  }
  EXPECT_NEAR(two.lse[0], std::log(sum), 1e-12);
}

TEST(GlobalPositions, KeyLengthsAreGlobal) {
  // A length past the view's own keys is valid with global positions (it counts global keys), and a shard wholly
  // past the length sees nothing.
  qkv_test::Problem pr = qkv_test::make_problem({1, 2, 1, 6, 12, 4, 4}, 9);
  pr.p.key_lengths = {7};
  const State past = run_shard<double>(pr, qkv::Backend::reference, 0, 6, 8, 12);
  for (double lse : past.lse) EXPECT_EQ(lse, -kInf);
  const State straddling = run_shard<double>(pr, qkv::Backend::reference, 0, 6, 4, 8);
  const brute::Result expected = restricted_brute(pr, 4, 8);
  EXPECT_LE(qkv_test::max_error(straddling.out, expected.out, "straddling"), 1e-12);
  EXPECT_LE(qkv_test::max_error(straddling.lse, expected.lse, "straddling lse"), 1e-12);
}

// ---- errors ------------------------------------------------------------------------------------------------------

TEST(GlobalPositions, BadPositionsThrow) {
  using qkv_test::expect_shape_error;
  qkv_test::ValidCall call;  // q [2, 4, 3, 4], k [2, 2, 5, 4]
  call.options.global_positions = qkv::GlobalPositions{-1, 0, 3, 5};
  expect_shape_error([&] { call.run(); }, {"qkv::attention", "options.global_positions", "q_begin -1"});
  call.options.global_positions = qkv::GlobalPositions{0, 0, 3, -5};
  expect_shape_error([&] { call.run(); }, {"options.global_positions", "skv -5", "no negative field"});
  call.options.global_positions = qkv::GlobalPositions{1, 0, 3, 5};
  expect_shape_error([&] { call.run(); },
                     {"options.global_positions", "q's 3 rows (q axis 2, Sq)", "global row 1", "global Sq 3"});
  call.options.global_positions = qkv::GlobalPositions{0, 6, 3, 10};
  expect_shape_error([&] { call.run(); },
                     {"options.global_positions", "k's 5 rows (k axis 2, Skv)", "global row 6", "global Skv 10"});
  call.options.global_positions = qkv::GlobalPositions{0, std::numeric_limits<Index>::max(), 3, 5};
  expect_shape_error([&] { call.run(); }, {"options.global_positions", "past the global Skv 5"});
  call.options.global_positions = qkv::GlobalPositions{0, 0, 3, 9};
  call.options.key_lengths = {9, 10};
  expect_shape_error([&] { call.run(); }, {"options.key_lengths[1] is 10", "[0, 9]", "options.global_positions.skv"});
  call.options.key_lengths = {9, 6};  // past the view's 5 keys, within the global 9: valid
  call.run();
}

TEST(GlobalPositions, NotCombinableWithVarlen) {
  qkv_test::ValidVarlenCall call;
  call.options.global_positions = qkv::GlobalPositions{0, 0, 6, 10};
  qkv_test::expect_shape_error([&] { call.run(); },
                               {"options.global_positions cannot be combined with cu_seqlens", "cu_seqlens_q has 3"});
}

}  // namespace
