// tests/support/plain_float.hpp — a plain float attention: scores, softmax and P·V materialized one row at a time, all
// in float. It is the yardstick of docs/design.md's accuracy rule for the fused kernel (test_fused, the fuzzer): the
// fused error against float64 is at most 2 × the error of this implementation + 1e-6·max(1, max|V|).
//
// Which keys a query sees and how a dot product becomes a score come from brute_force.hpp (`visible`,
// `finish_score`, written from the documented semantics), not from qkv's mask code, so the yardstick is independent
// of what it measures.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "brute_force.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv_test {

/// The order of the float arithmetic; every order is plain (the fuzzer takes the best of the four).
struct PlainFloatOrder {
  bool reverse = false;      ///< sum q·k over d, the denominator and P·V over keys from the last term to the first
  bool scale_first = false;  ///< multiply q by the scale before the dot product (as the fused kernel does)
};

/// Plain float attention of the call `p` describes (shapes and options; its values are floats held in double).
///
/// q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] and out [B, Hq, Sq, Dv] may have any strides; lse
/// [B, Hq, Sq] is written unless it is the empty view. A row that sees no key gets zeros and lse = its sink logit
/// (−∞ without sinks). Hidden keys are selected away, never multiplied by zero.
inline void plain_float(const qkv::TensorView4<const float>& q, const qkv::TensorView4<const float>& k,
                        const qkv::TensorView4<const float>& v, const brute::Params& p,
                        const qkv::TensorView4<float>& out, const qkv::TensorView3<float>& lse,
                        PlainFloatOrder order = {}) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float scale = p.scale ? static_cast<float>(*p.scale) : 1.0f / std::sqrt(static_cast<float>(p.D));
  const auto nth = [&order](long e, long n) { return order.reverse ? n - 1 - e : e; };
  for (const brute::Sequence& s : brute::sequences(p)) {
    std::vector<float> weight(static_cast<std::size_t>(s.skv));
    for (long h = 0; h < p.Hq; ++h) {
      const long h_kv = h / (p.Hq / p.Hkv);
      const float sink = p.sinks.empty() ? kNegInf : static_cast<float>(p.sinks[static_cast<std::size_t>(h)]);
      for (long i = 0; i < s.sq; ++i) {
        const long row = s.q0 + i;
        float m = sink;
        for (long j = 0; j < s.skv; ++j) {
          float score = kNegInf;
          if (brute::visible(p, s, h, i, j)) {
            float dot = 0;
            for (long e = 0; e < p.D; ++e) {
              const long d = nth(e, p.D);
              dot += (order.scale_first ? q(s.b, h, row, d) * scale : q(s.b, h, row, d)) * k(s.b, h_kv, s.k0 + j, d);
            }
            score = brute::finish_score(p, s, h, i, j, order.scale_first ? dot : dot * scale);
          }
          weight[static_cast<std::size_t>(j)] = score;
          m = std::max(m, score);
        }
        float denominator = p.sinks.empty() || m == kNegInf ? 0.0f : std::exp(sink - m);
        for (long e = 0; e < s.skv; ++e) {
          float& w = weight[static_cast<std::size_t>(nth(e, s.skv))];
          denominator += (w = (w == kNegInf ? 0.0f : std::exp(w - m)));
        }
        for (long d = 0; d < p.Dv; ++d) {
          float sum = 0;
          for (long e = 0; e < s.skv; ++e) {
            const long j = nth(e, s.skv);
            const float w = weight[static_cast<std::size_t>(j)];
            if (w != 0.0f) sum += w * v(s.b, h_kv, s.k0 + j, d);
          }
          out(s.b, h, row, d) = denominator > 0 ? sum / denominator : 0.0f;
        }
        if (lse.data() != nullptr) lse(s.b, h, row) = m == kNegInf ? kNegInf : m + std::log(denominator);
      }
    }
  }
}

}  // namespace qkv_test
