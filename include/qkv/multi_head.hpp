// qkv/multi_head.hpp — the multi-head attention module: projections W_q, W_k, W_v, W_o with their biases around
// the core entry point, for self-, cross- and incremental (KV-cache) attention, with GQA/MQA and varlen batches, and
// its backward pass (the gradients of the inputs and of every parameter, through `qkv::attention_backward`).
//
// Rows are tokens and every weight is stored [in, out], so a projection is one matrix product on the right:
//
//     Q = X_q·W_q + b_q     (Tq × Hq·head_dim)       head h of Q is columns [h·head_dim, (h+1)·head_dim)
//     K = X_k·W_k + b_k     (Tk × Hkv·head_dim)      K and V are computed once per kv head, never repeated
//     V = X_v·W_v + b_v     (Tk × Hkv·head_dim)
//     Q, K ← RoPE(Q), RoPE(K)                        only when Config::rope is set: each head of row t rotated by the
//                                                    angles of its position (positional.hpp); V is never rotated
//     O = attention(Q, K, V)                         (Tq × Hq·head_dim, heads side by side: the concatenation)
//     Y = O·W_o + b_o       (Tq × d_model)
//
// The packed matrices Q, K, V and O are handed to `qkv::attention` as zero-copy [1, H, T, head_dim] views (head
// stride head_dim, row stride H·head_dim): the G = Hq / Hkv query heads of a group read the same K/V memory.
// With a `KVCache`, K and V live in the cache as [Hkv, capacity, head_dim] and the core reads its first length()
// rows in place; a float module's cache may hold them in 16 bits (`KVCache<float, Eigen::half>` or
// `KVCache<float, Eigen::bfloat16>`, rounded once on append), which the core converts exactly to float as it reads.
//
// PyTorch's nn.Linear and nn.MultiheadAttention store weights [out, in] (y = x·Wᵀ + b); the `load_pytorch` loaders
// transpose them. Mapping of nn.MultiheadAttention's arguments onto `AttentionOptions` (one batch entry n):
//
//     attn_mask (bool, True = masked)        ->  allowed = !attn_mask            ([L, S] or, 3-D, [1, H, L, S])
//     attn_mask (float, added)               ->  bias = attn_mask
//     key_padding_mask[n] (bool, True = pad) ->  allowed = !key_padding_mask[n]  as a [1, 1, 1, S] view (broadcast);
//                                                or key_lengths = {S_n} when the padding is on the right
//     key_padding_mask[n] (float, added)     ->  bias row [1, 1, 1, S]
//     both boolean masks                     ->  allowed = !(attn_mask | key_padding_mask[n])
//     is_causal / a triangular attn_mask     ->  causal = true, alignment = CausalAlignment::top_left
//                                                (identical to the default bottom_right when L = S)
//     need_weights, average_attn_weights     ->  attention_weights(X_q, X_kv, head) per head (and their mean)
//     batch_first, a batch of N              ->  one forward per entry, or a varlen batch (cu_seqlens / a list)
//     dropout (on the attention weights)     ->  options.dropout_p, with dropout_seed / dropout_offset (a Philox mask,
//                                                not PyTorch's CPU generator: the same rate, different draws)
//     add_bias_kv, add_zero_attn             ->  not supported
//     loss.backward()                        ->  backward(X, dY, options) and the cross forms: dX and every
//                                                parameter's gradient, in the module's [in, out] layout
//
// A row whose keys are all masked is NaN in PyTorch 1.13; here its attention output is zeros, so Y's row is b_o.
//
// Sources: seed 002 §2.1 (the projections W_Q, W_K, W_V of one input), §3.3 (the output projection W_O and the
// residual around it), §4.1 and §4.3 (h heads of d_model / h, computed packed, concatenated, projected); seed 000
// §2.4.6 (shapes, the GQA / MQA paragraph) and §2.4.7 (attention weights are a debugging signal, not an
// explanation); PyTorch's nn.MultiheadAttention (weights, masks, defaults); Ainslie et al. 2023 (GQA).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/config.hpp"
#include "qkv/detail/cache_line_allocator.hpp"
#include "qkv/detail/validate.hpp"
#include "qkv/errors.hpp"
#include "qkv/options.hpp"
#include "qkv/positional.hpp"
#include "qkv/sdpa.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

template <class Scalar>
class MultiHeadAttention;
template <class Scalar, class Storage = Scalar>
class KVCache;

namespace detail {

/// Test seam (internal, not API): when `callback` is set, `MultiHeadAttention` calls it with the q, k and v views it
/// is about to hand to `qkv::attention`, so a test can check which memory the core reads (GQA reads K/V once per kv
/// head, no copies; a 16-bit cache is read in place, not widened). `Storage` is the element type of k and v: Scalar
/// for every call of a module but decoding from a `KVCache<Scalar, Storage>` with 16-bit storage. Set it only while no
/// other thread runs the module.
template <class Scalar, class Storage = Scalar>
struct MultiHeadCoreObserver {
  using Callback = void (*)(const TensorView4<const Scalar>& q, const TensorView4<const Storage>& k,
                            const TensorView4<const Storage>& v, void* context);
  static inline Callback callback = nullptr;
  static inline void* context = nullptr;
};

/// Whether `Storage` may hold the keys and values of a `KVCache<Scalar, Storage>`: Scalar itself, or (Scalar = float)
/// one of the 16-bit types `qkv::attention` reads, Eigen::half or Eigen::bfloat16.
template <class Scalar, class Storage>
inline constexpr bool is_cache_storage_v = std::is_same_v<Storage, Scalar> ||
                                           (std::is_same_v<Scalar, float> && is_kv16_v<Storage>);

}  // namespace detail

/// The keys and values of one sequence's past tokens, for incremental decoding with `MultiHeadAttention::forward(X_new,
/// cache)`: K and V stored as [Hkv, capacity, head_dim] (one contiguous [capacity, head_dim] block per kv head), of
/// which the first `length()` rows of each head are filled.
///
/// Storage: `Storage` is the element type the cache holds, `Scalar` (float or double) the module's type, of the keys
/// and values appended. Storage = Scalar (the default) stores them as they are. A float cache may store them in 16
/// bits instead, Storage = Eigen::half (IEEE binary16) or Eigen::bfloat16, two bytes per element, half of float's
/// memory and half the bytes a decoding step reads (`mha.make_cache<Eigen::half>(capacity)`): `append` rounds each
/// float once, with Eigen's conversion (round to nearest, ties to even); `keys()` and `values()` view the stored
/// 16-bit values, and decoding reads them in place (`qkv::attention` with 16-bit K/V converts each exactly to float
/// in the kernel; nothing is computed or accumulated in 16 bits, and the queries are never rounded). A float above
/// 65504 in magnitude becomes ±∞ in half, which then acts as a stored ±∞ in float K/V would (it may make the rows
/// that see it ±∞ or NaN): keys and values of that size need bfloat16, which keeps float's range with 8 significant
/// bits; NaN stays NaN. Any other pair, a double cache with 16-bit storage included, fails to compile (a static_assert
/// says so).
/// Shapes: `append` takes packed-heads K_new and V_new (T_new × Hkv·head_dim, head h in columns
/// [h·head_dim, (h+1)·head_dim), the layout X·W_k + b_k has); `keys()` and `values()` view the filled rows as
/// [1, Hkv, length, head_dim] of Storage with strides {Hkv·capacity·head_dim, capacity·head_dim, head_dim, 1}
/// (in elements).
/// GQA / MQA: the cache holds n_kv_heads heads, not n_heads: a 32-query / 8-kv-head model stores a quarter of what
/// multi-head attention would, and every query head of a group reads the same rows.
/// RoPE: a module with `Config::rope` stores its keys already rotated (row j of each head by the angles of position
/// j), as Hugging Face Llama and llama.cpp do, so cached keys are never rotated again (a 16-bit cache rounds the
/// rotated float keys, once).
/// Edge cases: slots past `length()` are never read (they start as NaN, a quiet NaN of Storage, so a read would
/// show); `clear()` keeps the memory and sets the length to 0; capacity 0 is allowed (nothing can be appended).
/// Throws: `shape_error` from the constructor for a negative capacity or head_dim < 1 or n_kv_heads < 1; from
/// `append` when the column counts are wrong, the row counts of K_new and V_new differ, or length() + T_new exceeds
/// the capacity (nothing is written then).
/// Complexity: the constructor allocates 2·Hkv·capacity·head_dim elements of Storage once
/// (2·Hkv·capacity·head_dim·sizeof(Storage) bytes: 2 per element for half and bfloat16, 4 for float); `append` copies
/// (and, for 16-bit storage, rounds) its rows, O(T_new·Hkv·head_dim), no allocation; the rest is O(1).
/// Thread safety: concurrent reads are safe; `append` and `clear` need exclusive access.
/// Example: see `MultiHeadAttention::forward(X_new, cache, options)` and README.md, "Multi-head attention and
/// KV-cache decoding":
///
///     qkv::KVCache<float, Eigen::half> cache = mha.make_cache<Eigen::half>(max_tokens);   // 2 bytes per element
///     for (qkv::Index t = 0; t < X.rows(); ++t) Y.row(t) = mha.forward(X.row(t), cache);
///
/// Source: the KV cache of autoregressive decoding (seed 000 §2.4.6: the cache grows with the kv heads, which is
/// why GQA / MQA share them); layout as FlashAttention's `k_cache` per head; 16-bit storage as llama.cpp's f16 cache
/// (its default `cache_type_k` / `cache_type_v`) and vLLM's cache in the model's float16 / bfloat16
/// (`kv_cache_dtype = "auto"`); half is IEEE 754 binary16.
template <class Scalar, class Storage>
class KVCache {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "qkv::KVCache: the scalar type must be float or double");
  static_assert(detail::is_cache_storage_v<Scalar, Storage>,
                "qkv::KVCache<Scalar, Storage>: Storage must be Scalar itself, or Eigen::half or Eigen::bfloat16 with "
                "Scalar = float (16-bit keys and values go with a float module only)");

 public:
  /// The module's scalar type: what `append` takes and decoding computes in.
  using scalar_type = Scalar;
  /// The element type the cache stores: what `keys()` and `values()` view.
  using storage_type = Storage;

  /// An empty cache for `capacity` tokens of `n_kv_heads` key/value heads of `head_dim` features each; every slot
  /// starts as a quiet NaN of Storage. Allocates 2·n_kv_heads·capacity·head_dim·sizeof(Storage) bytes, each array
  /// on a 64-byte boundary (so each head's rows start a cache line where head_dim·sizeof(Storage) is a multiple of 64:
  /// the decoding kernels' 512-bit loads then never straddle two lines).
  KVCache(Index capacity, Index n_kv_heads, Index head_dim)
      : capacity_(capacity), n_kv_heads_(n_kv_heads), head_dim_(head_dim) {
    const char* function = "qkv::KVCache::KVCache";
    detail::check_shape(capacity >= 0, function, ": capacity is ", capacity, ", expected at least 0");
    detail::check_shape(n_kv_heads >= 1, function, ": n_kv_heads is ", n_kv_heads, ", expected at least 1");
    detail::check_shape(head_dim >= 1, function, ": head_dim is ", head_dim, ", expected at least 1");
    const std::size_t size = static_cast<std::size_t>(n_kv_heads * capacity * head_dim);
    keys_.assign(size, std::numeric_limits<Storage>::quiet_NaN());
    values_.assign(size, std::numeric_limits<Storage>::quiet_NaN());
  }

  /// Tokens the cache can hold.
  Index capacity() const noexcept { return capacity_; }
  /// Tokens it holds (the rows of each head that `keys()` and `values()` show).
  Index length() const noexcept { return length_; }
  Index n_kv_heads() const noexcept { return n_kv_heads_; }
  Index head_dim() const noexcept { return head_dim_; }

  /// Forgets every token (length 0); keeps the memory. O(1).
  void clear() noexcept { length_ = 0; }

  /// Appends T_new tokens: K_new and V_new are T_new × Hkv·head_dim packed heads of Scalar (or, both, of Storage:
  /// copied as they are). With 16-bit storage each Scalar is rounded to Storage once (Eigen's conversion, round to
  /// nearest even; above 65504 in magnitude a half is ±∞). Throws shape_error (nothing written) for wrong column
  /// counts, different row counts, or length() + T_new > capacity(). O(T_new·Hkv·head_dim), no allocation.
  template <class DK, class DV>
  void append(const Eigen::MatrixBase<DK>& K_new, const Eigen::MatrixBase<DV>& V_new) {
    using KeyScalar = typename DK::Scalar;
    using ValueScalar = typename DV::Scalar;
    constexpr bool kKeysFit = std::is_same_v<KeyScalar, Scalar> || std::is_same_v<KeyScalar, Storage>;
    constexpr bool kValuesFit = std::is_same_v<ValueScalar, Scalar> || std::is_same_v<ValueScalar, Storage>;
    static_assert(kKeysFit && kValuesFit,
                  "qkv::KVCache::append: K_new and V_new must have the cache's scalar type (or its storage type)");
    const char* function = "qkv::KVCache::append";
    const Index columns = n_kv_heads_ * head_dim_;
    detail::check_shape(K_new.cols() == columns, function, ": K_new has ", K_new.cols(), " columns, expected ", columns,
                        " (n_kv_heads ", n_kv_heads_, " × head_dim ", head_dim_, ")");
    detail::check_shape(V_new.cols() == columns, function, ": V_new has ", V_new.cols(), " columns, expected ", columns,
                        " (n_kv_heads ", n_kv_heads_, " × head_dim ", head_dim_, ")");
    detail::check_shape(V_new.rows() == K_new.rows(), function, ": V_new has ", V_new.rows(), " rows, expected ",
                        K_new.rows(), " (the rows of K_new)");
    check_room(function, K_new.rows());
    const Index t_new = K_new.rows();
    for (Index h = 0; h < n_kv_heads_; ++h) {  // cast<Storage>: the one rounding (none when the types agree)
      head_rows(keys_.data(), h, length_, t_new) = K_new.middleCols(h * head_dim_, head_dim_).template cast<Storage>();
      head_rows(values_.data(), h, length_, t_new) =
          V_new.middleCols(h * head_dim_, head_dim_).template cast<Storage>();
    }
    length_ += t_new;
  }

  /// The cached keys, [1, Hkv, length, head_dim] of Storage (strides {Hkv·capacity·head_dim, capacity·head_dim,
  /// head_dim, 1}).
  TensorView4<const Storage> keys() const noexcept { return view(keys_.data()); }
  /// The cached values, same extents and strides as `keys()`.
  TensorView4<const Storage> values() const noexcept { return view(values_.data()); }

 private:
  friend class MultiHeadAttention<Scalar>;

  using HeadMap = Eigen::Map<Matrix<Storage>, Eigen::Unaligned, Eigen::OuterStride<>>;

  void check_room(const char* function, Index t_new) const {
    detail::check_shape(t_new <= capacity_ - length_, function, ": the KV cache overflows: it holds ", length_, " of ",
                        capacity_, " tokens and ", t_new, " more were appended (", length_ + t_new, " > capacity ",
                        capacity_, ")");
  }

  HeadMap head_rows(Storage* base, Index h, Index first, Index rows) {
    return HeadMap(base + (h * capacity_ + first) * head_dim_, rows, head_dim_, Eigen::OuterStride<>(head_dim_));
  }

  TensorView4<const Storage> view(const Storage* data) const noexcept {
    return TensorView4<const Storage>(data, {1, n_kv_heads_, length_, head_dim_},
                                      {n_kv_heads_ * capacity_ * head_dim_, capacity_ * head_dim_, head_dim_, 1});
  }

  /// Drops the newest tokens back to `length` (used to undo an append when the attention call after it throws).
  void truncate(Index length) noexcept { length_ = std::min(length_, length); }

  Index capacity_ = 0;
  Index n_kv_heads_ = 1;
  Index head_dim_ = 1;
  Index length_ = 0;
  // Each head's rows start a cache line where head_dim·sizeof(Storage) is a multiple of 64 (CacheLineAllocator).
  std::vector<Storage, detail::CacheLineAllocator<Storage>> keys_;    ///< [Hkv, capacity, head_dim]
  std::vector<Storage, detail::CacheLineAllocator<Storage>> values_;  ///< [Hkv, capacity, head_dim]
};

/// Multi-head attention with its projections (PyTorch's nn.MultiheadAttention, forward and backward), with
/// grouped-query (GQA) and multi-query (MQA) heads, varlen batches and incremental decoding with a `KVCache` (of
/// Scalar, or for a float module of 16-bit Eigen::half or Eigen::bfloat16: `make_cache<Eigen::half>(capacity)`):
///
///     Y = concat_h(softmax(Q_h·K_{h/G}ᵀ·scale + masks)·V_{h/G})·W_o + b_o,
///     Q = X_q·W_q + b_q,  K = X_k·W_k + b_k,  V = X_v·W_v + b_v,   G = n_heads / n_kv_heads,
///     with Config::rope set:  Q_h ← R(pos_q)·Q_h,  K_h ← R(pos_k)·K_h   (rotary position embedding, per head).
///
/// Shapes (rows are tokens; every weight is stored [in, out]):
///   W_q d_model × n_heads·head_dim,   W_k kdim × n_kv_heads·head_dim,   W_v vdim × n_kv_heads·head_dim,
///   W_o n_heads·head_dim × d_model;   b_q n_heads·head_dim, b_k and b_v n_kv_heads·head_dim, b_o d_model
///   (each bias has 0 entries when Config::bias is false). X_q Tq × d_model, X_k Tk × kdim, X_v Tk × vdim → Y Tq ×
///   d_model.
/// GQA: query head h (columns [h·head_dim, (h+1)·head_dim) of Q) reads key/value head h / G; n_kv_heads = n_heads is
///   multi-head attention, 1 is multi-query attention. K and V are projected once per kv head and the G query heads
///   of a group read the same memory (no repeated copy, unlike PyTorch's repeat_interleave formulation).
/// RoPE (Config::rope, unset = none): after the projections and their biases, every head of Q and K is rotated by
///   `qkv::apply_rope`'s rule with the options given (layout, base, interpolation_factor, ntk_factor), V never. Row
///   positions: 0 … T − 1 for the queries and, separately, for the keys of `forward(X)`, `forward(X_q, X_kv)` and
///   `attention_weights` (Hugging Face Llama's position_ids = arange(T) for a prefill; with varlen each sequence
///   starts again at 0); L … L + T_new − 1 for both the new queries and the new keys of `forward(X_new, cache)`,
///   L = cache.length() before the call. Cached keys are stored rotated. A Llama layer is this module with
///   `bias = false` and `rope` set (RMSNorm and the MLP stay outside it): examples/llama_decoder.cpp.
/// Options: every field of `AttentionOptions` passes through to `qkv::attention` with B = 1 (`key_lengths` has one
///   entry; `allowed` and `bias` are [1, n_heads or 1, Tq or 1, Tk] views). Default scale 1/√head_dim, as PyTorch.
///   The default causal alignment is bottom-right, PyTorch's `is_causal` is top-left: they agree when Tq = Tk.
///   PyTorch's boolean masks mean True = masked, the opposite of `allowed` (see the table at the top of this file).
/// Members: the weights are public and zero after construction; set them directly or with a loader. Every call checks
///   their shapes (O(1)) and throws `shape_error` if a weight was assigned a wrong shape.
/// Thread safety: the const members may run concurrently; changing weights while another thread runs a forward is a
///   data race.
/// Example: examples/real_layer.cpp (a pretrained PP-OCRv4 layer); examples/llama_decoder.cpp (a Llama-style layer
///   with RoPE, prefill and decoding); README.md, "Multi-head attention and KV-cache decoding" (a decode loop).
/// Source: Vaswani et al. 2017 §3.2.2; seed 002 §2.1, §3.3, §4.1, §4.3; seed 000 §2.4.6 (GQA / MQA); PyTorch's
///   nn.MultiheadAttention; Ainslie et al. 2023 (GQA), Shazeer 2019 (MQA); Su et al. 2021 (RoFormer) and Hugging Face
///   transformers' Llama `apply_rotary_pos_emb` (RoPE in the module, `rotate_half`).
template <class Scalar>
class MultiHeadAttention {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "qkv::MultiHeadAttention: the scalar type must be float or double");

 public:
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

  /// The module's sizes, set field by field (C++17 aggregate: designated initializers are C++20):
  ///
  ///     qkv::MultiHeadAttention<float>::Config config;
  ///     config.d_model = 4096;  config.n_heads = 32;  config.n_kv_heads = 8;   // Llama-style GQA, head_dim 128
  ///     config.bias = false;  config.rope = qkv::RopeOptions{};   // Llama: no biases, RoPE rotate_half, base 10000
  struct Config {
    Index d_model = 0;     ///< model width: the columns of X_q and of Y
    Index n_heads = 1;     ///< query heads, Hq
    Index n_kv_heads = 0;  ///< key/value heads, Hkv; 0 = n_heads; must divide n_heads
    Index head_dim = 0;    ///< features per head; 0 = d_model / n_heads, which must then divide
    Index kdim = 0;        ///< columns of the key input X_k; 0 = d_model (PyTorch's kdim, for cross-attention)
    Index vdim = 0;        ///< columns of the value input X_v; 0 = d_model (PyTorch's vdim)
    bool bias = true;      ///< whether b_q, b_k, b_v, b_o exist (PyTorch's bias)
    /// Rotary position embedding of Q and K (see the class comment and `RopeOptions`); unset = none. Needs an even
    /// head_dim. Llama 2 / 3: `RopeOptions{}` with base 10000 / 500000, layout rotate_half (Hugging Face checkpoints).
    std::optional<RopeOptions> rope;
  };

  /// Builds the module with every weight and bias zero. `config()` then returns the resolved sizes (no 0 left).
  /// Throws shape_error when d_model < 1, n_heads < 1, n_kv_heads < 0 or not dividing n_heads, head_dim < 0, head_dim
  /// = 0 with n_heads not dividing d_model, kdim / vdim < 0, or `rope` is set with an odd head_dim or an option of it
  /// not finite and > 0. Allocates the four weight matrices (and the head_dim / 2 RoPE frequencies, computed once).
  explicit MultiHeadAttention(const Config& config)
      : config_(resolve(config)), rope_frequencies_(resolve_rope_frequencies(config_)) {
    const Index q_out = config_.n_heads * config_.head_dim, kv_out = config_.n_kv_heads * config_.head_dim;
    const Index bias_q = config_.bias ? q_out : 0, bias_kv = config_.bias ? kv_out : 0;
    W_q = Matrix<Scalar>::Zero(config_.d_model, q_out);
    W_k = Matrix<Scalar>::Zero(config_.kdim, kv_out);
    W_v = Matrix<Scalar>::Zero(config_.vdim, kv_out);
    W_o = Matrix<Scalar>::Zero(q_out, config_.d_model);
    b_q = Vector::Zero(bias_q);
    b_k = Vector::Zero(bias_kv);
    b_v = Vector::Zero(bias_kv);
    b_o = Vector::Zero(config_.bias ? config_.d_model : 0);
  }

  /// The resolved configuration: n_kv_heads, head_dim, kdim and vdim filled in.
  const Config& config() const noexcept { return config_; }
  Index d_model() const noexcept { return config_.d_model; }
  Index n_heads() const noexcept { return config_.n_heads; }
  Index n_kv_heads() const noexcept { return config_.n_kv_heads; }
  Index head_dim() const noexcept { return config_.head_dim; }
  Index kdim() const noexcept { return config_.kdim; }
  Index vdim() const noexcept { return config_.vdim; }

  /// Query projection [in = d_model, out = n_heads·head_dim].
  Matrix<Scalar> W_q;
  /// Key projection [in = kdim, out = n_kv_heads·head_dim].
  Matrix<Scalar> W_k;
  /// Value projection [in = vdim, out = n_kv_heads·head_dim].
  Matrix<Scalar> W_v;
  /// Output projection [in = n_heads·head_dim, out = d_model].
  Matrix<Scalar> W_o;
  /// Biases (n_heads·head_dim, n_kv_heads·head_dim, n_kv_heads·head_dim, d_model entries; 0 when Config::bias is
  /// false).
  Vector b_q, b_k, b_v, b_o;

  // ---- loaders ----------------------------------------------------------------------------------------------------

  /// Loads PyTorch's packed nn.MultiheadAttention parameters (used when kdim = vdim = embed_dim):
  ///
  ///     W_q | W_k | W_v = in_proj_weightᵀ (split by columns),  b_q | b_k | b_v = in_proj_bias,
  ///     W_o = out_proj.weightᵀ,  b_o = out_proj.bias
  ///
  /// Shapes: in_proj_weight [(n_heads + 2·n_kv_heads)·head_dim, d_model] (PyTorch's [3·E, E] for multi-head attention:
  /// rows are outputs, [out, in]), in_proj_bias (n_heads + 2·n_kv_heads)·head_dim entries, out_proj_weight
  /// [d_model, n_heads·head_dim], out_proj_bias d_model entries; biases have 0 entries when Config::bias is false.
  /// Any Eigen expression of Scalar binds (e.g. an `Eigen::Map` of a NumPy / PyTorch buffer, row-major).
  /// Precondition: kdim = vdim = d_model (else use the separate form below).
  /// Throws: shape_error (nothing changed) for any other shape, naming the argument and both sizes.
  /// Complexity: O(parameters); reallocates the weights.
  /// Source: PyTorch nn.MultiheadAttention (`in_proj_weight`, `in_proj_bias`, `out_proj`).
  template <class DW, class DB, class DO, class DOB>
  void load_pytorch(const Eigen::MatrixBase<DW>& in_proj_weight, const Eigen::MatrixBase<DB>& in_proj_bias,
                    const Eigen::MatrixBase<DO>& out_proj_weight, const Eigen::MatrixBase<DOB>& out_proj_bias) {
    check_scalar<DW, DB, DO, DOB>();
    const char* function = "qkv::MultiHeadAttention::load_pytorch";
    check_self_projections(function, "the packed in_proj_weight needs",
                           "; use load_pytorch(q_proj_weight, k_proj_weight, v_proj_weight, in_proj_bias, ...)");
    const Index q_out = q_columns(), kv_out = kv_columns();
    check_matrix(function, "in_proj_weight", in_proj_weight.rows(), in_proj_weight.cols(), q_out + 2 * kv_out,
                 config_.d_model, "[(n_heads + 2·n_kv_heads)·head_dim, d_model], PyTorch's [out, in]");
    check_vector(function, "in_proj_bias", in_proj_bias, config_.bias ? q_out + 2 * kv_out : 0);
    check_matrix(function, "out_proj_weight", out_proj_weight.rows(), out_proj_weight.cols(), config_.d_model, q_out,
                 "[d_model, n_heads·head_dim], PyTorch's [out, in]");
    check_vector(function, "out_proj_bias", out_proj_bias, config_.bias ? config_.d_model : 0);
    W_q = in_proj_weight.topRows(q_out).transpose();
    W_k = in_proj_weight.middleRows(q_out, kv_out).transpose();
    W_v = in_proj_weight.bottomRows(kv_out).transpose();
    W_o = out_proj_weight.transpose();
    load_biases(in_proj_bias, out_proj_bias);
  }

  /// Loads PyTorch's separate nn.MultiheadAttention parameters (its form when kdim or vdim ≠ embed_dim):
  /// W_q = q_proj_weightᵀ, W_k = k_proj_weightᵀ, W_v = v_proj_weightᵀ, b_q | b_k | b_v = in_proj_bias,
  /// W_o = out_proj.weightᵀ, b_o = out_proj.bias.
  ///
  /// Shapes: q_proj_weight [n_heads·head_dim, d_model], k_proj_weight [n_kv_heads·head_dim, kdim], v_proj_weight
  /// [n_kv_heads·head_dim, vdim] (PyTorch's [out, in]); in_proj_bias (n_heads + 2·n_kv_heads)·head_dim entries (PyTorch
  /// keeps one packed bias even here); out_proj_weight [d_model, n_heads·head_dim]; out_proj_bias d_model entries.
  /// Throws: shape_error (nothing changed) for any other shape. Complexity: O(parameters).
  /// Source: PyTorch nn.MultiheadAttention (`q_proj_weight`, `k_proj_weight`, `v_proj_weight`,
  /// `_qkv_same_embed_dim = False`).
  template <class DQ, class DK, class DV, class DB, class DO, class DOB>
  void load_pytorch(const Eigen::MatrixBase<DQ>& q_proj_weight, const Eigen::MatrixBase<DK>& k_proj_weight,
                    const Eigen::MatrixBase<DV>& v_proj_weight, const Eigen::MatrixBase<DB>& in_proj_bias,
                    const Eigen::MatrixBase<DO>& out_proj_weight, const Eigen::MatrixBase<DOB>& out_proj_bias) {
    check_scalar<DQ, DK, DV, DB, DO, DOB>();
    const char* function = "qkv::MultiHeadAttention::load_pytorch";
    const Index q_out = q_columns(), kv_out = kv_columns();
    check_matrix(function, "q_proj_weight", q_proj_weight.rows(), q_proj_weight.cols(), q_out, config_.d_model,
                 "[n_heads·head_dim, d_model], PyTorch's [out, in]");
    check_matrix(function, "k_proj_weight", k_proj_weight.rows(), k_proj_weight.cols(), kv_out, config_.kdim,
                 "[n_kv_heads·head_dim, kdim], PyTorch's [out, in]");
    check_matrix(function, "v_proj_weight", v_proj_weight.rows(), v_proj_weight.cols(), kv_out, config_.vdim,
                 "[n_kv_heads·head_dim, vdim], PyTorch's [out, in]");
    check_vector(function, "in_proj_bias", in_proj_bias, config_.bias ? q_out + 2 * kv_out : 0);
    check_matrix(function, "out_proj_weight", out_proj_weight.rows(), out_proj_weight.cols(), config_.d_model, q_out,
                 "[d_model, n_heads·head_dim], PyTorch's [out, in]");
    check_vector(function, "out_proj_bias", out_proj_bias, config_.bias ? config_.d_model : 0);
    W_q = q_proj_weight.transpose();
    W_k = k_proj_weight.transpose();
    W_v = v_proj_weight.transpose();
    W_o = out_proj_weight.transpose();
    load_biases(in_proj_bias, out_proj_bias);
  }

  /// Loads a fused [in, out] QKV projection, as exported by Paddle, ONNX graphs and many C++ engines:
  ///
  ///     X·W_qkv + b_qkv = [Q | K | V]:  W_q | W_k | W_v = W_qkv (split by columns),  b_q | b_k | b_v = b_qkv
  ///
  /// Shapes: W_qkv [d_model, (n_heads + 2·n_kv_heads)·head_dim], b_qkv (n_heads + 2·n_kv_heads)·head_dim entries,
  /// W_o [n_heads·head_dim, d_model], b_o d_model entries (biases: 0 entries when Config::bias is false).
  /// Precondition: kdim = vdim = d_model. Throws: shape_error (nothing changed) otherwise or for any other shape.
  /// Complexity: O(parameters). Example: examples/real_layer.cpp (PP-OCRv4's `linear_77` and `linear_78`).
  /// Source: the fused `qkv` linear layer of ViT / SVTR / PaddleOCR blocks.
  template <class DW, class DB, class DO, class DOB>
  void load_fused_qkv(const Eigen::MatrixBase<DW>& W_qkv, const Eigen::MatrixBase<DB>& b_qkv,
                      const Eigen::MatrixBase<DO>& W_o_in, const Eigen::MatrixBase<DOB>& b_o_in) {
    check_scalar<DW, DB, DO, DOB>();
    const char* function = "qkv::MultiHeadAttention::load_fused_qkv";
    check_self_projections(function, "a fused W_qkv needs");
    const Index q_out = q_columns(), kv_out = kv_columns();
    check_matrix(function, "W_qkv", W_qkv.rows(), W_qkv.cols(), config_.d_model, q_out + 2 * kv_out,
                 "[d_model, (n_heads + 2·n_kv_heads)·head_dim], [in, out]");
    check_vector(function, "b_qkv", b_qkv, config_.bias ? q_out + 2 * kv_out : 0);
    check_matrix(function, "W_o", W_o_in.rows(), W_o_in.cols(), q_out, config_.d_model, "[n_heads·head_dim, d_model]");
    check_vector(function, "b_o", b_o_in, config_.bias ? config_.d_model : 0);
    W_q = W_qkv.leftCols(q_out);
    W_k = W_qkv.middleCols(q_out, kv_out);
    W_v = W_qkv.rightCols(kv_out);
    W_o = W_o_in;
    load_biases(b_qkv, b_o_in);
  }

  // ---- forward ----------------------------------------------------------------------------------------------------

  /// Self-attention: Y = MHA(X, X, X). X is T × d_model (any Eigen expression of Scalar; kdim = vdim = d_model);
  /// Y is T × d_model.
  ///
  /// Varlen batch: set `options.cu_seqlens_q` and `options.cu_seqlens_k` (both usually the same offsets, B + 1
  /// entries from 0 to T) and X holds the sequences one after another; sequence b is rows [cu[b], cu[b+1]) and never
  /// sees another sequence. The projections are row-wise, so the concatenation is projected in one product and
  /// nothing is padded. `forward(sequences, options)` below does the concatenation for a list.
  /// RoPE (Config::rope): row t of Q and of K is rotated by the angles of position t (of position t − cu[b] in
  /// sequence b of a varlen batch), as Hugging Face Llama's prefill; O(T·(Hq + Hkv)·head_dim) more, plus
  /// O(T·head_dim) cos/sin.
  /// Edge cases: T = 0 gives a 0 × d_model result; a row that sees no key (masks) gets Y = b_o.
  /// Throws: shape_error when X does not have d_model columns, a weight has the wrong shape, the cu_seqlens do not
  /// start at 0, decrease, or do not end at T, or for anything `qkv::attention` rejects; unsupported_error as the core.
  /// Complexity: O(T·d_model·(Hq + 2·Hkv)·head_dim) for the projections, O(Hq·T²·head_dim) for attention (less with
  /// causal, window or varlen masks); allocates Q, K, V, the attention output and Y.
  /// Example: `Y = mha.forward(X);`  with causal masking: `options.causal = true; Y = mha.forward(X, options);`
  /// Source: PyTorch nn.MultiheadAttention(query = key = value = X); seed 002 §4.1.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X,
                         const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DX>();
    return forward_impl("qkv::MultiHeadAttention::forward", X.derived(), "X", X.derived(), "X", X.derived(), "X",
                        options);
  }

  /// Cross-attention: queries from X_q (Tq × d_model), keys and values from one sequence X_kv (Tk × kdim, with
  /// kdim = vdim), as a decoder attends to an encoder's output. Y is Tq × d_model. Varlen: cu_seqlens_q over the rows
  /// of X_q, cu_seqlens_k over the rows of X_kv. RoPE (Config::rope): queries at positions 0 … Tq − 1, keys at
  /// 0 … Tk − 1, each sequence from its own start (for new queries placed after cached keys, use the `KVCache` form).
  /// Throws, complexity and edge cases as the self-attention form (Tk = 0 gives Y rows equal to b_o).
  /// Source: PyTorch nn.MultiheadAttention(query = X_q, key = value = X_kv); seed 002 §2.1 (cross attention).
  template <class DQ, class DKV>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DQ>& X_q, const Eigen::MatrixBase<DKV>& X_kv,
                         const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DQ, DKV>();
    return forward_impl("qkv::MultiHeadAttention::forward", X_q.derived(), "X_q", X_kv.derived(), "X_kv",
                        X_kv.derived(), "X_kv", options);
  }

  /// Attention with different key and value inputs: X_q Tq × d_model, X_k Tk × kdim, X_v Tk × vdim (PyTorch's kdim
  /// ≠ vdim case). Y is Tq × d_model. Throws shape_error when X_k and X_v have different row counts, or as above.
  /// Source: PyTorch nn.MultiheadAttention(query, key, value) with kdim, vdim.
  template <class DQ, class DK, class DV>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DQ>& X_q, const Eigen::MatrixBase<DK>& X_k,
                         const Eigen::MatrixBase<DV>& X_v,
                         const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DQ, DK, DV>();
    return forward_impl("qkv::MultiHeadAttention::forward", X_q.derived(), "X_q", X_k.derived(), "X_k", X_v.derived(),
                        "X_v", options);
  }

  /// Self-attention over a batch of sequences of different lengths (each T_b × d_model), returned in the same order.
  /// The sequences are concatenated (a copy of the input, no padding) and run as one varlen call (cu_seqlens = the
  /// running row counts): sequence b sees only its own keys. `options` applies to every sequence (e.g. causal) and
  /// must not set cu_seqlens itself, nor `key_lengths`, `allowed` or `bias` (not combinable with varlen).
  /// Throws: shape_error when a sequence does not have d_model columns, or options set cu_seqlens, or as `forward(X)`.
  /// Complexity: as `forward(X)` on the concatenation, plus O(Σ T_b·d_model) copies in and out.
  /// Source: FlashAttention's flash_attn_varlen_func (packed sequences, cu_seqlens).
  std::vector<Matrix<Scalar>> forward(const std::vector<Matrix<Scalar>>& sequences,
                                      const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    const char* function = "qkv::MultiHeadAttention::forward";
    detail::check_shape(options.cu_seqlens_q.empty() && options.cu_seqlens_k.empty(), function,
                        ": options.cu_seqlens_q/k are set (", options.cu_seqlens_q.size(), " and ",
                        options.cu_seqlens_k.size(), " entries), expected none: the list of sequences defines them");
    std::vector<Index> cu{0};
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      detail::check_shape(sequences[b].cols() == config_.d_model, function, ": sequences[", b, "] has ",
                          sequences[b].cols(), " columns, expected d_model ", config_.d_model);
      cu.push_back(cu.back() + sequences[b].rows());
    }
    Matrix<Scalar> X(cu.back(), config_.d_model);
    for (std::size_t b = 0; b < sequences.size(); ++b) X.middleRows(cu[b], sequences[b].rows()) = sequences[b];
    AttentionOptions<Scalar> varlen = options;
    varlen.cu_seqlens_q = cu;
    varlen.cu_seqlens_k = cu;
    const Matrix<Scalar> Y = forward_impl(function, X, "X", X, "X", X, "X", varlen);
    std::vector<Matrix<Scalar>> outputs(sequences.size());
    for (std::size_t b = 0; b < sequences.size(); ++b) outputs[b] = Y.middleRows(cu[b], sequences[b].rows());
    return outputs;
  }

  /// Incremental (KV-cache) self-attention: appends the keys and values of the T_new new tokens X_new
  /// (T_new × d_model) to `cache`, then lets the new tokens attend over everything cached (length L after the append):
  ///
  ///     Y = MHA(X_new, cache[0 .. L)),   causal, bottom-right: new token i sees cached keys j ≤ L − T_new + i
  ///
  /// whatever `options.causal` and `options.alignment` say (the other options apply: window, ALiBi, softcap, sinks,
  /// scale, key_lengths ≤ L, `allowed` / `bias` of extents [1, Hq or 1, T_new or 1, L]). Feeding a sequence token by
  /// token, or in chunks (chunked prefill), gives the rows of one causal `forward(X, options)` over the whole sequence,
  /// within 1e-5·max(1, max|Y|) in float (tested for MHA, GQA 32/8 and MQA, with and without RoPE).
  /// RoPE (Config::rope): the new queries and the new keys are rotated by the angles of positions L − T_new … L − 1,
  /// i.e. from the cache's length before the call onwards (Hugging Face Llama's cache_position, llama.cpp's n_past),
  /// and the keys are appended rotated; the cached keys are not touched again. Positions come from the cache alone,
  /// so a cache holds one sequence from its first token (`clear()` starts the next one at position 0).
  /// 16-bit cache (Scalar = float, `KVCache<float, Eigen::half>` or `KVCache<float, Eigen::bfloat16>` from
  /// `make_cache<Eigen::half>(capacity)`): the new keys (rotated, with RoPE) and values are rounded once as they are
  /// appended, and the new tokens attend over the stored 16-bit values, their own included, read in place and
  /// converted exactly to float in the kernel; Q is never rounded. The result is the float call's on those values, bit
  /// for bit: token by token or in chunks it gives the rows of one causal pass over the same rounded K/V, within the
  /// float rule above (tested for half and bfloat16, GQA 8/2, with and without RoPE). It differs from the float cache's
  /// result by the rounding of K and V (at most 2⁻¹¹ relative per element for half in its normal range, 2⁻⁸ for
  /// bfloat16).
  /// Shapes: cache of n_kv_heads() heads of head_dim() (e.g. `make_cache(capacity)`); Y is T_new × d_model.
  /// Precondition: kdim = vdim = d_model (K and V come from X_new).
  /// Edge cases: slots past the cache's length are never read; T_new = 0 appends nothing and returns 0 × d_model. With
  /// `options.dropout_p` > 0 the new rows draw the dropout mask of positions L … L + T_new − 1 (the mask one forward
  /// over all the tokens would draw for them).
  /// Throws: shape_error when X_new does not have d_model columns, the cache's heads or head_dim differ from the
  /// module's, length + T_new exceeds the capacity (the cache is left unchanged), or as `qkv::attention` (the append is
  /// then undone).
  /// Complexity: O(T_new·d_model·(Hq + 2·Hkv)·head_dim) projections + O(Hq·T_new·L·head_dim) attention (+ with RoPE
  /// O(T_new·(Hq + Hkv)·head_dim) rotations and O(T_new·head_dim) cos/sin); the cache is read in place (no copy of the
  /// past keys, a 16-bit cache is not widened); allocates O(T_new·d_model).
  /// Thread safety: needs exclusive access to `cache`; distinct caches may run concurrently on one module.
  /// Example:
  ///
  ///     qkv::KVCache<float> cache = mha.make_cache(max_tokens);      // or, 2 bytes per element:
  ///     // qkv::KVCache<float, Eigen::half> cache = mha.make_cache<Eigen::half>(max_tokens);
  ///     for (qkv::Index t = 0; t < X.rows(); ++t) Y.row(t) = mha.forward(X.row(t), cache);
  ///
  /// Source: autoregressive decoding with a KV cache (FlashAttention's flash_attn_with_kvcache: bottom-right causal);
  /// seed 000 §2.4.6; a 16-bit cache as llama.cpp's f16 cache.
  template <class DX, class Storage>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X_new, KVCache<Scalar, Storage>& cache,
                         const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DX>();
    const char* function = "qkv::MultiHeadAttention::forward";
    check_weights(function);
    check_shape_input(function, "X_new", X_new.cols(), config_.d_model, "d_model");
    check_self_projections(function, "decoding with a KV cache projects keys and values from X_new, which needs");
    detail::check_shape(cache.n_kv_heads() == config_.n_kv_heads && cache.head_dim() == config_.head_dim, function,
                        ": the cache has ", cache.n_kv_heads(), " kv heads of ", cache.head_dim(),
                        " features, expected n_kv_heads ", config_.n_kv_heads, " of head_dim ", config_.head_dim);
    cache.check_room(function, X_new.rows());

    const Index old_length = cache.length();
    Matrix<Scalar> Q = project(X_new.derived(), W_q, b_q);
    Matrix<Scalar> K_new = project(X_new.derived(), W_k, b_k);
    rotate(Q, config_.n_heads, 0, Q.rows(), old_length);  // RoPE, if configured: positions L … L + T_new − 1
    rotate(K_new, config_.n_kv_heads, 0, K_new.rows(), old_length);
    cache.append(K_new, project(X_new.derived(), W_v, b_v));
    struct Undo {  // undoes the append if the attention call throws
      KVCache<Scalar, Storage>& cache;
      Index length;
      bool committed = false;
      ~Undo() {
        if (!committed) cache.truncate(length);
      }
    } undo{cache, old_length};

    AttentionOptions<Scalar> causal = options;
    causal.causal = true;
    causal.alignment = CausalAlignment::bottom_right;
    if (options.dropout_p > Scalar(0) && !options.global_positions) {
      // Dropout keys its mask by position: the new queries are positions L … L + T_new − 1 of the sequence, as in one
      // forward over all L + T_new tokens (the same visibility: bottom-right causal at global positions is the same
      // diagonal).
      const Index total = old_length + X_new.rows();
      causal.global_positions = GlobalPositions{old_length, 0, total, total};
    }
    Matrix<Scalar> Y = attend<Storage>(Q, cache.keys(), cache.values(), causal);
    undo.committed = true;
    return Y;
  }

  /// A cache for this module: `KVCache<Scalar, Storage>(capacity, n_kv_heads(), head_dim())`. Storage defaults to
  /// Scalar (`make_cache(capacity)` is a `KVCache<Scalar>`); a float module may store its keys and values in 16 bits,
  /// `make_cache<Eigen::half>(capacity)` or `make_cache<Eigen::bfloat16>(capacity)` (rounded once on append; see
  /// `KVCache`), and a double module with a 16-bit Storage fails to compile. Allocates 2·Hkv·capacity·head_dim elements
  /// of Storage. Throws shape_error for a negative capacity.
  template <class Storage = Scalar>
  KVCache<Scalar, Storage> make_cache(Index capacity) const {
    return KVCache<Scalar, Storage>(capacity, config_.n_kv_heads, config_.head_dim);
  }

  /// The Tq × Tk attention weights P of query head `head`, for inspection (seed 000 §2.4.7: a debugging signal, not an
  /// explanation): P = softmax(Q_h·K_{h/G}ᵀ·scale + masks) with Q = X_q·W_q + b_q and K = X_kv·W_k + b_k (rotated
  /// as in `forward(X_q, X_kv)` when Config::rope is set).
  ///
  /// Shapes: X_q Tq × d_model, X_kv Tk × kdim (only the keys are needed, so this also serves kdim ≠ vdim); head in
  /// [0, n_heads). Row i sums to 1 over its visible keys (1 − p_sink with sinks) and is exactly 0 at hidden keys; a row
  /// that sees no key is all zeros (NaN in PyTorch 1.13). PyTorch's need_weights with average_attn_weights = True is
  /// the mean of these matrices over the heads; average_attn_weights = False gives them one by one. With varlen options
  /// the result is block diagonal (sequence b's block at rows cu_q[b].., columns cu_k[b]..).
  /// Computed by the reference path in double (as `qkv::attention_weights`).
  /// Throws: shape_error for a head outside [0, n_heads), wrong input columns or weights, or as
  /// `qkv::attention_weights`. Complexity: O((Tq·d_model + Tk·kdim)·heads·head_dim) projections + O(Tq·Tk·head_dim);
  /// allocates O(Tq·Tk). Source: PyTorch nn.MultiheadAttention's attn_output_weights; seed 000 §2.4.7.
  template <class DQ, class DKV>
  Matrix<Scalar> attention_weights(const Eigen::MatrixBase<DQ>& X_q, const Eigen::MatrixBase<DKV>& X_kv, Index head,
                                   const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DQ, DKV>();
    const char* function = "qkv::MultiHeadAttention::attention_weights";
    check_weights(function);
    check_shape_input(function, "X_q", X_q.cols(), config_.d_model, "d_model");
    check_shape_input(function, "X_kv", X_kv.cols(), config_.kdim, "kdim");
    detail::check_shape(head >= 0 && head < config_.n_heads, function, ": head is ", head,
                        ", expected an index in [0, ", config_.n_heads, ") (n_heads)");
    check_varlen(function, options, X_q.rows(), "X_q", X_kv.rows(), "X_kv");
    Matrix<Scalar> Q = project(X_q.derived(), W_q, b_q);
    Matrix<Scalar> K = project(X_kv.derived(), W_k, b_k);
    rotate_sequences(Q, config_.n_heads, options.cu_seqlens_q);
    rotate_sequences(K, config_.n_kv_heads, options.cu_seqlens_k);
    return qkv::attention_weights(Q, K, Heads{config_.n_heads, config_.n_kv_heads}, head, options);
  }

  // ---- backward ---------------------------------------------------------------------------------------------------

  /// The gradients of a scalar loss L through one forward call, as `backward` returns them: each has the shape of
  /// what it is the gradient of (the parameters' shapes and layout, [in, out] weights), so an SGD step is
  /// `mha.W_q -= lr * g.dW_q;` field by field. PyTorch's names: dX_q, dX_k, dX_v are `query.grad`, `key.grad` and
  /// `value.grad` of nn.MultiheadAttention(query, key, value); dX is `x.grad` of the self-attention call
  /// nn.MultiheadAttention(x, x, x) (the three paths summed); dW_q … db_o are the parameters' `.grad` (transposed from
  /// PyTorch's [out, in] to the module's [in, out], and packed PyTorch's in_proj_bias.grad is db_q | db_k | db_v).
  struct Gradients {
    /// Self-attention `backward(X, dY)`: ∂L/∂X = dX_q + dX_k + dX_v, T × d_model. Empty (0 × 0) from the cross forms.
    Matrix<Scalar> dX;
    /// `backward(X_q, X_kv, dY)`: ∂L/∂X_kv = dX_k + dX_v, Tk × kdim. Empty (0 × 0) from the other forms.
    Matrix<Scalar> dX_kv;
    /// The gradient through the query input, Tq × d_model (every form).
    Matrix<Scalar> dX_q;
    /// The gradient through the key input, Tk × kdim (every form; in self-attention, X's share through K).
    Matrix<Scalar> dX_k;
    /// The gradient through the value input, Tk × vdim (every form; in self-attention, X's share through V).
    Matrix<Scalar> dX_v;
    /// ∂L/∂W_q (d_model × n_heads·head_dim), ∂L/∂W_k (kdim × n_kv_heads·head_dim), ∂L/∂W_v (vdim ×
    /// n_kv_heads·head_dim), ∂L/∂W_o (n_heads·head_dim × d_model).
    Matrix<Scalar> dW_q, dW_k, dW_v, dW_o;
    /// ∂L/∂b_q, ∂L/∂b_k, ∂L/∂b_v, ∂L/∂b_o; 0 entries when Config::bias is false.
    Vector db_q, db_k, db_v, db_o;
  };

  /// Backward pass of self-attention: given dY = ∂L/∂Y for Y = forward(X, options), the gradients of L with respect to
  /// X and to every parameter (`Gradients`), by the chain rule through the module:
  ///
  ///     dW_o = Oᵀ·dY,   db_o = Σ_t dY_t,   dO = dY·W_oᵀ
  ///     dQ, dK, dV = attention_backward(Q, K, V, O, lse, dO)       (qkv::attention_backward, GQA summed per kv head)
  ///     dQ ← R(pos_q)ᵀ·dQ,  dK ← R(pos_k)ᵀ·dK                      (Config::rope only: the rotation taken back)
  ///     dW_q = X_qᵀ·dQ,  db_q = Σ_t dQ_t,  dX_q = dQ·W_qᵀ           (and the same for K with X_k, V with X_v)
  ///     dX = dX_q + dX_k + dX_v
  ///
  /// It recomputes the forward (projections, RoPE, `qkv::attention` with its lse) and keeps no state, so a `const`
  /// module serves concurrent backward passes; the recomputed Y is not returned (call `forward` for it).
  /// Shapes: X T × d_model, dY T × d_model (kdim = vdim = d_model). Gradients as `Gradients` documents.
  /// Options: the same options as the forward call, every one differentiated as `qkv::attention_backward` does (masks,
  ///   scale, softcap, ALiBi, sinks, varlen with cu_seqlens over X's rows, global positions). Dropout
  ///   (`options.dropout_p`): pass the same dropout_seed and dropout_offset as the forward call whose loss this is; the
  ///   mask is a function of them and of the positions (never stored), so forward and backward see the same mask.
  ///   Options are not parameters of the module: no gradient is returned for `bias` or `sinks` (call
  ///   `qkv::attention_backward` with `AttentionGradientExtras` for those).
  /// RoPE (Config::rope): the rotation is differentiated exactly (dQ and dK rotated back by Rᵀ, positions as in
  ///   `forward(X)`, each varlen sequence from 0).
  /// Edge cases: T = 0 gives empty dX and zero parameter gradients; a row that sees no key passes no gradient into
  ///   the attention (its Y = b_o still gives db_o its dY row); NaN follows `qkv::attention_backward`'s rule.
  /// Throws: shape_error when X or dY does not have d_model columns, dY does not have X's rows, kdim or vdim differs
  ///   from d_model, a weight has the wrong shape, or as `qkv::attention` / `qkv::attention_backward`;
  ///   unsupported_error as the core (Backend::fused with double).
  /// Complexity: about three forward passes: the forward itself (projections, O(T·d_model·(2·Hq + 2·Hkv)·head_dim),
  ///   and attention), then twice the projections' cost (dX and dW of each of the four projections) and
  ///   the attention backward (≈ 2–2.5× the attention forward on the fused path); allocates Q, K, V, O, lse, dO, dQ,
  ///   dK, dV and the gradients, O(T·(d_model + (Hq + Hkv)·head_dim) + parameters); the attention itself stores no
  ///   T × T matrix on the fused path (float, Backend::automatic).
  /// Thread safety: const; concurrent calls on one module are safe.
  /// Example: examples/train_tiny.cpp (SGD on a copy task):
  ///
  ///     const auto g = mha.backward(X, dY, options);
  ///     mha.W_q -= lr * g.dW_q;  mha.W_k -= lr * g.dW_k;  mha.W_v -= lr * g.dW_v;  mha.W_o -= lr * g.dW_o;
  ///
  /// Source: backpropagation through the projections (seed 002 §2.1, §3.3, §4.1); the attention backward of
  /// FlashAttention-2 (Dao 2023, Algorithm 2); RoPE's rotation is orthogonal (Su et al. 2021), so its Jacobian's
  /// transpose is the rotation by −θ; PyTorch autograd's results for nn.MultiheadAttention.
  template <class DX, class DY>
  Gradients backward(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DY>& dY,
                     const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DX, DY>();
    const char* function = "qkv::MultiHeadAttention::backward";
    check_self_projections(function, "the self-attention backward (X is the query, key and value input) needs",
                           "; use backward(X_q, X_kv, dY) or backward(X_q, X_k, X_v, dY)");
    Gradients g = backward_impl(function, X.derived(), "X", X.derived(), "X", X.derived(), "X", dY.derived(), options);
    g.dX = g.dX_q + g.dX_k + g.dX_v;
    return g;
  }

  /// Backward pass of cross-attention `forward(X_q, X_kv, options)`: X_q Tq × d_model, X_kv Tk × kdim (kdim = vdim),
  /// dY Tq × d_model. dX_kv = dX_k + dX_v is the gradient with respect to X_kv; dX_q, the parameters' gradients and
  /// everything else as the self-attention form (RoPE: queries and keys each from position 0, as the forward).
  /// Throws: shape_error when kdim ≠ vdim, or as the self-attention form. Complexity as the self-attention form.
  /// Source: PyTorch nn.MultiheadAttention(query = X_q, key = value = X_kv) under autograd.
  template <class DQ, class DKV, class DY>
  Gradients backward(const Eigen::MatrixBase<DQ>& X_q, const Eigen::MatrixBase<DKV>& X_kv,
                     const Eigen::MatrixBase<DY>& dY,
                     const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DQ, DKV, DY>();
    const char* function = "qkv::MultiHeadAttention::backward";
    detail::check_shape(config_.kdim == config_.vdim, function,
                        ": X_kv is both the key and the value input, which needs kdim = vdim, but kdim is ",
                        config_.kdim, " and vdim is ", config_.vdim, "; use backward(X_q, X_k, X_v, dY)");
    Gradients g = backward_impl(function, X_q.derived(), "X_q", X_kv.derived(), "X_kv", X_kv.derived(), "X_kv",
                                dY.derived(), options);
    g.dX_kv = g.dX_k + g.dX_v;
    return g;
  }

  /// Backward pass of `forward(X_q, X_k, X_v, options)`: X_q Tq × d_model, X_k Tk × kdim, X_v Tk × vdim, dY Tq ×
  /// d_model; dX_q, dX_k and dX_v are the gradients with respect to the three inputs (dX and dX_kv stay empty), the
  /// rest as the self-attention form.
  /// Throws: shape_error when X_k and X_v have different row counts, or as the self-attention form.
  /// Source: PyTorch nn.MultiheadAttention(query, key, value) with kdim, vdim, under autograd.
  template <class DQ, class DK, class DV, class DY>
  Gradients backward(const Eigen::MatrixBase<DQ>& X_q, const Eigen::MatrixBase<DK>& X_k,
                     const Eigen::MatrixBase<DV>& X_v, const Eigen::MatrixBase<DY>& dY,
                     const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    check_scalar<DQ, DK, DV, DY>();
    return backward_impl("qkv::MultiHeadAttention::backward", X_q.derived(), "X_q", X_k.derived(), "X_k", X_v.derived(),
                         "X_v", dY.derived(), options);
  }

  /// Not differentiated: a KV-cache step (`forward(X_new, cache)`) is inference; its loss would depend on the cached
  /// keys and values, which the cache keeps as numbers, not as functions of the earlier inputs. Always throws
  /// shape_error saying so; run `backward(X, dY, options)` on the whole sequence with `options.causal = true` instead
  /// (the same rows, tested equal in the forward). The cache is not touched. Source: as PyTorch, where a KV cache is
  /// used under torch.no_grad() in generation.
  template <class DX, class Storage, class DY>
  Gradients backward(const Eigen::MatrixBase<DX>& X_new, const KVCache<Scalar, Storage>& cache,
                     const Eigen::MatrixBase<DY>& dY,
                     const AttentionOptions<Scalar>& options = AttentionOptions<Scalar>()) const {
    (void)options;
    const char* advice =
        " rows) is not differentiated; run backward(X, dY, options) with options.causal = true on "
        "the whole sequence";
    detail::raise<shape_error>(detail::concat("qkv::MultiHeadAttention::backward: a KV-cache call (X_new of ",
                                              X_new.rows(), " rows, a cache of ", cache.length(), " tokens, dY of ",
                                              dY.rows(), advice));
  }

 private:
  /// Compile-time check of the scalar type of every Eigen argument: float or double, and the module's.
  template <class... D>
  static constexpr void check_scalar() {
    (detail::check_scalar_type<typename D::Scalar>(), ...);
    static_assert((std::is_same_v<typename D::Scalar, Scalar> && ...),
                  "qkv::MultiHeadAttention: inputs and weights must have the module's scalar type");
  }

  /// Checks kdim = vdim = d_model, which `what` needs (a message fragment ending in "needs"), then `hint`.
  void check_self_projections(const char* function, const char* what, const char* hint = "") const {
    detail::check_shape(config_.kdim == config_.d_model && config_.vdim == config_.d_model, function, ": ", what,
                        " kdim = vdim = d_model, but kdim is ", config_.kdim, ", vdim is ", config_.vdim,
                        " and d_model is ", config_.d_model, hint);
  }

  static Config resolve(Config c) {
    const char* function = "qkv::MultiHeadAttention";
    detail::check_shape(c.d_model >= 1, function, ": Config::d_model is ", c.d_model, ", expected at least 1");
    detail::check_shape(c.n_heads >= 1, function, ": Config::n_heads is ", c.n_heads, ", expected at least 1");
    detail::check_shape(c.n_kv_heads >= 0, function, ": Config::n_kv_heads is ", c.n_kv_heads,
                        ", expected 0 (= n_heads) or at least 1");
    if (c.n_kv_heads == 0) c.n_kv_heads = c.n_heads;
    detail::check_shape(c.n_heads % c.n_kv_heads == 0, function, ": Config::n_heads ", c.n_heads,
                        " is not a multiple of Config::n_kv_heads ", c.n_kv_heads,
                        " (GQA needs n_heads % n_kv_heads == 0)");
    detail::check_shape(c.head_dim >= 0, function, ": Config::head_dim is ", c.head_dim,
                        ", expected 0 (= d_model / n_heads) or at least 1");
    const bool head_dim_derived = c.head_dim == 0;
    if (c.head_dim == 0) {
      detail::check_shape(c.d_model % c.n_heads == 0, function, ": Config::d_model ", c.d_model,
                          " is not divisible by Config::n_heads ", c.n_heads,
                          " (head_dim = 0 means d_model / n_heads); set Config::head_dim explicitly");
      c.head_dim = c.d_model / c.n_heads;
    }
    detail::check_shape(c.kdim >= 0, function, ": Config::kdim is ", c.kdim, ", expected 0 (= d_model) or at least 1");
    detail::check_shape(c.vdim >= 0, function, ": Config::vdim is ", c.vdim, ", expected 0 (= d_model) or at least 1");
    if (c.kdim == 0) c.kdim = c.d_model;
    if (c.vdim == 0) c.vdim = c.d_model;
    if (c.rope) {
      detail::check_shape(c.head_dim % 2 == 0, function, ": Config::rope is set and head_dim is ", c.head_dim,
                          head_dim_derived ? " (d_model / n_heads)" : " (Config::head_dim)",
                          ", expected an even number (RoPE rotates pairs of features)");
      detail::check_positive_finite(function, "Config::rope->base", c.rope->base);
      detail::check_positive_finite(function, "Config::rope->interpolation_factor", c.rope->interpolation_factor);
      detail::check_positive_finite(function, "Config::rope->ntk_factor", c.rope->ntk_factor);
    }
    return c;
  }

  /// The head_dim / 2 RoPE frequencies of a resolved configuration (positional.hpp's rule), empty without rope.
  static std::vector<double> resolve_rope_frequencies(const Config& c) {
    if (!c.rope) return {};
    return detail::rope_frequencies("qkv::MultiHeadAttention", c.head_dim, *c.rope);
  }

  /// RoPE in place (nothing without Config::rope) on `rows` rows of M (packed heads, T × n_heads·head_dim) from row
  /// `first_row`: every head of row first_row + t is rotated by the angles of position first_position + t, with
  /// positional.hpp's rotation; `inverse` rotates by the opposite angles instead, R(−θ) = R(θ)ᵀ = R(θ)⁻¹, which takes
  /// a gradient with respect to the rotated rows back to the unrotated ones. O(rows·n_heads·head_dim) +
  /// O(rows·head_dim) cos/sin; allocates O(head_dim).
  void rotate(Matrix<Scalar>& M, Index n_heads, Index first_row, Index rows, Index first_position,
              bool inverse = false) const {
    if (!config_.rope) return;
    const Index D = config_.head_dim;
    QKV_ASSERT(M.cols() == n_heads * D && first_row >= 0 && rows >= 0 && first_row + rows <= M.rows());
    std::vector<double> cosines(rope_frequencies_.size()), sines(rope_frequencies_.size());
    for (Index t = 0; t < rows; ++t) {
      detail::rope_angles(first_position + t, rope_frequencies_, cosines, sines);
      if (inverse) {
        for (double& sine : sines) sine = -sine;  // cos(−θ) = cos θ, sin(−θ) = −sin θ
      }
      Scalar* row = M.data() + (first_row + t) * M.cols();  // row-major: the heads of a row are contiguous
      for (Index h = 0; h < n_heads; ++h) detail::rope_rotate(row + h * D, D, cosines, sines, config_.rope->layout);
    }
  }

  /// RoPE on the rows of M from position 0, or, with varlen offsets `cu_seqlens` (already checked against M's rows),
  /// on each sequence from its own position 0; `inverse` as `rotate`.
  void rotate_sequences(Matrix<Scalar>& M, Index n_heads, const std::vector<Index>& cu_seqlens,
                        bool inverse = false) const {
    if (cu_seqlens.empty()) {
      rotate(M, n_heads, 0, M.rows(), 0, inverse);
      return;
    }
    for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b)
      rotate(M, n_heads, cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b], 0, inverse);
  }

  Index q_columns() const noexcept { return config_.n_heads * config_.head_dim; }
  Index kv_columns() const noexcept { return config_.n_kv_heads * config_.head_dim; }

  static void check_matrix(const char* function, const char* argument, Index rows, Index cols, Index expected_rows,
                           Index expected_cols, const char* meaning) {
    detail::check_shape(rows == expected_rows && cols == expected_cols, function, ": ", argument, " is ", rows, " × ",
                        cols, ", expected ", expected_rows, " × ", expected_cols, " (", meaning, ")");
  }

  template <class D>
  static void check_vector(const char* function, const char* argument, const Eigen::MatrixBase<D>& v, Index expected) {
    detail::check_shape(v.size() == expected && (v.rows() == 1 || v.cols() == 1 || v.size() == 0), function, ": ",
                        argument, " is ", v.rows(), " × ", v.cols(), ", expected a vector of ", expected, " entries",
                        expected == 0 ? " (the module has no biases: Config::bias is false)" : "");
  }

  static void check_shape_input(const char* function, const char* argument, Index cols, Index expected,
                                const char* name) {
    detail::check_shape(cols == expected, function, ": ", argument, " has ", cols, " columns, expected ", name, " ",
                        expected);
  }

  template <class DB, class DOB>
  void load_biases(const Eigen::MatrixBase<DB>& b_qkv, const Eigen::MatrixBase<DOB>& b_out) {
    const Index q_out = q_columns(), kv_out = kv_columns();
    if (!config_.bias) return;  // sizes checked: both are empty
    const Vector packed = b_qkv.derived().reshaped();
    b_q = packed.head(q_out);
    b_k = packed.segment(q_out, kv_out);
    b_v = packed.tail(kv_out);
    b_o = b_out.derived().reshaped();
  }

  /// Checks the public weights against the configuration (they may have been assigned any shape).
  void check_weights(const char* function) const {
    const Index q_out = q_columns(), kv_out = kv_columns();
    check_matrix(function, "W_q", W_q.rows(), W_q.cols(), config_.d_model, q_out, "[d_model, n_heads·head_dim]");
    check_matrix(function, "W_k", W_k.rows(), W_k.cols(), config_.kdim, kv_out, "[kdim, n_kv_heads·head_dim]");
    check_matrix(function, "W_v", W_v.rows(), W_v.cols(), config_.vdim, kv_out, "[vdim, n_kv_heads·head_dim]");
    check_matrix(function, "W_o", W_o.rows(), W_o.cols(), q_out, config_.d_model, "[n_heads·head_dim, d_model]");
    check_vector(function, "b_q", b_q, config_.bias ? q_out : 0);
    check_vector(function, "b_k", b_k, config_.bias ? kv_out : 0);
    check_vector(function, "b_v", b_v, config_.bias ? kv_out : 0);
    check_vector(function, "b_o", b_o, config_.bias ? config_.d_model : 0);
  }

  static void check_varlen(const char* function, const AttentionOptions<Scalar>& options, Index q_rows,
                           const char* q_name, Index kv_rows, const char* kv_name) {
    // Checked here, before the projections, to name the input whose rows they split. An empty list is left to the
    // core, which rejects one side set without the other.
    if (!options.cu_seqlens_q.empty()) {
      detail::check_cu_seqlens(function, "options.cu_seqlens_q", options.cu_seqlens_q, q_rows, "the rows of ", q_name);
    }
    if (!options.cu_seqlens_k.empty()) {
      detail::check_cu_seqlens(function, "options.cu_seqlens_k", options.cu_seqlens_k, kv_rows, "the rows of ",
                               kv_name);
    }
  }

  /// X·W + b (b empty: no bias), rows are tokens.
  template <class DX>
  static Matrix<Scalar> project(const Eigen::MatrixBase<DX>& X, const Matrix<Scalar>& W, const Vector& b) {
    Matrix<Scalar> Y(X.rows(), W.cols());
    Y.noalias() = X * W;
    if (b.size() > 0) Y.rowwise() += b.transpose();
    return Y;
  }

  /// The checks of every forward and backward form: the weights, the inputs' columns, the key and value rows, the
  /// varlen offsets against the rows they split.
  template <class DQ, class DK, class DV>
  void check_inputs(const char* function, const DQ& X_q, const char* q_name, const DK& X_k, const char* k_name,
                    const DV& X_v, const char* v_name, const AttentionOptions<Scalar>& options) const {
    check_weights(function);
    check_shape_input(function, q_name, X_q.cols(), config_.d_model, "d_model");
    check_shape_input(function, k_name, X_k.cols(), config_.kdim, "kdim");
    check_shape_input(function, v_name, X_v.cols(), config_.vdim, "vdim");
    detail::check_shape(X_k.rows() == X_v.rows(), function, ": ", v_name, " has ", X_v.rows(), " rows, expected ",
                        X_k.rows(), " (the rows of ", k_name, ")");
    check_varlen(function, options, X_q.rows(), q_name, X_k.rows(), k_name);
  }

  template <class DQ, class DK, class DV>
  Matrix<Scalar> forward_impl(const char* function, const DQ& X_q, const char* q_name, const DK& X_k,
                              const char* k_name, const DV& X_v, const char* v_name,
                              const AttentionOptions<Scalar>& options) const {
    check_inputs(function, X_q, q_name, X_k, k_name, X_v, v_name, options);
    Matrix<Scalar> Q = project(X_q, W_q, b_q);
    Matrix<Scalar> K = project(X_k, W_k, b_k);  // once per kv head: Tk × Hkv·head_dim
    const Matrix<Scalar> V = project(X_v, W_v, b_v);
    rotate_sequences(Q, config_.n_heads, options.cu_seqlens_q);  // RoPE, if configured: positions from 0
    rotate_sequences(K, config_.n_kv_heads, options.cu_seqlens_k);
    const Index H_kv = config_.n_kv_heads, D = config_.head_dim;
    return attend<Scalar>(Q, detail::packed_heads_view(K.data(), K.rows(), H_kv, D, K.cols()),
                          detail::packed_heads_view(V.data(), V.rows(), H_kv, D, V.cols()), options);
  }

  /// The backward pass of every form: recomputes the forward (projections, RoPE, attention with its lse), then runs
  /// the chain rule documented at `backward(X, dY, options)`. dX and dX_kv are left for the public forms.
  /// The column sums of M as a vector (a bias's gradient): zeros for M without rows (Eigen's colwise().sum() of an
  /// empty matrix offsets a null pointer, which UBSan rejects).
  static Vector column_sums(const Matrix<Scalar>& M) {
    if (M.rows() == 0) return Vector::Zero(M.cols());
    return M.colwise().sum().transpose();
  }

  template <class DQ, class DK, class DV, class DY>
  Gradients backward_impl(const char* function, const DQ& X_q, const char* q_name, const DK& X_k, const char* k_name,
                          const DV& X_v, const char* v_name, const DY& dY,
                          const AttentionOptions<Scalar>& options) const {
    check_inputs(function, X_q, q_name, X_k, k_name, X_v, v_name, options);
    detail::check_shape(dY.rows() == X_q.rows() && dY.cols() == config_.d_model, function, ": dY is ", dY.rows(), " × ",
                        dY.cols(), ", expected ", X_q.rows(), " × ", config_.d_model, " (the rows of ", q_name,
                        " × d_model: the shape of Y)");
    const Index Tq = X_q.rows(), Tk = X_k.rows(), H_q = config_.n_heads, H_kv = config_.n_kv_heads,
                D = config_.head_dim;
    // The forward, as forward_impl computes it, keeping O and the lse for the attention backward.
    Matrix<Scalar> Q = project(X_q, W_q, b_q);
    Matrix<Scalar> K = project(X_k, W_k, b_k);
    const Matrix<Scalar> V = project(X_v, W_v, b_v);
    rotate_sequences(Q, H_q, options.cu_seqlens_q);
    rotate_sequences(K, H_kv, options.cu_seqlens_k);
    Matrix<Scalar> O(Tq, H_q * D), lse(H_q, Tq);  // lse [1, Hq, Tq]: one row per head
    const TensorView4<const Scalar> q = detail::packed_heads_view(Q.data(), Tq, H_q, D, Q.cols());
    const TensorView4<const Scalar> k = detail::packed_heads_view(K.data(), Tk, H_kv, D, K.cols());
    const TensorView4<const Scalar> v = detail::packed_heads_view(V.data(), Tk, H_kv, D, V.cols());
    const TensorView4<Scalar> out = detail::packed_heads_view(O.data(), Tq, H_q, D, O.cols());
    const TensorView3<Scalar> lse_view(lse.data(), {1, H_q, Tq}, {H_q * Tq, Tq, 1});
    qkv::attention<Scalar>(q, k, v, out, lse_view, options);

    Gradients g;
    g.dW_o.noalias() = O.transpose() * dY;
    g.db_o = config_.bias ? column_sums(dY) : Vector();
    Matrix<Scalar> dO(Tq, H_q * D);
    dO.noalias() = dY * W_o.transpose();
    Matrix<Scalar> dQ(Tq, H_q * D), dK(Tk, H_kv * D), dV(Tk, H_kv * D);
    qkv::attention_backward<Scalar>(q, k, v, out, lse_view, detail::packed_heads_view(dO.data(), Tq, H_q, D, dO.cols()),
                                    detail::packed_heads_view(dQ.data(), Tq, H_q, D, dQ.cols()),
                                    detail::packed_heads_view(dK.data(), Tk, H_kv, D, dK.cols()),
                                    detail::packed_heads_view(dV.data(), Tk, H_kv, D, dV.cols()), options);
    rotate_sequences(dQ, H_q, options.cu_seqlens_q, /*inverse=*/true);  // Rᵀ: back to the unrotated projections
    rotate_sequences(dK, H_kv, options.cu_seqlens_k, /*inverse=*/true);
    project_backward(X_q, dQ, W_q, g.dX_q, g.dW_q, g.db_q);
    project_backward(X_k, dK, W_k, g.dX_k, g.dW_k, g.db_k);
    project_backward(X_v, dV, W_v, g.dX_v, g.dW_v, g.db_v);
    return g;
  }

  /// The gradients of P = X·W + b given dP: dX = dP·Wᵀ, dW = Xᵀ·dP, db = Σ_t dP_t (empty without biases).
  template <class DX>
  void project_backward(const DX& X, const Matrix<Scalar>& dP, const Matrix<Scalar>& W, Matrix<Scalar>& dX,
                        Matrix<Scalar>& dW, Vector& db) const {
    dX.resize(X.rows(), W.rows());
    dX.noalias() = dP * W.transpose();
    dW.resize(W.rows(), W.cols());
    dW.noalias() = X.transpose() * dP;
    db = config_.bias ? column_sums(dP) : Vector();
  }

  /// Y = attention(Q, k, v)·W_o + b_o, with Q packed (Tq × Hq·head_dim) and k, v [1, Hkv, Tk, head_dim] views of
  /// Storage (Scalar, or a 16-bit cache's storage, which `qkv::attention` reads in place).
  template <class Storage>
  Matrix<Scalar> attend(const Matrix<Scalar>& Q, const TensorView4<const Storage>& k,
                        const TensorView4<const Storage>& v, const AttentionOptions<Scalar>& options) const {
    const Index Tq = Q.rows(), H_q = config_.n_heads, D = config_.head_dim;
    Matrix<Scalar> O(Tq, H_q * D);
    const TensorView4<const Scalar> q = detail::packed_heads_view(Q.data(), Tq, H_q, D, Q.cols());
    using Observer = detail::MultiHeadCoreObserver<Scalar, Storage>;
    if (Observer::callback != nullptr) Observer::callback(q, k, v, Observer::context);
    qkv::attention<Scalar>(q, k, v, detail::packed_heads_view(O.data(), Tq, H_q, D, O.cols()), options);
    return project(O, W_o, b_o);
  }

  Config config_;
  std::vector<double> rope_frequencies_;  ///< head_dim / 2 angular frequencies of Config::rope; empty without it
};

}  // namespace qkv
