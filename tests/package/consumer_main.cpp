// The program of the three consumer projects (find_package of an installed qkv, add_subdirectory and FetchContent of
// the source tree), built by qkv_package_consumer() in consumer.cmake once per qkv target it links. It checks:
//   1. scaled_dot_product_attention on seed 000, example 2.4.1 (Q = K, 3 x 2) against the numbers computed here by
//      hand (double: the reference path);
//   2. the fused float kernel (GQA 4/2, causal, odd sizes) against the reference backend in double on the same inputs;
//   3. at compile time, that the target it links gives it OpenMP or not as promised (QKV_CONSUMER_EXPECT_SERIAL for
//      qkv::qkv_serial, QKV_CONSUMER_EXPECT_OPENMP for qkv::qkv when that carries OpenMP), and prints which, so that
//      tests/package/run.sh checks it again from the output.
// Returns non-zero on a mismatch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <qkv/qkv.hpp>
#include <vector>

#if defined(QKV_CONSUMER_EXPECT_SERIAL) && defined(_OPENMP)
#error "linked to qkv::qkv_serial, yet compiled with OpenMP (_OPENMP is defined)"
#endif
#if defined(QKV_CONSUMER_EXPECT_OPENMP) && !defined(_OPENMP)
#error "linked to qkv::qkv, which carries OpenMP::OpenMP_CXX, yet _OPENMP is not defined"
#endif

#ifndef QKV_CONSUMER_TARGET
#define QKV_CONSUMER_TARGET "qkv"
#endif

namespace {

// Check 1. Query 2 = (1, 1): scores (1, 1, 2) / sqrt(2); weights e^s / sum; out[2][1] = weights . (2, 4, 6),
// 4.51047...
bool seed_example_matches(double* value, double* expected) {
  qkv::Matrix<double> q(3, 2);
  qkv::Matrix<double> v(3, 2);
  q << 1, 0, 0, 1, 1, 1;
  v << 1, 2, 3, 4, 5, 6;
  const qkv::Matrix<double> k = q;

  const qkv::Matrix<double> out = qkv::scaled_dot_product_attention(q, k, v);

  const double s = 1.0 / std::sqrt(2.0);
  const double sum = 2.0 * std::exp(s) + std::exp(2.0 * s);
  *expected = (std::exp(s) * 2.0 + std::exp(s) * 4.0 + std::exp(2.0 * s) * 6.0) / sum;
  if (out.rows() != 3 || out.cols() != 2) {
    std::printf("qkv consumer: MISMATCH: out is %ld x %ld, expected 3 x 2\n", static_cast<long>(out.rows()),
                static_cast<long>(out.cols()));
    return false;
  }
  *value = out(2, 1);
  return std::abs(out(2, 1) - *expected) < 1e-9 && std::abs(out(0, 0) - 3.0) < 1e-9 && std::abs(out(0, 1) - 4.0) < 1e-9;
}

// Check 2. Inputs in [-1, 1] from a fixed pattern; returns the largest |fused float - reference double|.
double fused_error() {
  constexpr Eigen::Index B = 1, Hq = 4, Hkv = 2, Sq = 37, Skv = 37, D = 16;
  std::vector<float> q(B * Hq * Sq * D), k(B * Hkv * Skv * D), v(B * Hkv * Skv * D), out(B * Hq * Sq * D);
  for (std::size_t n = 0; n < q.size(); ++n) q[n] = std::sin(0.37f * static_cast<float>(n));
  for (std::size_t n = 0; n < k.size(); ++n) k[n] = std::cos(0.53f * static_cast<float>(n));
  for (std::size_t n = 0; n < v.size(); ++n) v[n] = std::sin(0.71f * static_cast<float>(n) + 1.0f);
  const std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end());
  std::vector<double> out64(out.size());

  qkv::AttentionOptions<float> options;
  options.causal = true;
  options.backend = qkv::Backend::fused;
  qkv::attention(qkv::view_bhsd(q.data(), B, Hq, Sq, D), qkv::view_bhsd(k.data(), B, Hkv, Skv, D),
                 qkv::view_bhsd(v.data(), B, Hkv, Skv, D), qkv::view_bhsd(out.data(), B, Hq, Sq, D), options);
  qkv::AttentionOptions<double> reference;
  reference.causal = true;
  reference.backend = qkv::Backend::reference;
  qkv::attention(qkv::view_bhsd(q64.data(), B, Hq, Sq, D), qkv::view_bhsd(k64.data(), B, Hkv, Skv, D),
                 qkv::view_bhsd(v64.data(), B, Hkv, Skv, D), qkv::view_bhsd(out64.data(), B, Hq, Sq, D), reference);

  double largest = 0;
  for (std::size_t n = 0; n < out.size(); ++n) {
    const double error = std::abs(static_cast<double>(out[n]) - out64[n]);
    largest = std::isnan(error) ? INFINITY : std::max(largest, error);
  }
  return largest;
}

}  // namespace

int main() {
#if defined(_OPENMP)
  const char* openmp = "_OPENMP defined";
#else
  const char* openmp = "_OPENMP not defined";
#endif
  double value = 0, expected = 0;
  if (!seed_example_matches(&value, &expected)) {
    std::printf("qkv consumer [%s]: MISMATCH: out[2][1] = %.9f, expected %.9f\n", QKV_CONSUMER_TARGET, value, expected);
    return 1;
  }
  const double error = fused_error();
  if (!(error <= 1e-4)) {
    std::printf("qkv consumer [%s]: MISMATCH: fused float differs from the reference by %g (> 1e-4)\n",
                QKV_CONSUMER_TARGET, error);
    return 1;
  }
  std::printf("qkv consumer [%s]: ok, out[2][1] = %.6f (expected %.6f), fused float within %.1e of the reference; %s\n",
              QKV_CONSUMER_TARGET, value, expected, error, openmp);
  return 0;
}
