// tests/brute_force.hpp — an independent float64 brute-force attention, written from DESIGN.md's
// "Semantics every path shares" alone: plain loops over std::vector<double>, no Eigen, no qkv header.
// It is the expected value the tests compare qkv against, so it favours being obviously right over speed.
//
// Layouts are dense row-major: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv];
// out [B, Hq, Sq, Dv], lse [B, Hq, Sq], weights [B, Hq, Sq, Skv]. Varlen: B = 1 and sequence s owns rows
// [cu_seqlens_q[s], cu_seqlens_q[s+1]) of q and [cu_seqlens_k[s], cu_seqlens_k[s+1]) of k and v.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <vector>

namespace brute {

enum class Alignment { bottom_right, top_left };

/// A dense row-major tensor of extents [B or 1, Hq or 1, Sq or 1, Skv]; an axis of extent 1 broadcasts.
template <class T>
struct Broadcast4 {
  std::array<long, 4> extents{};
  std::vector<T> data;

  T at(long b, long h, long i, long j) const {
    const long b_ = extents[0] == 1 ? 0 : b;
    const long h_ = extents[1] == 1 ? 0 : h;
    const long i_ = extents[2] == 1 ? 0 : i;
    return data[static_cast<std::size_t>(((b_ * extents[1] + h_) * extents[2] + i_) * extents[3] + j)];
  }
};

struct Params {
  long B = 1, Hq = 1, Hkv = 1, Sq = 0, Skv = 0, D = 1, Dv = 1;
  std::optional<double> scale;  // unset = 1/sqrt(D)
  double softcap = 0;           // 0 = off
  bool causal = false;
  Alignment alignment = Alignment::bottom_right;
  long window_left = -1, window_right = -1;  // -1 = unbounded
  long global_tokens = 0;
  std::vector<long> key_lengths;            // size B or empty
  std::optional<Broadcast4<char>> allowed;  // nonzero = may attend
  std::optional<Broadcast4<double>> bias;
  std::vector<double> alibi_slopes;              // size Hq or empty
  std::vector<double> sinks;                     // size Hq or empty
  std::vector<long> cu_seqlens_q, cu_seqlens_k;  // size B+1 each (varlen, B = 1 in the views) or empty
};

struct Result {
  std::vector<double> out;      // [B, Hq, Sq, Dv]
  std::vector<double> lse;      // [B, Hq, Sq]
  std::vector<double> weights;  // [B, Hq, Sq, Skv]; 0 where hidden
};

inline Result attention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                        const Params& p) {
  const double inf = std::numeric_limits<double>::infinity();
  const auto at = [](long n1, long n2, long n3, long i0, long i1, long i2, long i3) {
    return static_cast<std::size_t>(((i0 * n1 + i1) * n2 + i2) * n3 + i3);
  };
  Result r;
  r.out.assign(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Dv), 0.0);
  r.lse.assign(static_cast<std::size_t>(p.B * p.Hq * p.Sq), -inf);
  r.weights.assign(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Skv), 0.0);
  const double scale = p.scale ? *p.scale : 1.0 / std::sqrt(static_cast<double>(p.D));
  const bool varlen = !p.cu_seqlens_q.empty();
  const long n_sequences = varlen ? static_cast<long>(p.cu_seqlens_q.size()) - 1 : p.B;
  const long group = p.Hq / p.Hkv;  // GQA: query head h reads key/value head h / group

  for (long s = 0; s < n_sequences; ++s) {
    const long b = varlen ? 0 : s;
    const long q0 = varlen ? p.cu_seqlens_q[s] : 0;  // first row of this sequence in q
    const long k0 = varlen ? p.cu_seqlens_k[s] : 0;  // first row of this sequence in k and v
    const long Sq_b = varlen ? p.cu_seqlens_q[s + 1] - q0 : p.Sq;
    const long Skv_b = varlen ? p.cu_seqlens_k[s + 1] - k0 : (p.key_lengths.empty() ? p.Skv : p.key_lengths[b]);
    for (long h = 0; h < p.Hq; ++h) {
      const long h_kv = h / group;
      for (long i = 0; i < Sq_b; ++i) {
        const long row = q0 + i;
        const long diag = p.alignment == Alignment::bottom_right ? i + (Skv_b - Sq_b) : i;
        std::vector<double> score(static_cast<std::size_t>(Skv_b), 0.0);
        std::vector<bool> visible(static_cast<std::size_t>(Skv_b), false);
        for (long j = 0; j < Skv_b; ++j) {  // keys j >= Skv_b are hidden: never looked at
          const long col = k0 + j;
          bool hidden = p.causal && j > diag;
          if (j >= p.global_tokens) {
            if (p.window_left >= 0 && j < diag - p.window_left) hidden = true;
            if (p.window_right >= 0 && j > diag + p.window_right) hidden = true;
          }
          if (p.allowed && !p.allowed->at(b, h, row, col)) hidden = true;
          const double bias = p.bias ? p.bias->at(b, h, row, col) : 0.0;
          if (bias == -inf) hidden = true;
          if (hidden) continue;  // select, never multiply: k and v of hidden keys are not read
          double dot = 0;
          for (long d = 0; d < p.D; ++d)
            dot += q[at(p.Hq, p.Sq, p.D, b, h, row, d)] * k[at(p.Hkv, p.Skv, p.D, b, h_kv, col, d)];
          double s_ij = dot * scale;
          if (p.softcap > 0) s_ij = p.softcap * std::tanh(s_ij / p.softcap);
          s_ij += bias;
          if (!p.alibi_slopes.empty()) s_ij -= p.alibi_slopes[h] * std::abs(static_cast<double>(diag - j));
          if (s_ij == -inf) continue;
          score[j] = s_ij;
          visible[j] = true;
        }
        const bool has_sink = !p.sinks.empty();
        const double sink = has_sink ? p.sinks[h] : -inf;
        bool any = false;
        double m = sink;  // the row maximum, sink included; NaN propagates
        for (long j = 0; j < Skv_b; ++j)
          if (visible[j]) {
            any = true;
            if (std::isnan(score[j]) || score[j] > m) m = score[j];
          }
        const std::size_t lse_at = at(p.Hq, p.Sq, 1, b, h, row, 0);
        if (!any) {  // no visible key: zeros (already there) and lse = log 0, or the sink logit
          r.lse[lse_at] = sink;
          continue;
        }
        double denominator = has_sink ? std::exp(sink - m) : 0.0;
        for (long j = 0; j < Skv_b; ++j)
          if (visible[j]) denominator += std::exp(score[j] - m);
        r.lse[lse_at] = m + std::log(denominator);
        for (long j = 0; j < Skv_b; ++j) {
          if (!visible[j]) continue;
          const double w = std::exp(score[j] - m) / denominator;
          r.weights[at(p.Hq, p.Sq, p.Skv, b, h, row, k0 + j)] = w;
          for (long d = 0; d < p.Dv; ++d)
            r.out[at(p.Hq, p.Sq, p.Dv, b, h, row, d)] += w * v[at(p.Hkv, p.Skv, p.Dv, b, h_kv, k0 + j, d)];
        }
      }
    }
  }
  return r;
}

}  // namespace brute
