// qkv/score.hpp — what turns a dot product q·k into the score the softmax sees: scale, softcap, bias, ALiBi.
//
// Both backends finish their scores here (the reference path through `HeadMask`, the fused kernel through its tile
// of scores), so the two cannot disagree on the formula:
//
//     s_ij = softcap(q_i·k_j·scale) + bias_ij − alibi_slope·|diag(i) − j|,    softcap(x) = c·tanh(x / c) if c > 0
#pragma once

#include <cmath>

#include "qkv/config.hpp"
#include "qkv/options.hpp"

namespace qkv {

/// Resolves `options.scale`: the explicit value, or 1/√D (seed 000 定理 2.4.1: the variance of q·k is D for
/// unit-variance components, so this brings the scores back to unit variance).
template <class T>
T resolve_scale(const AttentionOptions<T>& options, Index D) noexcept {
  return options.scale ? *options.scale : T(1) / std::sqrt(static_cast<T>(D));
}

// ScoreFinish's arithmetic is compiled with the build's ISA flags (an FMA may fuse the ALiBi step) and the fused
// kernel calls it: it sits in the ISA-named inline namespace (docs/design.md, ODR safety).
inline namespace QKV_ISA_NAME {

/// The finishing steps of one (sequence, query head) after the scale: softcap, then bias and ALiBi. Row i of the
/// head's bias starts at bias + i·bias_row_stride (stride 0 when the Sq axis broadcasts); ALiBi measures the
/// distance to query i's causal diagonal, which the caller passes (mask.hpp, MaskGeometry::diag).
/// Units: scores in natural-log units (the softmax's exponent, before any base-2 conversion). Throws nothing;
/// O(1) per score; no allocation. Values are validated by qkv::attention (finite softcap ≥ 0, finite slopes).
/// Source: softcap as Gemma 2 and FlashAttention 2 (`softcap`); bias as PyTorch's float `attn_mask`; ALiBi as
/// Press et al. 2022 (and FlashAttention's `alibi_slopes`, measured from the bottom-right diagonal).
template <class T>
struct ScoreFinish {
  T softcap = T(0);         ///< 0 = off
  const T* bias = nullptr;  ///< this head's bias slice, or null
  Index bias_row_stride = 0;
  T alibi_slope = T(0);
  bool has_alibi = false;

  /// The score of query i (diagonal `diag`) and key j from an already scaled dot product (q_i·k_j·scale), in the
  /// accumulation type `Acc`.
  template <class Acc>
  Acc operator()(Acc scaled, Index i, Index j, Index diag) const noexcept {
    Acc s = scaled;
    if (softcap > T(0)) s = static_cast<Acc>(softcap) * std::tanh(s / static_cast<Acc>(softcap));
    if (bias != nullptr) s += static_cast<Acc>(bias_at(i, j));
    if (has_alibi) {
      const Index distance = diag > j ? diag - j : j - diag;
      s -= static_cast<Acc>(alibi_slope) * static_cast<Acc>(distance);
    }
    return s;
  }

  /// The bias of (i, j); only when `bias` is set.
  T bias_at(Index i, Index j) const noexcept { return bias[i * bias_row_stride + j]; }

  /// Whether finishing changes a scaled score (softcap, bias or ALiBi present).
  bool modifies_scores() const noexcept { return softcap > T(0) || bias != nullptr || has_alibi; }
};

}  // namespace QKV_ISA_NAME

}  // namespace qkv
