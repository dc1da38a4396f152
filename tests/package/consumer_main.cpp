// The program of both consumer projects (find_package of an installed qkv, add_subdirectory of the source tree): one
// scaled_dot_product_attention on seed 000, example 2.4.1 (Q = K, 3 x 2), checked against the same numbers computed
// here by hand. Returns non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <qkv/qkv.hpp>

int main() {
  qkv::Matrix<double> q(3, 2);
  qkv::Matrix<double> v(3, 2);
  q << 1, 0, 0, 1, 1, 1;
  v << 1, 2, 3, 4, 5, 6;
  const qkv::Matrix<double> k = q;

  const qkv::Matrix<double> out = qkv::scaled_dot_product_attention(q, k, v);

  // Query 2 = (1, 1): scores (1, 1, 2) / sqrt(2); weights e^s / sum; out[2][1] = weights . (2, 4, 6) = 4.51047...
  const double s = 1.0 / std::sqrt(2.0);
  const double sum = 2.0 * std::exp(s) + std::exp(2.0 * s);
  const double expected = (std::exp(s) * 2.0 + std::exp(s) * 4.0 + std::exp(2.0 * s) * 6.0) / sum;

  const bool shape_ok = out.rows() == 3 && out.cols() == 2;
  const bool ok = shape_ok && std::abs(out(2, 1) - expected) < 1e-9 && std::abs(out(0, 0) - 3.0) < 1e-9 &&
                  std::abs(out(0, 1) - 4.0) < 1e-9;
  if (!ok) {
    std::printf("qkv consumer: MISMATCH: out is %ld x %ld, out[2][1] = %.9f, expected %.9f\n",
                static_cast<long>(out.rows()), static_cast<long>(out.cols()), shape_ok ? out(2, 1) : 0.0, expected);
    return 1;
  }
  std::printf("qkv consumer: ok, out[2][1] = %.6f (expected %.6f)\n", out(2, 1), expected);
  return 0;
}
