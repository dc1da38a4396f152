// tests/test_reference.cpp — qkv::attention (Backend::reference and the default `automatic`) in float and
// double against the independent float64 brute force of brute_force.hpp, which follows docs/design.md's
// "Semantics every path shares" literally.
//
// Tolerances are docs/design.md's accuracy rule for the reference path, never loosened: the maximum absolute
// output error is at most 1e-12·max(1, max|V|) in double and 1e-6·max(1, max|V|) in float. The brute force
// sees exactly the inputs the library sees (every float input is rounded to float first), so these bounds
// measure the library's arithmetic alone. The lse is compared with the same epsilon relative to max(1, |lse|).
//
// Layout of this file: helpers (problems, running qkv, comparing); the grid over shape × options; edge cases;
// GQA; layouts (BSHD, padded rows); varlen; merge_attention_states.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <qkv/qkv.hpp>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "brute_force.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

namespace {

using brute::flat;
using qkv::Index;
using qkv_test::make_problem;
using qkv_test::Problem;
using qkv_test::rounded;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr qkv::Backend kBackends[] = {qkv::Backend::reference, qkv::Backend::automatic};

const char* backend_name(qkv::Backend backend) {
  return backend == qkv::Backend::reference ? "backend=reference" : "backend=automatic";
}

// ---------------------------------------------------------------------------------------------------------
// Problems (support/problem.hpp: shapes and options for the brute force, dense BHSD q, k, v in double) and their
// masks.

std::size_t count(long a, long b, long c, long d) { return static_cast<std::size_t>(a * b * c * d); }

brute::Broadcast4<char> random_allowed(std::array<long, 4> extents, std::mt19937_64& rng, double p_true = 0.75) {
  std::bernoulli_distribution coin(p_true);
  brute::Broadcast4<char> allowed;
  allowed.extents = extents;
  allowed.data.resize(count(extents[0], extents[1], extents[2], extents[3]));
  for (char& a : allowed.data) a = coin(rng) ? 1 : 0;
  return allowed;
}

// Normal entries, a fraction of them −∞.
brute::Broadcast4<double> random_bias(std::array<long, 4> extents, std::mt19937_64& rng, double p_minus_inf = 0.2) {
  std::bernoulli_distribution coin(p_minus_inf);
  brute::Broadcast4<double> bias;
  bias.extents = extents;
  bias.data = qkv_test::random_normal(count(extents[0], extents[1], extents[2], extents[3]), rng);
  for (double& b : bias.data)
    if (coin(rng)) b = -kInf;
  return bias;
}

std::vector<double> alibi_slopes(long Hq) {  // Press et al.: 2^(−8(h+1)/H)
  std::vector<double> slopes;
  for (long h = 0; h < Hq; ++h) slopes.push_back(std::pow(2.0, -8.0 * static_cast<double>(h + 1) / Hq));
  return slopes;
}

template <class T>
constexpr double kEps = std::is_same_v<T, double> ? 1e-12 : 1e-6;

double max_abs_finite(const std::vector<double>& x) {
  double m = 0;
  for (double value : x)
    if (std::isfinite(value)) m = std::max(m, std::abs(value));
  return m;
}

// docs/design.md's bound for the reference path: kEps · max(1, max|V|).
template <class T>
double output_tolerance(const Problem& pr) {
  return kEps<T> * std::max(1.0, max_abs_finite(pr.v));
}

template <class T>
std::vector<T> convert(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

template <class T>
std::vector<double> to_double(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// ---------------------------------------------------------------------------------------------------------
// Running qkv (support/problem.hpp: Inputs, run) and comparing.

// Every element of `got` is within abs_tol + rel_tol·|want| of `want`; an infinite `want` must be met exactly
// and NaN never matches.
::testing::AssertionResult near(const std::vector<double>& got, const std::vector<double>& want, double abs_tol,
                                double rel_tol = 0) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << ", expected " << want.size();
  std::size_t bad = 0, first = 0;
  double worst = 0;
  for (std::size_t n = 0; n < got.size(); ++n) {
    const bool ok =
        std::isinf(want[n]) ? got[n] == want[n] : std::abs(got[n] - want[n]) <= abs_tol + rel_tol * std::abs(want[n]);
    if (!ok) {
      if (bad++ == 0) first = n;
      if (!(std::abs(got[n] - want[n]) <= worst)) worst = std::abs(got[n] - want[n]);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ (worst |error| " << worst
                                       << "); first at flat index " << first << ": got " << got[first] << ", expected "
                                       << want[first] << ", tolerance " << abs_tol << " + " << rel_tol << "·|expected|";
}

// qkv in T, both backends, both forms, against the brute force: output, lse, and for sinks the identity
// Σ_j p_ij = 1 − exp(sink_h − lse_i) with the library's lse.
template <class T>
void check_against_brute(const Problem& original) {
  const Problem pr = rounded<T>(original);
  const brute::Params& p = pr.p;
  const brute::Result want = brute::attention(pr.q, pr.k, pr.v, p);
  const double tol = output_tolerance<T>(pr);
  for (qkv::Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    const auto got = qkv_test::run<T>(pr, backend);
    EXPECT_TRUE(near(got.out, want.out, tol)) << "out";
    EXPECT_TRUE(near(got.lse, want.lse, kEps<T>, kEps<T>)) << "lse";
    EXPECT_TRUE(near(got.out_alone, want.out, tol)) << "out of the form without lse";
    if (p.sinks.empty()) continue;
    brute::for_each_row(p, [&](long b, long h, long i) {
      const double row_sum = brute::row_weight_sum(want, p, b, h, i);
      if (row_sum == 0) return;  // a row that sees no key: lse = sink, checked above
      const double lse = got.lse[flat(p.Hq, p.Sq, 1, b, h, i, 0)];
      EXPECT_NEAR(row_sum, 1.0 - std::exp(p.sinks[h] - lse), kEps<T> * std::max(1.0, std::abs(lse)))
          << "b=" << b << " h=" << h << " i=" << i;
    });
  }
}

// The (b, h) slice of a broadcast tensor as a [1, 1, Sq or 1, Skv] view (for the one-head Eigen entry point).
template <class E, class D>
qkv::TensorView4<const E> head_slice(const E* data, const brute::Broadcast4<D>& tensor, long b, long h) {
  const auto& e = tensor.extents;
  const long offset = ((e[0] == 1 ? 0 : b) * e[1] + (e[1] == 1 ? 0 : h)) * e[2] * e[3];
  return qkv::TensorView4<const E>(data + offset, {1, 1, e[2], e[3]});
}

// qkv::attention_weights for every (b, h) of a non-varlen problem: P against the brute force, the causal
// upper triangle exactly 0, every visible row summing to 1 (1 − p_sink with sinks), hidden rows exactly 0.
template <class T>
void check_weights(const Problem& original) {
  const Problem pr = rounded<T>(original);
  const brute::Params& p = pr.p;
  const brute::Result want = brute::attention(pr.q, pr.k, pr.v, p);
  const qkv_test::Inputs<T> in(pr, qkv::Backend::reference);
  for (qkv::Backend backend : kBackends)
    for (long b = 0; b < p.B; ++b)
      for (long h = 0; h < p.Hq; ++h) {
        SCOPED_TRACE(::testing::Message() << backend_name(backend) << " b=" << b << " h=" << h);
        const long h_kv = h / (p.Hq / p.Hkv);
        qkv::Matrix<T> Q(p.Sq, p.D), K(p.Skv, p.D);
        for (long i = 0; i < p.Sq; ++i)
          for (long d = 0; d < p.D; ++d) Q(i, d) = in.q[flat(p.Hq, p.Sq, p.D, b, h, i, d)];
        for (long j = 0; j < p.Skv; ++j)
          for (long d = 0; d < p.D; ++d) K(j, d) = in.k[flat(p.Hkv, p.Skv, p.D, b, h_kv, j, d)];
        qkv::AttentionOptions<T> options = in.options;
        options.backend = backend;
        if (!p.key_lengths.empty()) options.key_lengths = {static_cast<Index>(p.key_lengths[b])};
        if (p.allowed) options.allowed = head_slice(in.allowed.get(), *p.allowed, b, h);
        if (p.bias) options.bias = head_slice(in.bias.data(), *p.bias, b, h);
        if (!p.alibi_slopes.empty()) options.alibi_slopes = {in.options.alibi_slopes[h]};
        if (!p.sinks.empty()) options.sinks = {in.options.sinks[h]};
        const qkv::Matrix<T> P = qkv::attention_weights(Q, K, options);
        ASSERT_EQ(P.rows(), p.Sq);
        ASSERT_EQ(P.cols(), p.Skv);
        const long Skv_b = p.key_lengths.empty() ? p.Skv : p.key_lengths[b];
        for (long i = 0; i < p.Sq; ++i) {
          const long diag = p.alignment == brute::Alignment::bottom_right ? i + (Skv_b - p.Sq) : i;
          double got_sum = 0, want_sum = 0;
          for (long j = 0; j < p.Skv; ++j) {
            const double w = want.weights[flat(p.Hq, p.Sq, p.Skv, b, h, i, j)];
            EXPECT_NEAR(P(i, j), w, kEps<T>) << "P(" << i << ", " << j << ")";
            if (p.causal && j > diag) {
              EXPECT_EQ(P(i, j), T(0)) << "causal upper triangle at (" << i << ", " << j << ")";
            }
            got_sum += static_cast<double>(P(i, j));
            want_sum += w;
          }
          if (want_sum == 0) {
            EXPECT_EQ(got_sum, 0.0) << "row " << i << " sees no key";
          } else {
            const double lse = want.lse[flat(p.Hq, p.Sq, 1, b, h, i, 0)];
            const double expected = p.sinks.empty() ? 1.0 : 1.0 - std::exp(p.sinks[h] - lse);
            EXPECT_NEAR(got_sum, expected, kEps<T>) << "row " << i << " sum";
          }
        }
      }
}

// ---------------------------------------------------------------------------------------------------------
// The grid: shapes (odd sizes next to round ones, GQA, MQA, dv ≠ dk, Sq <, =, > Skv) × option sets.

struct Config {
  std::string name;
  std::function<void(brute::Params&, std::mt19937_64&)> apply;
};

void set_causal(brute::Params& p, brute::Alignment alignment) {
  p.causal = true;
  p.alignment = alignment;
}

// Batch 0 keeps about two thirds of its keys, batch 1 half (zero keys when Skv = 1: a batch that sees nothing).
void set_key_lengths(brute::Params& p) {
  for (long b = 0; b < p.B; ++b) p.key_lengths.push_back(b % 2 == 0 ? p.Skv - p.Skv / 3 : p.Skv / 2);
}

std::vector<Config> grid_configs() {
  using brute::Alignment;
  using brute::Params;
  using Rng = std::mt19937_64;
  std::vector<Config> configs = {
      {"plain", [](Params&, Rng&) {}},
      {"scale_0_37", [](Params& p, Rng&) { p.scale = 0.37; }},
      {"key_lengths", [](Params& p, Rng&) { set_key_lengths(p); }},
      {"key_lengths_window_1_1",
       [](Params& p, Rng&) {
         set_key_lengths(p);
         p.window_left = 1, p.window_right = 1;
       }},
      {"allowed_B11S",
       [](Params& p, Rng& rng) {
         p.allowed = random_allowed({p.B, 1, 1, p.Skv}, rng);
       }},
      {"allowed_11SS",
       [](Params& p, Rng& rng) {
         p.allowed = random_allowed({1, 1, p.Sq, p.Skv}, rng);
       }},
      {"allowed_1H1S",
       [](Params& p, Rng& rng) {
         p.allowed = random_allowed({1, p.Hq, 1, p.Skv}, rng);
       }},
      {"allowed_BHSS",
       [](Params& p, Rng& rng) {
         p.allowed = random_allowed({p.B, p.Hq, p.Sq, p.Skv}, rng, 0.5);
       }},
      {"bias_1HSS_minus_inf",
       [](Params& p, Rng& rng) {
         p.bias = random_bias({1, p.Hq, p.Sq, p.Skv}, rng);
       }},
      {"bias_B11S_minus_inf",
       [](Params& p, Rng& rng) {
         p.bias = random_bias({p.B, 1, 1, p.Skv}, rng);
       }},
      {"bias_11SS_causal",
       [](Params& p, Rng& rng) {
         p.bias = random_bias({1, 1, p.Sq, p.Skv}, rng, 0.1);
         p.causal = true;
       }},
      {"alibi", [](Params& p, Rng&) { p.alibi_slopes = alibi_slopes(p.Hq); }},
      {"alibi_window_2_2_top_left",
       [](Params& p, Rng&) {
         p.alibi_slopes = alibi_slopes(p.Hq);
         p.window_left = 2, p.window_right = 2, p.alignment = Alignment::top_left;
       }},
      {"softcap", [](Params& p, Rng&) { p.scale = 1.0, p.softcap = 2.0; }},
      {"softcap_causal_top_left",
       [](Params& p, Rng&) {
         p.scale = 1.0, p.softcap = 1.5;
         set_causal(p, Alignment::top_left);
       }},
      {"sinks",
       [](Params& p, Rng& rng) { p.sinks = qkv_test::random_uniform(static_cast<std::size_t>(p.Hq), -1, 2, rng); }},
      {"combo_masks",
       [](Params& p, Rng& rng) {
         set_causal(p, Alignment::top_left);
         p.window_left = 3, p.global_tokens = 1;
         set_key_lengths(p);
         p.allowed = random_allowed({p.B, 1, 1, p.Skv}, rng, 0.8);
         p.bias = random_bias({1, p.Hq, p.Sq, p.Skv}, rng, 0.1);
       }},
      {"combo_scores",
       [](Params& p, Rng& rng) {
         set_causal(p, Alignment::bottom_right);
         p.scale = 0.8, p.softcap = 3.0;
         p.alibi_slopes = alibi_slopes(p.Hq);
         p.sinks = qkv_test::random_uniform(static_cast<std::size_t>(p.Hq), -1, 2, rng);
         p.bias = random_bias({p.B, 1, 1, p.Skv}, rng, 0.1);
       }},
      {"combo_all",
       [](Params& p, Rng& rng) {
         set_causal(p, Alignment::bottom_right);
         p.window_left = 4, p.window_right = 0, p.global_tokens = 2;
         set_key_lengths(p);
         p.allowed = random_allowed({1, 1, p.Sq, p.Skv}, rng, 0.85);
         p.bias = random_bias({p.B, p.Hq, 1, p.Skv}, rng, 0.1);
         p.alibi_slopes = alibi_slopes(p.Hq);
         p.softcap = 4.0;
         p.sinks = qkv_test::random_uniform(static_cast<std::size_t>(p.Hq), -1, 2, rng);
       }},
  };
  struct Window {
    const char* name;
    long left, right;
  };
  const Window windows[] = {
      {"window_left2", 2, -1}, {"window_right1", -1, 1}, {"window_2_3", 2, 3}, {"window_0_0", 0, 0}};
  for (Alignment alignment : {Alignment::bottom_right, Alignment::top_left}) {
    const std::string suffix = alignment == Alignment::bottom_right ? "_bottom_right" : "_top_left";
    configs.push_back({"causal" + suffix, [alignment](Params& p, Rng&) { set_causal(p, alignment); }});
    for (const Window& w : windows)
      for (bool causal : {false, true})
        configs.push_back(
            {(causal ? "causal_" : "") + std::string(w.name) + suffix, [alignment, w, causal](Params& p, Rng&) {
               p.alignment = alignment, p.causal = causal;
               p.window_left = w.left, p.window_right = w.right;
             }});
    configs.push_back({"global2_window_1_1" + suffix, [alignment](Params& p, Rng&) {
                         p.alignment = alignment, p.global_tokens = 2, p.window_left = 1, p.window_right = 1;
                       }});
    configs.push_back({"causal_global3_window_left2" + suffix, [alignment](Params& p, Rng&) {
                         set_causal(p, alignment);
                         p.global_tokens = 3, p.window_left = 2;
                       }});
    configs.push_back({"key_lengths_causal" + suffix, [alignment](Params& p, Rng&) {
                         set_causal(p, alignment);
                         set_key_lengths(p);
                       }});
    configs.push_back({"alibi_causal" + suffix, [alignment](Params& p, Rng&) {
                         set_causal(p, alignment);
                         p.alibi_slopes = alibi_slopes(p.Hq);
                       }});
    configs.push_back({"sinks_causal" + suffix, [alignment](Params& p, Rng& rng) {
                         set_causal(p, alignment);
                         p.sinks = qkv_test::random_uniform(static_cast<std::size_t>(p.Hq), -1, 2, rng);
                       }});
  }
  return configs;
}

struct GridCase {
  std::string name;
  qkv_test::Shape shape;
  Config config;
  std::uint64_t seed;

  Problem problem() const {
    Problem pr = make_problem(shape, seed);
    std::mt19937_64 rng(seed + 1);
    config.apply(pr.p, rng);
    return pr;
  }
};

void PrintTo(const GridCase& c, std::ostream* os) { *os << c.name; }

std::vector<GridCase> grid_cases() {
  const qkv_test::Shape shapes[] = {
      {1, 1, 1, 1, 1, 1, 1},     {1, 1, 1, 1, 64, 16, 16},  {2, 2, 1, 3, 5, 3, 3},
      {1, 2, 2, 5, 3, 5, 5},     {2, 3, 3, 17, 17, 16, 16}, {1, 4, 2, 16, 17, 17, 5},
      {1, 2, 1, 64, 64, 64, 64}, {2, 1, 1, 17, 64, 16, 33}, {1, 2, 2, 64, 17, 8, 8},
  };
  std::vector<GridCase> cases;
  std::uint64_t seed = 1000;
  for (const qkv_test::Shape& s : shapes)
    for (const Config& config : grid_configs()) {
      const std::string name = "B" + std::to_string(s.B) + "_H" + std::to_string(s.Hq) + "x" + std::to_string(s.Hkv) +
                               "_Sq" + std::to_string(s.Sq) + "_Skv" + std::to_string(s.Skv) + "_D" +
                               std::to_string(s.D) + "_Dv" + std::to_string(s.Dv) + "_" + config.name;
      cases.push_back({name, s, config, seed++});
    }
  return cases;
}

class ReferenceGrid : public ::testing::TestWithParam<GridCase> {};

TEST_P(ReferenceGrid, DoubleMatchesBruteForce) { check_against_brute<double>(GetParam().problem()); }
TEST_P(ReferenceGrid, FloatMatchesBruteForce) { check_against_brute<float>(GetParam().problem()); }
TEST_P(ReferenceGrid, DoubleWeights) { check_weights<double>(GetParam().problem()); }
TEST_P(ReferenceGrid, FloatWeights) { check_weights<float>(GetParam().problem()); }

INSTANTIATE_TEST_SUITE_P(ShapesByOptions, ReferenceGrid, ::testing::ValuesIn(grid_cases()),
                         [](const ::testing::TestParamInfo<GridCase>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------------------
// The typed suites below, each over float and double: one empty fixture under five names.

template <class T>
class ScalarSuite : public ::testing::Test {};
template <class T>
using EdgeCases = ScalarSuite<T>;
template <class T>
using GroupedQuery = ScalarSuite<T>;
template <class T>
using Layouts = ScalarSuite<T>;
template <class T>
using Varlen = ScalarSuite<T>;
template <class T>
using MergeStates = ScalarSuite<T>;

// ---------------------------------------------------------------------------------------------------------
// Edge cases, in float and double.

TYPED_TEST_SUITE(EdgeCases, qkv_test::Scalars, );

/// A row of the edge-case tables: a name, a shape, what the case sets in the options and what the test expects.
template <class Expected>
struct EdgeCase {
  const char* name;
  qkv_test::Shape shape;
  std::function<void(brute::Params&)> apply;
  Expected expected;
};

TYPED_TEST(EdgeCases, RowThatSeesNoKeyGetsZerosAndMinusInfinityLse) {
  using T = TypeParam;
  using Case = EdgeCase<long>;  // expected: the number of rows that see no key, over all (b, h, i)
  const Case cases[] = {
      {"allowed row all false",
       {1, 2, 2, 4, 6, 4, 4},
       [](brute::Params& p) {
         brute::Broadcast4<char> allowed{{1, 1, p.Sq, p.Skv}, std::vector<char>(count(1, 1, p.Sq, p.Skv), 1)};
         for (long j = 0; j < p.Skv; ++j) allowed.data[flat(1, p.Sq, p.Skv, 0, 0, 1, j)] = 0;
         p.allowed = allowed;
       },
       2},
      {"causal bottom_right with Sq > Skv",
       {1, 2, 1, 6, 3, 4, 5},
       [](brute::Params& p) { set_causal(p, brute::Alignment::bottom_right); },
       6},
      {"key_lengths 0",
       {2, 1, 1, 3, 5, 4, 4},
       [](brute::Params& p) {
         p.key_lengths = {0, 5};
       },
       3},
      {"bias row all minus infinity",
       {1, 1, 1, 3, 4, 4, 4},
       [](brute::Params& p) {
         brute::Broadcast4<double> bias{{1, 1, p.Sq, p.Skv}, std::vector<double>(count(1, 1, p.Sq, p.Skv), 0.25)};
         for (long j = 0; j < p.Skv; ++j) bias.data[flat(1, p.Sq, p.Skv, 0, 0, 2, j)] = -kInf;
         p.bias = bias;
       },
       1},
      {"window before the first key",
       {1, 1, 1, 6, 3, 4, 4},
       [](brute::Params& p) {  // bottom_right, not causal: diag(i) = i - 3, window [diag - 1, diag]
         p.window_left = 1, p.window_right = 0;
       },
       3},
  };
  for (const Case& c : cases)
    for (bool with_sinks : {false, true}) {
      SCOPED_TRACE(::testing::Message() << c.name << (with_sinks ? ", with sinks" : ""));
      Problem pr = make_problem(c.shape, 7);
      c.apply(pr.p);
      if (with_sinks) pr.p.sinks = std::vector<double>(static_cast<std::size_t>(pr.p.Hq), 0.75);
      pr = rounded<T>(pr);
      const brute::Params& p = pr.p;
      const brute::Result want = brute::attention(pr.q, pr.k, pr.v, p);
      for (qkv::Backend backend : kBackends) {
        SCOPED_TRACE(backend_name(backend));
        const auto got = qkv_test::run<T>(pr, backend);
        long empty_rows = 0;
        brute::for_each_row(p, [&](long b, long h, long i) {
          const double weight_sum = brute::row_weight_sum(want, p, b, h, i);
          const double lse = got.lse[flat(p.Hq, p.Sq, 1, b, h, i, 0)];
          EXPECT_FALSE(std::isnan(lse));
          for (long d = 0; d < p.Dv; ++d) EXPECT_FALSE(std::isnan(got.out[flat(p.Hq, p.Sq, p.Dv, b, h, i, d)]));
          if (weight_sum != 0) return;
          ++empty_rows;
          for (long d = 0; d < p.Dv; ++d) {
            EXPECT_EQ(got.out[flat(p.Hq, p.Sq, p.Dv, b, h, i, d)], 0.0) << "b=" << b << " h=" << h << " i=" << i;
            EXPECT_EQ(got.out_alone[flat(p.Hq, p.Sq, p.Dv, b, h, i, d)], 0.0);
          }
          if (with_sinks) {
            EXPECT_EQ(lse, p.sinks[h]) << "an empty row's lse is its sink logit";
          } else {
            EXPECT_TRUE(std::isinf(lse) && lse < 0) << "lse " << lse << " at b=" << b << " h=" << h << " i=" << i;
          }
        });
        EXPECT_EQ(empty_rows, c.expected);
        EXPECT_TRUE(near(got.out, want.out, output_tolerance<T>(pr)));
        EXPECT_TRUE(near(got.lse, want.lse, kEps<T>, kEps<T>));
      }
    }
}

// Sets key rows j of kv head (b, h_kv) to NaN and their value rows to +∞.
void poison_key(Problem& pr, long b, long h_kv, long j) {
  const brute::Params& p = pr.p;
  for (long d = 0; d < p.D; ++d) pr.k[flat(p.Hkv, p.Skv, p.D, b, h_kv, j, d)] = kNaN;
  for (long d = 0; d < p.Dv; ++d) pr.v[flat(p.Hkv, p.Skv, p.Dv, b, h_kv, j, d)] = kInf;
}

TYPED_TEST(EdgeCases, NanInHiddenKeyOrValueSlotsDoesNotReachTheOutput) {
  using T = TypeParam;
  using Case = EdgeCase<std::vector<std::array<long, 3>>>;  // expected: the (b, h_kv, j) hidden from every query
  std::vector<Case> cases = {
      {"past key_lengths",
       {2, 2, 1, 5, 8, 4, 3},
       [](brute::Params& p) {
         p.key_lengths = {3, 6};
         set_causal(p, brute::Alignment::bottom_right);
       },
       {{0, 0, 3}, {0, 0, 4}, {0, 0, 5}, {0, 0, 6}, {0, 0, 7}, {1, 0, 6}, {1, 0, 7}}},
      {"under a false allowed",
       {2, 2, 2, 4, 7, 4, 4},
       [](brute::Params& p) {
         brute::Broadcast4<char> allowed{{p.B, 1, 1, p.Skv}, std::vector<char>(count(p.B, 1, 1, p.Skv), 1)};
         allowed.data[2] = allowed.data[5] = 0;  // b = 0: keys 2, 5
         allowed.data[p.Skv + 0] = 0;            // b = 1: key 0
         p.allowed = allowed;
       },
       {{0, 0, 2}, {0, 1, 2}, {0, 0, 5}, {0, 1, 5}, {1, 0, 0}, {1, 1, 0}}},
      {"behind the causal diagonal (top_left)",
       {1, 2, 1, 4, 9, 4, 4},
       [](brute::Params& p) { set_causal(p, brute::Alignment::top_left); },
       {{0, 0, 4}, {0, 0, 5}, {0, 0, 6}, {0, 0, 7}, {0, 0, 8}}},
      {"under a minus infinity bias",
       {2, 1, 1, 3, 7, 4, 4},
       [](brute::Params& p) {
         brute::Broadcast4<double> bias{{p.B, 1, 1, p.Skv}, std::vector<double>(count(p.B, 1, 1, p.Skv), 0.3)};
         bias.data[1] = bias.data[6] = -kInf;  // b = 0: keys 1, 6
         bias.data[p.Skv + 3] = -kInf;         // b = 1: key 3
         p.bias = bias;
       },
       {{0, 0, 1}, {0, 0, 6}, {1, 0, 3}}},
      {"outside the window (global key 0 visible)",
       {1, 1, 1, 2, 12, 4, 4},
       [](brute::Params& p) {  // bottom_right: diag = 10, 11; visible keys 0 and 7..11
         p.window_left = 3, p.global_tokens = 1;
       },
       {{0, 0, 1}, {0, 0, 2}, {0, 0, 3}, {0, 0, 4}, {0, 0, 5}, {0, 0, 6}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem clean = make_problem(c.shape, 11);
    c.apply(clean.p);
    clean = rounded<T>(clean);
    Problem poisoned = clean;
    for (const auto& slot : c.expected) poison_key(poisoned, slot[0], slot[1], slot[2]);
    const brute::Result want = brute::attention(clean.q, clean.k, clean.v, clean.p);
    const brute::Result want_poisoned = brute::attention(poisoned.q, poisoned.k, poisoned.v, poisoned.p);
    ASSERT_TRUE(near(want_poisoned.out, want.out, 0)) << "the brute force itself reads a hidden slot";
    for (qkv::Backend backend : kBackends) {
      SCOPED_TRACE(backend_name(backend));
      const auto got_clean = qkv_test::run<T>(clean, backend);
      const auto got = qkv_test::run<T>(poisoned, backend);
      // "Equals the run without NaN" within docs/design.md's accuracy rule: a path may sum in another order once
      // it meets non-finite data (bits may differ), but nothing of the hidden slots may show.
      const double tol = output_tolerance<T>(clean);
      EXPECT_TRUE(near(got_clean.out, want.out, tol));
      EXPECT_TRUE(near(got.out, got_clean.out, tol)) << "output differs from the run without NaN";
      EXPECT_TRUE(near(got.out, want.out, tol)) << "output with NaN in hidden slots";
      EXPECT_TRUE(near(got.lse, got_clean.lse, kEps<T>, kEps<T>)) << "lse differs from the run without NaN";
      EXPECT_TRUE(near(got.out_alone, got_clean.out, tol));
    }
  }
}

TYPED_TEST(EdgeCases, NanInVisibleQueryKeyOrValueTouchesOnlyItsRows) {
  using T = TypeParam;
  const qkv_test::Shape shape{2, 4, 2, 9, 9, 8, 6};
  Problem clean = make_problem(shape, 13);
  set_causal(clean.p, brute::Alignment::bottom_right);
  clean = rounded<T>(clean);
  const brute::Params& p = clean.p;
  const brute::Result want = brute::attention(clean.q, clean.k, clean.v, p);
  const double tol = output_tolerance<T>(clean);

  struct Case {
    const char* name;
    std::function<void(Problem&)> poison;
    std::function<bool(long, long, long)> touched;  // (b, h, i) reads the NaN
    bool whole_row_nan;                             // every output of a touched row is NaN
  };
  const Case cases[] = {
      {"q[1, 2, 4, 3]", [](Problem& pr) { pr.q[flat(4, 9, 8, 1, 2, 4, 3)] = kNaN; },
       [](long b, long h, long i) { return b == 1 && h == 2 && i == 4; }, true},
      {"k[0, 1, 5, 0] (query heads 2, 3; causal rows i >= 5)",
       [](Problem& pr) { pr.k[flat(2, 9, 8, 0, 1, 5, 0)] = kNaN; },
       [](long b, long h, long i) { return b == 0 && (h == 2 || h == 3) && i >= 5; }, true},
      {"v[0, 0, 2, 1] (query heads 0, 1; causal rows i >= 2)",
       [](Problem& pr) { pr.v[flat(2, 9, 6, 0, 0, 2, 1)] = kNaN; },
       [](long b, long h, long i) { return b == 0 && (h == 0 || h == 1) && i >= 2; }, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Problem poisoned = clean;
    c.poison(poisoned);
    for (qkv::Backend backend : kBackends) {
      SCOPED_TRACE(backend_name(backend));
      const auto got = qkv_test::run<T>(poisoned, backend);
      long touched_rows = 0;
      brute::for_each_row(p, [&](long b, long h, long i) {
        const std::size_t row = flat(p.Hq, p.Sq, p.Dv, b, h, i, 0);
        const std::vector<double> got_row(got.out.begin() + row, got.out.begin() + row + p.Dv);
        const std::vector<double> want_row(want.out.begin() + row, want.out.begin() + row + p.Dv);
        if (!c.touched(b, h, i)) {
          EXPECT_TRUE(near(got_row, want_row, tol)) << "untouched row b=" << b << " h=" << h << " i=" << i;
          return;
        }
        ++touched_rows;
        if (!c.whole_row_nan) return;
        for (double x : got_row) {
          EXPECT_TRUE(std::isnan(x)) << "NaN propagates in b=" << b << " h=" << h << " i=" << i;
        }
      });
      EXPECT_GT(touched_rows, 0);
    }
  }
}

TYPED_TEST(EdgeCases, NoKeysGiveZerosAndMinusInfinityLse) {
  using T = TypeParam;
  for (bool causal : {false, true})
    for (bool with_sinks : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "causal=" << causal << " sinks=" << with_sinks);
      Problem pr = make_problem({2, 2, 1, 3, 0, 4, 5}, 17);
      pr.p.causal = causal;
      if (with_sinks) pr.p.sinks = {0.5, -1.25};
      for (qkv::Backend backend : kBackends) {
        SCOPED_TRACE(backend_name(backend));
        const auto got = qkv_test::run<T>(pr, backend);
        ASSERT_EQ(got.out.size(), count(2, 2, 3, 5));
        for (double x : got.out) EXPECT_EQ(x, 0.0);
        for (double x : got.out_alone) EXPECT_EQ(x, 0.0);
        for (std::size_t n = 0; n < got.lse.size(); ++n) {
          if (with_sinks) {
            EXPECT_EQ(got.lse[n], pr.p.sinks[(n / 3) % 2]);
          } else {
            EXPECT_TRUE(std::isinf(got.lse[n]) && got.lse[n] < 0) << got.lse[n];
          }
        }
      }
    }
}

TYPED_TEST(EdgeCases, NoQueriesWriteNothing) {
  using T = TypeParam;
  const std::vector<T> q(1, T(1)), k(2 * 5 * 4, T(1)), v(2 * 5 * 3, T(1));
  for (bool causal : {false, true})
    for (qkv::Backend backend : kBackends) {
      std::vector<T> out(1, T(42)), lse(1, T(42));
      qkv::AttentionOptions<T> options;
      options.causal = causal;
      options.backend = backend;
      const qkv::TensorView4<const T> q_view(q.data(), {2, 2, 0, 4}), k_view(k.data(), {2, 1, 5, 4}),
          v_view(v.data(), {2, 1, 5, 3});
      EXPECT_NO_THROW(qkv::attention(q_view, k_view, v_view, qkv::TensorView4<T>(out.data(), {2, 2, 0, 3}),
                                     qkv::TensorView3<T>(lse.data(), {2, 2, 0}), options));
      EXPECT_NO_THROW(qkv::attention(q_view, k_view, v_view, qkv::TensorView4<T>(out.data(), {2, 2, 0, 3}), options));
      EXPECT_EQ(out[0], T(42)) << "an empty output was written";
      EXPECT_EQ(lse[0], T(42)) << "an empty lse was written";
    }
}

TYPED_TEST(EdgeCases, ValueWidthDiffersFromKeyWidth) {
  for (const qkv_test::Shape& s : {qkv_test::Shape{1, 2, 1, 5, 7, 3, 7}, qkv_test::Shape{2, 2, 2, 17, 16, 16, 1},
                                   qkv_test::Shape{1, 1, 1, 16, 17, 64, 5}}) {
    Problem pr = make_problem(s, 19);
    set_causal(pr.p, brute::Alignment::top_left);
    check_against_brute<TypeParam>(pr);
  }
}

TYPED_TEST(EdgeCases, ScaleZeroGivesTheMeanOfTheVisibleValues) {
  using T = TypeParam;
  Problem pr = make_problem({2, 2, 1, 5, 7, 4, 3}, 23);
  pr.p.scale = 0.0;
  set_causal(pr.p, brute::Alignment::top_left);
  pr.p.key_lengths = {7, 3};
  pr = rounded<T>(pr);
  const brute::Params& p = pr.p;
  std::vector<double> mean(count(p.B, p.Hq, p.Sq, p.Dv), 0.0);  // computed here, not by the brute force
  for (long b = 0; b < p.B; ++b)
    for (long h = 0; h < p.Hq; ++h)
      for (long i = 0; i < p.Sq; ++i) {
        const long last = std::min(i, p.key_lengths[b] - 1);  // visible keys: 0 ..= last
        for (long j = 0; j <= last; ++j)
          for (long d = 0; d < p.Dv; ++d)
            mean[flat(p.Hq, p.Sq, p.Dv, b, h, i, d)] +=
                pr.v[flat(1, p.Skv, p.Dv, b, 0, j, d)] / static_cast<double>(last + 1);
      }
  for (qkv::Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    const auto got = qkv_test::run<T>(pr, backend);
    EXPECT_TRUE(near(got.out, mean, output_tolerance<T>(pr)));
  }
  check_against_brute<T>(pr);
}

TYPED_TEST(EdgeCases, ScoresNear1e30GiveFiniteOneHotWeights) {
  using T = TypeParam;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "causal=" << causal);
    Problem pr = make_problem({1, 1, 1, 6, 9, 8, 4}, 29);
    pr.p.scale = 1e29;  // |q·k| up to ~10: scores up to ~1e30
    pr.p.causal = causal;
    pr = rounded<T>(pr);
    const brute::Params& p = pr.p;
    const double tol = output_tolerance<T>(pr);
    // The one key each row should pick: the visible argmax of q·k, found here.
    std::vector<long> argmax(static_cast<std::size_t>(p.Sq));
    for (long i = 0; i < p.Sq; ++i) {
      const long last = causal ? i + (p.Skv - p.Sq) : p.Skv - 1;
      double best = -kInf;
      for (long j = 0; j <= last; ++j) {
        double dot = 0;
        for (long d = 0; d < p.D; ++d)
          dot += pr.q[flat(1, p.Sq, p.D, 0, 0, i, d)] * pr.k[flat(1, p.Skv, p.D, 0, 0, j, d)];
        if (dot > best) best = dot, argmax[i] = j;
      }
    }
    const brute::Result want = brute::attention(pr.q, pr.k, pr.v, p);
    for (qkv::Backend backend : kBackends) {
      SCOPED_TRACE(backend_name(backend));
      const auto got = qkv_test::run<T>(pr, backend);
      for (long i = 0; i < p.Sq; ++i) {
        const double lse = got.lse[static_cast<std::size_t>(i)];
        EXPECT_TRUE(std::isfinite(lse)) << "lse " << lse << " of row " << i;
        for (long d = 0; d < p.Dv; ++d) {
          const double o = got.out[flat(1, p.Sq, p.Dv, 0, 0, i, d)];
          EXPECT_TRUE(std::isfinite(o));
          EXPECT_NEAR(o, pr.v[flat(1, p.Skv, p.Dv, 0, 0, argmax[i], d)], tol)
              << "row " << i << " picks key " << argmax[i];
        }
      }
      EXPECT_TRUE(near(got.out, want.out, tol));
      EXPECT_TRUE(near(got.lse, want.lse, 0, kEps<T>));

      qkv::Matrix<T> Q(p.Sq, p.D), K(p.Skv, p.D);
      for (long i = 0; i < p.Sq; ++i)
        for (long d = 0; d < p.D; ++d) Q(i, d) = static_cast<T>(pr.q[flat(1, p.Sq, p.D, 0, 0, i, d)]);
      for (long j = 0; j < p.Skv; ++j)
        for (long d = 0; d < p.D; ++d) K(j, d) = static_cast<T>(pr.k[flat(1, p.Skv, p.D, 0, 0, j, d)]);
      qkv::AttentionOptions<T> options;
      options.scale = static_cast<T>(*p.scale);
      options.causal = causal;
      options.backend = backend;
      const qkv::Matrix<T> P = qkv::attention_weights(Q, K, options);
      ASSERT_TRUE(P.allFinite());
      for (long i = 0; i < p.Sq; ++i)
        for (long j = 0; j < p.Skv; ++j)
          EXPECT_NEAR(P(i, j), j == argmax[i] ? 1.0 : 0.0, kEps<T>) << "P(" << i << ", " << j << ")";
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// GQA and MQA: query head h reads key/value head h / (Hq / Hkv).

TYPED_TEST_SUITE(GroupedQuery, qkv_test::Scalars, );

TYPED_TEST(GroupedQuery, QueryHeadsReadTheirGroupsKeyValueHead) {
  using T = TypeParam;
  for (long Hkv : {2L, 1L}) {
    const long B = 2, Hq = 6, Sq = 5, Skv = 7, D = 8, Dv = 4, group = Hq / Hkv;
    SCOPED_TRACE(::testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv);
    Problem pr = make_problem({B, Hq, Hkv, Sq, Skv, D, Dv}, 31);
    for (long b = 0; b < B; ++b)  // make kv head 1 unmistakable: values offset by 50
      for (long h_kv = 1; h_kv < Hkv; ++h_kv)
        for (long j = 0; j < Skv; ++j)
          for (long d = 0; d < Dv; ++d) pr.v[flat(Hkv, Skv, Dv, b, h_kv, j, d)] += 50.0;
    set_causal(pr.p, brute::Alignment::bottom_right);
    pr = rounded<T>(pr);
    check_against_brute<T>(pr);

    const qkv_test::Inputs<T> in(pr, qkv::Backend::reference);
    for (qkv::Backend backend : kBackends) {
      SCOPED_TRACE(backend_name(backend));
      std::vector<T> out(count(B, Hq, Sq, Dv));
      qkv::AttentionOptions<T> options = in.options;
      options.backend = backend;
      qkv::attention(in.q_view(), in.k_view(), in.v_view(), qkv::TensorView4<T>(out.data(), {B, Hq, Sq, Dv}), options);
      // One head alone: views into the same buffers (strided, no copies) with one query and one kv head.
      const auto single_head = [&](long h, long h_kv) {
        std::vector<T> single(count(B, 1, Sq, Dv));
        qkv::attention(
            qkv::TensorView4<const T>(in.q.data() + h * Sq * D, {B, 1, Sq, D}, {Hq * Sq * D, Sq * D, D, 1}),
            qkv::TensorView4<const T>(in.k.data() + h_kv * Skv * D, {B, 1, Skv, D}, {Hkv * Skv * D, Skv * D, D, 1}),
            qkv::TensorView4<const T>(in.v.data() + h_kv * Skv * Dv, {B, 1, Skv, Dv},
                                      {Hkv * Skv * Dv, Skv * Dv, Dv, 1}),
            qkv::TensorView4<T>(single.data(), {B, 1, Sq, Dv}), options);
        return to_double(single);
      };
      for (long h = 0; h < Hq; ++h) {
        const long expected_kv = Hkv == 2 ? (h <= 2 ? 0 : 1) : 0;  // written out, not computed from the rule
        ASSERT_EQ(expected_kv, h / group);
        std::vector<double> head;
        for (long b = 0; b < B; ++b)
          for (long n = 0; n < Sq * Dv; ++n)
            head.push_back(out[flat(Hq, Sq, Dv, b, h, 0, 0) + static_cast<std::size_t>(n)]);
        EXPECT_TRUE(near(head, single_head(h, expected_kv), output_tolerance<T>(pr))) << "query head " << h;
        if (Hkv == 2) {
          EXPECT_FALSE(near(head, single_head(h, 1 - expected_kv), 1.0))
              << "query head " << h << " reads the wrong kv head";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Layouts: BSHD and BHSD views of the same data; rows padded beyond D.

TYPED_TEST_SUITE(Layouts, qkv_test::Scalars, );

TYPED_TEST(Layouts, BshdAndBhsdViewsGiveTheSameOutput) {
  using T = TypeParam;
  const long B = 2, Hq = 4, Hkv = 2, Sq = 17, Skv = 33, D = 16, Dv = 5;
  Problem pr = make_problem({B, Hq, Hkv, Sq, Skv, D, Dv}, 37);
  set_causal(pr.p, brute::Alignment::bottom_right);
  pr.p.window_left = 7;
  pr = rounded<T>(pr);
  const brute::Result want = brute::attention(pr.q, pr.k, pr.v, pr.p);
  const qkv_test::Inputs<T> in(pr, qkv::Backend::reference);
  // The same data laid out [B, S, H, D].
  const auto to_bshd = [](const std::vector<T>& bhsd, long B_, long H, long S, long D_) {
    std::vector<T> bshd(bhsd.size());
    for (long b = 0; b < B_; ++b)
      for (long h = 0; h < H; ++h)
        for (long s = 0; s < S; ++s)
          for (long d = 0; d < D_; ++d) bshd[flat(S, H, D_, b, s, h, d)] = bhsd[flat(H, S, D_, b, h, s, d)];
    return bshd;
  };
  const std::vector<T> q = to_bshd(in.q, B, Hq, Sq, D), k = to_bshd(in.k, B, Hkv, Skv, D),
                       v = to_bshd(in.v, B, Hkv, Skv, Dv);
  for (qkv::Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    qkv::AttentionOptions<T> options = in.options;
    options.backend = backend;
    std::vector<T> out_bhsd(count(B, Hq, Sq, Dv)), out_bshd(count(B, Sq, Hq, Dv));
    qkv::attention(in.q_view(), in.k_view(), in.v_view(), qkv::TensorView4<T>(out_bhsd.data(), {B, Hq, Sq, Dv}),
                   options);
    qkv::attention(qkv::TensorView4<const T>(q.data(), {B, Hq, Sq, D}, {Sq * Hq * D, D, Hq * D, 1}),
                   qkv::TensorView4<const T>(k.data(), {B, Hkv, Skv, D}, {Skv * Hkv * D, D, Hkv * D, 1}),
                   qkv::TensorView4<const T>(v.data(), {B, Hkv, Skv, Dv}, {Skv * Hkv * Dv, Dv, Hkv * Dv, 1}),
                   qkv::TensorView4<T>(out_bshd.data(), {B, Hq, Sq, Dv}, {Sq * Hq * Dv, Dv, Hq * Dv, 1}), options);
    std::vector<double> bshd_as_bhsd(out_bhsd.size());
    for (long b = 0; b < B; ++b)
      for (long h = 0; h < Hq; ++h)
        for (long s = 0; s < Sq; ++s)
          for (long d = 0; d < Dv; ++d)
            bshd_as_bhsd[flat(Hq, Sq, Dv, b, h, s, d)] = out_bshd[flat(Sq, Hq, Dv, b, s, h, d)];
    const double tol = output_tolerance<T>(pr);
    EXPECT_TRUE(near(to_double(out_bhsd), want.out, tol)) << "BHSD";
    EXPECT_TRUE(near(bshd_as_bhsd, want.out, tol)) << "BSHD";
    EXPECT_TRUE(near(bshd_as_bhsd, to_double(out_bhsd), tol)) << "BSHD against BHSD";
  }
}

TYPED_TEST(Layouts, PaddedRowsAreNeitherReadNorWritten) {
  using T = TypeParam;
  const long B = 2, Hq = 2, Hkv = 1, Sq = 5, Skv = 17, D = 3, Dv = 4, pad = 3, out_pad = 2;
  Problem pr = make_problem({B, Hq, Hkv, Sq, Skv, D, Dv}, 41);
  set_causal(pr.p, brute::Alignment::top_left);
  pr = rounded<T>(pr);
  const brute::Result want = brute::attention(pr.q, pr.k, pr.v, pr.p);
  const qkv_test::Inputs<T> in(pr, qkv::Backend::reference);
  // Rows of width D + pad whose padding holds NaN.
  const auto padded = [](const std::vector<T>& dense, long rows, long width, long extra) {
    std::vector<T> buffer(static_cast<std::size_t>(rows * (width + extra)), std::numeric_limits<T>::quiet_NaN());
    for (long r = 0; r < rows; ++r)
      for (long d = 0; d < width; ++d)
        buffer[static_cast<std::size_t>(r * (width + extra) + d)] = dense[static_cast<std::size_t>(r * width + d)];
    return buffer;
  };
  const std::vector<T> q = padded(in.q, B * Hq * Sq, D, pad), k = padded(in.k, B * Hkv * Skv, D, pad),
                       v = padded(in.v, B * Hkv * Skv, Dv, pad);
  const long qs = D + pad, vs = Dv + pad, os = Dv + out_pad;
  for (qkv::Backend backend : kBackends) {
    SCOPED_TRACE(backend_name(backend));
    qkv::AttentionOptions<T> options = in.options;
    options.backend = backend;
    std::vector<T> out(static_cast<std::size_t>(B * Hq * Sq * os), T(7));
    qkv::attention(qkv::TensorView4<const T>(q.data(), {B, Hq, Sq, D}, {Hq * Sq * qs, Sq * qs, qs, 1}),
                   qkv::TensorView4<const T>(k.data(), {B, Hkv, Skv, D}, {Hkv * Skv * qs, Skv * qs, qs, 1}),
                   qkv::TensorView4<const T>(v.data(), {B, Hkv, Skv, Dv}, {Hkv * Skv * vs, Skv * vs, vs, 1}),
                   qkv::TensorView4<T>(out.data(), {B, Hq, Sq, Dv}, {Hq * Sq * os, Sq * os, os, 1}), options);
    std::vector<double> dense;
    for (long r = 0; r < B * Hq * Sq; ++r) {
      for (long d = 0; d < Dv; ++d) dense.push_back(out[static_cast<std::size_t>(r * os + d)]);
      for (long d = Dv; d < os; ++d)
        EXPECT_EQ(out[static_cast<std::size_t>(r * os + d)], T(7)) << "padding of row " << r;
    }
    EXPECT_TRUE(near(dense, want.out, output_tolerance<T>(pr)));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Varlen: packed sequences equal running each sequence alone.

TYPED_TEST_SUITE(Varlen, qkv_test::Scalars, );

TYPED_TEST(Varlen, PackedSequencesEqualEachSequenceAlone) {
  using T = TypeParam;
  // Four sequences: an ordinary one, one with no keys, one with no queries, a longer square one.
  const std::vector<long> cu_q = {0, 5, 8, 8, 24}, cu_k = {0, 9, 9, 13, 29};
  const long Hq = 4, Hkv = 2, D = 8, Dv = 6, Tq = cu_q.back(), Tk = cu_k.back();
  struct Variant {
    const char* name;
    std::function<void(brute::Params&)> apply;
  };
  const Variant variants[] = {
      {"plain", [](brute::Params&) {}},
      {"causal bottom_right", [](brute::Params& p) { set_causal(p, brute::Alignment::bottom_right); }},
      {"causal top_left", [](brute::Params& p) { set_causal(p, brute::Alignment::top_left); }},
      {"causal top_left, window 2, global 1, sinks, alibi",
       [](brute::Params& p) {
         set_causal(p, brute::Alignment::top_left);
         p.window_left = 2, p.global_tokens = 1;
         p.sinks = {0.5, -0.5, 1.0, 0.0};
         p.alibi_slopes = alibi_slopes(4);
       }},
      {"bottom_right window 1 1", [](brute::Params& p) { p.window_left = 1, p.window_right = 1; }},
  };
  for (const Variant& variant : variants) {
    SCOPED_TRACE(variant.name);
    Problem pr = make_problem({1, Hq, Hkv, Tq, Tk, D, Dv}, 43);
    variant.apply(pr.p);
    pr.p.cu_seqlens_q = cu_q;
    pr.p.cu_seqlens_k = cu_k;
    check_against_brute<T>(pr);

    pr = rounded<T>(pr);
    const qkv_test::Inputs<T> in(pr, qkv::Backend::reference);
    const double tol = output_tolerance<T>(pr);
    for (qkv::Backend backend : kBackends) {
      SCOPED_TRACE(backend_name(backend));
      const auto packed = qkv_test::run<T>(pr, backend);
      qkv::AttentionOptions<T> alone_options = in.options;
      alone_options.cu_seqlens_q.clear();
      alone_options.cu_seqlens_k.clear();
      alone_options.backend = backend;
      for (std::size_t s = 0; s + 1 < cu_q.size(); ++s) {
        SCOPED_TRACE(::testing::Message() << "sequence " << s);
        const long q0 = cu_q[s], Sq = cu_q[s + 1] - q0, k0 = cu_k[s], Skv = cu_k[s + 1] - k0;
        std::vector<T> out(count(1, Hq, Sq, Dv)), lse(count(1, Hq, Sq, 1));
        qkv::attention(
            qkv::TensorView4<const T>(in.q.data() + q0 * D, {1, Hq, Sq, D}, {Hq * Tq * D, Tq * D, D, 1}),
            qkv::TensorView4<const T>(in.k.data() + k0 * D, {1, Hkv, Skv, D}, {Hkv * Tk * D, Tk * D, D, 1}),
            qkv::TensorView4<const T>(in.v.data() + k0 * Dv, {1, Hkv, Skv, Dv}, {Hkv * Tk * Dv, Tk * Dv, Dv, 1}),
            qkv::TensorView4<T>(out.data(), {1, Hq, Sq, Dv}), qkv::TensorView3<T>(lse.data(), {1, Hq, Sq}),
            alone_options);
        std::vector<double> packed_out, packed_lse;
        for (long h = 0; h < Hq; ++h)
          for (long i = q0; i < q0 + Sq; ++i) {
            packed_lse.push_back(packed.lse[flat(Hq, Tq, 1, 0, h, i, 0)]);
            for (long d = 0; d < Dv; ++d) packed_out.push_back(packed.out[flat(Hq, Tq, Dv, 0, h, i, d)]);
          }
        EXPECT_TRUE(near(packed_out, to_double(out), tol)) << "out";
        EXPECT_TRUE(near(packed_lse, to_double(lse), kEps<T>, kEps<T>)) << "lse";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// merge_attention_states: two key halves merged equal one pass over all keys.

TYPED_TEST_SUITE(MergeStates, qkv_test::Scalars, );

TYPED_TEST(MergeStates, TwoKeyHalvesEqualOnePass) {
  using T = TypeParam;
  const long B = 2, Hq = 4, Hkv = 2, Sq = 6, Skv = 11, D = 8, Dv = 5;
  Problem pr = make_problem({B, Hq, Hkv, Sq, Skv, D, Dv}, 47);
  std::mt19937_64 rng(48);
  brute::Broadcast4<char> allowed = random_allowed({1, 1, Sq, Skv}, rng, 0.8);
  for (long j = 0; j < Skv; ++j) {
    allowed.data[flat(1, Sq, Skv, 0, 0, 4, j)] = 0;               // row 4 sees nothing
    if (j >= 4) allowed.data[flat(1, Sq, Skv, 0, 0, 2, j)] = 0;   // row 2 sees only keys < 4
    allowed.data[flat(1, Sq, Skv, 0, 0, 1, j)] = j == 9 ? 1 : 0;  // row 1 sees only key 9
  }
  pr.p.allowed = allowed;
  pr = rounded<T>(pr);
  const brute::Result want = brute::attention(pr.q, pr.k, pr.v, pr.p);
  const qkv_test::Inputs<T> in(pr, qkv::Backend::reference);
  const double tol = output_tolerance<T>(pr);
  for (long m : {0L, 4L, 10L, 11L})
    for (qkv::Backend backend : kBackends) {
      SCOPED_TRACE(::testing::Message() << "split at " << m << ", " << backend_name(backend));
      // Attention with lse over keys [first, first + n): views into the same k, v and allowed buffers.
      const auto half = [&](long first, long n, std::vector<T>& out, std::vector<T>& lse) {
        qkv::AttentionOptions<T> options = in.options;
        options.backend = backend;
        options.allowed =
            qkv::TensorView4<const bool>(in.allowed.get() + first, {1, 1, Sq, n}, {Sq * Skv, Sq * Skv, Skv, 1});
        out.assign(count(B, Hq, Sq, Dv), std::numeric_limits<T>::quiet_NaN());
        lse.assign(count(B, Hq, Sq, 1), std::numeric_limits<T>::quiet_NaN());
        qkv::attention(
            in.q_view(),
            qkv::TensorView4<const T>(in.k.data() + first * D, {B, Hkv, n, D}, {Hkv * Skv * D, Skv * D, D, 1}),
            qkv::TensorView4<const T>(in.v.data() + first * Dv, {B, Hkv, n, Dv}, {Hkv * Skv * Dv, Skv * Dv, Dv, 1}),
            qkv::TensorView4<T>(out.data(), {B, Hq, Sq, Dv}), qkv::TensorView3<T>(lse.data(), {B, Hq, Sq}), options);
      };
      std::vector<T> out_a, lse_a, out_b, lse_b;
      half(0, m, out_a, lse_a);
      half(m, Skv - m, out_b, lse_b);
      const auto out_view = [&](std::vector<T>& x) { return qkv::TensorView4<T>(x.data(), {B, Hq, Sq, Dv}); };
      const auto lse_view = [&](std::vector<T>& x) { return qkv::TensorView3<T>(x.data(), {B, Hq, Sq}); };
      std::vector<T> out(out_a.size(), std::numeric_limits<T>::quiet_NaN()),
          lse(lse_a.size(), std::numeric_limits<T>::quiet_NaN());
      qkv::merge_attention_states(out_view(out_a), lse_view(lse_a), out_view(out_b), lse_view(lse_b), out_view(out),
                                  lse_view(lse));
      EXPECT_TRUE(near(to_double(out), want.out, tol)) << "merged out";
      EXPECT_TRUE(near(to_double(lse), want.lse, kEps<T>, kEps<T>)) << "merged lse";
      for (long b = 0; b < B; ++b)
        for (long h = 0; h < Hq; ++h) {
          EXPECT_TRUE(std::isinf(lse[flat(Hq, Sq, 1, b, h, 4, 0)]) && lse[flat(Hq, Sq, 1, b, h, 4, 0)] < 0);
          for (long d = 0; d < Dv; ++d) EXPECT_EQ(out[flat(Hq, Sq, Dv, b, h, 4, d)], T(0)) << "row 4 sees nothing";
        }
      // In place: the merged state overwrites state a.
      qkv::merge_attention_states(out_view(out_a), lse_view(lse_a), out_view(out_b), lse_view(lse_b), out_view(out_a),
                                  lse_view(lse_a));
      EXPECT_TRUE(near(to_double(out_a), to_double(out), tol)) << "in-place out";
      EXPECT_TRUE(near(to_double(lse_a), to_double(lse), kEps<T>, kEps<T>)) << "in-place lse";
    }
}

TYPED_TEST(MergeStates, MinusInfinityStatesContributeNothing) {
  using T = TypeParam;
  const long B = 1, H = 2, S = 3, Dv = 4;
  std::mt19937_64 rng(53);
  const std::vector<double> a = qkv_test::random_normal(count(B, H, S, Dv), rng),
                            b = qkv_test::random_normal(count(B, H, S, Dv), rng);
  std::vector<T> out_a = convert<T>(a), out_b = convert<T>(b);
  std::vector<T> lse_a = convert<T>(qkv_test::random_uniform(count(B, H, S, 1), -2, 3, rng));
  std::vector<T> lse_b = convert<T>(qkv_test::random_uniform(count(B, H, S, 1), -2, 3, rng));
  const T minus_inf = -std::numeric_limits<T>::infinity();
  // Row (h, i) = (0, 0): b is −∞; (0, 1): a is −∞; (1, 2): both are −∞. The −∞ states hold arbitrary finite
  // outputs (5), which must not leak.
  const auto row = [&](long h, long i) { return static_cast<std::size_t>(h * S + i); };
  lse_b[row(0, 0)] = minus_inf;
  lse_a[row(0, 1)] = minus_inf;
  lse_a[row(1, 2)] = lse_b[row(1, 2)] = minus_inf;
  for (long d = 0; d < Dv; ++d) {
    out_b[row(0, 0) * Dv + static_cast<std::size_t>(d)] = T(5);
    out_a[row(0, 1) * Dv + static_cast<std::size_t>(d)] = T(5);
    out_a[row(1, 2) * Dv + static_cast<std::size_t>(d)] = out_b[row(1, 2) * Dv + static_cast<std::size_t>(d)] = T(5);
  }
  std::vector<T> out(out_a.size(), std::numeric_limits<T>::quiet_NaN()),
      lse(lse_a.size(), std::numeric_limits<T>::quiet_NaN());
  qkv::merge_attention_states(
      qkv::TensorView4<T>(out_a.data(), {B, H, S, Dv}), qkv::TensorView3<T>(lse_a.data(), {B, H, S}),
      qkv::TensorView4<T>(out_b.data(), {B, H, S, Dv}), qkv::TensorView3<T>(lse_b.data(), {B, H, S}),
      qkv::TensorView4<T>(out.data(), {B, H, S, Dv}), qkv::TensorView3<T>(lse.data(), {B, H, S}));
  const double tol = kEps<T> * std::max(1.0, std::max(max_abs_finite(a), max_abs_finite(b)));
  for (long h = 0; h < H; ++h)
    for (long i = 0; i < S; ++i) {
      SCOPED_TRACE(::testing::Message() << "h=" << h << " i=" << i);
      const std::size_t r = row(h, i);
      const bool a_empty = std::isinf(lse_a[r]), b_empty = std::isinf(lse_b[r]);
      double want_lse;
      if (a_empty && b_empty) {
        want_lse = -kInf;
      } else if (a_empty || b_empty) {
        want_lse = a_empty ? lse_b[r] : lse_a[r];
      } else {  // log(exp(a) + exp(b)), written the stable way
        const double hi = std::max<double>(lse_a[r], lse_b[r]), lo = std::min<double>(lse_a[r], lse_b[r]);
        want_lse = hi + std::log1p(std::exp(lo - hi));
      }
      EXPECT_TRUE(near({static_cast<double>(lse[r])}, {want_lse}, kEps<T>, kEps<T>));
      for (long d = 0; d < Dv; ++d) {
        const std::size_t n = r * Dv + static_cast<std::size_t>(d);
        double want_out = 0;
        if (!a_empty) want_out += std::exp(static_cast<double>(lse_a[r]) - want_lse) * static_cast<double>(out_a[n]);
        if (!b_empty) want_out += std::exp(static_cast<double>(lse_b[r]) - want_lse) * static_cast<double>(out_b[n]);
        if (a_empty && b_empty) {
          EXPECT_EQ(out[n], T(0)) << "two −∞ states give zeros";
        } else {
          EXPECT_NEAR(out[n], want_out, tol);
        }
      }
    }
}

}  // namespace
