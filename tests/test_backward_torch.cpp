// Tests of the backward pass (issue 17) against PyTorch autograd: tests/fixtures/backward_torch.safetensors, written by
// scripts/make_backward_fixtures.py (PyTorch 1.13 in float64; the script's docstring lists the cases and how each qkv
// option is written in PyTorch).
//
//   - qkv::attention_backward in double (reference backward) within 1e-9·max(1, max|g|) of PyTorch's float64 gradients,
//     g each of d_q, d_k, d_v, d_bias, d_sinks; qkv's double forward reproduces PyTorch's out and lse (the fixture's
//     option translation is qkv's semantics).
//   - attention_backward in float (fused, and the float reference when d_bias is requested): per gradient, the error
//     against PyTorch's float64 ≤ 2 × the error of a plain float backward (support/plain_backward.hpp: scores,
//     P, dP and dS materialized in float; the larger error of its two forms, weights from its own softmax and from the
//     float out and lse the call gets) + 1e-6·max(1, max|g|), and no NaN where float64 has none. The fused backward
//     gets the fixture's out and lse rounded to float, and (end to end) qkv's own float forward's.
//   - Gradients that are zero by structure (d_q of a row that sees no key, d_k and d_v of a key no query sees, d_q and
//     d_k with scale 0; decided from brute_force.hpp's visibility rule) are exactly zero, in PyTorch's and in qkv's.
//   - MultiHeadAttention::backward (self-attention, forward(X_q, X_kv) and forward(X_q, X_k, X_v), GQA, with and
//     without biases) in double within 1e-9·max(1, max|g|), in float within the same rule against a plain float module
//     backward (Eigen products in float around support/plain_float.hpp and support/plain_backward.hpp).
//
// The fixture's inputs are float32 values widened exactly (the test checks it), so the float runs read exactly the
// values the float64 expectations were computed from.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/multi_head.hpp"
#include "safetensors.hpp"
#include "support/options.hpp"
#include "support/plain_backward.hpp"
#include "support/plain_float.hpp"

namespace {

using qkv::Index;
using qkv::Matrix;

const safetensors::File& fixture() {
  static const safetensors::File file =
      safetensors::read(std::string(QKV_TEST_FIXTURES_DIR) + "/backward_torch.safetensors");
  return file;
}

bool has(const std::string& name) { return fixture().tensors.count(name) > 0; }

const safetensors::Tensor& tensor(const std::string& name) {
  const auto found = fixture().tensors.find(name);
  if (found == fixture().tensors.end()) throw std::runtime_error("backward_torch.safetensors has no " + name);
  return found->second;
}

const std::vector<double>& values(const std::string& name) { return tensor(name).values; }

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

template <class T>
std::vector<double> widen(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double value : x) m = std::max(m, std::abs(value));
  return m;
}

/// max |actual − expected|; +∞ when an element is NaN (or infinite) where the expected one is finite (the expected
/// gradients are finite everywhere).
double max_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double error = 0;
  for (std::size_t n = 0; n < actual.size(); ++n) {
    if (!std::isfinite(actual[n])) return std::numeric_limits<double>::infinity();
    error = std::max(error, std::abs(actual[n] - expected[n]));
  }
  return error;
}

/// Every element that `zero` marks (a gradient that is zero by structure: see StructuralZeros) is exactly zero (±0) in
/// `actual`, and in PyTorch's `expected` too.
void expect_structural_zeros(const std::vector<double>& actual, const std::vector<double>& expected,
                             const std::vector<char>& zero, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  ASSERT_EQ(zero.size(), expected.size()) << what;
  int reported = 0;
  for (std::size_t n = 0; n < actual.size(); ++n) {
    if (!zero[n]) continue;
    EXPECT_EQ(expected[n], 0.0) << what << " element " << n << ": PyTorch's gradient is not zero";
    if (actual[n] != 0.0 && reported++ < 3) {
      ADD_FAILURE() << what << " element " << n << " is " << actual[n] << ", not exactly 0";
    }
  }
}

/// The double rule: within 1e-9·max(1, max|g|) of PyTorch's float64.
void expect_double_close(const std::vector<double>& actual, const std::vector<double>& expected,
                         const std::string& what) {
  const double tolerance = 1e-9 * std::max(1.0, max_abs(expected));
  EXPECT_LE(max_error(actual, expected), tolerance) << what << " (max|g| " << max_abs(expected) << ")";
}

/// The float rule: error ≤ 2 × the plain float backward's error + 1e-6·max(1, max|g|), both against PyTorch. The plain
/// float backward runs in its two forms (support/plain_backward.hpp: weights from its own softmax, `own`, and from the
/// float out and lse the call was given, `given`, whose |lse|·2^-24 rounding every backward that reads them inherits);
/// the larger error is the baseline, as the forward's rule takes the largest over its plain orders.
void expect_float_rule(const std::vector<double>& actual, const std::vector<double>& own,
                       const std::vector<double>& given, const std::vector<double>& expected, const std::string& what) {
  const double plain_error = std::max(max_error(own, expected), max_error(given, expected));
  ASSERT_TRUE(std::isfinite(plain_error)) << what << ": the plain float backward is not finite";
  const double error = max_error(actual, expected);
  EXPECT_LE(error, 2 * plain_error + 1e-6 * std::max(1.0, max_abs(expected)))
      << what << ": plain float error " << plain_error << ", max|g| " << max_abs(expected);
}

// ---- the core: qkv::attention_backward ------------------------------------------------------------------------------

/// One core case of the fixture: the call (brute::Params: shapes and options in double) and its arrays.
struct CoreCase {
  std::string name;
  brute::Params p;
  std::vector<double> q, k, v, d_out, out, lse, d_q, d_k, d_v, d_bias, d_sinks;
  std::vector<Index> bias_extents;
  std::vector<char> zero_d_q, zero_d_k, zero_d_v;  // find_structural_zeros

  explicit CoreCase(const std::string& case_name) : name(case_name) {
    const std::vector<double>& c = get("config");
    const auto index = [&c](std::size_t n) { return static_cast<long>(c.at(n)); };
    p.B = index(0);
    p.Hq = index(1);
    p.Hkv = index(2);
    p.Sq = index(3);
    p.Skv = index(4);
    p.D = index(5);
    p.Dv = index(6);
    if (!std::isnan(c.at(7))) p.scale = c[7];
    p.softcap = c.at(8);
    p.causal = c.at(9) != 0;
    p.alignment = c.at(10) != 0 ? brute::Alignment::top_left : brute::Alignment::bottom_right;
    p.window_left = index(11);
    p.window_right = index(12);
    p.global_tokens = index(13);
    const auto longs = [](const std::vector<double>& x) { return std::vector<long>(x.begin(), x.end()); };
    if (present("key_lengths")) p.key_lengths = longs(get("key_lengths"));
    if (present("cu_seqlens_q")) {
      p.cu_seqlens_q = longs(get("cu_seqlens_q"));
      p.cu_seqlens_k = longs(get("cu_seqlens_k"));
    }
    if (present("alibi_slopes")) p.alibi_slopes = get("alibi_slopes");
    if (present("sinks")) p.sinks = get("sinks");
    if (present("allowed")) {
      brute::Broadcast4<char> allowed;
      for (std::size_t axis = 0; axis < 4; ++axis) allowed.extents[axis] = tensor(name + ".allowed").shape.at(axis);
      for (double x : get("allowed")) allowed.data.push_back(x != 0 ? 1 : 0);
      p.allowed = allowed;
    }
    if (present("bias")) {
      brute::Broadcast4<double> bias;
      for (std::size_t axis = 0; axis < 4; ++axis) {
        bias.extents[axis] = tensor(name + ".bias").shape.at(axis);
        bias_extents.push_back(bias.extents[axis]);
      }
      bias.data = get("bias");
      p.bias = bias;
      d_bias = get("d_bias");
    }
    if (present("d_sinks")) d_sinks = get("d_sinks");
    q = get("q");
    k = get("k");
    v = get("v");
    d_out = get("d_out");
    out = get("out");
    lse = get("lse");
    d_q = get("d_q");
    d_k = get("d_k");
    d_v = get("d_v");
    find_structural_zeros();
  }

  /// The gradients that are zero by structure, decided from brute_force.hpp's visibility rule alone: d_q of a row that
  /// sees no key, d_k and d_v of a key that no query of its group sees, and d_q, d_k everywhere with scale 0. (A row
  /// that sees a single key has dS = 0 too, but only up to rounding: D_i = dO_i·out_i cancels dP_i in float.)
  void find_structural_zeros() {
    std::vector<char> row_sees(static_cast<std::size_t>(p.B * p.Hq * p.Sq), 0),
        key_seen(static_cast<std::size_t>(p.B * p.Hkv * p.Skv), 0);
    for (const brute::Sequence& s : brute::sequences(p))
      for (long h = 0; h < p.Hq; ++h)
        for (long i = 0; i < s.sq; ++i)
          for (long j = 0; j < s.skv; ++j) {
            if (!brute::visible(p, s, h, i, j)) continue;
            row_sees[static_cast<std::size_t>((s.b * p.Hq + h) * p.Sq + s.q0 + i)] = 1;
            key_seen[static_cast<std::size_t>((s.b * p.Hkv + h / (p.Hq / p.Hkv)) * p.Skv + s.k0 + j)] = 1;
          }
    const bool scale_zero = p.scale && *p.scale == 0.0;
    for (std::size_t n = 0; n < d_q.size(); ++n) zero_d_q.push_back(scale_zero || !row_sees[n / p.D]);
    for (std::size_t n = 0; n < d_k.size(); ++n) zero_d_k.push_back(scale_zero || !key_seen[n / p.D]);
    for (std::size_t n = 0; n < d_v.size(); ++n) zero_d_v.push_back(!key_seen[n / p.Dv]);
  }

  bool present(const std::string& array) const { return has(name + "." + array); }
  const std::vector<double>& get(const std::string& array) const { return values(name + "." + array); }

  /// Every input, option value and forward result that float reads is a float32 value (the generator's promise).
  bool float_exact() const {
    const auto exact = [](const std::vector<double>& x) {
      return std::all_of(x.begin(), x.end(), [](double y) { return std::isnan(y) || double(float(y)) == y; });
    };
    bool ok = exact(q) && exact(k) && exact(v) && exact(d_out) && exact(p.alibi_slopes) && exact(p.sinks) &&
              double(float(p.softcap)) == p.softcap && (!p.scale || double(float(*p.scale)) == *p.scale);
    if (p.bias) ok = ok && exact(p.bias->data);
    return ok;
  }
};

/// The gradients qkv wrote, widened to double.
struct Gradients {
  std::vector<double> d_q, d_k, d_v, d_bias, d_sinks;
};

/// qkv::attention_backward in T on the case's inputs with the given out and lse (in T), dense BHSD views; the
/// outputs start as NaN (they must be written entirely). `extras`: request d_bias and d_sinks where the case has them.
template <class T>
Gradients run_backward(const CoreCase& c, qkv::Backend backend, const std::vector<T>& out, const std::vector<T>& lse,
                       bool extras) {
  const brute::Params& p = c.p;
  const std::vector<T> q = cast<T>(c.q), k = cast<T>(c.k), v = cast<T>(c.v), d_out = cast<T>(c.d_out);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::vector<T> d_q(q.size(), nan), d_k(k.size(), nan), d_v(v.size(), nan), d_bias, d_sinks;
  const qkv_test::OwnedOptions<T> owned = qkv_test::from_brute<T>(p, backend);
  qkv::AttentionGradientExtras<T> gradient_extras;
  if (extras && p.bias) {
    d_bias.assign(p.bias->data.size(), nan);
    gradient_extras.d_bias = qkv::TensorView4<T>(
        d_bias.data(), {c.bias_extents.at(0), c.bias_extents.at(1), c.bias_extents.at(2), c.bias_extents.at(3)});
  }
  if (extras && !p.sinks.empty()) {
    d_sinks.assign(p.sinks.size(), nan);
    gradient_extras.d_sinks = qkv::TensorView<T, 1>(d_sinks.data(), {p.Hq});
  }
  using View = qkv::TensorView4<const T>;
  qkv::attention_backward<T>(
      View(q.data(), {p.B, p.Hq, p.Sq, p.D}), View(k.data(), {p.B, p.Hkv, p.Skv, p.D}),
      View(v.data(), {p.B, p.Hkv, p.Skv, p.Dv}), View(out.data(), {p.B, p.Hq, p.Sq, p.Dv}),
      qkv::TensorView3<const T>(lse.data(), {p.B, p.Hq, p.Sq}), View(d_out.data(), {p.B, p.Hq, p.Sq, p.Dv}),
      qkv::view_bhsd(d_q.data(), p.B, p.Hq, p.Sq, p.D), qkv::view_bhsd(d_k.data(), p.B, p.Hkv, p.Skv, p.D),
      qkv::view_bhsd(d_v.data(), p.B, p.Hkv, p.Skv, p.Dv), owned.options, gradient_extras);
  return {widen(d_q), widen(d_k), widen(d_v), widen(d_bias), widen(d_sinks)};
}

/// qkv::attention in T on the case's inputs (backend `backend`): out and lse.
template <class T>
void run_forward(const CoreCase& c, qkv::Backend backend, std::vector<T>& out, std::vector<T>& lse) {
  const brute::Params& p = c.p;
  const std::vector<T> q = cast<T>(c.q), k = cast<T>(c.k), v = cast<T>(c.v);
  out.assign(c.out.size(), std::numeric_limits<T>::quiet_NaN());
  lse.assign(c.lse.size(), std::numeric_limits<T>::quiet_NaN());
  const qkv_test::OwnedOptions<T> owned = qkv_test::from_brute<T>(p, backend);
  using View = qkv::TensorView4<const T>;
  qkv::attention<T>(View(q.data(), {p.B, p.Hq, p.Sq, p.D}), View(k.data(), {p.B, p.Hkv, p.Skv, p.D}),
                    View(v.data(), {p.B, p.Hkv, p.Skv, p.Dv}), qkv::view_bhsd(out.data(), p.B, p.Hq, p.Sq, p.Dv),
                    qkv::TensorView3<T>(lse.data(), {p.B, p.Hq, p.Sq}), owned.options);
}

const std::vector<std::string>& core_cases() {
  static const std::vector<std::string> names = {
      "plain", "gqa_top_left",  "mqa_bottom_right", "empty_rows", "allowed_padding",
      "bias",  "bias_key_row",  "softcap",          "alibi",      "alibi_top_left",
      "sinks", "window_global", "scale_zero",       "varlen",     "everything"};
  return names;
}

class BackwardTorch : public ::testing::TestWithParam<std::string> {};

TEST(BackwardTorchFixture, EveryCoreCaseIsListedAndFloatExact) {
  const safetensors::File& file = fixture();
  EXPECT_EQ(file.metadata.at("generator"), "scripts/make_backward_fixtures.py");
  std::size_t configs = 0;
  for (const auto& [name, t] : file.tensors) {
    const std::size_t dot = name.find('.');
    if (name.substr(dot) != ".config" || name.rfind("module_", 0) == 0) continue;
    ++configs;
    EXPECT_NE(std::find(core_cases().begin(), core_cases().end(), name.substr(0, dot)), core_cases().end())
        << name << " is not tested";
  }
  EXPECT_EQ(configs, core_cases().size());
  for (const std::string& name : core_cases()) EXPECT_TRUE(CoreCase(name).float_exact()) << name;
  // The cases that exercise structural zeros have some: rows that see no key, keys that no query sees, scale 0.
  for (const char* name : {"empty_rows", "allowed_padding", "varlen", "scale_zero", "everything"}) {
    const CoreCase c(name);
    EXPECT_GT(std::count(c.zero_d_q.begin(), c.zero_d_q.end(), 1) + std::count(c.zero_d_v.begin(), c.zero_d_v.end(), 1),
              0)
        << name;
  }
}

// qkv's double forward gives PyTorch's out and lse: the fixture's options mean what qkv's options mean.
TEST_P(BackwardTorch, DoubleForwardMatchesPyTorch) {
  const CoreCase c(GetParam());
  std::vector<double> out, lse;
  run_forward<double>(c, qkv::Backend::reference, out, lse);
  EXPECT_LE(max_error(out, c.out), 1e-12 * std::max(1.0, max_abs(c.out)));
  for (std::size_t n = 0; n < lse.size(); ++n) {
    if (std::isinf(c.lse[n])) {
      EXPECT_EQ(lse[n], c.lse[n]) << "lse " << n;
    } else {
      EXPECT_NEAR(lse[n], c.lse[n], 1e-12 * std::max(1.0, std::abs(c.lse[n]))) << "lse " << n;
    }
  }
}

// The reference backward in double within 1e-9·max(1, max|g|) of PyTorch autograd, every gradient.
TEST_P(BackwardTorch, DoubleWithinOneInABillionOfPyTorch) {
  const CoreCase c(GetParam());
  for (const qkv::Backend backend : {qkv::Backend::automatic, qkv::Backend::reference}) {
    for (const bool extras : {false, true}) {
      const std::string what = c.name + (backend == qkv::Backend::reference ? " reference" : " automatic") +
                               (extras ? " with extras " : " ");
      const Gradients g = run_backward<double>(c, backend, c.out, c.lse, extras);
      expect_double_close(g.d_q, c.d_q, what + "d_q");
      expect_double_close(g.d_k, c.d_k, what + "d_k");
      expect_double_close(g.d_v, c.d_v, what + "d_v");
      expect_structural_zeros(g.d_q, c.d_q, c.zero_d_q, what + "d_q");
      expect_structural_zeros(g.d_k, c.d_k, c.zero_d_k, what + "d_k");
      expect_structural_zeros(g.d_v, c.d_v, c.zero_d_v, what + "d_v");
      if (extras && c.p.bias) expect_double_close(g.d_bias, c.d_bias, what + "d_bias");
      if (extras && !c.p.sinks.empty()) expect_double_close(g.d_sinks, c.d_sinks, what + "d_sinks");
    }
  }
}

/// The plain float backward of the case in its two forms (support/plain_backward.hpp), widened: `own` from its own
/// softmax, `given` from the float out and lse the call under test gets.
struct PlainForms {
  Gradients own, given;
};

PlainForms plain_float_backward(const CoreCase& c, const std::vector<float>& out, const std::vector<float>& lse) {
  const std::vector<float> q = cast<float>(c.q), k = cast<float>(c.k), v = cast<float>(c.v),
                           d_out = cast<float>(c.d_out);
  const auto widened = [](const qkv_test::PlainGradients<float>& g) {
    return Gradients{widen(g.d_q), widen(g.d_k), widen(g.d_v), widen(g.d_bias), widen(g.d_sinks)};
  };
  return {widened(qkv_test::plain_backward<float>(q, k, v, d_out, c.p)),
          widened(qkv_test::plain_backward<float>(q, k, v, d_out, c.p, &out, &lse))};
}

void expect_float_gradients(const CoreCase& c, const Gradients& g, const PlainForms& plain, const std::string& what) {
  expect_float_rule(g.d_q, plain.own.d_q, plain.given.d_q, c.d_q, what + " d_q");
  expect_float_rule(g.d_k, plain.own.d_k, plain.given.d_k, c.d_k, what + " d_k");
  expect_float_rule(g.d_v, plain.own.d_v, plain.given.d_v, c.d_v, what + " d_v");
  expect_structural_zeros(g.d_q, c.d_q, c.zero_d_q, what + " d_q");
  expect_structural_zeros(g.d_k, c.d_k, c.zero_d_k, what + " d_k");
  expect_structural_zeros(g.d_v, c.d_v, c.zero_d_v, what + " d_v");
  if (!g.d_bias.empty()) expect_float_rule(g.d_bias, plain.own.d_bias, plain.given.d_bias, c.d_bias, what + " d_bias");
  if (!g.d_sinks.empty())
    expect_float_rule(g.d_sinks, plain.own.d_sinks, plain.given.d_sinks, c.d_sinks, what + " d_sinks");
}

// The float backward (fused; the float reference when d_bias is requested) within docs/design.md's rule of PyTorch's
// float64 gradients, given PyTorch's out and lse rounded to float.
TEST_P(BackwardTorch, FloatWithinTwicePlainFloatOnPyTorchsForward) {
  const CoreCase c(GetParam());
  const std::vector<float> out = cast<float>(c.out), lse = cast<float>(c.lse);
  const PlainForms plain = plain_float_backward(c, out, lse);
  for (const qkv::Backend backend : {qkv::Backend::automatic, qkv::Backend::fused, qkv::Backend::reference}) {
    const std::string what = c.name + " backend " + std::to_string(static_cast<int>(backend));
    expect_float_gradients(c, run_backward<float>(c, backend, out, lse, false), plain, what);
    expect_float_gradients(c, run_backward<float>(c, backend, out, lse, true), plain, what + " with extras");
  }
}

// End to end in float: qkv's float forward (fused), then the fused backward on its out and lse.
TEST_P(BackwardTorch, FloatEndToEndWithinTwicePlainFloat) {
  const CoreCase c(GetParam());
  std::vector<float> out, lse;
  run_forward<float>(c, qkv::Backend::automatic, out, lse);
  const PlainForms plain = plain_float_backward(c, out, lse);
  expect_float_gradients(c, run_backward<float>(c, qkv::Backend::automatic, out, lse, true), plain,
                         c.name + " end to end");
}

INSTANTIATE_TEST_SUITE_P(Fixture, BackwardTorch, ::testing::ValuesIn(core_cases()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---- the module: MultiHeadAttention::backward -----------------------------------------------------------------------

/// One module case: config (d_model, n_heads, n_kv_heads, kdim, vdim, bias, causal, L, S, inputs) and its arrays.
struct ModuleCase {
  std::string name;
  Index E = 0, Hq = 0, Hkv = 0, kdim = 0, vdim = 0, L = 0, S = 0;
  bool bias = true, causal = false;
  int inputs = 1;

  explicit ModuleCase(const std::string& case_name) : name(case_name) {
    const std::vector<double>& c = get("config");
    E = static_cast<Index>(c.at(0));
    Hq = static_cast<Index>(c.at(1));
    Hkv = static_cast<Index>(c.at(2));
    kdim = static_cast<Index>(c.at(3));
    vdim = static_cast<Index>(c.at(4));
    bias = c.at(5) != 0;
    causal = c.at(6) != 0;
    L = static_cast<Index>(c.at(7));
    S = static_cast<Index>(c.at(8));
    inputs = static_cast<int>(c.at(9));
  }

  const std::vector<double>& get(const std::string& array) const { return values(name + "." + array); }
  const std::vector<std::int64_t>& shape(const std::string& array) const { return tensor(name + "." + array).shape; }

  /// A 2-D array as a matrix (C order = row-major, as qkv::Matrix).
  template <class T>
  Matrix<T> matrix(const std::string& array) const {
    const auto& s = shape(array);
    Matrix<T> m(s.at(0), s.at(1));
    const std::vector<double>& x = get(array);
    for (Index n = 0; n < m.size(); ++n) m.data()[n] = static_cast<T>(x[static_cast<std::size_t>(n)]);
    return m;
  }
  template <class T>
  Eigen::Matrix<T, Eigen::Dynamic, 1> vector(const std::string& array) const {
    const std::vector<double>& x = get(array);
    Eigen::Matrix<T, Eigen::Dynamic, 1> m(static_cast<Index>(x.size()));
    for (Index n = 0; n < m.size(); ++n) m(n) = static_cast<T>(x[static_cast<std::size_t>(n)]);
    return m;
  }

  template <class T>
  qkv::MultiHeadAttention<T> module() const {
    typename qkv::MultiHeadAttention<T>::Config config;
    config.d_model = E;
    config.n_heads = Hq;
    config.n_kv_heads = Hkv;
    config.kdim = kdim;
    config.vdim = vdim;
    config.bias = bias;
    qkv::MultiHeadAttention<T> m(config);
    m.W_q = matrix<T>("W_q");
    m.W_k = matrix<T>("W_k");
    m.W_v = matrix<T>("W_v");
    m.W_o = matrix<T>("W_o");
    m.b_q = vector<T>("b_q");
    m.b_k = vector<T>("b_k");
    m.b_v = vector<T>("b_v");
    m.b_o = vector<T>("b_o");
    return m;
  }

  template <class T>
  qkv::AttentionOptions<T> options() const {
    qkv::AttentionOptions<T> o;
    o.causal = causal;  // L = S where set: both alignments agree
    return o;
  }

  /// The inputs of the key and value projections (X in self-attention, X_kv, or X_k and X_v).
  template <class T>
  Matrix<T> X_q() const {
    return matrix<T>(inputs == 1 ? "X" : "X_q");
  }
  template <class T>
  Matrix<T> X_k() const {
    return matrix<T>(inputs == 1 ? "X" : inputs == 2 ? "X_kv" : "X_k");
  }
  template <class T>
  Matrix<T> X_v() const {
    return matrix<T>(inputs == 1 ? "X" : inputs == 2 ? "X_kv" : "X_v");
  }
};

template <class M>
std::vector<double> flat(const M& m) {  // row-major order, as the fixture's arrays
  std::vector<double> x;
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) x.push_back(static_cast<double>(m(i, j)));
  return x;
}

/// A module's gradients in the fixture's names (row-major), the input gradients under the case's input names.
using NamedGradients = std::map<std::string, std::vector<double>>;

template <class G>
NamedGradients named(const ModuleCase& c, const G& g) {
  NamedGradients n;
  if (c.inputs == 1) n["dX"] = flat(g.dX);
  if (c.inputs == 2) {
    n["dX_q"] = flat(g.dX_q);
    n["dX_kv"] = flat(g.dX_kv);
  }
  if (c.inputs == 3) {
    n["dX_q"] = flat(g.dX_q);
    n["dX_k"] = flat(g.dX_k);
    n["dX_v"] = flat(g.dX_v);
  }
  n["dW_q"] = flat(g.dW_q);
  n["dW_k"] = flat(g.dW_k);
  n["dW_v"] = flat(g.dW_v);
  n["dW_o"] = flat(g.dW_o);
  n["db_q"] = flat(g.db_q);
  n["db_k"] = flat(g.db_k);
  n["db_v"] = flat(g.db_v);
  n["db_o"] = flat(g.db_o);
  return n;
}

template <class T>
NamedGradients module_backward(const ModuleCase& c) {
  const qkv::MultiHeadAttention<T> m = c.module<T>();
  const Matrix<T> dY = c.matrix<T>("dY");
  if (c.inputs == 1) return named(c, m.backward(c.X_q<T>(), dY, c.options<T>()));
  if (c.inputs == 2) return named(c, m.backward(c.X_q<T>(), c.X_k<T>(), dY, c.options<T>()));
  return named(c, m.backward(c.X_q<T>(), c.X_k<T>(), c.X_v<T>(), dY, c.options<T>()));
}

/// Row t, heads side by side ([T, H·hd]) → dense [1, H, T, hd] and back.
template <class T>
std::vector<T> to_heads(const Matrix<T>& packed, Index H) {
  const Index rows = packed.rows(), hd = packed.cols() / H;
  std::vector<T> x(static_cast<std::size_t>(packed.size()));
  for (Index h = 0; h < H; ++h)
    for (Index t = 0; t < rows; ++t)
      for (Index d = 0; d < hd; ++d) x[static_cast<std::size_t>((h * rows + t) * hd + d)] = packed(t, h * hd + d);
  return x;
}
template <class T>
Matrix<T> from_heads(const std::vector<T>& x, Index H, Index rows, Index hd) {
  Matrix<T> packed(rows, H * hd);
  for (Index h = 0; h < H; ++h)
    for (Index t = 0; t < rows; ++t)
      for (Index d = 0; d < hd; ++d) packed(t, h * hd + d) = x[static_cast<std::size_t>((h * rows + t) * hd + d)];
  return packed;
}

/// The module's backward written plainly in float, in the two forms of support/plain_backward.hpp (`own` and
/// `given`, the latter from the plain forward's own out and lse): Eigen products in float, the attention forward of
/// support/plain_float.hpp and the backward of support/plain_backward.hpp.
std::array<NamedGradients, 2> plain_float_module_backward(const ModuleCase& c) {
  using Vector = Eigen::Matrix<float, Eigen::Dynamic, 1>;
  const qkv::MultiHeadAttention<float> m = c.module<float>();
  const Matrix<float> X_q = c.X_q<float>(), X_k = c.X_k<float>(), X_v = c.X_v<float>(), dY = c.matrix<float>("dY");
  const Index hd = c.E / c.Hq;
  Matrix<float> Q = X_q * m.W_q, K = X_k * m.W_k, V = X_v * m.W_v;
  if (c.bias) {
    Q.rowwise() += m.b_q.transpose();
    K.rowwise() += m.b_k.transpose();
    V.rowwise() += m.b_v.transpose();
  }
  brute::Params p;
  p.B = 1;
  p.Hq = c.Hq;
  p.Hkv = c.Hkv;
  p.Sq = c.L;
  p.Skv = c.S;
  p.D = p.Dv = hd;
  p.causal = c.causal;
  const std::vector<float> q = to_heads(Q, c.Hq), k = to_heads(K, c.Hkv), v = to_heads(V, c.Hkv);
  std::vector<float> o(static_cast<std::size_t>(c.Hq * c.L * hd)), lse(static_cast<std::size_t>(c.Hq * c.L));
  qkv_test::plain_float(qkv::TensorView4<const float>(q.data(), {1, c.Hq, c.L, hd}),
                        qkv::TensorView4<const float>(k.data(), {1, c.Hkv, c.S, hd}),
                        qkv::TensorView4<const float>(v.data(), {1, c.Hkv, c.S, hd}), p,
                        qkv::TensorView4<float>(o.data(), {1, c.Hq, c.L, hd}),
                        qkv::TensorView3<float>(lse.data(), {1, c.Hq, c.L}));
  const Matrix<float> O = from_heads(o, c.Hq, c.L, hd);
  const Matrix<float> dO = dY * m.W_o.transpose();
  const std::vector<float> d_o = to_heads(dO, c.Hq);
  const auto through_projections = [&](const qkv_test::PlainGradients<float>& g) {
    const Matrix<float> dQ = from_heads(g.d_q, c.Hq, c.L, hd), dK = from_heads(g.d_k, c.Hkv, c.S, hd),
                        dV = from_heads(g.d_v, c.Hkv, c.S, hd);
    NamedGradients n;
    const Matrix<float> dX_q = dQ * m.W_q.transpose(), dX_k = dK * m.W_k.transpose(), dX_v = dV * m.W_v.transpose();
    if (c.inputs == 1) n["dX"] = flat(Matrix<float>(dX_q + dX_k + dX_v));
    if (c.inputs == 2) {
      n["dX_q"] = flat(dX_q);
      n["dX_kv"] = flat(Matrix<float>(dX_k + dX_v));
    }
    if (c.inputs == 3) {
      n["dX_q"] = flat(dX_q);
      n["dX_k"] = flat(dX_k);
      n["dX_v"] = flat(dX_v);
    }
    n["dW_q"] = flat(Matrix<float>(X_q.transpose() * dQ));
    n["dW_k"] = flat(Matrix<float>(X_k.transpose() * dK));
    n["dW_v"] = flat(Matrix<float>(X_v.transpose() * dV));
    n["dW_o"] = flat(Matrix<float>(O.transpose() * dY));
    const auto column_sums = [&c](const Matrix<float>& x) {
      return c.bias ? flat(Vector(x.colwise().sum().transpose())) : std::vector<double>();
    };
    n["db_q"] = column_sums(dQ);
    n["db_k"] = column_sums(dK);
    n["db_v"] = column_sums(dV);
    n["db_o"] = column_sums(dY);
    return n;
  };
  return {through_projections(qkv_test::plain_backward<float>(q, k, v, d_o, p)),
          through_projections(qkv_test::plain_backward<float>(q, k, v, d_o, p, &o, &lse))};
}

const std::vector<std::string>& module_cases() {
  static const std::vector<std::string> names = {"module_self", "module_gqa", "module_cross_kv", "module_cross"};
  return names;
}

class ModuleBackwardTorch : public ::testing::TestWithParam<std::string> {};

TEST_P(ModuleBackwardTorch, DoubleForwardMatchesPyTorch) {
  const ModuleCase c(GetParam());
  const qkv::MultiHeadAttention<double> m = c.module<double>();
  Matrix<double> Y;
  if (c.inputs == 1) Y = m.forward(c.X_q<double>(), c.options<double>());
  if (c.inputs == 2) Y = m.forward(c.X_q<double>(), c.X_k<double>(), c.options<double>());
  if (c.inputs == 3) Y = m.forward(c.X_q<double>(), c.X_k<double>(), c.X_v<double>(), c.options<double>());
  EXPECT_LE(max_error(flat(Y), c.get("Y")), 1e-12 * std::max(1.0, max_abs(c.get("Y"))));
}

TEST_P(ModuleBackwardTorch, DoubleWithinOneInABillionOfPyTorch) {
  const ModuleCase c(GetParam());
  const NamedGradients g = module_backward<double>(c);
  for (const auto& [name, x] : g) expect_double_close(x, c.get(name), c.name + " " + name);
}

TEST_P(ModuleBackwardTorch, FloatWithinTwicePlainFloat) {
  const ModuleCase c(GetParam());
  const NamedGradients g = module_backward<float>(c);
  const std::array<NamedGradients, 2> plain = plain_float_module_backward(c);
  for (const auto& [name, x] : g)
    expect_float_rule(x, plain[0].at(name), plain[1].at(name), c.get(name), c.name + " " + name);
}

INSTANTIATE_TEST_SUITE_P(Fixture, ModuleBackwardTorch, ::testing::ValuesIn(module_cases()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The plain backward itself (the yardstick) in double agrees with PyTorch: it is an independent float64 backward.
TEST(PlainBackward, DoubleMatchesPyTorch) {
  for (const std::string& name : core_cases()) {
    const CoreCase c(name);
    for (const bool given : {false, true}) {  // weights from its own softmax, and from PyTorch's out and lse
      const qkv_test::PlainGradients<double> g =
          given ? qkv_test::plain_backward<double>(c.q, c.k, c.v, c.d_out, c.p, &c.out, &c.lse)
                : qkv_test::plain_backward<double>(c.q, c.k, c.v, c.d_out, c.p);
      const std::string what = name + (given ? " given out and lse" : "");
      expect_double_close(g.d_q, c.d_q, what + " d_q");
      expect_double_close(g.d_k, c.d_k, what + " d_k");
      expect_double_close(g.d_v, c.d_v, what + " d_v");
      if (c.p.bias) expect_double_close(g.d_bias, c.d_bias, what + " d_bias");
      if (!c.p.sinks.empty()) expect_double_close(g.d_sinks, c.d_sinks, what + " d_sinks");
    }
  }
}

}  // namespace
