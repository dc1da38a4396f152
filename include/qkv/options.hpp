// qkv/options.hpp — what an attention call computes besides softmax(q·kᵀ·scale)·v: masks, biases, backend.
#pragma once

#include <optional>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

/// Where the causal diagonal sits when the query and key counts differ (Sq_b queries, Skv_b keys).
///
/// `bottom_right` (the default; FlashAttention ≥ 2.1, KV-cache decoding): diag(i) = i + (Skv_b − Sq_b), so the
/// last query sees every key. `top_left` (PyTorch's `is_causal` and `torch.tril`): diag(i) = i. They agree
/// when Sq_b = Skv_b. Causal query i sees keys j ≤ diag(i). With Sq = 2, Skv = 4 (1 = visible):
///
///     bottom_right        top_left
///     1 1 1 0             1 0 0 0
///     1 1 1 1             1 1 0 0
///
/// Our default is NOT PyTorch's: port `is_causal=True` code with `alignment = CausalAlignment::top_left`
/// (or keep Sq = Skv, where the two agree).
enum class CausalAlignment { bottom_right, top_left };

/// Which implementation computes the call. `automatic` picks the fused kernel where one exists for the
/// scalar type and the reference path otherwise; `reference` is the materialized float64-accumulating path
/// of reference.hpp; `fused` is the FlashAttention-2 kernel and throws `unsupported_error` where none exists
/// for the scalar type.
enum class Backend { automatic, reference, fused };

/// Options of an attention call, shared by every entry point and every backend.
///
/// The score of query i and key j of query head h is
///
///     s_ij = softcap(q_i·k_j·scale) + bias_ij + alibi_ij,    softcap(x) = softcap·tanh(x / softcap) if softcap > 0,
///
/// the weights are the softmax of the visible scores along the key axis and the output row is Σ_j p_ij·v_j.
/// Key j is hidden from query i when any of these holds (with Skv_b the key count of sequence b):
///   - j ≥ Skv_b (key padding: `key_lengths`, or the end of a varlen sequence);
///   - `causal` and j > diag(i) (see `CausalAlignment`);
///   - j ≥ global_tokens and (j < diag(i) − window_left or j > diag(i) + window_right);
///   - `allowed` is false at (i, j), or `bias` is −∞ at (i, j), or s_ij is −∞.
/// Hidden keys are never read into the arithmetic, so NaN or ∞ stored there cannot reach the output. A query
/// that sees no key gets a zero output row and lse = −∞ (its sink logit when `sinks` is set), never NaN.
///
/// Example, Sq = Skv = 5, causal, window_left = 1, global_tokens = 1 (1 = visible):
///
///     1 0 0 0 0
///     1 1 0 0 0
///     1 1 1 0 0     query 2 sees key 0 (global), keys 1..2 (window) and none past the diagonal
///     1 0 1 1 0
///     1 0 0 1 1
///
/// Source: the options and their meaning follow FlashAttention 2 (`causal`, `window_size`, `softcap`,
/// `alibi_slopes`, `cu_seqlens`), PyTorch's `scaled_dot_product_attention` (`attn_mask` as `allowed` / `bias`,
/// `scale`) and gpt-oss / ONNX Runtime (`sinks`); seed 000 定义 2.4.5 (the causal mask) and seed 002 §3.2
/// (padding masks).
template <class T>
struct AttentionOptions {
  /// Multiplies q·k. Unset means 1/√D (seed 000 定理 2.4.1). An explicit 0 is honoured (uniform weights over
  /// the visible keys). NaN or ±∞ is an error.
  std::optional<T> scale;

  /// 0 = off. Otherwise s ← softcap·tanh(s / softcap) on the scaled scores, before bias (Gemma 2, ggml).
  /// Negative, NaN or ∞ is an error.
  T softcap = T(0);

  /// Causal masking: query i sees keys j ≤ diag(i); `alignment` places the diagonal.
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::bottom_right;

  /// Sliding window around diag(i): keys in [diag(i) − window_left, diag(i) + window_right] are inside;
  /// −1 = unbounded on that side. The window follows `alignment` whether or not `causal` is on
  /// (FlashAttention's `window_size = (left, right)` is the bottom-right case). Values below −1 are errors.
  Index window_left = -1;
  Index window_right = -1;

  /// Keys j < global_tokens are exempt from the window (Longformer's global keys, StreamingLLM's attention
  /// sinks); causal, key_lengths, `allowed` and `bias` still apply. Negative is an error.
  Index global_tokens = 0;

  /// Key padding (right padding), one length per batch entry (size B; size 1 on the Eigen entry points):
  /// keys j ≥ key_lengths[b] are hidden and the causal diagonal and window use Skv_b = key_lengths[b].
  /// Each length must lie in [0, Skv]. Empty = no padding.
  std::vector<Index> key_lengths;

  /// Boolean mask, true = may attend, of extents [B or 1, Hq or 1, Sq or 1, Skv]; an extent-1 axis
  /// broadcasts. Note PyTorch's boolean `key_padding_mask` / `attn_mask` of nn.MultiheadAttention mean the
  /// opposite (true = masked); `scaled_dot_product_attention`'s boolean `attn_mask` means the same.
  /// Empty = none. Built implicitly from a row-major Eigen bool matrix or array lvalue ([1, 1, Sq, Skv]).
  TensorView4<const bool> allowed;

  /// Additive bias on the scores, same extents and broadcasting as `allowed`; −∞ hides the key. Empty = none.
  /// Built implicitly from a row-major Eigen matrix lvalue of T ([1, 1, Sq, Skv]).
  TensorView4<const T> bias;

  /// ALiBi: one slope per query head; adds −slope_h·|diag(i) − j| to visible scores (computed from the
  /// indices, no tensor; Press et al. 2022). Empty = none. Must be finite.
  std::vector<T> alibi_slopes;

  /// One learned logit per query head that joins each row's softmax denominator and carries no value
  /// (gpt-oss; ggml and ONNX Runtime "attention sinks"): visible weights then sum to 1 − p_sink and the lse
  /// includes the sink. Empty = none. NaN or +∞ is an error; −∞ means no sink for that head.
  std::vector<T> sinks;

  /// Varlen batches (FlashAttention's `flash_attn_varlen_func`): both of size B+1, cu[0] = 0,
  /// non-decreasing (empty sequences allowed), last = the view's row count. The views then have batch
  /// extent 1 and sequence b owns rows [cu[b], cu[b+1]) of q and of k/v. Not combinable with `key_lengths`,
  /// `allowed` or `bias`. Empty = not varlen.
  std::vector<Index> cu_seqlens_q;
  std::vector<Index> cu_seqlens_k;

  /// Which implementation computes the call.
  Backend backend = Backend::automatic;
};

}  // namespace qkv
