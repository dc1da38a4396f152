// tests/support/backward_call.hpp — the valid call of ValidCall (support/problem.hpp) as a backward call, for the
// error tests of qkv::attention_backward (test_backward, test_malformed). Apart from problem.hpp so that the suites
// that do not call the backward do not compile it.
#pragma once

#include <vector>

#include "qkv/backward.hpp"
#include "support/problem.hpp"

namespace qkv_test {

/// The valid call of ValidCall as a backward call: qkv::attention_backward with d_out [2, 4, 3, 3] and the gradients
/// d_q [2, 4, 3, 4], d_k [2, 2, 5, 4], d_v [2, 2, 5, 3] (test_backward, test_malformed).
struct BackwardCall : ValidCall {
  std::vector<float> d_out_data = std::vector<float>(kRoom, 1.0f), d_q_data = std::vector<float>(kRoom),
                     d_k_data = std::vector<float>(kRoom), d_v_data = std::vector<float>(kRoom),
                     d_bias_data = std::vector<float>(kRoom), d_sinks_data = std::vector<float>(kRoom);
  qkv::TensorView4<const float> d_out{d_out_data.data(), {B, Hq, Sq, Dv}};
  qkv::TensorView4<float> d_q{d_q_data.data(), {B, Hq, Sq, D}};
  qkv::TensorView4<float> d_k{d_k_data.data(), {B, Hkv, Skv, D}};
  qkv::TensorView4<float> d_v{d_v_data.data(), {B, Hkv, Skv, Dv}};
  qkv::AttentionGradientExtras<float> extras;

  void run() { qkv::attention_backward<float>(q, k, v, out, lse, d_out, d_q, d_k, d_v, options, extras); }
};

}  // namespace qkv_test
