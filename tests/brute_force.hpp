// tests/brute_force.hpp — an independent float64 brute-force attention, written from docs/design.md's
// "Semantics every path shares" alone: plain loops over std::vector<double>, no Eigen, no qkv header.
// It is the expected value the tests compare qkv against, so it favours being obviously right over speed. Its
// visibility and score rules (`visible`, `finish_score`) also drive the plain float implementation of
// support/plain_float.hpp and the fuzzer's checks.
//
// Layouts are dense row-major: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv];
// out [B, Hq, Sq, Dv], lse [B, Hq, Sq], weights [B, Hq, Sq, Skv]. Varlen: B = 1 and sequence s owns rows
// [cu_seqlens_q[s], cu_seqlens_q[s+1]) of q and [cu_seqlens_k[s], cu_seqlens_k[s+1]) of k and v.
#pragma once

#include <algorithm>
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

/// Extents of one call: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv].
struct Shape {
  long B = 1, Hq = 1, Hkv = 1, Sq = 0, Skv = 0, D = 1, Dv = 1;
};

/// A call's extents and options (every field of qkv::AttentionOptions but the backend, in double).
struct Params : Shape {
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
  // Global positions: the views hold global queries [q_begin, q_begin + Sq) and keys [k_begin, k_begin + Skv) of a
  // sequence of sq queries and skv keys; key_lengths are then global lengths.
  struct GlobalPositions {
    long q_begin = 0, k_begin = 0, sq = 0, skv = 0;
  };
  std::optional<GlobalPositions> global_positions;
};

struct Result {
  std::vector<double> out;      // [B, Hq, Sq, Dv]
  std::vector<double> lse;      // [B, Hq, Sq]
  std::vector<double> weights;  // [B, Hq, Sq, Skv]; 0 where hidden
};

/// Flat index of (i0, i1, i2, i3) in a dense row-major tensor of extents [*, n1, n2, n3].
inline std::size_t flat(long n1, long n2, long n3, long i0, long i1, long i2, long i3) {
  return static_cast<std::size_t>(((i0 * n1 + i1) * n2 + i2) * n3 + i3);
}

/// Calls visit(b, h, i) for every query row of the views [B, Hq, Sq], in their order.
template <class Visit>
void for_each_row(const Shape& shape, Visit visit) {
  for (long b = 0; b < shape.B; ++b)
    for (long h = 0; h < shape.Hq; ++h)
      for (long i = 0; i < shape.Sq; ++i) visit(b, h, i);
}

/// One sequence of a call: batch entry `b` of the views, the rows [q0, q0 + sq) of q and [k0, k0 + skv) of k and v
/// that it owns, and skv = Skv_b, its key count after key padding. With global positions, `global` is set, skv counts
/// the view's keys that the (global) padding lets through, `diag_offset` places the diagonal in the view's key rows
/// (diag(i) = i + diag_offset) and `k_begin` is the global position of key row 0 (for the global tokens).
struct Sequence {
  long b = 0, q0 = 0, k0 = 0, sq = 0, skv = 0;
  bool global = false;
  long diag_offset = 0, k_begin = 0;
};

/// The sequences of a call in the views' order: one per batch entry, or one per varlen sequence (B = 1).
inline std::vector<Sequence> sequences(const Params& p) {
  std::vector<Sequence> result;
  if (!p.cu_seqlens_q.empty()) {
    for (std::size_t s = 0; s + 1 < p.cu_seqlens_q.size(); ++s) {
      result.push_back({0, p.cu_seqlens_q[s], p.cu_seqlens_k[s], p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s],
                        p.cu_seqlens_k[s + 1] - p.cu_seqlens_k[s]});
    }
    return result;
  }
  for (long b = 0; b < p.B; ++b) {
    if (p.global_positions) {
      // Global query q_begin + i and global key k_begin + j; the diagonal and padding are global.
      const Params::GlobalPositions& g = *p.global_positions;
      const long skv_b = p.key_lengths.empty() ? g.skv : p.key_lengths[static_cast<std::size_t>(b)];
      Sequence s{b, 0, 0, p.Sq, std::max(0L, std::min(p.Skv, skv_b - g.k_begin))};
      s.global = true;
      s.diag_offset = g.q_begin - g.k_begin + (p.alignment == Alignment::bottom_right ? skv_b - g.sq : 0);
      s.k_begin = g.k_begin;
      result.push_back(s);
      continue;
    }
    result.push_back({b, 0, 0, p.Sq, p.key_lengths.empty() ? p.Skv : p.key_lengths[static_cast<std::size_t>(b)]});
  }
  return result;
}

/// The causal diagonal of query i of sequence s: i + (Skv_b − Sq_b) bottom-right, i top-left (with global
/// positions: the global diagonal of global query q_begin + i, less k_begin, so that it compares with view rows j).
inline long diag(const Params& p, const Sequence& s, long i) {
  if (s.global) return i + s.diag_offset;
  return p.alignment == Alignment::bottom_right ? i + (s.skv - s.sq) : i;
}

/// Whether query i of sequence s and query head h may see key j of that sequence by every rule that does not need
/// the score: key padding, causal, the window (keys j < global_tokens exempt), `allowed`, a −∞ bias. (A −∞ score
/// hides the key too.)
inline bool visible(const Params& p, const Sequence& s, long h, long i, long j) {
  if (j < 0 || j >= s.skv) return false;
  const long d = diag(p, s, i);
  if (p.causal && j > d) return false;
  if (s.k_begin + j >= p.global_tokens) {  // global tokens are global key positions
    if (p.window_left >= 0 && j < d - p.window_left) return false;
    if (p.window_right >= 0 && j > d + p.window_right) return false;
  }
  if (p.allowed && !p.allowed->at(s.b, h, s.q0 + i, s.k0 + j)) return false;
  if (p.bias && p.bias->at(s.b, h, s.q0 + i, s.k0 + j) == -std::numeric_limits<double>::infinity()) return false;
  return true;
}

/// The score of a visible key from its scaled dot product q_i·k_j·scale, in T (double here; float in the plain
/// float implementation of tests/support/plain_float.hpp): softcap, then bias, then ALiBi.
template <class T>
T finish_score(const Params& p, const Sequence& s, long h, long i, long j, T scaled) {
  T score = scaled;
  if (p.softcap > 0) score = static_cast<T>(p.softcap) * std::tanh(score / static_cast<T>(p.softcap));
  if (p.bias) score += static_cast<T>(p.bias->at(s.b, h, s.q0 + i, s.k0 + j));
  if (!p.alibi_slopes.empty()) {
    score -= static_cast<T>(p.alibi_slopes[static_cast<std::size_t>(h)]) * static_cast<T>(std::abs(diag(p, s, i) - j));
  }
  return score;
}

inline Result attention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                        const Params& p) {
  const double inf = std::numeric_limits<double>::infinity();
  Result r;
  r.out.assign(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Dv), 0.0);
  r.lse.assign(static_cast<std::size_t>(p.B * p.Hq * p.Sq), -inf);
  r.weights.assign(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Skv), 0.0);
  const double scale = p.scale ? *p.scale : 1.0 / std::sqrt(static_cast<double>(p.D));
  const long group = p.Hq / p.Hkv;  // GQA: query head h reads key/value head h / group

  for (const Sequence& s : sequences(p)) {
    const long b = s.b;
    for (long h = 0; h < p.Hq; ++h) {
      const long h_kv = h / group;
      for (long i = 0; i < s.sq; ++i) {
        const long row = s.q0 + i;
        std::vector<double> score(static_cast<std::size_t>(s.skv), 0.0);
        std::vector<bool> visible_key(static_cast<std::size_t>(s.skv), false);
        for (long j = 0; j < s.skv; ++j) {  // keys j >= Skv_b are hidden: never looked at
          const long col = s.k0 + j;
          if (!visible(p, s, h, i, j)) continue;  // select, never multiply: k and v of hidden keys are not read
          double dot = 0;
          for (long d = 0; d < p.D; ++d)
            dot += q[flat(p.Hq, p.Sq, p.D, b, h, row, d)] * k[flat(p.Hkv, p.Skv, p.D, b, h_kv, col, d)];
          const double s_ij = finish_score(p, s, h, i, j, dot * scale);
          if (s_ij == -inf) continue;
          score[j] = s_ij;
          visible_key[j] = true;
        }
        const bool has_sink = !p.sinks.empty();
        const double sink = has_sink ? p.sinks[h] : -inf;
        bool any = false;
        double m = sink;  // the row maximum, sink included; NaN propagates
        for (long j = 0; j < s.skv; ++j)
          if (visible_key[j]) {
            any = true;
            if (std::isnan(score[j]) || score[j] > m) m = score[j];
          }
        const std::size_t lse_at = flat(p.Hq, p.Sq, 1, b, h, row, 0);
        if (!any) {  // no visible key: zeros (already there) and lse = log 0, or the sink logit
          r.lse[lse_at] = sink;
          continue;
        }
        double denominator = has_sink ? std::exp(sink - m) : 0.0;
        for (long j = 0; j < s.skv; ++j)
          if (visible_key[j]) denominator += std::exp(score[j] - m);
        r.lse[lse_at] = m + std::log(denominator);
        for (long j = 0; j < s.skv; ++j) {
          if (!visible_key[j]) continue;
          const double w = std::exp(score[j] - m) / denominator;
          r.weights[flat(p.Hq, p.Sq, p.Skv, b, h, row, s.k0 + j)] = w;
          for (long d = 0; d < p.Dv; ++d)
            r.out[flat(p.Hq, p.Sq, p.Dv, b, h, row, d)] += w * v[flat(p.Hkv, p.Skv, p.Dv, b, h_kv, s.k0 + j, d)];
        }
      }
    }
  }
  return r;
}

/// The sum of query (b, h, i)'s weights: 0 for a row that sees no key (i is the row in the views).
inline double row_weight_sum(const Result& r, const Params& p, long b, long h, long i) {
  double sum = 0;
  for (long j = 0; j < p.Skv; ++j) sum += r.weights[flat(p.Hq, p.Sq, p.Skv, b, h, i, j)];
  return sum;
}

}  // namespace brute
