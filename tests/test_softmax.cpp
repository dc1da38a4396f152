// Tests of qkv/softmax.hpp: stable row softmax, log-sum-exp, entropy and the (out, lse) merge, against values
// computed by hand or in closed form in the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "qkv/softmax.hpp"

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(Softmax, SeedRowsUnscaled) {
  // Seed 000 例 2.4.1 step (5): softmax of S's first row (1, 0, 1) and third row (1, 1, 2) without scaling.
  qkv::Matrix<double> s(2, 3);
  s << 1, 0, 1, 1, 1, 2;
  const auto p = qkv::softmax_rows(s);
  const double e = std::exp(1.0);
  EXPECT_NEAR(p(0, 0), e / (2 * e + 1), 1e-15);
  EXPECT_NEAR(p(0, 1), 1 / (2 * e + 1), 1e-15);
  EXPECT_NEAR(p(1, 2), e / (e + 2), 1e-15);  // (0.212, 0.212, 0.576)
  EXPECT_NEAR(p(0, 0), 0.422, 5e-4);
  EXPECT_NEAR(p(1, 2), 0.576, 5e-4);
}

TEST(Softmax, MinusInfinityHiddenAndEmptyRowsAreZero) {
  qkv::Matrix<double> s(3, 3);
  s << 0, -kInf, 0, -kInf, -kInf, -kInf, 1e30, 1e30 - 1e15, -1e30;
  const auto p = qkv::softmax_rows(s);
  EXPECT_EQ(p(0, 1), 0.0);
  EXPECT_DOUBLE_EQ(p(0, 0), 0.5);
  for (int j = 0; j < 3; ++j) EXPECT_EQ(p(1, j), 0.0);  // a row that sees nothing: zeros, not NaN
  EXPECT_TRUE(p.row(2).allFinite());                     // scores near 1e30: finite weights
  EXPECT_DOUBLE_EQ(p(2, 0), 1.0);
}

TEST(Softmax, NaNStaysInItsRow) {
  qkv::Matrix<float> s(2, 2);
  s << std::numeric_limits<float>::quiet_NaN(), 0, 1, 2;
  const auto p = qkv::softmax_rows(s);
  EXPECT_TRUE(std::isnan(p(0, 0)) && std::isnan(p(0, 1)));
  EXPECT_NEAR(p(1, 1), 1 / (1 + std::exp(-1.0)), 1e-6);
}

TEST(LogSumExp, ValuesAndEdges) {
  qkv::Matrix<double> s(3, 2);
  s << 0, 0, 1000, 1000, -kInf, -kInf;
  const auto lse = qkv::log_sum_exp_rows(s);
  EXPECT_NEAR(lse(0), std::log(2.0), 1e-15);
  EXPECT_NEAR(lse(1), 1000 + std::log(2.0), 1e-12);  // no overflow
  EXPECT_EQ(lse(2), -kInf);
}

TEST(RowEntropy, UniformAndOneHot) {
  qkv::Matrix<double> p(2, 4);
  p << 0.25, 0.25, 0.25, 0.25, 0, 1, 0, 0;
  const auto h = qkv::row_entropy(p);
  EXPECT_NEAR(h(0), std::log(4.0), 1e-15);
  EXPECT_EQ(h(1), 0.0);
}

TEST(MergeState, MatchesOnePassAndHandlesEmptyStates) {
  // Two halves of a softmax over scores (0, 1 | 2, 3) with values (1, 2 | 3, 4), merged, equal the whole.
  const double lse_a = std::log(std::exp(0.0) + std::exp(1.0)), lse_b = std::log(std::exp(2.0) + std::exp(3.0));
  const double out_a[] = {(1 * std::exp(0.0) + 2 * std::exp(1.0)) / std::exp(lse_a)};
  const double out_b[] = {(3 * std::exp(2.0) + 4 * std::exp(3.0)) / std::exp(lse_b)};
  double out[1], lse = 0;
  qkv::detail::merge_state(out_a, lse_a, out_b, lse_b, out, lse, 1);
  const double total = std::exp(0.0) + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(lse, std::log(total), 1e-14);
  EXPECT_NEAR(out[0], (1 * std::exp(0.0) + 2 * std::exp(1.0) + 3 * std::exp(2.0) + 4 * std::exp(3.0)) / total, 1e-14);
  // A state with lse −∞ contributes nothing and is not read (NaN there does not leak).
  const double nan_out[] = {std::numeric_limits<double>::quiet_NaN()};
  qkv::detail::merge_state(nan_out, -kInf, out_b, lse_b, out, lse, 1);
  EXPECT_EQ(out[0], out_b[0]);
  EXPECT_EQ(lse, lse_b);
  qkv::detail::merge_state(nan_out, -kInf, nan_out, -kInf, out, lse, 1);
  EXPECT_EQ(out[0], 0.0);
  EXPECT_EQ(lse, -kInf);
}

// Found by fuzz/fuzz_attention.cpp (a sink merged into a row whose lse is about 40): the weights must not be
// formed from the rounded merged lse, which loses |lse|·2^-24 of relative accuracy whatever the two states' gap.
// The merged output of a state with out = 1 and a sink (out = 0) is exp(lse_a − merged); against float64 its
// relative error may only be a few float ulp plus what rounding the gap costs exp (|lse_a − sink|·2^-24).
TEST(MergeState, AccurateForLargeLse) {
  constexpr double kEpsilon = std::numeric_limits<float>::epsilon();
  double worst = 0;  // error / allowed, over all cases
  for (int step = 0; step <= 800; ++step) {
    const float lse_a = 0.1f * static_cast<float>(step) + 0.0311705f;
    for (const float sink : {0.0f, 5.0f, 30.0f, lse_a - 3.0f, lse_a - 0.5f, lse_a + 2.0f}) {
      const float out_a = 1.0f, out_b = 0.0f;
      float out = 0, lse = 0;
      qkv::detail::merge_state(&out_a, lse_a, &out_b, sink, &out, lse, 1);
      const double gap = static_cast<double>(sink) - static_cast<double>(lse_a);
      const double expected = 1.0 / (1.0 + std::exp(gap));
      const double allowed = (4.0 + std::abs(gap)) * kEpsilon;
      worst = std::max(worst, std::abs(out - expected) / expected / allowed);
    }
  }
  EXPECT_LE(worst, 1.0) << "worst error, in units of (4 + |gap|)·epsilon: " << worst;
}

}  // namespace
