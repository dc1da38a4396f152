// qkv/detail/attention_shape.hpp — what validation learns about a call, shared by every backend (internal).
#pragma once

#include <vector>

#include "qkv/config.hpp"

namespace qkv {
namespace detail {

/// Rows of sequence b: [begin, begin + length) of the view's S axis.
struct SequenceRows {
  Index begin = 0;
  Index length = 0;
};

/// A validated attention call: the numbers every backend needs besides the views and options.
struct AttentionShape {
  Index n_sequences = 0;  ///< B, or the varlen sequence count
  Index Hq = 0, Hkv = 0, group = 1, D = 0, Dv = 0;
  bool varlen = false;
  std::vector<SequenceRows> q_rows, kv_rows;  ///< per sequence (varlen), else one entry per batch entry
  std::vector<Index> key_counts;              ///< Skv_b: visible key count per sequence (padding applied)

  /// The batch index of sequence b in the views (0 for varlen: one batch entry holds every sequence).
  Index view_batch(Index b) const noexcept { return varlen ? 0 : b; }
};

}  // namespace detail
}  // namespace qkv
