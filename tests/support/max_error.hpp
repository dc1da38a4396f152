// tests/support/max_error.hpp — the largest finite magnitude and the largest error against a float64 expectation,
// for tests that compare whole outputs (test_global_positions, the MPI tests).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace qkv_test {

/// The largest |x| over the finite elements.
inline double max_finite_abs(const std::vector<double>& x) {
  double m = 0;
  for (double value : x)
    if (std::isfinite(value)) m = std::max(m, std::fabs(value));
  return m;
}

/// The largest |a − e| over elements where the expected value e is finite; an infinite expected value (the lse of a
/// row that sees no key) must be matched exactly, and a finite one never by NaN (both are gtest failures).
inline double max_error(const std::vector<double>& actual, const std::vector<double>& expected,
                        const std::string& what) {
  EXPECT_EQ(actual.size(), expected.size()) << what;
  double error = 0;
  for (std::size_t n = 0; n < std::min(actual.size(), expected.size()); ++n) {
    if (std::isinf(expected[n])) {
      EXPECT_EQ(actual[n], expected[n]) << what << " element " << n;
      continue;
    }
    EXPECT_FALSE(std::isnan(actual[n])) << what << " element " << n << " (expected " << expected[n] << ")";
    error = std::max(error, std::fabs(actual[n] - expected[n]));
  }
  return error;
}

}  // namespace qkv_test
