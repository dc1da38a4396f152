// Tests of qkv/mask.hpp: the index rules of one sequence (causal in both alignments, sliding window, global
// tokens, key padding), the tile classification and key ranges a tiled kernel relies on, and HeadMask's
// visibility and score (the scale's default: test_score.cpp). Expected values come from the rule as docs/design.md
// states it, written out in the test, and from the worked tables in the header docs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qkv/mask.hpp"

namespace {

using qkv::Index;
using qkv::MaskGeometry;
using qkv::TileVisibility;

/// docs/design.md, "Semantics every path shares", literally: key j is hidden for query i if j ≥ Skv_b, or causal and
/// j > diag(i), or (j ≥ global_tokens and (j < diag(i) − window_left or j > diag(i) + window_right)).
bool expected_visible(const MaskGeometry& g, Index i, Index j) {
  const Index diag = i + g.diag_offset;
  if (j >= g.skv) return false;
  if (g.causal && j > diag) return false;
  const bool outside_left = g.window_left >= 0 && j < diag - g.window_left;
  const bool outside_right = g.window_right >= 0 && j > diag + g.window_right;
  if (j >= g.global_tokens && (outside_left || outside_right)) return false;
  return true;
}

std::string table(const MaskGeometry& g) {
  std::string s;
  for (Index i = 0; i < g.sq; ++i) {
    for (Index j = 0; j < g.skv; ++j) s += g.visible(i, j) ? '1' : '0';
    s += '\n';
  }
  return s;
}

MaskGeometry make(Index sq, Index skv, bool causal, qkv::CausalAlignment alignment, Index left = -1, Index right = -1,
                  Index global = 0) {
  qkv::AttentionOptions<float> o;
  o.causal = causal;
  o.alignment = alignment;
  o.window_left = left;
  o.window_right = right;
  o.global_tokens = global;
  return MaskGeometry::make(sq, skv, o);
}

TEST(MaskGeometry, CausalAlignmentTablesFromTheDocs) {
  // The tables in CausalAlignment's doc comment: Sq = 2, Skv = 4.
  EXPECT_EQ(table(make(2, 4, true, qkv::CausalAlignment::bottom_right)), "1110\n1111\n");
  EXPECT_EQ(table(make(2, 4, true, qkv::CausalAlignment::top_left)), "1000\n1100\n");
  // Sq > Skv, bottom-right: the first Sq − Skv queries see nothing.
  EXPECT_EQ(table(make(4, 2, true, qkv::CausalAlignment::bottom_right)), "00\n00\n10\n11\n");
  EXPECT_EQ(table(make(4, 2, true, qkv::CausalAlignment::top_left)), "10\n11\n11\n11\n");
  // The two alignments agree when Sq = Skv.
  EXPECT_EQ(table(make(3, 3, true, qkv::CausalAlignment::bottom_right)),
            table(make(3, 3, true, qkv::CausalAlignment::top_left)));
}

TEST(MaskGeometry, WindowWithGlobalTokenTableFromTheDocs) {
  // AttentionOptions' doc example: Sq = Skv = 5, causal, window_left = 1, global_tokens = 1.
  EXPECT_EQ(table(make(5, 5, true, qkv::CausalAlignment::bottom_right, 1, -1, 1)),
            "10000\n11000\n11100\n10110\n10011\n");
  // A symmetric window without causal: |i − j| ≤ 1.
  EXPECT_EQ(table(make(4, 4, false, qkv::CausalAlignment::top_left, 1, 1)), "1100\n1110\n0111\n0011\n");
}

struct RandomGeometry : ::testing::TestWithParam<int> {};

TEST_P(RandomGeometry, VisibleBandGlobalKeyRangeAndClassifyAgreeWithTheRule) {
  std::mt19937 rng(static_cast<unsigned>(GetParam()));
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 40; ++trial) {
    const Index sq = pick(0, 13), skv = pick(0, 13);
    const MaskGeometry g = make(sq, pick(0, skv), pick(0, 1) == 1,
                                pick(0, 1) ? qkv::CausalAlignment::bottom_right : qkv::CausalAlignment::top_left,
                                pick(-1, 4), pick(-1, 4), pick(0, 3));
    const std::string context = "sq " + std::to_string(g.sq) + " skv " + std::to_string(g.skv) + " causal " +
                                std::to_string(g.causal) + " offset " + std::to_string(g.diag_offset) + " window " +
                                std::to_string(g.window_left) + "," + std::to_string(g.window_right) + " global " +
                                std::to_string(g.global_tokens);
    for (Index i = 0; i < sq; ++i) {
      const auto band = g.band(i), global = g.global(i);
      for (Index j = -1; j <= skv + 1; ++j) {
        const bool expected = j >= 0 && expected_visible(g, i, j);
        ASSERT_EQ(g.visible(i, j), expected) << context << " i " << i << " j " << j;
        const bool in_union = (j >= band.begin && j < band.end) || (j >= global.begin && j < global.end);
        ASSERT_EQ(in_union, expected) << context << " i " << i << " j " << j;
      }
    }
    // Every tile, classified, against the element rule; key_range holds every visible key of a query range.
    for (Index i0 = 0; i0 < sq; ++i0) {
      for (Index i1 = i0 + 1; i1 <= sq; ++i1) {
        const auto range = g.key_range(i0, i1);
        for (Index i = i0; i < i1; ++i) {
          for (Index j = 0; j < skv; ++j) {
            if (g.visible(i, j)) {
              ASSERT_TRUE(j >= range.begin && j < range.end) << context << " rows " << i0 << ".." << i1 << " key " << j;
            }
          }
        }
        for (Index j0 = 0; j0 < skv + 2; ++j0) {
          for (Index j1 = j0 + 1; j1 <= skv + 2; j1 += 2) {
            int seen = 0, total = 0;
            for (Index i = i0; i < i1; ++i) {
              for (Index j = j0; j < j1; ++j, ++total) seen += g.visible(i, j) ? 1 : 0;
            }
            const TileVisibility expected =
                seen == 0 ? TileVisibility::hidden : (seen == total ? TileVisibility::full : TileVisibility::partial);
            ASSERT_EQ(g.classify(i0, i1, j0, j1), expected)
                << context << " tile rows " << i0 << ".." << i1 << " keys " << j0 << ".." << j1;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, RandomGeometry, ::testing::Range(1, 9));

TEST(HeadMask, AllowedBroadcastBiasAndScore) {
  // allowed [1, 2, 1, 3]: per head, broadcast over queries. bias [1, 1, 2, 3]: per query, broadcast over heads.
  const bool allowed[] = {true, false, true, false, true, true};
  const float bias[] = {0.5f, -std::numeric_limits<float>::infinity(), 1.0f, 0.0f, 2.0f, -1.0f};
  qkv::AttentionOptions<float> o;
  o.allowed = qkv::TensorView4<const bool>(allowed, {1, 2, 1, 3});
  o.bias = qkv::TensorView4<const float>(bias, {1, 1, 2, 3});
  o.alibi_slopes = {0.5f, 0.25f};
  o.scale = 2.0f;
  const auto head1 = qkv::HeadMask<float>::make(qkv::MaskRules<float>::of(o, 4), 0, 1, 2, 3);
  EXPECT_FALSE(head1.visible(0, 0));  // allowed false for head 1, key 0
  EXPECT_FALSE(head1.visible(0, 1));  // bias −∞ hides whatever allowed says
  EXPECT_TRUE(head1.visible(0, 2));
  EXPECT_TRUE(head1.visible(1, 1));
  const auto head0 = qkv::HeadMask<float>::make(qkv::MaskRules<float>::of(o, 4), 0, 0, 2, 3);
  EXPECT_FALSE(head0.visible(1, 1));  // allowed false for head 0, key 1
  // Score: dot·scale + bias − slope·|diag(i) − j|, diag(i) = i + (3 − 2).
  EXPECT_DOUBLE_EQ(head1.score(3.0, 1, 0), 3.0 * 2.0 + 0.0 - 0.25 * 2.0);
  EXPECT_DOUBLE_EQ(head0.score(-1.0, 0, 2), -2.0 + 1.0 - 0.5 * 1.0);
  // Softcap applies to the scaled dot product, before the bias.
  o.softcap = 5.0f;
  const auto capped = qkv::HeadMask<float>::make(qkv::MaskRules<float>::of(o, 4), 0, 0, 2, 3);
  EXPECT_NEAR(capped.score(10.0, 0, 0), 5.0 * std::tanh(20.0 / 5.0) + 0.5 - 0.5 * 1.0, 1e-12);
}

}  // namespace
