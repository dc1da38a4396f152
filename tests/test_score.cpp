// Tests of qkv/score.hpp: the scale's default (seed 000, 定理 2.4.1) and ScoreFinish, the softcap, bias and ALiBi
// steps both backends apply to a scaled dot product. Expected values are the formulas of the header written out
// here in double: softcap(x) = c·tanh(x / c), then + bias_ij, then − slope·|diag(i) − j|.
#include <gtest/gtest.h>

#include <cmath>

#include "qkv/score.hpp"

namespace {

using qkv::Index;

TEST(Score, DefaultScaleIsInverseSqrtD) {
  qkv::AttentionOptions<double> o;
  EXPECT_DOUBLE_EQ(qkv::resolve_scale(o, 64), 0.125);
  EXPECT_DOUBLE_EQ(qkv::resolve_scale(o, 2), 1.0 / std::sqrt(2.0));
  o.scale = 0.0;
  EXPECT_DOUBLE_EQ(qkv::resolve_scale(o, 64), 0.0);  // an explicit 0 is honoured
  o.scale = -3.5;
  EXPECT_DOUBLE_EQ(qkv::resolve_scale(o, 64), -3.5);
}

TEST(Score, NothingSetLeavesTheScaledScore) {
  const qkv::ScoreFinish<float> finish;
  EXPECT_FALSE(finish.modifies_scores());
  EXPECT_EQ(finish(1.25, 3, 7, 3), 1.25);
  EXPECT_EQ(finish(-2.5f, 0, 0, 0), -2.5f);
}

TEST(Score, SoftcapBoundsTheScoreBeforeBiasAndAlibi) {
  const float bias[] = {0.5f,  -1.0f, 2.0f,    // row 0
                        0.25f, 4.0f,  -3.0f};  // row 1
  qkv::ScoreFinish<float> finish;
  finish.softcap = 5.0f;
  EXPECT_TRUE(finish.modifies_scores());
  EXPECT_NEAR(finish(20.0, 0, 0, 0), 5.0 * std::tanh(4.0), 1e-12);
  EXPECT_NEAR(finish(-1e6, 0, 0, 0), -5.0, 1e-12);  // bounded by the cap
  finish.bias = bias;
  finish.bias_row_stride = 3;
  finish.alibi_slope = 0.5f;
  finish.has_alibi = true;
  // Query 1 with its diagonal at 2: key 0 is 2 away, key 2 on it.
  EXPECT_NEAR(finish(20.0, 1, 0, 2), 5.0 * std::tanh(4.0) + 0.25 - 0.5 * 2.0, 1e-12);
  EXPECT_NEAR(finish(-3.0, 1, 2, 2), 5.0 * std::tanh(-0.6) - 3.0 - 0.0, 1e-12);
}

TEST(Score, BiasRowsAndBroadcastQueries) {
  const double bias[] = {1.0, 2.0, 3.0, 10.0, 20.0, 30.0};
  qkv::ScoreFinish<double> finish;
  finish.bias = bias;
  finish.bias_row_stride = 3;
  EXPECT_TRUE(finish.modifies_scores());
  EXPECT_DOUBLE_EQ(finish(0.5, 0, 2, 0), 3.5);
  EXPECT_DOUBLE_EQ(finish(0.5, 1, 1, 0), 20.5);
  EXPECT_DOUBLE_EQ(finish.bias_at(1, 2), 30.0);
  finish.bias_row_stride = 0;  // the Sq axis broadcasts: every query reads row 0
  EXPECT_DOUBLE_EQ(finish(0.5, 1, 1, 0), 2.5);
}

TEST(Score, AlibiMeasuresTheDistanceToTheDiagonalOnBothSides) {
  qkv::ScoreFinish<double> finish;
  finish.alibi_slope = 0.25;
  finish.has_alibi = true;
  EXPECT_TRUE(finish.modifies_scores());
  for (Index j = 0; j < 10; ++j) {
    const Index diag = 4;
    const double expected = 1.0 - 0.25 * static_cast<double>(j > diag ? j - diag : diag - j);
    EXPECT_DOUBLE_EQ(finish(1.0, 0, j, diag), expected) << "key " << j;
  }
  finish.alibi_slope = 0.0;  // a zero slope is still "present", and changes nothing
  EXPECT_TRUE(finish.modifies_scores());
  EXPECT_DOUBLE_EQ(finish(1.0, 0, 9, 0), 1.0);
}

}  // namespace
