// Tests of the shared test helpers in tests/support/ (and brute_force.hpp's rules they use): what the other suites
// rely on them for.
//   - options.hpp: to_brute and from_brute copy every field of AttentionOptions (a value of every field survives the
//     round trip; a field added to AttentionOptions breaks the converter's build, see its structured bindings);
//   - plain_float.hpp: visibility follows the worked examples of options.hpp (causal alignment, window with a global
//     key), and every option gives the brute force's values within float rounding, in each of the four orders;
//   - expect_shape_error.hpp: fails on a call that does not throw and on a message without a part.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "support/expect_shape_error.hpp"
#include "support/options.hpp"
#include "support/plain_float.hpp"
#include "support/problem.hpp"

namespace {

using qkv::Index;
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- options.hpp ---------------------------------------------------------------------------------------------------

/// A mask view as comparable values: unset, or its extents and its elements in double.
template <class E>
std::optional<std::pair<std::array<Index, 4>, std::vector<double>>> mask_values(const qkv::TensorView4<E>& view) {
  if (!qkv_test::is_set(view)) return std::nullopt;
  return std::make_pair(view.extents(), qkv_test::dense_copy<double>(view).data);
}

/// Every field of `o`, the backend too, as a tuple of comparable values (in double). A structured binding, as in the
/// converter: a field added to AttentionOptions stops the build here until it is compared.
template <class T>
auto fields(const qkv::AttentionOptions<T>& o) {
  const auto& [scale, softcap, causal, alignment, window_left, window_right, global_tokens, key_lengths, allowed, bias,
               alibi_slopes, sinks, global_positions, cu_seqlens_q, cu_seqlens_k, dropout_p, dropout_seed,
               dropout_offset, backend, allowed_storage, bias_storage] = o;
  const auto positions =
      global_positions ? std::optional<std::array<Index, 4>>({global_positions->q_begin, global_positions->k_begin,
                                                              global_positions->sq, global_positions->skv})
                       : std::nullopt;
  // The storage fields are not values of the call: they keep `allowed` and `bias` alive, whose values are compared.
  // Whether they are set is part of the tuple (from_brute leaves them null: its storage is OwnedOptions').
  return std::make_tuple(scale ? std::optional<double>(*scale) : std::nullopt, static_cast<double>(softcap), causal,
                         alignment, window_left, window_right, global_tokens, key_lengths, mask_values(allowed),
                         mask_values(bias), std::vector<double>(alibi_slopes.begin(), alibi_slopes.end()),
                         std::vector<double>(sinks.begin(), sinks.end()), positions, cu_seqlens_q, cu_seqlens_k,
                         static_cast<double>(dropout_p), dropout_seed, dropout_offset, backend,
                         allowed_storage != nullptr, bias_storage != nullptr);
}

TEST(Options, EveryFieldSurvivesToBruteAndBack) {
  // A value other than the default in every field (not a valid call: the converter does not validate), but dropout,
  // which brute::Params does not carry (to_brute rejects it; its defaults round-trip). The masks are strided views
  // with broadcast axes, to check the dense copies.
  const bool allowed_data[] = {true, false, true, true, false, false, true, false, true, true, true, false};
  std::vector<float> bias_data(40);
  for (std::size_t n = 0; n < bias_data.size(); ++n) bias_data[n] = n % 7 == 3 ? -kInf : 0.25f * float(n) - 3.0f;
  qkv::AttentionOptions<float> o;
  o.scale = 0.37f;
  o.softcap = 5.5f;
  o.causal = true;
  o.alignment = qkv::CausalAlignment::top_left;
  o.window_left = 3;
  o.window_right = 2;
  o.global_tokens = 1;
  o.key_lengths = {4, 2};
  o.allowed = qkv::TensorView4<const bool>(allowed_data, {2, 1, 1, 5}, {6, 1 << 20, 1 << 20, 1});
  o.bias = qkv::TensorView4<const float>(bias_data.data(), {1, 2, 3, 5}, {0, 20, 6, 1});
  o.alibi_slopes = {0.5f, 0.25f};
  o.sinks = {1.5f, -kInf};
  o.global_positions = qkv::GlobalPositions{7, 2, 11, 9};
  o.cu_seqlens_q = {0, 1, 3};
  o.cu_seqlens_k = {0, 2, 5};
  o.backend = qkv::Backend::fused;

  const brute::Params p = qkv_test::to_brute(o, {2, 2, 1, 3, 5, 4, 6});
  EXPECT_EQ(fields(qkv_test::from_brute<float>(p, o.backend).options), fields(o)) << "back to float";
  EXPECT_EQ(fields(qkv_test::from_brute<double>(p, o.backend).options), fields(o)) << "to double";
  EXPECT_EQ(qkv_test::from_brute<float>(p).options.backend, qkv::Backend::automatic);  // not part of brute::Params
  // brute::Params itself: the shape, and what the brute force reads of the strided masks and the alignment.
  EXPECT_EQ(std::make_tuple(p.B, p.Hq, p.Hkv, p.Sq, p.Skv, p.D, p.Dv), std::make_tuple(2L, 2L, 1L, 3L, 5L, 4L, 6L));
  EXPECT_EQ(p.allowed->data, (std::vector<char>{1, 0, 1, 1, 0, 1, 0, 1, 1, 1}));
  EXPECT_EQ(p.bias->at(0, 1, 2, 4), double(bias_data[20 + 2 * 6 + 4]));
  EXPECT_EQ(p.alignment, brute::Alignment::top_left);

  // Moving owned options keeps their views valid (they point into the moved storage).
  qkv_test::OwnedOptions<double> moved = qkv_test::from_brute<double>(p, o.backend);
  const qkv_test::OwnedOptions<double> target = std::move(moved);
  EXPECT_EQ(fields(target.options), fields(o));
}

TEST(Options, OwnedMasksConvertByValueAndComeBackAsViews) {
  // Options that own their mask and bias (set_allowed / set_bias) convert as views do: the values are copied into
  // brute::Params, and from_brute gives views into OwnedOptions' storage with null storage fields.
  std::vector<float> bias_data(12);
  for (std::size_t n = 0; n < bias_data.size(); ++n) bias_data[n] = 0.5f * float(n) - 2.0f;
  qkv::Matrix<bool> mask(3, 4);
  mask << true, false, true, true, false, true, true, false, true, true, false, true;
  qkv::AttentionOptions<float> o;
  o.set_allowed(mask).set_bias(Eigen::Map<const qkv::Matrix<float>>(bias_data.data(), 3, 4));
  o.causal = true;
  qkv::AttentionOptions<float> as_views = o;
  as_views.allowed_storage = nullptr;
  as_views.bias_storage = nullptr;
  const brute::Params p = qkv_test::to_brute(o, {1, 1, 1, 3, 4, 2, 2});
  EXPECT_EQ(p.allowed->data, (std::vector<char>{1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1}));
  EXPECT_EQ(p.bias->at(0, 0, 2, 3), double(bias_data[11]));
  EXPECT_EQ(fields(qkv_test::from_brute<float>(p).options), fields(as_views));
  EXPECT_NE(fields(as_views), fields(o));  // the storage fields are in the tuple
}

TEST(Options, DefaultsStayDefaultsAndEmptyMasksStaySet) {
  const qkv::AttentionOptions<float> defaults;
  const brute::Params p = qkv_test::to_brute(defaults, {1, 1, 1, 2, 3, 4, 4});
  EXPECT_EQ(fields(qkv_test::from_brute<float>(p).options), fields(defaults));
  // A bias with a zero extent and no data is still set (the library rejects it with varlen), and stays set.
  qkv::AttentionOptions<float> empty_bias;
  empty_bias.bias = qkv::TensorView4<const float>(nullptr, {1, 2, 0, 3});
  const brute::Params q = qkv_test::to_brute(empty_bias, {1, 2, 2, 0, 3, 4, 4});
  ASSERT_TRUE(q.bias.has_value());
  EXPECT_EQ(fields(qkv_test::from_brute<float>(q).options), fields(empty_bias));
}

// ---- plain_float.hpp -----------------------------------------------------------------------------------------------

/// Which keys each query sees under `o` (one sequence, one head, Sq × Skv, 1 = visible), read from plain_float's
/// output: q = 0 makes every visible score 0 and v = the identity makes output column j the weight of key j.
std::vector<std::string> plain_float_visibility(const qkv::AttentionOptions<float>& o, Index Sq, Index Skv) {
  const std::vector<float> q(static_cast<std::size_t>(Sq), 0.0f), k(static_cast<std::size_t>(Skv), 1.0f);
  std::vector<float> v(static_cast<std::size_t>(Skv * Skv), 0.0f), out(static_cast<std::size_t>(Sq * Skv), -1.0f);
  for (Index j = 0; j < Skv; ++j) v[static_cast<std::size_t>(j * Skv + j)] = 1.0f;
  qkv_test::plain_float(qkv::view_bhsd(q.data(), 1, 1, Sq, 1), qkv::view_bhsd(k.data(), 1, 1, Skv, 1),
                        qkv::view_bhsd(v.data(), 1, 1, Skv, Skv), qkv_test::to_brute(o, {1, 1, 1, Sq, Skv, 1, Skv}),
                        qkv::view_bhsd(out.data(), 1, 1, Sq, Skv), {});
  std::vector<std::string> rows;
  for (Index i = 0; i < Sq; ++i) {
    std::string row;
    for (Index j = 0; j < Skv; ++j) row += out[static_cast<std::size_t>(i * Skv + j)] > 0 ? '1' : '0';
    rows.push_back(row);
  }
  return rows;
}

TEST(PlainFloat, VisibilityFollowsTheWorkedExamplesOfOptionsHpp) {
  qkv::AttentionOptions<float> o;
  o.causal = true;  // CausalAlignment's example: Sq = 2, Skv = 4
  EXPECT_EQ(plain_float_visibility(o, 2, 4), (std::vector<std::string>{"1110", "1111"}));
  o.alignment = qkv::CausalAlignment::top_left;
  EXPECT_EQ(plain_float_visibility(o, 2, 4), (std::vector<std::string>{"1000", "1100"}));
  qkv::AttentionOptions<float> w;  // AttentionOptions' example: Sq = Skv = 5, causal, window_left 1, one global key
  w.causal = true;
  w.window_left = 1;
  w.global_tokens = 1;
  EXPECT_EQ(plain_float_visibility(w, 5, 5), (std::vector<std::string>{"10000", "11000", "11100", "10110", "10011"}));
  w.key_lengths = {3};  // key padding: keys 3 and 4 hidden, and the diagonal moves with Skv_b = 3
  EXPECT_EQ(plain_float_visibility(w, 5, 5), (std::vector<std::string>{"00000", "00000", "10000", "11000", "11100"}));
}

TEST(PlainFloat, EveryOptionMatchesTheBruteForceInEveryOrder) {
  // Float inputs (the brute force on the same values in double): the two differ by float rounding only.
  std::mt19937_64 rng(5);
  for (int variant = 0; variant < 6; ++variant) {
    const bool varlen = variant == 5;  // sequences of 4, 0 and 5 queries over 6, 3 and 4 keys
    qkv_test::Problem pr = qkv_test::make_problem({varlen ? 1 : 2, 4, 2, 9, 13, 8, 5}, 100 + variant);
    brute::Params& p = pr.p;
    p.causal = variant % 2 == 0;
    p.alignment = variant % 3 == 0 ? brute::Alignment::top_left : brute::Alignment::bottom_right;
    p.window_left = variant < 3 ? 4 : -1;
    p.window_right = variant == 1 ? 2 : -1;
    p.global_tokens = variant % 3;
    if (variant == 2) p.scale = 0.75;
    p.softcap = variant == 3 ? 2.5 : 0.0;
    p.alibi_slopes = {0.5, 0.25, 0.125, 0.0625};
    p.sinks = {0.5, -1.0, 2.0, -std::numeric_limits<double>::infinity()};
    if (varlen) {
      p.cu_seqlens_q = {0, 4, 4, 9};
      p.cu_seqlens_k = {0, 6, 9, 13};
    } else {
      p.key_lengths = {13, 7};
      brute::Broadcast4<char> allowed{{2, 1, 9, 13}, std::vector<char>(2 * 9 * 13)};
      for (char& a : allowed.data) a = std::bernoulli_distribution(0.8)(rng) ? 1 : 0;
      brute::Broadcast4<double> bias{{1, 4, 1, 13}, qkv_test::random_normal(4 * 13, rng)};
      bias.data[3] = -std::numeric_limits<double>::infinity();
      p.allowed = allowed;
      p.bias = bias;
    }
    pr = qkv_test::rounded<float>(pr);
    const brute::Result want = brute::attention(pr.q, pr.k, pr.v, pr.p);
    const qkv_test::Inputs<float> in(pr, qkv::Backend::automatic);
    for (int order = 0; order < 4; ++order) {
      SCOPED_TRACE("variant " + std::to_string(variant) + ", order " + std::to_string(order));
      std::vector<float> out(want.out.size(), -7.0f), lse(want.lse.size(), -7.0f);
      qkv_test::plain_float(
          in.q_view(), in.k_view(), in.v_view(), pr.p, qkv::view_bhsd(out.data(), pr.p.B, pr.p.Hq, pr.p.Sq, pr.p.Dv),
          qkv::TensorView3<float>(lse.data(), {pr.p.B, pr.p.Hq, pr.p.Sq}), {(order & 1) != 0, (order & 2) != 0});
      for (std::size_t n = 0; n < out.size(); ++n) EXPECT_NEAR(out[n], want.out[n], 1e-5) << "out " << n;
      for (std::size_t n = 0; n < lse.size(); ++n) {
        if (std::isinf(want.lse[n])) {
          EXPECT_EQ(lse[n], want.lse[n]) << "lse " << n;
        } else {
          EXPECT_NEAR(lse[n], want.lse[n], 1e-5 * std::max(1.0, std::abs(want.lse[n]))) << "lse " << n;
        }
      }
    }
  }
}

// ---- expect_shape_error.hpp ----------------------------------------------------------------------------------------

TEST(ExpectShapeError, FailsWithoutTheErrorOrWithoutAPart) {
  qkv_test::ValidCall c;
  c.options.window_left = -2;
  qkv_test::expect_shape_error([&] { c.run(); }, {"options.window_left is -2"});
  EXPECT_NONFATAL_FAILURE(qkv_test::expect_shape_error([] {}, {}), "expected qkv::shape_error");
  qkv_test::ValidCall d;
  d.options.window_left = -2;
  EXPECT_NONFATAL_FAILURE(qkv_test::expect_shape_error([&] { d.run(); }, {"window_right"}), "'window_right' not in");
}

}  // namespace
