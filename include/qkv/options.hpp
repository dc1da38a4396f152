// qkv/options.hpp — what an attention call computes besides softmax(q·kᵀ·scale)·v: masks, biases, backend.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
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

/// Where a call's rows sit in a longer sequence, for a call that sees one shard of it (context parallelism: ring
/// attention, key shards merged with `merge_attention_states`). Query row i of the call is global query
/// `q_begin + i` of a sequence of `sq` queries; key row j is global key `k_begin + j` of `skv` keys. The causal
/// diagonal, the window, the global tokens, ALiBi and `key_lengths` are then decided on global positions:
///
///     diag(i_global) = i_global + (Skv_b − sq) for bottom_right (i_global for top_left),
///     Skv_b = key_lengths[b] (global lengths, each in [0, skv]) or skv,
///
/// so a call over q rows [q_begin, q_begin + Sq) and keys [k_begin, k_begin + Skv) computes exactly the whole
/// call's attention of those queries restricted to those keys: its out and lse merge with the other key shards'
/// (`merge_attention_states`) into the whole call's rows. Example: a causal sequence of sq = skv = 8, split in two
/// shards of 4 rows. The call of queries 4..7 over keys 0..3 ({4, 0, 8, 8}) sees every key (global diag ≥ 4 > 3); the
/// call of queries 0..3 over keys 4..7 ({0, 4, 8, 8}) sees none (zeros and lse −∞); queries 4..7 over keys 4..7
/// ({4, 4, 8, 8}) is the usual causal triangle. With bottom_right and sq = 2, skv = 8 (decoding two queries over a
/// cache split in two), queries {0, 1} over keys 4..7 ({0, 4, 2, 8}) have global diag 6 and 7: query 0 sees keys
/// 4..6, query 1 all four.
/// `allowed` and `bias` keep the call's own extents ([.., Sq, Skv] of this call, local rows and keys). Unset (the
/// default) is the same as {0, 0, Sq, Skv}. Not combinable with `cu_seqlens`. Preconditions (else shape_error):
/// every field ≥ 0, q_begin + Sq ≤ sq, k_begin + Skv ≤ skv. Source: the block offsets of ring attention (Liu et al.
/// 2023) and of Megatron's context parallelism, expressed as FlashAttention's (Sq, Skv)-relative masks.
struct GlobalPositions {
  Index q_begin = 0;  ///< global position of q's first row
  Index k_begin = 0;  ///< global position of k's (and v's) first row
  Index sq = 0;       ///< the global query count Sq
  Index skv = 0;      ///< the global key count Skv
};

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
  /// Each length must lie in [0, Skv]. Empty = no padding. With `global_positions` the lengths are global:
  /// key k_begin + j is hidden when k_begin + j ≥ key_lengths[b], and each length lies in [0, global skv].
  std::vector<Index> key_lengths;

  /// Boolean mask, true = may attend, of extents [B or 1, Hq or 1, Sq or 1, Skv]; an extent-1 axis
  /// broadcasts. Note PyTorch's boolean `key_padding_mask` / `attn_mask` of nn.MultiheadAttention mean the
  /// opposite (true = masked); `scaled_dot_product_attention`'s boolean `attn_mask` means the same.
  /// Empty = none. A view: built implicitly from a row-major Eigen bool matrix or array lvalue or a row-major
  /// Eigen::Map ([1, 1, Sq, Skv]), zero-copy, and the caller keeps that memory alive while the options are used.
  /// Column-major objects, expressions and temporaries fail to compile with a sentence saying so; to let the
  /// options own the mask (and return them from a function), use `set_allowed`.
  TensorView4<const bool> allowed;

  /// Additive bias on the scores, same extents and broadcasting as `allowed`; −∞ hides the key. Empty = none.
  /// A view, built implicitly from a row-major Eigen matrix lvalue of T or a row-major Eigen::Map
  /// ([1, 1, Sq, Skv]), as `allowed` is; to let the options own the bias, use `set_bias`.
  TensorView4<const T> bias;

  /// ALiBi: one slope per query head; adds −slope_h·|diag(i) − j| to visible scores (computed from the
  /// indices, no tensor; Press et al. 2022). Empty = none. Must be finite.
  std::vector<T> alibi_slopes;

  /// One learned logit per query head that joins each row's softmax denominator and carries no value
  /// (gpt-oss; ggml and ONNX Runtime "attention sinks"): visible weights then sum to 1 − p_sink and the lse
  /// includes the sink. Empty = none. NaN or +∞ is an error; −∞ means no sink for that head.
  std::vector<T> sinks;

  /// The global positions of this call's rows in a longer sequence (see `GlobalPositions`): causal, window, global
  /// tokens, ALiBi and `key_lengths` are then decided on global positions. Unset = this call is the whole sequence.
  std::optional<GlobalPositions> global_positions;

  /// Varlen batches (FlashAttention's `flash_attn_varlen_func`): both of size B+1, cu[0] = 0,
  /// non-decreasing (empty sequences allowed), last = the view's row count. The views then have batch
  /// extent 1 and sequence b owns rows [cu[b], cu[b+1]) of q and of k/v. Not combinable with `key_lengths`,
  /// `allowed` or `bias`. Empty = not varlen.
  std::vector<Index> cu_seqlens_q;
  std::vector<Index> cu_seqlens_k;

  /// Dropout on the attention weights (Srivastava et al. 2014, placed after the softmax and before P·V as in the
  /// original Transformer and seed 002): each weight p_ij is kept with probability 1 − dropout_p and scaled by
  /// 1/(1 − dropout_p), or dropped (exactly 0; its value row is then not read), so
  ///
  ///     out_i = Σ_j (keep_ij ? p_ij / (1 − dropout_p) : 0) · v_j,   lse_i unchanged (the undropped softmax's),
  ///
  /// as FlashAttention's dropout. E[out_i] over masks is the output without dropout. keep_ij is a pure function of
  /// (dropout_seed, dropout_offset, sequence, query head, query position, key position), from the counter-based
  /// generator Philox 4×32-10 (qkv/dropout.hpp documents the keying exactly): the mask is never stored, is the same on
  /// every backend, tiling, thread count and varlen packing, and is recomputed by a backward pass. The sequence is the
  /// batch index (or the varlen sequence index, so a varlen batch's sequence b gets the mask of batch entry b of a
  /// padded call); positions are global ones with `global_positions`.
  /// 0 (the default) = no dropout: no dropout code runs, bit-identical to a call without it. 1 drops every weight
  /// (zero outputs, lse unchanged). Outside [0, 1] or NaN is a shape_error. A row whose scores are undefined (NaN among
  /// its visible scores) stays NaN whatever is dropped. `attention_weights` returns the dropped, rescaled weights.
  T dropout_p = T(0);
  /// The generator's seed (its key): fixed for a training run, or drawn once.
  std::uint64_t dropout_seed = 0;
  /// Selects a fresh mask per call with the same seed: advance it on every call (e.g. the step count times the number
  /// of attention calls per step plus the call's index), so the options stay `const` and a module shareable.
  std::uint64_t dropout_offset = 0;

  /// Which implementation computes the call.
  Backend backend = Backend::automatic;

  /// What keeps the memory of `allowed` and of `bias` alive: null for a plain view (the caller owns the memory),
  /// else shared ownership of it, set by `set_allowed` / `set_bias` (PyTorch's model: a tensor is a view over a
  /// reference-counted storage). Copying the options shares the storage (no copy of the data), so a copy stays
  /// valid after the original and the data it was built from are gone; the memory is freed with the last copy.
  /// Not semantic: the call reads only the views. Assigning a view to `allowed` or `bias` directly leaves its
  /// storage as it was (it is then only kept, never read); the `set_` functions replace both together.
  std::shared_ptr<const void> allowed_storage;
  std::shared_ptr<const void> bias_storage;

  /// Lets the options own a Sq × Skv mask (true = may attend), viewed as `allowed` [1, 1, Sq, Skv]: the options
  /// can then be copied, stored and returned from the function that built the mask.
  ///
  ///     qkv::AttentionOptions<float> options_for(qkv::Index Sq, qkv::Index Skv) {
  ///       qkv::AttentionOptions<float> options;
  ///       qkv::Matrix<bool> mask = ...;             // local
  ///       options.set_allowed(std::move(mask));     // moved in: no copy; the options now own it
  ///       return options;                           // safe (a plain `options.allowed = mask` would dangle here)
  ///     }
  ///
  /// `mask` is taken by value: an rvalue is moved in (O(1)); an lvalue, a column-major matrix, an Eigen::Array or
  /// any expression of bools (e.g. `(scores.array() > 0)`) is copied into row-major storage (O(Sq·Skv)). One
  /// allocation of the shared owner. Throws std::bad_alloc only; the extents are checked by the call, as for a
  /// view (shape_error). Returns *this. Peer: PyTorch's `attn_mask` tensor, which the call holds by reference
  /// count.
  AttentionOptions& set_allowed(Matrix<bool> mask) {
    auto owned = std::make_shared<const Matrix<bool>>(std::move(mask));
    allowed = TensorView4<const bool>(*owned);
    allowed_storage = std::move(owned);
    return *this;
  }

  /// Lets the options own a Sq × Skv bias of T, viewed as `bias` [1, 1, Sq, Skv]; as `set_allowed(Matrix<bool>)`
  /// (by value: moved in O(1), or copied in O(Sq·Skv) from an lvalue, a column-major matrix or an expression).
  AttentionOptions& set_bias(Matrix<T> values) {
    auto owned = std::make_shared<const Matrix<T>>(std::move(values));
    bias = TensorView4<const T>(*owned);
    bias_storage = std::move(owned);
    return *this;
  }

  /// Any mask of extents [B or 1, Hq or 1, Sq or 1, Skv] together with what owns its memory: `view` becomes
  /// `allowed` and `storage` its keep-alive (the aliasing idea of std::shared_ptr: `storage` may own a larger
  /// object, e.g. a std::vector, a qkv::Matrix<bool> of B·Hq·Sq rows, or a buffer the view strides through).
  /// O(1), no allocation, no throw. A null `storage` makes `allowed` a plain view again.
  AttentionOptions& set_allowed(TensorView4<const bool> view, std::shared_ptr<const void> storage) noexcept {
    allowed = view;
    allowed_storage = std::move(storage);
    return *this;
  }

  /// `bias` from a view of extents [B or 1, Hq or 1, Sq or 1, Skv] and what owns its memory; as `set_allowed`.
  AttentionOptions& set_bias(TensorView4<const T> view, std::shared_ptr<const void> storage) noexcept {
    bias = view;
    bias_storage = std::move(storage);
    return *this;
  }

  /// Shares ownership of an object that converts to a mask view, as a view-convertible lvalue does: a row-major
  /// qkv::Matrix<bool> or Eigen::Array of bool held by a std::shared_ptr, shared between several options without
  /// a copy. A null `owner` clears the mask (`allowed` empty, no storage). O(1), no allocation, no throw.
  template <class Owner>
  AttentionOptions& set_allowed(std::shared_ptr<Owner> owner) noexcept {
    static_assert(std::is_convertible_v<const Owner&, TensorView4<const bool>>,
                  "qkv::AttentionOptions::set_allowed: the shared object must convert to a TensorView4<const bool> "
                  "(a row-major bool matrix or array)");
    allowed = owner ? TensorView4<const bool>(*owner) : TensorView4<const bool>();
    allowed_storage = std::move(owner);
    return *this;
  }

  /// Shares ownership of an object that converts to a bias view: a row-major qkv::Matrix<T>, or a
  /// qkv::PositionBias<T> ([1, H, Sq, Skv]) held by a std::shared_ptr. A null `owner` clears the bias. O(1), no
  /// allocation, no throw.
  template <class Owner>
  AttentionOptions& set_bias(std::shared_ptr<Owner> owner) noexcept {
    static_assert(std::is_convertible_v<const Owner&, TensorView4<const T>>,
                  "qkv::AttentionOptions::set_bias: the shared object must convert to a TensorView4<const T> (a "
                  "row-major matrix of T, or a qkv::PositionBias<T>)");
    bias = owner ? TensorView4<const T>(*owner) : TensorView4<const T>();
    bias_storage = std::move(owner);
    return *this;
  }
};

}  // namespace qkv
