// Death tests of the -fno-exceptions build (the `noexcept` preset): a bad call prints the shape_error message it would
// throw, exactly and on a line of its own, to stderr and aborts (SIGABRT); a valid call still works. The expected
// messages are written here by hand from the inputs (the same wording tests/test_malformed.cpp checks with exceptions).
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <string>
#include <vector>

#include "qkv/qkv.hpp"

#if QKV_HAS_EXCEPTIONS
#error "tests/noexcept/test_noexcept.cpp is built only with exceptions off (-fno-exceptions)"
#endif

namespace {

using qkv::Index;

/// A POSIX extended regex matching exactly `message` on a line of its own in stderr.
std::string exact_line(const std::string& message) {
  std::string pattern = "(^|\n)";
  for (char c : message) {
    if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) pattern += '\\';
    pattern += c;
  }
  return pattern + "\n";
}

/// The death-test style that is safe once OpenMP has started threads (the valid call may start them).
void use_threadsafe_death_tests() { GTEST_FLAG_SET(death_test_style, "threadsafe"); }

TEST(NoExceptions, CoreBadBatchPrintsTheMessageAndAborts) {
  use_threadsafe_death_tests();
  const std::vector<float> q(2 * 4 * 3 * 4, 0.5f), k(2 * 2 * 5 * 4, 0.25f), v(2 * 2 * 5 * 3, 1.0f);
  std::vector<float> out(2 * 4 * 3 * 3, 0.0f);
  const auto call = [&] {
    qkv::attention(qkv::TensorView4<const float>(q.data(), {2, 4, 3, 4}),
                   qkv::TensorView4<const float>(k.data(), {1, 2, 5, 4}),  // batch 1, q has 2
                   qkv::TensorView4<const float>(v.data(), {2, 2, 5, 3}),
                   qkv::TensorView4<float>(out.data(), {2, 4, 3, 3}));
  };
  EXPECT_EXIT(call(), ::testing::KilledBySignal(SIGABRT),
              exact_line("qkv::attention: k axis 0 (B) has extent 1, expected 2 (the extent of q axis 0)"));
}

TEST(NoExceptions, CoreBadOptionPrintsTheMessageAndAborts) {
  use_threadsafe_death_tests();
  const std::vector<float> q(1 * 2 * 3 * 4, 0.5f), k(1 * 2 * 5 * 4, 0.25f), v(1 * 2 * 5 * 3, 1.0f);
  std::vector<float> out(1 * 2 * 3 * 3, 0.0f);
  qkv::AttentionOptions<float> options;
  options.key_lengths = {6};
  const auto call = [&] {
    qkv::attention(qkv::TensorView4<const float>(q.data(), {1, 2, 3, 4}),
                   qkv::TensorView4<const float>(k.data(), {1, 2, 5, 4}),
                   qkv::TensorView4<const float>(v.data(), {1, 2, 5, 3}),
                   qkv::TensorView4<float>(out.data(), {1, 2, 3, 3}), options);
  };
  EXPECT_EXIT(call(), ::testing::KilledBySignal(SIGABRT),
              exact_line("qkv::attention: options.key_lengths[0] is 6, expected a length in [0, 5] (k axis 2, Skv)"));
}

TEST(NoExceptions, SdpaBadValueRowsPrintsTheMessageAndAborts) {
  use_threadsafe_death_tests();
  const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(3, 4), K = qkv::Matrix<float>::Ones(5, 4),
                           V = qkv::Matrix<float>::Ones(4, 2);
  EXPECT_EXIT((void)qkv::scaled_dot_product_attention(Q, K, V), ::testing::KilledBySignal(SIGABRT),
              exact_line("qkv::scaled_dot_product_attention: V has 4 rows, expected 5 (the rows of K)"));
}

qkv::MultiHeadAttention<float> small_module() {  // d_model 8, n_heads 2, head_dim 4, zero weights
  qkv::MultiHeadAttention<float>::Config config;
  config.d_model = 8;
  config.n_heads = 2;
  return qkv::MultiHeadAttention<float>(config);
}

TEST(NoExceptions, MultiHeadAttentionBadInputPrintsTheMessageAndAborts) {
  use_threadsafe_death_tests();
  const qkv::MultiHeadAttention<float> mha = small_module();
  const qkv::Matrix<float> X = qkv::Matrix<float>::Ones(3, 5);
  EXPECT_EXIT((void)mha.forward(X), ::testing::KilledBySignal(SIGABRT),
              exact_line("qkv::MultiHeadAttention::forward: X has 5 columns, expected d_model 8"));
}

TEST(NoExceptions, KVCacheOverflowPrintsTheMessageAndAborts) {
  use_threadsafe_death_tests();
  const qkv::MultiHeadAttention<float> mha = small_module();
  qkv::KVCache<float> cache = mha.make_cache(4);
  (void)mha.forward(qkv::Matrix<float>::Ones(3, 8), cache);  // 3 of 4 tokens
  ASSERT_EQ(cache.length(), 3);
  EXPECT_EXIT((void)mha.forward(qkv::Matrix<float>::Ones(2, 8), cache), ::testing::KilledBySignal(SIGABRT),
              exact_line("qkv::MultiHeadAttention::forward: the KV cache overflows: it holds 3 of 4 tokens and 2 more "
                         "were appended (5 > capacity 4)"));
  qkv::KVCache<float> direct(2, 2, 4);
  EXPECT_EXIT(
      direct.append(qkv::Matrix<float>::Ones(3, 8), qkv::Matrix<float>::Ones(3, 8)), ::testing::KilledBySignal(SIGABRT),
      exact_line("qkv::KVCache::append: the KV cache overflows: it holds 0 of 2 tokens and 3 more were appended "
                 "(3 > capacity 2)"));
}

TEST(NoExceptions, ValidCallsStillWork) {
  // Seed 000, 例 2.4.1: Q = K = [1 0; 0 1; 1 1], V = [1 2; 3 4; 5 6], scale 1/√2; expected from a float64 loop here.
  qkv::Matrix<double> Q(3, 2), V(3, 2);
  Q << 1, 0, 0, 1, 1, 1;
  V << 1, 2, 3, 4, 5, 6;
  const qkv::Matrix<double> O = qkv::scaled_dot_product_attention(Q, Q, V);
  const qkv::Matrix<float> O_float =
      qkv::scaled_dot_product_attention(Q.cast<float>().eval(), Q.cast<float>().eval(), V.cast<float>().eval());
  for (Index i = 0; i < 3; ++i) {
    double weights[3], sum = 0;
    for (Index j = 0; j < 3; ++j) {
      weights[j] = std::exp((Q(i, 0) * Q(j, 0) + Q(i, 1) * Q(j, 1)) / std::sqrt(2.0));
      sum += weights[j];
    }
    for (Index d = 0; d < 2; ++d) {
      double expected = 0;
      for (Index j = 0; j < 3; ++j) expected += weights[j] / sum * V(j, d);
      EXPECT_NEAR(O(i, d), expected, 1e-12 * 6) << "double, i " << i << " d " << d;      // 1e-12·max(1, max|V|)
      EXPECT_NEAR(O_float(i, d), expected, 1e-6 * 6) << "float, i " << i << " d " << d;  // 1e-6·max(1, max|V|)
    }
  }
  // The module and its cache: two tokens fill 2 of 4 slots.
  const qkv::MultiHeadAttention<float> mha = small_module();
  qkv::KVCache<float> cache = mha.make_cache(4);
  const qkv::Matrix<float> Y = mha.forward(qkv::Matrix<float>::Ones(2, 8), cache);
  EXPECT_EQ(cache.length(), 2);
  EXPECT_EQ(Y.rows(), 2);
  EXPECT_TRUE(Y.isZero(0.0f));  // zero weights and biases: Y = b_o = 0
}

}  // namespace
