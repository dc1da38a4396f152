// Tests of the owning forms of AttentionOptions' `allowed` and `bias` (qkv/options.hpp: `allowed_storage`,
// `bias_storage`, `set_allowed`, `set_bias`): options built in a helper function from local data and returned run
// attention correctly, against the float64 brute force fed from the helper's rules (not from the options); copies
// share the storage and keep it alive after the original is gone. Under the sanitize preset (ASan + UBSan) a view
// left dangling would be a heap-use-after-free here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "qkv/positional.hpp"
#include "support/plain_float.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

namespace {

using qkv::Index;
using Extents = qkv::TensorView4<const float>::Extents;  // std::array<Index, 4>, the same for every element type

// The call: GQA (Hq = 4 over Hkv = 2), B = 2, odd lengths; masks of [1, 1, Sq, Skv] broadcast over b and h.
constexpr long kB = 2, kHq = 4, kHkv = 2, kSq = 5, kSkv = 17, kD = 8, kDv = 3;
constexpr float kScale = 0.4f;

// The helper's rules, written once and read by both the helper (into qkv types) and the expected value (into
// brute::Params): query i may see key j unless (i + 2j) mod 5 = 1; the bias is 0.1·(i − j), −∞ at (i, j) = (1, 3).
bool rule_allowed(long i, long j) { return (i + 2 * j) % 5 != 1; }
double rule_bias(long i, long j) {
  return i == 1 && j == 3 ? -std::numeric_limits<double>::infinity() : 0.1 * static_cast<double>(i - j);
}

/// Options built from data local to this function and returned: a column-major mask (copied into the options'
/// row-major storage) and a row-major bias moved in. With views (`options.allowed = mask`) this would dangle.
template <class T>
qkv::AttentionOptions<T> options_from_locals(qkv::Backend backend) {
  Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> mask(kSq, kSkv);  // column-major: a view could not bind it
  qkv::Matrix<T> bias(kSq, kSkv);
  for (long i = 0; i < kSq; ++i)
    for (long j = 0; j < kSkv; ++j) {
      mask(i, j) = rule_allowed(i, j);
      bias(i, j) = static_cast<T>(rule_bias(i, j));
    }
  qkv::AttentionOptions<T> options;
  options.scale = static_cast<T>(kScale);
  options.backend = backend;
  options.set_allowed(mask).set_bias(std::move(bias));
  return options;  // mask and bias die here; the options own copies of both
}

/// The problem with the helper's rules as brute::Params (in double, the bias rounded to T), inputs rounded to T.
template <class T>
qkv_test::Problem expected_problem(std::uint64_t seed) {
  qkv_test::Problem pr = qkv_test::make_problem({kB, kHq, kHkv, kSq, kSkv, kD, kDv}, seed);
  brute::Broadcast4<char> allowed{{1, 1, kSq, kSkv}, {}};
  brute::Broadcast4<double> bias{{1, 1, kSq, kSkv}, {}};
  for (long i = 0; i < kSq; ++i)
    for (long j = 0; j < kSkv; ++j) {
      allowed.data.push_back(rule_allowed(i, j) ? 1 : 0);
      bias.data.push_back(rule_bias(i, j));
    }
  pr.p.allowed = allowed;
  pr.p.bias = bias;
  pr.p.scale = static_cast<double>(kScale);
  return qkv_test::rounded<T>(pr);
}

/// Runs qkv::attention on the problem's inputs in T with `options`; the output in double.
template <class T>
std::vector<double> run(const qkv_test::Problem& pr, const qkv::AttentionOptions<T>& options) {
  const brute::Params& p = pr.p;
  const std::vector<T> q(pr.q.begin(), pr.q.end()), k(pr.k.begin(), pr.k.end()), v(pr.v.begin(), pr.v.end());
  std::vector<T> out(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Dv), std::numeric_limits<T>::quiet_NaN());
  qkv::attention(qkv::view_bhsd(q.data(), p.B, p.Hq, p.Sq, p.D), qkv::view_bhsd(k.data(), p.B, p.Hkv, p.Skv, p.D),
                 qkv::view_bhsd(v.data(), p.B, p.Hkv, p.Skv, p.Dv), qkv::view_bhsd(out.data(), p.B, p.Hq, p.Sq, p.Dv),
                 options);
  return {out.begin(), out.end()};
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (std::size_t n = 0; n < std::min(a.size(), b.size()); ++n) {
    const double d = std::abs(a[n] - b[n]);
    m = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(m, d);
  }
  return m;
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double value : x) m = std::max(m, std::abs(value));
  return m;
}

/// docs/design.md's accuracy rule for `backend` in T: the reference path within kEps·max(1, max|V|) (1e-6 in float,
/// 1e-12 in double); the fused float path within 2 × the plain float implementation's error + 1e-6·max(1, max|V|).
template <class T>
double tolerance(const qkv_test::Problem& pr, const std::vector<double>& want, qkv::Backend backend) {
  const double floor = std::max(1.0, max_abs(pr.v));
  if constexpr (std::is_same_v<T, double>) {
    return 1e-12 * floor;
  } else {
    if (backend == qkv::Backend::reference) return 1e-6 * floor;
    const brute::Params& p = pr.p;
    const std::vector<float> q(pr.q.begin(), pr.q.end()), k(pr.k.begin(), pr.k.end()), v(pr.v.begin(), pr.v.end());
    std::vector<float> plain(want.size());
    qkv_test::plain_float(
        qkv::view_bhsd(q.data(), p.B, p.Hq, p.Sq, p.D), qkv::view_bhsd(k.data(), p.B, p.Hkv, p.Skv, p.D),
        qkv::view_bhsd(v.data(), p.B, p.Hkv, p.Skv, p.Dv), p, qkv::view_bhsd(plain.data(), p.B, p.Hq, p.Sq, p.Dv), {});
    return 2 * max_abs_difference({plain.begin(), plain.end()}, want) + 1e-6 * floor;
  }
}

/// The backends a type runs: automatic (fused in float, reference in double) and reference.
std::vector<qkv::Backend> backends() { return {qkv::Backend::automatic, qkv::Backend::reference}; }

template <class T>
class MaskOwnership : public ::testing::Test {};
TYPED_TEST_SUITE(MaskOwnership, qkv_test::Scalars, );

TYPED_TEST(MaskOwnership, OptionsReturnedFromAHelperRunCorrectly) {
  using T = TypeParam;
  const qkv_test::Problem pr = expected_problem<T>(11);
  const std::vector<double> want = brute::attention(pr.q, pr.k, pr.v, pr.p).out;
  for (qkv::Backend backend : backends()) {
    const qkv::AttentionOptions<T> options = options_from_locals<T>(backend);
    ASSERT_NE(options.allowed_storage, nullptr);
    ASSERT_NE(options.bias_storage, nullptr);
    EXPECT_EQ(options.allowed.extents(), (Extents{1, 1, kSq, kSkv}));
    EXPECT_EQ(options.bias.extents(), (Extents{1, 1, kSq, kSkv}));
    const std::vector<double> got = run<T>(pr, options);
    EXPECT_LE(max_abs_difference(got, want), tolerance<T>(pr, want, backend)) << "backend " << int(backend);
  }
  // The mask and the bias matter: without them the output differs by far more than the tolerance.
  qkv_test::Problem bare = pr;
  bare.p.allowed.reset();
  bare.p.bias.reset();
  EXPECT_GT(max_abs_difference(brute::attention(bare.q, bare.k, bare.v, bare.p).out, want), 1e-2);
}

TYPED_TEST(MaskOwnership, CopiesShareTheStorageAndKeepItAlive) {
  using T = TypeParam;
  const qkv_test::Problem pr = expected_problem<T>(12);
  const std::vector<double> want = brute::attention(pr.q, pr.k, pr.v, pr.p).out;
  std::vector<qkv::AttentionOptions<T>> kept;
  {
    auto original = std::make_unique<qkv::AttentionOptions<T>>(options_from_locals<T>(qkv::Backend::automatic));
    kept.push_back(*original);  // a copy: shares the mask and the bias, copies no element
    EXPECT_EQ(kept[0].allowed.data(), original->allowed.data());
    EXPECT_EQ(kept[0].bias.data(), original->bias.data());
    EXPECT_EQ(original->allowed_storage.use_count(), 2);
    EXPECT_EQ(original->bias_storage.use_count(), 2);
    original.reset();  // the original options are gone
  }
  EXPECT_EQ(kept[0].allowed_storage.use_count(), 1);
  EXPECT_EQ(kept[0].bias_storage.use_count(), 1);
  kept.resize(8, kept[0]);  // more copies, and the vector reallocates: every view stays valid
  kept.erase(kept.begin());
  for (const qkv::AttentionOptions<T>& options : kept) {
    EXPECT_LE(max_abs_difference(run<T>(pr, options), want), tolerance<T>(pr, want, qkv::Backend::automatic));
  }
  // Moving leaves the source empty of storage; the target keeps the views and the storage.
  qkv::AttentionOptions<T> moved = std::move(kept.back());
  kept.pop_back();
  EXPECT_EQ(moved.allowed_storage.use_count(), static_cast<long>(kept.size()) + 1);
  EXPECT_LE(max_abs_difference(run<T>(pr, moved), want), tolerance<T>(pr, want, qkv::Backend::automatic));
}

TYPED_TEST(MaskOwnership, FourDimensionalViewsWithTheirStorage) {
  using T = TypeParam;
  // A per-batch key-padding mask [B, 1, 1, Skv] in a shared bool array and a per-head bias [1, Hq, Sq, Skv] in a
  // shared std::vector, both built and attached inside a lambda that returns the options.
  const auto make = [] {
    std::shared_ptr<bool[]> padding(new bool[kB * kSkv]);
    for (long b = 0; b < kB; ++b)
      for (long j = 0; j < kSkv; ++j) padding[static_cast<std::size_t>(b * kSkv + j)] = j < kSkv - 3 * b;
    auto bias = std::make_shared<std::vector<T>>();
    for (long h = 0; h < kHq; ++h)
      for (long i = 0; i < kSq; ++i)
        for (long j = 0; j < kSkv; ++j) bias->push_back(static_cast<T>(0.05 * static_cast<double>(h * i - j)));
    qkv::AttentionOptions<T> options;
    options.set_allowed(qkv::TensorView4<const bool>(padding.get(), {kB, 1, 1, kSkv}), padding);
    options.set_bias(qkv::TensorView4<const T>(bias->data(), {1, kHq, kSq, kSkv}), bias);
    options.causal = true;
    return options;
  };
  const qkv::AttentionOptions<T> options = make();

  qkv_test::Problem pr = qkv_test::make_problem({kB, kHq, kHkv, kSq, kSkv, kD, kDv}, 13);
  brute::Broadcast4<char> allowed{{kB, 1, 1, kSkv}, {}};
  for (long b = 0; b < kB; ++b)
    for (long j = 0; j < kSkv; ++j) allowed.data.push_back(j < kSkv - 3 * b ? 1 : 0);
  brute::Broadcast4<double> bias{{1, kHq, kSq, kSkv}, {}};
  for (long h = 0; h < kHq; ++h)
    for (long i = 0; i < kSq; ++i)
      for (long j = 0; j < kSkv; ++j) bias.data.push_back(0.05 * static_cast<double>(h * i - j));
  pr.p.allowed = allowed;
  pr.p.bias = bias;
  pr.p.causal = true;
  pr = qkv_test::rounded<T>(pr);
  const std::vector<double> want = brute::attention(pr.q, pr.k, pr.v, pr.p).out;
  EXPECT_LE(max_abs_difference(run<T>(pr, options), want), tolerance<T>(pr, want, qkv::Backend::automatic));
}

TYPED_TEST(MaskOwnership, SharedOwnersConvertToViews) {
  using T = TypeParam;
  // One bias matrix shared by two options without a copy, and a PositionBias shared the same way.
  auto matrix = std::make_shared<qkv::Matrix<T>>(qkv::Matrix<T>::Constant(kSq, kSkv, T(0.5)));
  qkv::AttentionOptions<T> a, b;
  a.set_bias(matrix);
  b.set_bias(matrix);
  EXPECT_EQ(a.bias.data(), matrix->data());
  EXPECT_EQ(b.bias.data(), matrix->data());
  EXPECT_EQ(matrix.use_count(), 3);
  matrix.reset();
  EXPECT_EQ(a.bias(0, 0, kSq - 1, kSkv - 1), T(0.5));

  auto position = std::make_shared<qkv::PositionBias<T>>(kHq, kSq, kSkv);
  (*position)(kHq - 1, 2, 3) = T(-1.5);
  a.set_bias(position);
  EXPECT_EQ(a.bias.extents(), (Extents{1, kHq, kSq, kSkv}));
  EXPECT_EQ(a.bias(0, kHq - 1, 2, 3), T(-1.5));
  EXPECT_EQ(b.bias_storage.use_count(), 1);  // a let go of the shared matrix; b still holds it

  auto mask = std::make_shared<const qkv::Matrix<bool>>(qkv::Matrix<bool>::Constant(kSq, kSkv, true));
  a.set_allowed(mask);
  EXPECT_EQ(a.allowed.data(), mask->data());
  // A null owner clears the mask or bias: no view, no storage.
  a.set_allowed(std::shared_ptr<qkv::Matrix<bool>>()).set_bias(std::shared_ptr<qkv::Matrix<T>>());
  EXPECT_TRUE(a.allowed.empty());
  EXPECT_EQ(a.allowed.data(), nullptr);
  EXPECT_EQ(a.allowed_storage, nullptr);
  EXPECT_TRUE(a.bias.empty());
  EXPECT_EQ(a.bias_storage, nullptr);
  // set_ with a null storage makes a plain view again.
  const qkv::Matrix<T> local = qkv::Matrix<T>::Zero(2, 3);
  b.set_bias(local, nullptr);
  EXPECT_EQ(b.bias.data(), local.data());
  EXPECT_EQ(b.bias_storage, nullptr);
}

TYPED_TEST(MaskOwnership, SetTakesAnyEigenObjectByValue) {
  using T = TypeParam;
  // What a view cannot bind, the owning form copies: an array expression, a column-major matrix, a transpose.
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> scores(3, 4);  // column-major
  scores << 1, -2, 3, -4, -5, 6, -7, 8, 9, -10, 11, -12;
  qkv::AttentionOptions<T> options;
  options.set_allowed(scores.array() > T(0));
  options.set_bias(scores.transpose());
  ASSERT_EQ(options.allowed.extents(), (Extents{1, 1, 3, 4}));
  ASSERT_EQ(options.bias.extents(), (Extents{1, 1, 4, 3}));
  for (Index i = 0; i < 3; ++i)
    for (Index j = 0; j < 4; ++j) {
      EXPECT_EQ(options.allowed(0, 0, i, j), scores(i, j) > T(0));
      EXPECT_EQ(options.bias(0, 0, j, i), scores(i, j));
    }
  // An rvalue is moved in: the storage holds the very buffer.
  qkv::Matrix<T> bias = qkv::Matrix<T>::Ones(3, 4);
  const T* buffer = bias.data();
  options.set_bias(std::move(bias));
  EXPECT_EQ(options.bias.data(), buffer);
}

TEST(MaskOwnership, ZeroCopyViewsStayViews) {
  // The view path is unchanged: an lvalue binds zero-copy and the options hold no storage.
  qkv::Matrix<bool> mask = qkv::Matrix<bool>::Constant(2, 3, true);
  qkv::Matrix<float> bias = qkv::Matrix<float>::Zero(2, 3);
  qkv::AttentionOptions<float> options;
  options.allowed = mask;
  options.bias = bias;
  EXPECT_EQ(options.allowed.data(), mask.data());
  EXPECT_EQ(options.bias.data(), bias.data());
  EXPECT_EQ(options.allowed_storage, nullptr);
  EXPECT_EQ(options.bias_storage, nullptr);
}

}  // namespace
