// qkv/mask.hpp — the one place that decides whether query i may see key j, and which key tiles a query
// tile must visit.
//
// Every backend asks this header and nothing else: `MaskGeometry` holds the index rules of one sequence
// (key padding, causal diagonal, sliding window, global tokens), `MaskRules` holds a call's rules resolved once
// from its options, and `HeadMask` adds the data-dependent parts of one (sequence, query head) — the `allowed`
// and `bias` slices — with the score finishing of score.hpp (scale, softcap, bias, ALiBi).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "qkv/config.hpp"
#include "qkv/options.hpp"
#include "qkv/score.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

/// Half-open range of key indices [begin, end); empty when end <= begin.
struct KeyRange {
  Index begin = 0;
  Index end = 0;
  bool empty() const noexcept { return end <= begin; }
};

/// How much of a (query tile × key tile) block the index rules let through.
enum class TileVisibility {
  hidden,   ///< no (i, j) of the tile is visible: the tile is skipped
  partial,  ///< some are: the tile is masked element by element (a boundary tile)
  full      ///< all are: the tile needs no index mask (`allowed` and `bias` may still hide keys)
};

/// The index rules of one sequence with `sq` queries and `skv` keys (Skv_b: the key count after padding).
///
///     diag(i) = i + diag_offset          diag_offset = skv − sq (bottom_right) or 0 (top_left)
///     visible(i, j) = 0 ≤ j < skv
///                     and (not causal or j ≤ diag(i))
///                     and (j < global_tokens
///                          or ((window_left < 0 or j ≥ diag(i) − window_left)
///                              and (window_right < 0 or j ≤ diag(i) + window_right)))
///
/// Example: sq = 2, skv = 4, causal. bottom_right: diag = (2, 3), query 0 sees keys 0..2 and query 1 all four
/// (decoding: the newest query sees the whole cache). top_left: diag = (0, 1).
///
/// The visible keys of a query are the union of two intervals, the band around the diagonal and the global
/// prefix; both move right (never left) as i grows, which is what `key_range` and `classify` rely on.
struct MaskGeometry {
  Index sq = 0;
  Index skv = 0;
  Index diag_offset = 0;
  bool causal = false;
  Index window_left = -1;
  Index window_right = -1;
  Index global_tokens = 0;

  /// The geometry `options` give a sequence of `sq` queries and `skv` keys.
  template <class T>
  static MaskGeometry make(Index sq, Index skv, const AttentionOptions<T>& options) noexcept {
    MaskGeometry g;
    g.sq = sq;
    g.skv = skv;
    g.diag_offset = options.alignment == CausalAlignment::bottom_right ? skv - sq : 0;
    g.causal = options.causal;
    g.window_left = options.window_left;
    g.window_right = options.window_right;
    g.global_tokens = options.global_tokens;
    return g;
  }

  /// The same index rules for a sequence of `sq` queries and `skv` keys (alignment as `bottom_right` says).
  MaskGeometry resized(Index sq_b, Index skv_b, bool bottom_right) const noexcept {
    MaskGeometry g = *this;
    g.sq = sq_b;
    g.skv = skv_b;
    g.diag_offset = bottom_right ? skv_b - sq_b : 0;
    return g;
  }

  Index diag(Index i) const noexcept { return i + diag_offset; }

  /// Whether the index rules let query i see key j.
  bool visible(Index i, Index j) const noexcept {
    if (j < 0 || j >= skv) return false;
    const Index d = diag(i);
    if (causal && j > d) return false;
    if (j < global_tokens) return true;
    if (window_left >= 0 && j < d - window_left) return false;
    if (window_right >= 0 && j > d + window_right) return false;
    return true;
  }

  /// The band of query i: the keys the causal and window rules let through, clipped to [0, skv).
  KeyRange band(Index i) const noexcept {
    const Index d = diag(i);
    const Index begin = std::min(skv, window_left >= 0 ? std::max<Index>(0, d - window_left) : Index(0));
    return {begin, std::max(begin, band_end(i))};
  }

  /// The global keys query i sees: [0, min(global_tokens, skv, diag(i) + 1 if causal)).
  KeyRange global(Index i) const noexcept {
    Index end = std::min(global_tokens, skv);
    if (causal) end = std::min(end, diag(i) + 1);
    return {0, std::max<Index>(0, end)};
  }

  /// The smallest key range that holds every key some query in [i_begin, i_end) may see (a bound, tight
  /// unless every band in between is empty). Tiles of keys outside it are never visited (FlashAttention's
  /// n_block_min / n_block_max). Empty for an empty query range.
  KeyRange key_range(Index i_begin, Index i_end) const noexcept {
    if (i_end <= i_begin) return {0, 0};
    // Band begins and ends, and the global prefix, all move right as i grows.
    Index begin = band(i_begin).begin;
    Index end = std::max<Index>(0, band_end(i_end - 1));
    const KeyRange global_last = global(i_end - 1);
    if (!global_last.empty()) {
      begin = 0;
      end = std::max(end, global_last.end);
    }
    if (end <= begin) return {0, 0};
    return {begin, end};
  }

  /// Classifies the tile of queries [i_begin, i_end) × keys [j_begin, j_end) (both non-empty).
  TileVisibility classify(Index i_begin, Index i_end, Index j_begin, Index j_end) const noexcept {
    QKV_ASSERT(i_begin < i_end && j_begin < j_end);
    const Index j_last = std::min(j_end, skv) - 1;  // last key that padding lets through
    if (j_begin > j_last) return TileVisibility::hidden;
    constexpr Index kUnbounded = std::numeric_limits<Index>::max() / 4;
    // The band is lo <= j - i <= hi; every integer j - i between the tile's extremes occurs in the tile.
    const Index lo = window_left >= 0 ? diag_offset - window_left : -kUnbounded;
    Index hi = kUnbounded;
    if (causal) hi = std::min(hi, diag_offset);
    if (window_right >= 0) hi = std::min(hi, diag_offset + window_right);
    const Index d_min = j_begin - (i_end - 1), d_max = j_last - i_begin;
    const bool band_hits = d_max >= lo && d_min <= hi && lo <= hi;
    const bool global_hits = j_begin < global_tokens && (!causal || j_begin <= diag(i_end - 1));
    if (!band_hits && !global_hits) return TileVisibility::hidden;
    if (j_end > skv) return TileVisibility::partial;
    if (causal && j_end - 1 - i_begin > diag_offset) return TileVisibility::partial;
    const Index j_windowed = std::max(j_begin, global_tokens);  // first key the window applies to
    if (j_windowed < j_end) {
      if (window_left >= 0 && j_windowed - (i_end - 1) < diag_offset - window_left) return TileVisibility::partial;
      if (window_right >= 0 && j_end - 1 - i_begin > diag_offset + window_right) return TileVisibility::partial;
    }
    return TileVisibility::full;
  }

 private:
  /// End of query i's band before clipping at its begin (may be ≤ 0).
  Index band_end(Index i) const noexcept {
    const Index d = diag(i);
    Index end = skv;
    if (causal) end = std::min(end, d + 1);
    if (window_right >= 0) end = std::min(end, d + window_right + 1);
    return end;
  }
};

// MaskRules and HeadMask carry ScoreFinish (score.hpp), whose arithmetic depends on the build's ISA: they sit in
// the ISA-named inline namespace with it, so that two units built with different flags never share a definition.
inline namespace QKV_ISA_NAME {

/// The mask and score rules of one call, resolved once from its validated options: the scale (explicit or 1/√D),
/// softcap, the index rules and the views behind `allowed`, `bias` and ALiBi. Every (sequence, query head) takes its
/// `HeadMask` from here (HeadMask::make), so no backend resolves the options again. Points into the options' storage,
/// which outlives the call. Throws nothing; O(1) to build; no allocation. Source: FlashAttention 2's
/// `Flash_fwd_params` (options resolved once at the boundary); the rules are those of AttentionOptions (options.hpp).
template <class T>
struct MaskRules {
  T scale = T(1);
  T softcap = T(0);
  MaskGeometry index_rules;  ///< causal, window and global tokens; resized per sequence
  bool bottom_right = true;  ///< the causal alignment
  TensorView4<const bool> allowed;
  TensorView4<const T> bias;
  const T* alibi_slopes = nullptr;  ///< one per query head, or null
  /// `options.global_positions` (options.hpp), when set: the call sees global queries [q_begin, q_begin + Sq) and
  /// keys [k_begin, k_begin + Skv) of a sequence of global.sq queries and global.skv keys.
  bool has_global_positions = false;
  GlobalPositions global;
  const Index* global_key_lengths = nullptr;  ///< with global positions: the global Skv_b per batch entry, or null

  /// The rules of `options` for head dimension D.
  static MaskRules of(const AttentionOptions<T>& options, Index D) noexcept {
    MaskRules r;
    r.scale = resolve_scale(options, D);
    r.softcap = options.softcap;
    r.index_rules = MaskGeometry::make(0, 0, options);
    r.bottom_right = options.alignment == CausalAlignment::bottom_right;
    r.allowed = options.allowed;
    r.bias = options.bias;
    r.alibi_slopes = options.alibi_slopes.empty() ? nullptr : options.alibi_slopes.data();
    if (options.global_positions) {
      r.has_global_positions = true;
      r.global = *options.global_positions;
      r.global_key_lengths = options.key_lengths.empty() ? nullptr : options.key_lengths.data();
    }
    return r;
  }

  /// The index rules of batch entry `b` (the view's batch index; varlen calls have no global positions) for a
  /// sequence of `sq` queries and `skv` keys in the call's own rows: `skv` is the count of the view's keys that
  /// padding lets through (AttentionShape::key_counts).
  ///
  /// With global positions, the geometry is the global one moved to the call's rows: local query i is global query
  /// q_begin + i and local key j global key k_begin + j, so
  ///
  ///     diag_local(i) = diag_global(q_begin + i) − k_begin = i + q_begin − k_begin + (Skv_b − Sq, bottom_right)
  ///     global_tokens_local = max(0, global_tokens − k_begin)
  ///
  /// with Skv_b and Sq global. ALiBi measures |diag(i) − j|, the same in both frames. The window bounds and causal
  /// rule are relations between diag(i) and j, so they move with it.
  MaskGeometry geometry(Index b, Index sq, Index skv) const noexcept {
    if (!has_global_positions) return index_rules.resized(sq, skv, bottom_right);
    const Index skv_b = global_key_lengths != nullptr ? global_key_lengths[b] : global.skv;
    MaskGeometry g = index_rules;
    g.sq = sq;
    g.skv = skv;
    g.diag_offset = global.q_begin - global.k_begin + (bottom_right ? skv_b - global.sq : 0);
    g.global_tokens = std::max<Index>(0, index_rules.global_tokens - global.k_begin);
    return g;
  }
};

/// Everything that turns a dot product into a score, and decides visibility, for one (sequence, query head).
/// Built by the entry points after validation; the views it points into outlive it.
template <class T>
struct HeadMask {
  MaskGeometry geometry;
  T scale = T(1);
  ScoreFinish<T> finishing;       ///< softcap, bias, ALiBi (score.hpp)
  const bool* allowed = nullptr;  ///< row i of this head's `allowed` slice starts at allowed + i·allowed_row_stride
  Index allowed_row_stride = 0;   ///< 0 when the Sq axis broadcasts

  /// The mask of query head `h` of batch entry `b` (the view's batch index) for a sequence of `sq` queries and
  /// `skv` keys (no varlen row offset: `allowed` and `bias` are not combinable with varlen); global positions, when
  /// the options set them, come with `rules` (MaskRules::geometry).
  static HeadMask make(const MaskRules<T>& rules, Index b, Index h, Index sq, Index skv) noexcept {
    HeadMask m;
    m.geometry = rules.geometry(b, sq, skv);
    m.scale = rules.scale;
    m.finishing.softcap = rules.softcap;
    if (rules.allowed.data() != nullptr) {
      const auto& a = rules.allowed;
      m.allowed = a.data() + (a.extent(0) > 1 ? b * a.stride(0) : 0) + (a.extent(1) > 1 ? h * a.stride(1) : 0);
      m.allowed_row_stride = a.extent(2) > 1 ? a.stride(2) : 0;
    }
    if (rules.bias.data() != nullptr) {
      const auto& a = rules.bias;
      m.finishing.bias = a.data() + (a.extent(0) > 1 ? b * a.stride(0) : 0) + (a.extent(1) > 1 ? h * a.stride(1) : 0);
      m.finishing.bias_row_stride = a.extent(2) > 1 ? a.stride(2) : 0;
    }
    if (rules.alibi_slopes != nullptr) {
      m.finishing.alibi_slope = rules.alibi_slopes[h];
      m.finishing.has_alibi = true;
    }
    return m;
  }

  /// Whether query i may see key j before its score is known: the index rules, `allowed`, and a −∞ bias
  /// (decided from the bias alone, so a NaN in k under a −∞ bias stays hidden).
  bool visible(Index i, Index j) const noexcept {
    if (!geometry.visible(i, j)) return false;
    if (allowed != nullptr && !allowed[i * allowed_row_stride + j]) return false;
    if (finishing.bias != nullptr && finishing.bias_at(i, j) == -std::numeric_limits<T>::infinity()) return false;
    return true;
  }

  /// The score of a visible (i, j) from its dot product q_i·k_j, in the accumulation type `Acc`:
  /// softcap(dot·scale) + bias_ij − alibi_slope·|diag(i) − j|.
  template <class Acc>
  Acc score(Acc dot, Index i, Index j) const noexcept {
    return finish(dot * static_cast<Acc>(scale), i, j);
  }

  /// The score from an already scaled dot product (q_i·k_j·scale): softcap, then bias and ALiBi.
  template <class Acc>
  Acc finish(Acc scaled, Index i, Index j) const noexcept {
    return finishing(scaled, i, j, geometry.diag(i));
  }

  /// Whether `finish` changes a scaled score (softcap, bias or ALiBi present).
  bool modifies_scores() const noexcept { return finishing.modifies_scores(); }

  /// Whether visibility depends on data (`allowed` or `bias`), not only on the index rules.
  bool has_data_mask() const noexcept { return allowed != nullptr || finishing.bias != nullptr; }
};

}  // namespace QKV_ISA_NAME

}  // namespace qkv
