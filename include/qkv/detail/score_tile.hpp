// qkv/detail/score_tile.hpp — a tile of dot products made into the scores the online softmax takes.
//
// One function for prefill and decoding: the post-scale (where Q could not carry the scale: query_block.hpp), then
// per element softcap, bias and ALiBi (score.hpp, through HeadMask) and the mask. The index mask runs only in
// boundary tiles (`index_mask`); `allowed` and `bias` decide in every tile where they are set. Hidden keys become
// −∞, which the softmax turns into weight 0 (never a multiplication by zero).
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/score_tile.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_SCORE_TILE_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_SCORE_TILE_HPP
#undef QKV_DETAIL_SCORE_TILE_HPP
#else
#define QKV_DETAIL_SCORE_TILE_HPP
#endif

#include <algorithm>
#include <cmath>
#include <limits>

#include "qkv/config.hpp"
#include "qkv/detail/query_block.hpp"
#include "qkv/mask.hpp"
#include "qkv/simd/exp_constants.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// The rows of a task's block: block row r is query i_begin + r % rows of the group's head r / rows, whose mask is
/// masks[r / rows].
struct BlockRows {
  const HeadMask<float>* masks = nullptr;
  Index rows = 1;
  Index i_begin = 0;
};

/// Finishes the scores s[rr·lds + jj] of block rows r_begin + rr (rr < n_rows) and keys j0 + jj (first ≤ jj < n) in
/// place. kBase2: the softmax takes base-2 scores, so a score finished by softcap, bias or ALiBi (which work in base
/// e) is multiplied by log2 e here; returns false if that overflowed a finite score (the task must then run in base
/// e), true otherwise. O(n_rows·(n − first)) where anything applies.
template <bool kBase2>
bool finish_score_tile(float* s, Index lds, Index r_begin, Index n_rows, Index first, Index n, Index j0,
                       const BlockRows& block, bool index_mask, const QueryScale& scaled) noexcept {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kLog2e = simd::exp_constants::kLog2e;
  if (scaled.post_scale) {
    for (Index rr = 0; rr < n_rows; ++rr)
      for (Index jj = first; jj < n; ++jj) s[rr * lds + jj] = s[rr * lds + jj] * scaled.score_scale * scaled.score_base;
  }
  const HeadMask<float>& first_mask = block.masks[0];
  const bool data_mask = first_mask.has_data_mask(), modifies = first_mask.modifies_scores();
  bool fits = true;
  if (data_mask || modifies) {
    for (Index rr = 0; rr < n_rows; ++rr) {
      const Index r = r_begin + rr;
      const HeadMask<float>& mask = block.masks[r / block.rows];
      const Index i = block.i_begin + r % block.rows;
      float* row = s + rr * lds;
      for (Index jj = first; jj < n; ++jj) {
        const Index j = j0 + jj;
        if ((index_mask || data_mask) && !mask.visible(i, j)) {
          row[jj] = kNegInf;
        } else if (modifies) {
          const float finished = mask.finish(row[jj], i, j);
          row[jj] = kBase2 ? finished * kLog2e : finished;
          if (kBase2 && std::isinf(row[jj]) && !std::isinf(finished)) fits = false;
        }
      }
    }
  } else if (index_mask) {
    // Index rules only: query i sees its band and the global prefix (MaskGeometry::band, ::global), two ranges of
    // columns; the rest of [first, n) is filled with −∞ (on a causal diagonal strip, a few columns per row).
    const MaskGeometry& geometry = first_mask.geometry;
    const auto column = [&](Index j) { return std::min(std::max(j - j0, first), n); };
    for (Index rr = 0; rr < n_rows; ++rr) {
      const Index i = block.i_begin + (r_begin + rr) % block.rows;
      const KeyRange band = geometry.band(i), global = geometry.global(i);
      float* row = s + rr * lds;
      const Index hidden_from = column(global.end);  // [first, hidden_from) is the global prefix
      const Index band_begin = column(band.begin), band_end = column(band.end);
      std::fill(row + hidden_from, row + std::max(hidden_from, band_begin), kNegInf);
      std::fill(row + std::max(hidden_from, band_end), row + n, kNegInf);
    }
  }
  return fits;
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_SCORE_TILE_HPP, per pass
