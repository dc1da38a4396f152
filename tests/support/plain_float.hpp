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
  // The loops index the data by offsets and strides computed once per head and row rather than through the views'
  // operator(): the same terms in the same order, without an index of four products per element, which took most of
  // test_fused's time (at -O0 under the sanitizers, three calls more per element; docs/development.md, CI budget).
  const long D = p.D, Dv = p.Dv;
  const long q_d = q.stride(3), k_j = k.stride(2), k_d = k.stride(3), v_j = v.stride(2), v_d = v.stride(3);
  const float* const q_data = q.data();
  const float* const k_data = k.data();
  const float* const v_data = v.data();
  for (const brute::Sequence& s : brute::sequences(p)) {
    std::vector<float> weights(static_cast<std::size_t>(s.skv));
    float* const weight = weights.data();
    for (long h = 0; h < p.Hq; ++h) {
      const long h_kv = h / (p.Hq / p.Hkv);
      const float sink = p.sinks.empty() ? kNegInf : static_cast<float>(p.sinks[static_cast<std::size_t>(h)]);
      // Offsets in elements (of the sequence's first key row of this head); a pointer is formed only for an element
      // read, as operator() forms it.
      const long k_head = s.b * k.stride(0) + h_kv * k.stride(1) + s.k0 * k_j;
      const long v_head = s.b * v.stride(0) + h_kv * v.stride(1) + s.k0 * v_j;
      for (long i = 0; i < s.sq; ++i) {
        const long row = s.q0 + i;
        const long q_row = s.b * q.stride(0) + h * q.stride(1) + row * q.stride(2);
        float m = sink;
        for (long j = 0; j < s.skv; ++j) {
          float score = kNegInf;
          if (brute::visible(p, s, h, i, j)) {
            const long k_row = k_head + j * k_j;
            float dot = 0;
            for (long e = 0; e < D; ++e) {
              const long d = order.reverse ? D - 1 - e : e;
              const float qd = q_data[q_row + d * q_d];
              dot += (order.scale_first ? qd * scale : qd) * k_data[k_row + d * k_d];
            }
            score = brute::finish_score(p, s, h, i, j, order.scale_first ? dot : dot * scale);
          }
          weight[j] = score;
          m = std::max(m, score);
        }
        float denominator = p.sinks.empty() || m == kNegInf ? 0.0f : std::exp(sink - m);
        for (long e = 0; e < s.skv; ++e) {
          float& w = weight[order.reverse ? s.skv - 1 - e : e];
          denominator += (w = (w == kNegInf ? 0.0f : std::exp(w - m)));
        }
        for (long d = 0; d < Dv; ++d) {
          float sum = 0;
          for (long e = 0; e < s.skv; ++e) {
            const long j = order.reverse ? s.skv - 1 - e : e;
            const float w = weight[j];
            if (w != 0.0f) sum += w * v_data[v_head + j * v_j + d * v_d];
          }
          out(s.b, h, row, d) = denominator > 0 ? sum / denominator : 0.0f;
        }
        if (lse.data() != nullptr) lse(s.b, h, row) = m == kNegInf ? kNegInf : m + std::log(denominator);
      }
    }
  }
}

}  // namespace qkv_test
