// Tests of qkv/attention.hpp: every shape_error and unsupported_error the core entry point and
// merge_attention_states throw, with messages that name the argument, the axis and both sizes.
// (Values of the core entry point against a float64 brute force are in test_reference.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "qkv/attention.hpp"
#include "support/expect_shape_error.hpp"
#include "support/problem.hpp"

namespace {

using qkv::Index;
using qkv::TensorView3;
using qkv::TensorView4;
using qkv_test::expect_shape_error;
using Call = qkv_test::ValidCall;  // each test breaks one thing of a valid call
using VarlenCall = qkv_test::ValidVarlenCall;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(AttentionErrors, ValidCallDoesNotThrow) {
  Call c;
  EXPECT_NO_THROW(c.run_with_lse());
  // Every output row of this all-visible call is the mean of the (constant) values: 1.
  for (float x : c.out_elements()) EXPECT_FLOAT_EQ(x, 1.0f);
}

TEST(AttentionErrors, NegativeExtent) {
  Call c;
  c.q = TensorView4<const float>(c.q_data.data(), {c.B, c.Hq, -1, c.D});
  expect_shape_error([&] { c.run(); }, {"q axis 2 (Sq)", "negative extent -1"});
}

TEST(AttentionErrors, NegativeStride) {
  Call c;
  c.k =
      TensorView4<const float>(c.k_data.data(), {c.B, c.Hkv, c.Skv, c.D}, {c.Hkv * c.Skv * c.D, c.Skv * c.D, -c.D, 1});
  expect_shape_error([&] { c.run(); }, {"k axis 2 (Skv)", "negative stride"});
}

TEST(AttentionErrors, NullDataWithElements) {
  Call c;
  c.v = TensorView4<const float>(nullptr, {c.B, c.Hkv, c.Skv, c.Dv});
  expect_shape_error([&] { c.run(); }, {"v has 60 elements but null data"});
}

TEST(AttentionErrors, InnermostStrideNotOne) {
  Call c;
  c.q = TensorView4<const float>(c.q_data.data(), {c.B, c.Hq, c.Sq, 2}, {c.Hq * c.Sq * c.D, c.Sq * c.D, c.D, 2});
  expect_shape_error([&] { c.run(); }, {"q axis 3 (D) has stride 2, expected 1"});
}

TEST(AttentionErrors, BatchMismatch) {
  Call c;
  c.k = TensorView4<const float>(c.k_data.data(), {1, c.Hkv, c.Skv, c.D});
  expect_shape_error([&] { c.run(); }, {"k axis 0 (B) has extent 1, expected 2"});
}

TEST(AttentionErrors, HeadDimMismatch) {
  Call c;
  c.k = TensorView4<const float>(c.k_data.data(), {c.B, c.Hkv, c.Skv / 2, 2 * c.D},
                                 {c.Hkv * c.Skv * c.D, c.Skv * c.D, 2 * c.D, 1});
  expect_shape_error([&] { c.run(); }, {"k axis 3 (D) has extent 8, expected 4"});
}

TEST(AttentionErrors, ZeroHeadDim) {
  Call c;
  c.q = TensorView4<const float>(c.q_data.data(), {c.B, c.Hq, c.Sq, 0});
  c.k = TensorView4<const float>(c.k_data.data(), {c.B, c.Hkv, c.Skv, 0});
  expect_shape_error([&] { c.run(); }, {"q axis 3 (D) has extent 0"});
}

TEST(AttentionErrors, HeadsNotDivisible) {
  Call c;
  c.k = TensorView4<const float>(c.k_data.data(), {c.B, 3, 3, c.D});
  c.v = TensorView4<const float>(c.v_data.data(), {c.B, 3, 3, c.Dv});
  expect_shape_error([&] { c.run(); }, {"Hq) has extent 4", "Hkv) extent 3"});
}

TEST(AttentionErrors, NoKeyHeads) {
  Call c;
  c.k = TensorView4<const float>(c.k_data.data(), {c.B, 0, c.Skv, c.D});
  expect_shape_error([&] { c.run(); }, {"k axis 1 (Hkv) has extent 0 but q has 4 heads"});
}

TEST(AttentionErrors, ValueShapeMismatch) {
  Call c;
  c.v = TensorView4<const float>(c.v_data.data(), {c.B, c.Hkv, c.Skv - 1, c.Dv});
  expect_shape_error([&] { c.run(); }, {"v axis 2 (Skv) has extent 4, expected 5"});
  Call d;
  d.v = TensorView4<const float>(d.v_data.data(), {d.B, 1, d.Skv, d.Dv});
  expect_shape_error([&] { d.run(); }, {"v axis 1 (Hkv) has extent 1, expected 2"});
  Call e;
  e.v = TensorView4<const float>(e.v_data.data(), {1, e.Hkv, e.Skv, e.Dv});
  expect_shape_error([&] { e.run(); }, {"v axis 0 (B) has extent 1, expected 2"});
}

TEST(AttentionErrors, OutputShapeMismatch) {
  Call c;
  c.out = TensorView4<float>(c.out_data.data(), {c.B, c.Hq, c.Sq, c.Dv - 1});
  expect_shape_error([&] { c.run(); }, {"out axis 3 (Dv) has extent 2, expected 3"});
  Call d;
  d.out = TensorView4<float>(d.out_data.data(), {d.B, d.Hq, d.Sq - 1, d.Dv});
  expect_shape_error([&] { d.run(); }, {"out axis 2 (Sq) has extent 2, expected 3"});
}

TEST(AttentionErrors, OutputOverlapsItself) {
  Call c;
  c.out = TensorView4<float>(c.out_data.data(), {c.B, c.Hq, c.Sq, c.Dv}, {c.Hq * c.Sq * c.Dv, c.Sq * c.Dv, 1, 1});
  expect_shape_error([&] { c.run(); }, {"out has strides whose elements overlap"});
}

TEST(AttentionErrors, OutputOverlapsInput) {
  Call c;
  std::vector<float> shared(c.q_data.size() + c.out_data.size(), 0.0f);
  c.q = TensorView4<const float>(shared.data(), {c.B, c.Hq, c.Sq, c.D});
  c.out = TensorView4<float>(shared.data() + 5, {c.B, c.Hq, c.Sq, c.Dv});
  expect_shape_error([&] { c.run(); }, {"out overlaps an input"});
}

TEST(AttentionErrors, LseShapeAndOverlap) {
  Call c;
  c.lse = TensorView3<float>(c.lse_data.data(), {c.B, c.Hq, c.Sq + 1});
  expect_shape_error([&] { c.run_with_lse(); }, {"lse axis 2 (Sq) has extent 4, expected 3"});
  Call d;
  d.lse = TensorView3<float>(d.out_data.data(), {d.B, d.Hq, d.Sq});
  expect_shape_error([&] { d.run_with_lse(); }, {"lse overlaps out"});
}

TEST(AttentionErrors, BadScaleAndSoftcap) {
  for (float bad : {kNaN, kInf, -kInf}) {
    Call c;
    c.options.scale = bad;
    expect_shape_error([&] { c.run(); }, {"options.scale"});
  }
  for (float bad : {-1.0f, kNaN, kInf}) {
    Call c;
    c.options.softcap = bad;
    expect_shape_error([&] { c.run(); }, {"options.softcap"});
  }
}

TEST(AttentionErrors, BadWindowAndGlobalTokens) {
  Call c;
  c.options.window_left = -2;
  expect_shape_error([&] { c.run(); }, {"options.window_left is -2"});
  Call d;
  d.options.window_right = -5;
  expect_shape_error([&] { d.run(); }, {"options.window_right is -5"});
  Call e;
  e.options.global_tokens = -1;
  expect_shape_error([&] { e.run(); }, {"options.global_tokens is -1"});
}

TEST(AttentionErrors, AlibiSlopes) {
  Call c;
  c.options.alibi_slopes = {0.5f, 0.25f};
  expect_shape_error([&] { c.run(); }, {"options.alibi_slopes has 2 entries, expected 4"});
  Call d;
  d.options.alibi_slopes = {0.5f, kNaN, 0.1f, 0.1f};
  expect_shape_error([&] { d.run(); }, {"options.alibi_slopes[1]"});
}

TEST(AttentionErrors, Sinks) {
  Call c;
  c.options.sinks = {0.0f};
  expect_shape_error([&] { c.run(); }, {"options.sinks has 1 entries, expected 4"});
  for (float bad : {kNaN, kInf}) {
    Call d;
    d.options.sinks = {0.0f, 0.0f, bad, 0.0f};
    expect_shape_error([&] { d.run(); }, {"options.sinks[2]"});
  }
  Call e;  // −∞ is "no sink": valid
  e.options.sinks = {-kInf, 0.0f, 1.0f, -2.0f};
  EXPECT_NO_THROW(e.run());
}

TEST(AttentionErrors, KeyLengths) {
  Call c;
  c.options.key_lengths = {5};
  expect_shape_error([&] { c.run(); }, {"options.key_lengths has 1 entries, expected 2"});
  Call d;
  d.options.key_lengths = {5, 6};
  expect_shape_error([&] { d.run(); }, {"options.key_lengths[1] is 6", "[0, 5]"});
  Call e;
  e.options.key_lengths = {-1, 2};
  expect_shape_error([&] { e.run(); }, {"options.key_lengths[0] is -1"});
}

TEST(AttentionErrors, AllowedAndBiasShapes) {
  std::vector<char> storage(static_cast<std::size_t>(2 * 4 * 3 * 5), 1);
  const bool* allowed = reinterpret_cast<const bool*>(storage.data());
  Call c;
  c.options.allowed = TensorView4<const bool>(allowed, {2, 4, 3, 4});
  expect_shape_error([&] { c.run(); }, {"options.allowed axis 3 (Skv) has extent 4, expected 5"});
  Call d;
  d.options.allowed = TensorView4<const bool>(allowed, {2, 2, 3, 5});
  expect_shape_error([&] { d.run(); }, {"options.allowed axis 1 (Hq) has extent 2, expected 4 or 1"});
  std::vector<float> bias(static_cast<std::size_t>(2 * 4 * 3 * 5), 0.0f);
  Call e;
  e.options.bias = TensorView4<const float>(bias.data(), {3, 1, 1, 5});
  expect_shape_error([&] { e.run(); }, {"options.bias axis 0 (B) has extent 3, expected 2 or 1"});
  Call f;
  f.options.bias = TensorView4<const float>(bias.data(), {1, 1, 3, 5}, {15, 15, 10, 2});
  expect_shape_error([&] { f.run(); }, {"options.bias axis 3 (Skv) has stride 2, expected 1"});
  Call g;  // broadcast extents are valid
  g.options.bias = TensorView4<const float>(bias.data(), {1, 4, 1, 5});
  g.options.allowed = TensorView4<const bool>(allowed, {2, 1, 3, 5});
  EXPECT_NO_THROW(g.run());
}

TEST(AttentionErrors, Varlen) {
  VarlenCall ok;
  EXPECT_NO_THROW(ok.run());
  Call c;  // batch extent 2
  c.options.cu_seqlens_q = {0, 3};
  c.options.cu_seqlens_k = {0, 5};
  expect_shape_error([&] { c.run(); }, {"q axis 0 (B) has extent 2, expected 1 with cu_seqlens"});
  VarlenCall d;
  d.options.cu_seqlens_k.clear();
  expect_shape_error([&] { d.run(); }, {"options.cu_seqlens_k is empty"});
  VarlenCall e;
  e.options.cu_seqlens_q = {1, 2, 6};
  expect_shape_error([&] { e.run(); }, {"options.cu_seqlens_q[0] is 1, expected 0"});
  VarlenCall f;
  f.options.cu_seqlens_k = {0, 7, 5, 10};
  f.options.cu_seqlens_q = {0, 2, 4, 6};
  expect_shape_error([&] { f.run(); }, {"options.cu_seqlens_k decreases at 2", "= 7 >", "= 5"});
  VarlenCall g;
  g.options.cu_seqlens_q = {0, 2, 5};
  expect_shape_error([&] { g.run(); }, {"options.cu_seqlens_q ends at 5, expected 6"});
  VarlenCall h;
  h.options.cu_seqlens_q = {0, 6};
  expect_shape_error([&] { h.run(); }, {"cu_seqlens_q has 2 entries and options.cu_seqlens_k 3"});
  VarlenCall i;
  i.options.key_lengths = {3};
  expect_shape_error([&] { i.run(); }, {"key_lengths cannot be combined with cu_seqlens"});
  std::vector<float> bias(60, 0.0f);
  VarlenCall j;
  j.options.bias = TensorView4<const float>(bias.data(), {1, 1, 6, 10});
  expect_shape_error([&] { j.run(); }, {"bias cannot be combined with cu_seqlens"});
  std::vector<char> storage(60, 1);
  VarlenCall k;
  k.options.allowed = TensorView4<const bool>(reinterpret_cast<const bool*>(storage.data()), {1, 1, 6, 10});
  expect_shape_error([&] { k.run(); }, {"allowed cannot be combined with cu_seqlens"});
}

TEST(AttentionErrors, FusedBackendExistsForFloatOnly) {
  Call c;
  c.options.backend = qkv::Backend::fused;
  EXPECT_NO_THROW(c.run());
  for (float x : c.out_elements()) EXPECT_FLOAT_EQ(x, 1.0f);
  // double has no fused kernel: an explicit request throws; automatic and reference run the reference path.
  std::vector<double> q(2 * 4 * 3 * 4, 0.5), k(2 * 2 * 5 * 4, 0.25), v(2 * 2 * 5 * 3, 1.0), out(2 * 4 * 3 * 3, 0.0);
  qkv::AttentionOptions<double> o;
  o.backend = qkv::Backend::fused;
  auto run = [&] {
    qkv::attention(TensorView4<const double>(q.data(), {2, 4, 3, 4}), TensorView4<const double>(k.data(), {2, 2, 5, 4}),
                   TensorView4<const double>(v.data(), {2, 2, 5, 3}), TensorView4<double>(out.data(), {2, 4, 3, 3}), o);
  };
  EXPECT_THROW(run(), qkv::unsupported_error);
  o.backend = qkv::Backend::automatic;
  EXPECT_NO_THROW(run());
  EXPECT_DOUBLE_EQ(out[0], 1.0);
}

// Found by fuzz/fuzz_attention.cpp: a varlen call with Dv = 0 on the reference backend offset out's null data
// pointer to the second sequence's rows (undefined behaviour, reported by the sanitize preset). It must only
// write the lse.
TEST(AttentionEdgeCases, VarlenWithEmptyValueDimension) {
  std::vector<float> q(5 * 2, 0.5f), k(4 * 2, 0.25f), lse(5, 7.0f);
  for (const qkv::Backend backend : {qkv::Backend::reference, qkv::Backend::fused}) {
    qkv::AttentionOptions<float> options;
    options.backend = backend;
    options.cu_seqlens_q = {0, 2, 5};
    options.cu_seqlens_k = {0, 3, 4};
    EXPECT_NO_THROW(qkv::attention(
        TensorView4<const float>(q.data(), {1, 1, 5, 2}), TensorView4<const float>(k.data(), {1, 1, 4, 2}),
        TensorView4<const float>(nullptr, {1, 1, 4, 0}), TensorView4<float>(nullptr, {1, 1, 5, 0}),
        TensorView3<float>(lse.data(), {1, 1, 5}), options));
    // Equal scores s = 2·0.125/√2 over 3 keys, then over 1 key.
    const float s = 0.25f / std::sqrt(2.0f);
    for (int i = 0; i < 2; ++i) EXPECT_NEAR(lse[static_cast<std::size_t>(i)], s + std::log(3.0f), 1e-6f);
    for (int i = 2; i < 5; ++i) EXPECT_NEAR(lse[static_cast<std::size_t>(i)], s, 1e-6f);
  }
}

TEST(AttentionErrors, NothingWrittenWhenThrowing) {
  Call c;
  std::fill(c.out_data.begin(), c.out_data.end(), 7.0f);
  c.options.window_left = -3;
  EXPECT_THROW(c.run(), qkv::shape_error);
  for (float x : c.out_data) EXPECT_EQ(x, 7.0f);
}

// merge_attention_states ------------------------------------------------------------------------------------

struct MergeCall {
  std::vector<float> a_out, b_out, out, a_lse, b_lse, lse;
  MergeCall() : a_out(24, 1.0f), b_out(24, 2.0f), out(24, 0.0f), a_lse(8, 0.0f), b_lse(8, 0.0f), lse(8, 0.0f) {}
  TensorView4<float> view4(std::vector<float>& x) { return TensorView4<float>(x.data(), {1, 2, 4, 3}); }
  TensorView3<float> view3(std::vector<float>& x) { return TensorView3<float>(x.data(), {1, 2, 4}); }
};

TEST(MergeAttentionStates, EqualLseAveragesAndAddsLog2) {
  MergeCall m;
  qkv::merge_attention_states(m.view4(m.a_out), m.view3(m.a_lse), m.view4(m.b_out), m.view3(m.b_lse), m.view4(m.out),
                              m.view3(m.lse));
  for (float x : m.out) EXPECT_FLOAT_EQ(x, 1.5f);
  for (float x : m.lse) EXPECT_FLOAT_EQ(x, std::log(2.0f));
}

TEST(MergeAttentionStates, Errors) {
  MergeCall m;
  expect_shape_error(
      [&] {
        qkv::merge_attention_states(m.view4(m.a_out), m.view3(m.a_lse),
                                    TensorView4<float>(m.b_out.data(), {1, 2, 4, 2}), m.view3(m.b_lse), m.view4(m.out),
                                    m.view3(m.lse));
      },
      {"out_b axis 3 (Dv) has extent 2, expected 3"});
  expect_shape_error(
      [&] {
        qkv::merge_attention_states(m.view4(m.a_out), m.view3(m.a_lse), m.view4(m.b_out), m.view3(m.b_lse),
                                    m.view4(m.out), TensorView3<float>(m.lse.data(), {1, 2, 3}));
      },
      {"lse axis 2 (S) has extent 3, expected 4"});
  expect_shape_error(
      [&] {
        qkv::merge_attention_states(m.view4(m.a_out), m.view3(m.a_lse), m.view4(m.b_out), m.view3(m.b_lse),
                                    TensorView4<float>(m.a_out.data() + 1, {1, 2, 4, 3}), m.view3(m.lse));
      },
      {"out overlaps out_a without being the same view"});
  expect_shape_error(
      [&] {
        qkv::merge_attention_states(m.view4(m.a_out), m.view3(m.a_lse), m.view4(m.b_out), m.view3(m.b_lse),
                                    m.view4(m.b_out), m.view3(m.lse));
      },
      {"out overlaps out_b"});
}

}  // namespace
