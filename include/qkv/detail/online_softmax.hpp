// qkv/detail/online_softmax.hpp — the running softmax of a block of query rows (FlashAttention's Softmax).
//
// Per row r: row_max (the largest score seen), row_sum (Σ exp(s − row_max) over the keys seen) and acc_o (Σ of the
// weights times V, in the same units). Each tile of scores becomes weights in place (`update`, or `update_rows` for
// a prefill strip's rows at once), acc_o is rescaled only when the row's max rose, and `finalize` divides once per
// row and gives the lse. The base is a template parameter: kBase2 takes scores already multiplied by log2 e and uses
// exp2 (the prefill's fast path), otherwise exp (decoding, and a prefill task whose scores could overflow in base 2:
// query_block.hpp, base2_fits).
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/online_softmax.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_ONLINE_SOFTMAX_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_ONLINE_SOFTMAX_HPP
#undef QKV_DETAIL_ONLINE_SOFTMAX_HPP
#else
#define QKV_DETAIL_ONLINE_SOFTMAX_HPP
#endif

#include <algorithm>
#include <cmath>
#include <limits>

#include "qkv/config.hpp"
#include "qkv/simd/simd.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// The online softmax state of a task's rows, over scratch the caller owns: row_max and row_sum (M floats each),
/// row_nan (M flags: a NaN among the row's visible scores) and acc_o (M × Dv floats, row r at acc_o + r·Dv).
template <class Tag, bool kBase2>
class OnlineSoftmax {
 public:
  using Vec = typename Tag::Vec;

  OnlineSoftmax(float* row_max, float* row_sum, char* row_nan, float* acc_o, Index Dv) noexcept
      : row_max_(row_max), row_sum_(row_sum), row_nan_(row_nan), acc_o_(acc_o), Dv_(Dv) {}

  /// exp in the softmax's base, vector and scalar (apart: with the scalar tag, Vec is float, and its simd::exp is
  /// not std::exp). Unqualified calls, found by argument-dependent lookup at instantiation: a tag defined after this
  /// header (the tests' emulated one) brings its own exp and exp2.
  static Vec vector_exp(Vec x) noexcept {
    using namespace simd;
    if constexpr (kBase2) {
      return exp2(Tag(), x);
    } else {
      return exp(Tag(), x);
    }
  }
  static float scalar_exp(float x) noexcept { return kBase2 ? std::exp2(x) : std::exp(x); }

  /// Clears rows [0, M): no key seen, acc_o zero.
  void reset(Index M) noexcept {
    std::fill(row_max_, row_max_ + M, -std::numeric_limits<float>::infinity());
    std::fill(row_sum_, row_sum_ + M, 0.0f);
    std::fill(row_nan_, row_nan_ + M, 0);
    std::fill(acc_o_, acc_o_ + M * Dv_, 0.0f);
  }

  /// Row r's acc_o (its output after `finalize`).
  float* acc_o(Index r) const noexcept { return acc_o_ + r * Dv_; }

  /// Turns the scores row[first, n) of row r (hidden keys −∞) into weights exp(s − row_max) in place and adds them
  /// to row_sum (the vector exp throughout: the last (n − first) mod L scores as one masked vector, tail_vector);
  /// rescales row_sum and acc_o by exp(old max − new max) when the max rose. While the row has seen no visible key,
  /// its weights are 0 and a NaN among them is remembered (max would lose it). update_rows for one row. O(n − first),
  /// plus O(Dv) where the max rose; throws nothing.
  void update(Index r, float* row, Index first, Index n) noexcept { update_rows<1>(r, row, 0, first, n); }

  /// update() for kRows consecutive rows r, r + 1, … (r + kRows ≤ M) whose scores lie `ld` floats apart from `rows`
  /// on (rows that do not overlap, ld ≥ n − first, and not in this object's state), their passes interleaved: each
  /// row's four running maxes (so that the max pass is not one chain of dependent maxes), exps and sum take the same
  /// values in the same order whatever kRows is, so the results are the same bits as one row at a time, but the
  /// rows' dependency chains (the horizontal max, then that row's exps and their sum) overlap instead of running one
  /// row after another (a prefill at T = 1024, D = 64 spent 9.25 % of its time in its rows one at a time, 8.05 % in
  /// strips of 6: bench/README.md, "2026-12-04, nineteenth session"). A group in which some row's max stays −∞ after
  /// these scores (no visible key yet, or a NaN that reached the tile's max) goes one row at a time. kRows × 4
  /// running max vectors: 24 at a strip of 6, within AVX-512's 32 registers; AVX2 and the scalar tag spill some
  /// (measured faster all the same). O(kRows · (n − first)) in two passes, plus O(kRows · Dv) where a row's max
  /// rose; throws nothing.
  template <int kRows>
  void update_rows(Index r, float* rows, Index ld, Index first, Index n) noexcept {
    using namespace simd;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr int L = Tag::kLanes;
    const Index n_vec = first + (n - first) / L * L;
    // The last n − n_vec < L scores as one vector whose other lanes are −∞ (a causal diagonal strip ends anywhere):
    // their exp is 0 in either base and adds nothing, and no scalar exp runs.
    const int tail = static_cast<int>(n - n_vec);
    Vec vmax[4][kRows];
    QKV_UNROLL for (int a = 0; a < 4; ++a) {
      QKV_UNROLL for (int k = 0; k < kRows; ++k) vmax[a][k] = set1(Tag(), kNegInf);
    }
    Index j = first;
    for (; j + 4 * L <= n_vec; j += 4 * L) {
      QKV_UNROLL for (int k = 0; k < kRows; ++k) {
        QKV_UNROLL for (int a = 0; a < 4; ++a) vmax[a][k] = max(vmax[a][k], load(Tag(), rows + k * ld + j + a * L));
      }
    }
    for (; j < n_vec; j += L) {
      QKV_UNROLL for (int k = 0; k < kRows; ++k) vmax[0][k] = max(vmax[0][k], load(Tag(), rows + k * ld + j));
    }
    Vec vm[kRows];
    float new_max[kRows];
    bool any_empty = false;
    QKV_UNROLL for (int k = 0; k < kRows; ++k) {
      const auto v_tail = tail > 0 ? tail_vector(rows + k * ld + n_vec, tail) : set1(Tag(), kNegInf);
      const float tile_max =
          reduce_max(Tag(), max(max(max(vmax[0][k], vmax[1][k]), max(vmax[2][k], vmax[3][k])), v_tail));
      new_max[k] = std::max(row_max_[r + k], tile_max);
      any_empty |= new_max[k] == kNegInf;
      vm[k] = set1(Tag(), new_max[k]);
    }
    if (any_empty) {
      if constexpr (kRows == 1) {
        no_visible_key(r, rows, first, n);
      } else {
        for (int k = 0; k < kRows; ++k) update_rows<1>(r + k, rows + k * ld, ld, first, n);
      }
      return;
    }
    Vec vsum[kRows];
    QKV_UNROLL for (int k = 0; k < kRows; ++k) vsum[k] = zero(Tag());
    for (Index jj = first; jj < n_vec; jj += L) {
      QKV_UNROLL for (int k = 0; k < kRows; ++k) {
        float* p = rows + k * ld + jj;
        const auto e = vector_exp(sub(load(Tag(), p), vm[k]));
        store(Tag(), p, e);
        vsum[k] = add(vsum[k], e);
      }
    }
    if (tail > 0) {
      QKV_UNROLL for (int k = 0; k < kRows; ++k) {
        float* p = rows + k * ld + n_vec;
        const auto e = vector_exp(sub(tail_vector(p, tail), vm[k]));
        store_partial(Tag(), p, e, tail);
        vsum[k] = add(vsum[k], e);
      }
    }
    for (int k = 0; k < kRows; ++k) finish_update(r + k, new_max[k], reduce_sum(Tag(), vsum[k]));
  }

  /// Row r's output in acc_o(r): acc_o / row_sum (one division per row); zeros for a row that saw no key, NaN for
  /// a row with NaN among its visible scores. Returns its lse in base e: row_max·ln 2 + log(row_sum) in base 2
  /// (in double, so that the conversion adds no rounding beyond the final one), −∞ or NaN in those two cases.
  float finalize(Index r) noexcept {
    constexpr double kLn2 = 0.69314718055994530942;
    float* o = acc_o(r);
    if (row_nan_[r]) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (Index d = 0; d < Dv_; ++d) o[d] = nan;
      return nan;
    }
    if (row_sum_[r] == 0.0f) {
      for (Index d = 0; d < Dv_; ++d) o[d] = 0.0f;
      return -std::numeric_limits<float>::infinity();
    }
    const float inverse = 1.0f / row_sum_[r];
    for (Index d = 0; d < Dv_; ++d) o[d] *= inverse;
    if constexpr (kBase2) {
      return static_cast<float>(double(row_max_[r]) * kLn2 + std::log(double(row_sum_[r])));
    } else {
      return row_max_[r] + std::log(row_sum_[r]);
    }
  }

 private:
  float* row_max_;
  float* row_sum_;
  char* row_nan_;
  float* acc_o_;
  Index Dv_;

  /// Row r's scores row[first, n) while its max stays −∞ (no visible key yet): weights 0, and a NaN among them
  /// remembered in row_nan (max would lose it). O(n − first).
  void no_visible_key(Index r, float* row, Index first, Index n) noexcept {
    for (Index j = first; j < n; ++j) {
      if (std::isnan(row[j])) row_nan_[r] = 1;
      row[j] = 0.0f;
    }
  }

  /// The end of row r's update to `new_max` (not −∞) with the tile's weights summing to `sum`: rescales row_sum and
  /// acc_o by exp(old max − new max) if the max rose from a finite value (a row's first visible keys rescale
  /// nothing), then adds the tile's sum. O(Dv); throws nothing.
  void finish_update(Index r, float new_max, float sum) noexcept {
    using namespace simd;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr int L = Tag::kLanes;
    const float old_max = row_max_[r];
    if (new_max > old_max && old_max != kNegInf) {
      const float alpha = scalar_exp(old_max - new_max);
      row_sum_[r] *= alpha;
      float* o = acc_o(r);
      const auto va = set1(Tag(), alpha);
      const Index dv_vec = Dv_ / L * L;
      for (Index d = 0; d < dv_vec; d += L) store(Tag(), o + d, mul(load(Tag(), o + d), va));
      for (Index d = dv_vec; d < Dv_; ++d) o[d] *= alpha;
    }
    row_sum_[r] += sum;
    row_max_[r] = new_max;
  }

  /// The first `tail` (1 ≤ tail < L) floats at p in a vector's first lanes, −∞ in the others: the masked load's
  /// zeros plus a row of 0 then −∞ shifted by tail (x + 0 = x for every x but −0, whose exp is the same).
  static Vec tail_vector(const float* p, int tail) noexcept {
    using namespace simd;
    constexpr int L = Tag::kLanes;
    static constexpr struct Pad {
      float lanes[2 * L];
      constexpr Pad() : lanes() {
        for (int i = L; i < 2 * L; ++i) lanes[i] = -std::numeric_limits<float>::infinity();
      }
    } kPad{};
    return add(load_partial(Tag(), p, tail), load(Tag(), kPad.lanes + (L - tail)));
  }
};

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_ONLINE_SOFTMAX_HPP, per pass
