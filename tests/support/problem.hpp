// tests/support/problem.hpp — random test problems: shapes, random q, k, v and matrices, and the inputs, options and
// views through which qkv sees a problem in float or double. Shared by test_reference and test_nan_policy (problems
// against the brute force), test_thread_safety (shapes), test_inspect, test_positional, test_scoring, test_sdpa and
// test_multi_head (random matrices), test_attention and test_malformed (a valid call to break).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "brute_force.hpp"
#include "options.hpp"
#include "qkv/attention.hpp"

namespace qkv_test {

using Shape = brute::Shape;

/// n draws of N(0, 1), from a distribution of this call's own (std::normal_distribution draws in pairs and keeps the
/// second: a shared one would carry a draw from one vector into the next).
inline std::vector<double> random_normal(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(n);
  for (double& value : x) value = normal(rng);
  return x;
}

/// n draws of U[low, high).
inline std::vector<double> random_uniform(std::size_t n, double low, double high, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> uniform(low, high);
  std::vector<double> x(n);
  for (double& value : x) value = uniform(rng);
  return x;
}

/// A rows × cols matrix of N(0, scale²) draws, row by row, from std::mt19937(seed).
template <class T>
qkv::Matrix<T> random_matrix(qkv::Index rows, qkv::Index cols, unsigned seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  qkv::Matrix<T> m(rows, cols);
  for (qkv::Index i = 0; i < rows; ++i)
    for (qkv::Index j = 0; j < cols; ++j) m(i, j) = static_cast<T>(normal(rng));
  return m;
}

/// A call for the brute force and for qkv: shapes and options (brute::Params) with dense row-major q [B, Hq, Sq, D],
/// k [B, Hkv, Skv, D] and v [B, Hkv, Skv, Dv] in double.
struct Problem {
  brute::Params p;
  std::vector<double> q, k, v;

  double& q_at(long b, long h, long i, long d) { return q[brute::flat(p.Hq, p.Sq, p.D, b, h, i, d)]; }
  double& k_at(long b, long h, long j, long d) { return k[brute::flat(p.Hkv, p.Skv, p.D, b, h, j, d)]; }
  double& v_at(long b, long h, long j, long d) { return v[brute::flat(p.Hkv, p.Skv, p.Dv, b, h, j, d)]; }
};

/// A problem of `shape` without options: q, k and v (in that order) drawn N(0, 1) from std::mt19937_64(seed).
inline Problem make_problem(const Shape& shape, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem pr;
  static_cast<Shape&>(pr.p) = shape;
  const auto n = [](long a, long b, long c, long d) { return static_cast<std::size_t>(a * b * c * d); };
  pr.q = random_normal(n(shape.B, shape.Hq, shape.Sq, shape.D), rng);
  pr.k = random_normal(n(shape.B, shape.Hkv, shape.Skv, shape.D), rng);
  pr.v = random_normal(n(shape.B, shape.Hkv, shape.Skv, shape.Dv), rng);
  return pr;
}

/// The problem as qkv sees it in T: every input rounded to T (NaN and ±∞ stay), in double for the brute force.
template <class T>
Problem rounded(Problem pr) {
  const auto round = [](double& x) { x = static_cast<double>(static_cast<T>(x)); };
  for (std::vector<double>* values : {&pr.q, &pr.k, &pr.v, &pr.p.alibi_slopes, &pr.p.sinks})
    for (double& x : *values) round(x);
  if (pr.p.bias)
    for (double& x : pr.p.bias->data) round(x);
  if (pr.p.scale) round(*pr.p.scale);
  round(pr.p.softcap);
  return pr;
}

/// The problem in T as qkv takes it: q, k and v converted to T, the options with their storage (options.hpp) and
/// dense BHSD views. Not copyable: the views point into it.
template <class T>
struct Inputs : OwnedOptions<T> {
  Inputs(const Problem& pr, qkv::Backend backend)
      : OwnedOptions<T>(from_brute<T>(pr.p, backend)),
        p(pr.p),
        q(pr.q.begin(), pr.q.end()),
        k(pr.k.begin(), pr.k.end()),
        v(pr.v.begin(), pr.v.end()) {}

  qkv::TensorView4<const T> q_view() const { return qkv::TensorView4<const T>(q.data(), {p.B, p.Hq, p.Sq, p.D}); }
  qkv::TensorView4<const T> k_view() const { return qkv::TensorView4<const T>(k.data(), {p.B, p.Hkv, p.Skv, p.D}); }
  qkv::TensorView4<const T> v_view() const { return qkv::TensorView4<const T>(v.data(), {p.B, p.Hkv, p.Skv, p.Dv}); }

  brute::Params p;
  std::vector<T> q, k, v;
};

/// What `run` gives, in double.
struct Output {
  std::vector<double> out{}, lse{};  // from attention(q, k, v, out, lse, options)
  std::vector<double> out_alone{};   // from attention(q, k, v, out, options); may be left empty by other producers
};

/// Runs both forms of qkv::attention on the problem in T on `backend`. The outputs start as NaN, so an element the
/// library does not write shows.
template <class T>
Output run(const Problem& pr, qkv::Backend backend) {
  const brute::Params& p = pr.p;
  const Inputs<T> in(pr, backend);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::vector<T> out(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Dv), nan), out_alone(out.size(), nan),
      lse(static_cast<std::size_t>(p.B * p.Hq * p.Sq), nan);
  qkv::attention(in.q_view(), in.k_view(), in.v_view(), qkv::TensorView4<T>(out.data(), {p.B, p.Hq, p.Sq, p.Dv}),
                 qkv::TensorView3<T>(lse.data(), {p.B, p.Hq, p.Sq}), in.options);
  qkv::attention(in.q_view(), in.k_view(), in.v_view(), qkv::TensorView4<T>(out_alone.data(), {p.B, p.Hq, p.Sq, p.Dv}),
                 in.options);
  return {{out.begin(), out.end()}, {lse.begin(), lse.end()}, {out_alone.begin(), out_alone.end()}};
}

/// A valid call of qkv::attention with constant inputs: q [2, 4, 3, 4] (0.5), k [2, 2, 5, 4] (0.25), v [2, 2, 5, 3]
/// (1), out [2, 4, 3, 3], lse [2, 4, 3]; every output element is 1, the mean of the values. The error tests
/// (test_attention, test_malformed) break one thing each. Every buffer holds kRoom elements, so that no malformed view
/// points past its buffer.
struct ValidCall {
  static constexpr std::size_t kRoom = 4096;
  qkv::Index B = 2, Hq = 4, Hkv = 2, Sq = 3, Skv = 5, D = 4, Dv = 3;
  std::vector<float> q_data = std::vector<float>(kRoom, 0.5f), k_data = std::vector<float>(kRoom, 0.25f),
                     v_data = std::vector<float>(kRoom, 1.0f), out_data = std::vector<float>(kRoom, 0.0f),
                     lse_data = std::vector<float>(kRoom, 0.0f), bias_data = std::vector<float>(kRoom, 0.0f);
  std::unique_ptr<bool[]> allowed_data{new bool[kRoom]()};
  qkv::TensorView4<const float> q{q_data.data(), {B, Hq, Sq, D}};
  qkv::TensorView4<const float> k{k_data.data(), {B, Hkv, Skv, D}};
  qkv::TensorView4<const float> v{v_data.data(), {B, Hkv, Skv, Dv}};
  qkv::TensorView4<float> out{out_data.data(), {B, Hq, Sq, Dv}};
  qkv::TensorView3<float> lse{lse_data.data(), {B, Hq, Sq}};
  qkv::AttentionOptions<float> options;

  void run() { qkv::attention(q, k, v, out, options); }
  void run_with_lse() { qkv::attention(q, k, v, out, lse, options); }
  /// The elements `out` covers (the front of out_data while out is the dense view above).
  std::vector<float> out_elements() const {
    return {out_data.begin(), out_data.begin() + static_cast<std::ptrdiff_t>(out.size())};
  }
};

/// A valid varlen call: B = 1, sequences of 2 and 4 queries over 7 and 3 keys.
struct ValidVarlenCall : ValidCall {
  ValidVarlenCall() {
    B = 1;
    q = qkv::TensorView4<const float>(q_data.data(), {1, Hq, 6, D});
    k = qkv::TensorView4<const float>(k_data.data(), {1, Hkv, 10, D});
    v = qkv::TensorView4<const float>(v_data.data(), {1, Hkv, 10, Dv});
    out = qkv::TensorView4<float>(out_data.data(), {1, Hq, 6, Dv});
    options.cu_seqlens_q = {0, 2, 6};
    options.cu_seqlens_k = {0, 7, 10};
  }
};

}  // namespace qkv_test
