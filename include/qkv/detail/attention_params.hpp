// qkv/detail/attention_params.hpp — a call's options, resolved once at the boundary (FlashAttention's
// Flash_fwd_params).
//
// attention.hpp builds these after validation, and both backends read them: the mask and score rules (MaskRules:
// the scale resolved once, softcap, index rules, `allowed`, `bias`, ALiBi), scale·log2 e for the base-2 softmax,
// the sinks, and the dropout rule (dropout.hpp) with the global position of the call's first query and key row. Every
// later option is meant to arrive here too, so that no kernel reads the user's options struct.
#pragma once

#include <limits>

#include "qkv/config.hpp"
#include "qkv/dropout.hpp"
#include "qkv/mask.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {  // holds MaskRules, whose HeadMask arithmetic depends on the ISA (mask.hpp)

/// The parameters of one call (see the comment above).
template <class T>
struct AttentionParams {
  MaskRules<T> rules;        ///< rules.scale is the call's scale: options.scale or 1/√D
  T scale_log2e = T(1);      ///< rules.scale · log2 e, rounded once: the base-2 prefill's factor on Q
  const T* sinks = nullptr;  ///< one logit per query head, or null
  /// Dropout on the weights (inactive when options.dropout_p = 0). A kernel applies it to a row of weights with
  /// `dropout.apply_row(sequence, h, dropout_q_begin + i, dropout_k_begin + j0, n, row)`: sequence = the batch index
  /// (or the varlen sequence index), i and j0 positions in that sequence's rows of this call.
  DropoutRule<T> dropout;
  /// options.global_positions' q_begin and k_begin (0 without global positions): dropout keys on global positions.
  Index dropout_q_begin = 0, dropout_k_begin = 0;

  /// The mask of query head h of batch entry b (the view's batch index) for a sequence of sq queries, skv keys.
  HeadMask<T> head_mask(Index b, Index h, Index sq, Index skv) const noexcept {
    return HeadMask<T>::make(rules, b, h, sq, skv);
  }

  /// Query head h's sink logit; −∞ (no sink) when the call has none.
  T sink(Index h) const noexcept { return sinks != nullptr ? sinks[h] : -std::numeric_limits<T>::infinity(); }
};

}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv
