// Compile-fail cases of qkv/tensor_view.hpp's Eigen constructors, as AttentionOptions' users meet them, and of
// qkv/multi_head.hpp's KVCache storage rule (a 16-bit Storage needs a float Scalar; no other Storage exists). Built by
// tests/CMakeLists.txt once per case, each with QKV_COMPILE_FAIL_<case> defined, as a target outside `all`; its ctest
// entry builds the target and passes only when the compiler's output holds the case's sentence (so a case that
// compiles, or fails for another reason, fails the test). This file spells none of the sentences, so the output
// can hold one only when the library's static_assert fires.
//
// Without a case defined the file is the control: the right cases compile, warning-free, as part of `all` (the right
// KVCache cases compile in tests/test_multi_head.cpp; the module's header is included only by the KVCache cases).
#include "qkv/options.hpp"

#if defined(QKV_COMPILE_FAIL_kv_cache_double_half) || defined(QKV_COMPILE_FAIL_kv_cache_float_int16) || \
    defined(QKV_COMPILE_FAIL_make_cache_double_bfloat16)
#include <cstdint>

#include "qkv/multi_head.hpp"
#endif

void qkv_compile_fail_views();
void qkv_compile_fail_views() {
  qkv::AttentionOptions<float> options;
#if defined(QKV_COMPILE_FAIL_column_major)
  Eigen::MatrixXf bias(2, 3);  // column-major: Eigen's default
  bias.setZero();
  options.bias = bias;
#elif defined(QKV_COMPILE_FAIL_expression)
  qkv::Matrix<float> scores = qkv::Matrix<float>::Zero(2, 3);
  options.allowed = (scores.array() > 0.0f);  // an expression: no memory to view
#elif defined(QKV_COMPILE_FAIL_temporary)
  options.bias = qkv::Matrix<float>::Zero(2, 3).eval();  // a temporary: gone before the call
#elif defined(QKV_COMPILE_FAIL_scalar)
  qkv::Matrix<double> bias = qkv::Matrix<double>::Zero(2, 3);  // double into a float view
  options.bias = bias;
#elif defined(QKV_COMPILE_FAIL_kv_cache_double_half)
  qkv::KVCache<double, Eigen::half> cache(4, 1, 2);  // 16-bit keys and values go with a float module only
  (void)cache;
#elif defined(QKV_COMPILE_FAIL_kv_cache_float_int16)
  qkv::KVCache<float, std::int16_t> cache(4, 1, 2);  // not a storage type qkv::attention reads
  (void)cache;
#elif defined(QKV_COMPILE_FAIL_make_cache_double_bfloat16)
  qkv::MultiHeadAttention<double>::Config config;
  config.d_model = 4;
  const qkv::MultiHeadAttention<double> module(config);
  auto cache = module.make_cache<Eigen::bfloat16>(4);  // a double module's cache in 16 bits
  (void)cache;
#else
  // The control: what binds as a view, and what the owning form takes.
  qkv::Matrix<float> bias = qkv::Matrix<float>::Zero(2, 3);
  Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> allowed(2, 3);
  allowed.setConstant(true);
  options.bias = bias;
  options.allowed = allowed;
  options.bias = Eigen::Map<const qkv::Matrix<float>>(bias.data(), 2, 3);
  Eigen::MatrixXf column_major = Eigen::MatrixXf::Zero(2, 3);
  options.set_bias(column_major).set_allowed(column_major.array() > 0.0f);
  options.set_bias(qkv::Matrix<float>::Zero(2, 3));
#endif
  (void)options;
}
