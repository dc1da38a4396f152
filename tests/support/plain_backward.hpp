// tests/support/plain_backward.hpp — a plain, materialized attention backward in any scalar type T: per query row the
// scores, the softmax, dP = dO·Vᵀ and dS = P ∘ (dP − Σ_j P∘dP) written out in T, then dQ, dK, dV (and the bias and
// sink gradients) accumulated in T. In float it is the yardstick of the backward's accuracy rule (issue 17: the fused
// float error against float64 is at most 2 × this implementation's error + 1e-6·max(1, max|float64 gradient|)); in
// double it is an independent float64 backward (test_backward_torch, the fuzzer).
//
// Which keys a query sees and how a dot product becomes a score come from brute_force.hpp (`visible`,
// `finish_score`, written from the documented semantics), not from qkv's code, so the yardstick is independent of what
// it measures. It recomputes the forward from q, k and v (it reads no out or lse), has no dropout, and is meant for
// finite inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "brute_force.hpp"

namespace qkv_test {

/// The gradients of L = Σ out ∘ d_out, dense row-major: d_q [B, Hq, Sq, D], d_k [B, Hkv, Skv, D], d_v [B, Hkv, Skv,
/// Dv], d_bias with the bias's extents (empty without a bias), d_sinks [Hq] (empty without sinks).
template <class T>
struct PlainGradients {
  std::vector<T> d_q, d_k, d_v, d_bias, d_sinks;
};

/// The materialized backward of the call `p` describes (shapes and options, values of T held in double), on dense
/// row-major q, k, v and d_out in T. A row that sees no key contributes nothing; a row that sees only its sink
/// contributes nothing either (its out is 0, so D_i = 0).
///
///   s_ij = finish_score(q_i·k_j·scale),  P = softmax over the visible keys and the sink,  dP_ij = dO_i·v_j,
///   D_i = Σ_j P_ij·dP_ij,  dS_ij = P_ij·(dP_ij − D_i),  dx_ij = dS_ij·(1 − tanh²(q_i·k_j·scale / softcap)) with
///   softcap (dS_ij without),  dQ_i += dx_ij·scale·k_j,  dK_j += dx_ij·scale·q_i,  dV_j += P_ij·dO_i,
///   d_bias_ij += dS_ij (summed over broadcast axes),  d_sink_h += −P_sink·D_i.
///
/// With `out` and `lse` (dense [B, Hq, Sq, Dv] and [B, Hq, Sq] in T: a forward's results, the inputs
/// qkv::attention_backward takes), the weights come from them instead, as a backward given the forward's results
/// computes them: P_ij = exp(s_ij − lse_i), P_sink = exp(sink − lse_i), D_i = dO_i·out_i. The two forms differ in
/// float by where the rounding enters (a float lse carries |lse|·2^-24 into every weight), so a float yardstick takes
/// the larger of their errors, as the forward's takes the largest over its summation orders.
template <class T>
PlainGradients<T> plain_backward(const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                                 const std::vector<T>& d_out, const brute::Params& p,
                                 const std::vector<T>* out = nullptr, const std::vector<T>* lse = nullptr) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  PlainGradients<T> g;
  g.d_q.assign(q.size(), T(0));
  g.d_k.assign(k.size(), T(0));
  g.d_v.assign(v.size(), T(0));
  if (p.bias) g.d_bias.assign(p.bias->data.size(), T(0));
  g.d_sinks.assign(p.sinks.size(), T(0));
  const T scale = p.scale ? static_cast<T>(*p.scale) : T(1) / std::sqrt(static_cast<T>(p.D));
  const T softcap = static_cast<T>(p.softcap);
  const long group = p.Hq / p.Hkv;
  for (const brute::Sequence& s : brute::sequences(p)) {
    std::vector<T> score(static_cast<std::size_t>(s.skv)), weight(static_cast<std::size_t>(s.skv)),
        d_weight(static_cast<std::size_t>(s.skv)), slope(static_cast<std::size_t>(s.skv));
    std::vector<char> seen(static_cast<std::size_t>(s.skv));
    for (long h = 0; h < p.Hq; ++h) {
      const long h_kv = h / group;
      const T sink = p.sinks.empty() ? kNegInf : static_cast<T>(p.sinks[static_cast<std::size_t>(h)]);
      for (long i = 0; i < s.sq; ++i) {
        const long row = s.q0 + i;
        const auto q_at = [&](long d) -> const T& { return q[brute::flat(p.Hq, p.Sq, p.D, s.b, h, row, d)]; };
        T m = sink;
        bool any = false;
        for (long j = 0; j < s.skv; ++j) {
          const std::size_t jj = static_cast<std::size_t>(j);
          seen[jj] = 0;
          if (!brute::visible(p, s, h, i, j)) continue;
          T dot = 0;
          for (long d = 0; d < p.D; ++d) dot += q_at(d) * k[brute::flat(p.Hkv, p.Skv, p.D, s.b, h_kv, s.k0 + j, d)];
          const T x = dot * scale;
          score[jj] = brute::finish_score(p, s, h, i, j, x);
          if (score[jj] == kNegInf) continue;
          seen[jj] = 1;
          any = true;
          if (softcap > 0) {
            const T t = std::tanh(x / softcap);
            slope[jj] = T(1) - t * t;
          } else {
            slope[jj] = T(1);
          }
          m = std::max(m, score[jj]);
        }
        if (!any) continue;  // zeros out; with a sink, P_sink = 1 and D_i = 0: no gradient anywhere
        const bool given = out != nullptr && lse != nullptr;
        const T row_lse = given ? (*lse)[brute::flat(p.Hq, p.Sq, 1, s.b, h, row, 0)] : T(0);
        T denominator = sink == kNegInf ? T(0) : std::exp(sink - m);
        for (long j = 0; j < s.skv; ++j) {
          const std::size_t jj = static_cast<std::size_t>(j);
          if (seen[jj]) denominator += (weight[jj] = given ? std::exp(score[jj] - row_lse) : std::exp(score[jj] - m));
        }
        T row_sum = 0;  // D_i = Σ_j P_ij·dP_ij, or dO_i·out_i
        for (long j = 0; j < s.skv; ++j) {
          const std::size_t jj = static_cast<std::size_t>(j);
          if (!seen[jj]) continue;
          if (!given) weight[jj] /= denominator;
          T dp = 0;
          for (long d = 0; d < p.Dv; ++d) {
            dp += d_out[brute::flat(p.Hq, p.Sq, p.Dv, s.b, h, row, d)] *
                  v[brute::flat(p.Hkv, p.Skv, p.Dv, s.b, h_kv, s.k0 + j, d)];
          }
          d_weight[jj] = dp;
          if (!given) row_sum += weight[jj] * dp;
        }
        if (given) {
          for (long d = 0; d < p.Dv; ++d) {
            const std::size_t at = brute::flat(p.Hq, p.Sq, p.Dv, s.b, h, row, d);
            row_sum += d_out[at] * (*out)[at];
          }
        }
        if (!p.sinks.empty() && sink != kNegInf) {
          const T sink_weight = given ? std::exp(sink - row_lse) : std::exp(sink - m) / denominator;
          g.d_sinks[static_cast<std::size_t>(h)] -= sink_weight * row_sum;
        }
        for (long j = 0; j < s.skv; ++j) {
          const std::size_t jj = static_cast<std::size_t>(j);
          if (!seen[jj]) continue;
          const T ds = weight[jj] * (d_weight[jj] - row_sum);
          if (p.bias) {
            const auto& e = p.bias->extents;
            const long b_ = e[0] == 1 ? 0 : s.b, h_ = e[1] == 1 ? 0 : h, i_ = e[2] == 1 ? 0 : row;
            g.d_bias[static_cast<std::size_t>(((b_ * e[1] + h_) * e[2] + i_) * e[3] + s.k0 + j)] += ds;
          }
          const T dx = ds * slope[jj] * scale;
          for (long d = 0; d < p.D; ++d) {
            const std::size_t at_k = brute::flat(p.Hkv, p.Skv, p.D, s.b, h_kv, s.k0 + j, d);
            g.d_q[brute::flat(p.Hq, p.Sq, p.D, s.b, h, row, d)] += dx * k[at_k];
            g.d_k[at_k] += dx * q_at(d);
          }
          for (long d = 0; d < p.Dv; ++d) {
            g.d_v[brute::flat(p.Hkv, p.Skv, p.Dv, s.b, h_kv, s.k0 + j, d)] +=
                weight[jj] * d_out[brute::flat(p.Hq, p.Sq, p.Dv, s.b, h, row, d)];
          }
        }
      }
    }
  }
  return g;
}

}  // namespace qkv_test
