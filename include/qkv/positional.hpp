// qkv/positional.hpp — positional information for attention: the sinusoidal encoding, rotary embeddings (RoPE) with
// position interpolation, ALiBi slopes and biases, and T5's bucketed relative position bias.
//
// Attention alone is permutation equivariant (seed 000 定理 2.4.2): reorder the tokens and the outputs are reordered
// the same way, so word order is invisible. Each tool here breaks that symmetry in a different place:
//
//     tool                         where it acts                       how it reaches qkv
//     sinusoidal_encoding          added to the inputs X               X += sinusoidal_encoding<float>(T, d_model)
//     apply_rope                   rotates q and k in place            before scaled_dot_product_attention / attention
//     alibi_slopes                 −slope·|diag(i) − j| on the scores  AttentionOptions::alibi_slopes
//     alibi_bias, RelativePositionBias::bias
//                                  an additive score bias               AttentionOptions::bias = a PositionBias
//
// Rows are tokens; packed heads sit side by side in the columns (head h in columns [h·D, (h+1)·D)), as everywhere in
// qkv. Angles and frequencies are computed in double whatever the scalar type, so large positions keep their
// precision in float.
//
// Sources: seed 002 §6 (6.1: sinusoidal encoding; 6.2: relative position bias), §7.4 (position interpolation,
// NTK-aware scaling); seed 000 定理 2.4.2; Vaswani et al. 2017 §3.5; Su et al. 2021, "RoFormer: Enhanced Transformer
// with Rotary Position Embedding"; Chen et al. 2023, "Extending Context Window of Large Language Models via
// Positional Interpolation"; bloc97 2023, "NTK-Aware Scaled RoPE" (r/LocalLLaMA); Press, Smith & Lewis 2022, "Train
// Short, Test Long" (ALiBi); Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
// Text-to-Text Transformer" (T5) §2.1.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/errors.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {

namespace detail {

template <class Scalar>
constexpr void check_positional_scalar() {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "qkv: positional encodings support float and double");
}

inline void check_positive_finite(const char* function, const char* name, double value) {
  check_shape(std::isfinite(value) && value > 0, function, ": ", name, " is ", value, ", expected a finite number > 0");
}

}  // namespace detail

// ---- sinusoidal encoding -------------------------------------------------------------------------------------------

/// The sinusoidal position encoding of Vaswani et al. (seed 002 §6.1), rows = positions:
///
///     PE(pos, 2i) = sin(pos / base^(2i/d_model)),   PE(pos, 2i+1) = cos(pos / base^(2i/d_model)),
///
/// for pos = first_position, …, first_position + length − 1 (row r is position first_position + r).
///
/// Shapes: → length × d_model (`Matrix<Scalar>`, row-major), to be added to the token embeddings X (length ×
/// d_model): `X += qkv::sinusoidal_encoding<float>(X.rows(), X.cols());`.
/// Odd d_model: the last column (index d_model − 1 = 2i) is the sine of the frequency base^(−(d_model − 1)/d_model)
/// and has no cosine partner; every other column is as above (the formula, not a truncated even-d table).
/// Property (the seed: "一个位置向量可以用其他位置向量的线性组合来表示"): for each frequency ω_i, the pair
/// (PE(pos + k, 2i), PE(pos + k, 2i+1)) is the pair at pos rotated by the angle k·ω_i — a linear map that depends on
/// k only — and PE(pos)·PE(pos + k) depends on k only.
/// Parameters: `first_position` (may be negative; for KV-cache decoding, the number of tokens already cached),
/// `base` the wavelength base (10000 in the paper).
/// Edge cases: length = 0 gives a 0 × d_model matrix. Angles are computed in double, then rounded to Scalar.
/// Throws: shape_error when length < 0, d_model < 1, or base is not finite and > 0.
/// Complexity: O(length·d_model) sin/cos; allocates the result. Thread safety: a pure function.
/// Example: `qkv::Matrix<float> PE = qkv::sinusoidal_encoding<float>(/*length=*/50, /*d_model=*/512);`
/// Source: Vaswani et al. 2017 §3.5; seed 002 §6.1.
template <class Scalar = double>
Matrix<Scalar> sinusoidal_encoding(Index length, Index d_model, Index first_position = 0, double base = 10000.0) {
  detail::check_positional_scalar<Scalar>();
  const char* function = "qkv::sinusoidal_encoding";
  detail::check_shape(length >= 0, function, ": length is ", length, ", expected at least 0");
  detail::check_shape(d_model >= 1, function, ": d_model is ", d_model, ", expected at least 1");
  detail::check_positive_finite(function, "base", base);
  Matrix<Scalar> pe(length, d_model);
  for (Index c = 0; c < d_model; c += 2) {
    const double frequency = std::pow(base, -static_cast<double>(c) / static_cast<double>(d_model));
    for (Index r = 0; r < length; ++r) {
      const double angle = static_cast<double>(first_position + r) * frequency;
      pe(r, c) = static_cast<Scalar>(std::sin(angle));
      if (c + 1 < d_model) pe(r, c + 1) = static_cast<Scalar>(std::cos(angle));
    }
  }
  return pe;
}

// ---- rotary position embedding (RoPE) ------------------------------------------------------------------------------

/// Which features of a head RoPE rotates together (head_dim D even, i in [0, D/2)):
///
///   - `rotate_half`: (x_i, x_{i + D/2}) — GPT-NeoX, Llama / Mistral / Qwen in Hugging Face transformers
///     (`rotate_half`), vLLM's `is_neox_style = True`, llama.cpp's NEOX mode.
///   - `interleaved`: (x_{2i}, x_{2i+1}) — adjacent pairs: RoFormer, GPT-J, Meta's original Llama (complex
///     multiplication), llama.cpp's default mode.
///
/// The same weights give different results in the two layouts: use the one the checkpoint was trained with.
enum class RopeLayout { rotate_half, interleaved };

/// Parameters of `apply_rope`. With θ_i the frequency of pair i and m the position of a row:
///
///     angle(m, i) = (m / interpolation_factor) · θ_i,   θ_i = base'^(−2i/D),
///     base' = base · ntk_factor^(D / (D − 2))   (D > 2; for D = 2 the single frequency θ_0 = 1 is unaffected).
///
/// `interpolation_factor` s: linear position interpolation (Chen et al. 2023; Hugging Face `rope_scaling =
/// {"type": "linear", "factor": s}`): a model trained on L positions reads positions up to s·L squeezed into [0, L).
/// `ntk_factor` α: NTK-aware scaling (bloc97 2023): the base grows so that the highest frequency θ_0 is unchanged
/// while the lowest, θ_{D/2−1}, is divided by exactly α — interpolation for the slow pairs, extrapolation for the fast
/// ones (seed 002 §7.4: "线性插值或NTK-aware插值"). Both 1 = off; they may be combined. All must be finite and > 0.
struct RopeOptions {
  double base = 10000.0;
  RopeLayout layout = RopeLayout::rotate_half;
  double interpolation_factor = 1.0;
  double ntk_factor = 1.0;
};

namespace detail {

/// `rope_frequencies` with the calling function's name in its errors.
inline std::vector<double> rope_frequencies(const char* function, Index head_dim, const RopeOptions& options) {
  check_shape(head_dim >= 2 && head_dim % 2 == 0, function, ": head_dim is ", head_dim,
              ", expected an even number ≥ 2 (RoPE rotates pairs of features)");
  check_positive_finite(function, "options.base", options.base);
  check_positive_finite(function, "options.interpolation_factor", options.interpolation_factor);
  check_positive_finite(function, "options.ntk_factor", options.ntk_factor);
  const double D = static_cast<double>(head_dim);
  const double base = head_dim > 2 ? options.base * std::pow(options.ntk_factor, D / (D - 2)) : options.base;
  std::vector<double> frequencies(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < frequencies.size(); ++i)
    frequencies[i] = std::pow(base, -2.0 * static_cast<double>(i) / D) / options.interpolation_factor;
  return frequencies;
}

}  // namespace detail

/// The D/2 angular frequencies of RoPE, θ_i / interpolation_factor with θ_i = base'^(−2i/D) (see `RopeOptions`):
/// position m rotates pair i by m times entry i. Computed in double.
/// Throws: shape_error when head_dim is not even and ≥ 2, or an option is not finite and > 0. Complexity O(D).
/// Source: Su et al. 2021 (RoFormer) §3.2, θ_i = base^(−2i/D); Chen et al. 2023 (position interpolation); bloc97 2023.
inline std::vector<double> rope_frequencies(Index head_dim, const RopeOptions& options = RopeOptions()) {
  return detail::rope_frequencies("qkv::rope_frequencies", head_dim, options);
}

namespace detail {

/// Rotates the D features at `x` (contiguous) by the angles whose cosines and sines are given (D/2 each).
template <class Scalar>
void rope_rotate(Scalar* x, Index head_dim, const std::vector<double>& cosines, const std::vector<double>& sines,
                 RopeLayout layout) noexcept {
  const Index half = head_dim / 2;
  for (Index i = 0; i < half; ++i) {
    const Index a = layout == RopeLayout::rotate_half ? i : 2 * i;
    const Index b = layout == RopeLayout::rotate_half ? i + half : 2 * i + 1;
    const double c = cosines[static_cast<std::size_t>(i)], s = sines[static_cast<std::size_t>(i)];
    const double x_a = static_cast<double>(x[a]), x_b = static_cast<double>(x[b]);
    x[a] = static_cast<Scalar>(x_a * c - x_b * s);
    x[b] = static_cast<Scalar>(x_a * s + x_b * c);
  }
}

inline void rope_angles(Index position, const std::vector<double>& frequencies, std::vector<double>& cosines,
                        std::vector<double>& sines) {
  for (std::size_t i = 0; i < frequencies.size(); ++i) {
    const double angle = static_cast<double>(position) * frequencies[i];
    cosines[i] = std::cos(angle);
    sines[i] = std::sin(angle);
  }
}

template <class Derived>
void apply_rope_matrix(Eigen::MatrixBase<Derived>& X, Index n_heads, Index first_position, const RopeOptions& options) {
  using Scalar = typename Derived::Scalar;
  check_positional_scalar<Scalar>();
  const char* function = "qkv::apply_rope";
  check_shape(n_heads >= 1, function, ": n_heads is ", n_heads, ", expected at least 1");
  check_shape(X.cols() % n_heads == 0, function, ": X has ", X.cols(), " columns, not a multiple of n_heads ", n_heads);
  const Index head_dim = X.cols() / n_heads;
  const std::vector<double> frequencies = rope_frequencies(function, head_dim, options);
  std::vector<double> cosines(frequencies.size()), sines(frequencies.size());
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> head(head_dim);
  for (Index t = 0; t < X.rows(); ++t) {
    rope_angles(first_position + t, frequencies, cosines, sines);
    for (Index h = 0; h < n_heads; ++h) {
      head = X.row(t).segment(h * head_dim, head_dim).transpose();  // any storage order: through a contiguous copy
      rope_rotate(head.data(), head_dim, cosines, sines, options.layout);
      X.row(t).segment(h * head_dim, head_dim) = head.transpose();
    }
  }
}

}  // namespace detail

/// Rotary position embedding, in place: rotates each pair of features of each head of row t by the angle
/// (first_position + t)·θ_i (see `RopeOptions`, `RopeLayout`):
///
///     (x_a, x_b) ← (x_a·cos φ − x_b·sin φ,  x_a·sin φ + x_b·cos φ),   φ = angle(first_position + t, i).
///
/// Apply it to Q and to K (never to V) before attention; then q_m·k_n depends on m − n only (RoFormer's relative
/// property: R(m)ᵀR(n) = R(n − m)), so attention sees relative positions although each row was rotated by its own
/// absolute position.
///
/// Shapes: X rows × n_heads·D (packed heads: head h in columns [h·D, (h+1)·D)), D even; any writable Eigen matrix
/// or block of float or double (e.g. `Q.middleCols(...)`); row t has position first_position + t.
/// Mapping rules: GQA needs nothing special: rotate Q with n_heads = Hq and K with n_heads = Hkv, same positions.
/// Parameters: `first_position` — the position of row 0: 0 for a prefill; the number of tokens already in the KV
/// cache when decoding (rotating the new rows with that offset equals rotating the whole sequence at once).
/// Edge cases: rows = 0 does nothing; position 0 is the identity. Arithmetic in double, then rounded to Scalar.
/// Throws: shape_error when n_heads < 1, the columns are not a multiple of n_heads, D is odd, or an option is not
/// finite and > 0 (X is left unchanged).
/// Complexity: O(rows·n_heads·D) plus O(rows·D) cos/sin; allocates O(D).
/// Thread safety: writes X only; distinct matrices may be rotated concurrently.
/// Example:
///
///     qkv::apply_rope(Q, /*n_heads=*/32, /*first_position=*/cache_length);   // Llama layout (rotate_half)
///     qkv::apply_rope(K, /*n_heads=*/8, cache_length);
///
/// Source: Su et al. 2021 (RoFormer) §3.2 and its relative property; Hugging Face transformers `apply_rotary_pos_emb`
/// (rotate_half) and GPT-J / Meta Llama (interleaved); Chen et al. 2023 and bloc97 2023 for the scaling options; seed
/// 002 §7.4.
template <class Derived>
void apply_rope(Eigen::MatrixBase<Derived>& X, Index n_heads, Index first_position = 0,
                const RopeOptions& options = RopeOptions()) {
  detail::apply_rope_matrix(X, n_heads, first_position, options);
}

/// As above, for a temporary writable expression such as `Q.middleCols(h·D, D)` or `Q.topRows(n)`.
template <class Derived>
void apply_rope(Eigen::MatrixBase<Derived>&& X, Index n_heads, Index first_position = 0,
                const RopeOptions& options = RopeOptions()) {
  detail::apply_rope_matrix(X, n_heads, first_position, options);
}

/// RoPE in place on a [B, H, S, D] view (the axes of `qkv::attention`, any memory layout): element (b, h, s, :) is
/// rotated by the angles of position first_position + s, for every b and h. Same math, options and sources as the
/// Eigen form.
/// Shapes: x [B, H, S, D] with D even and innermost stride 1. Throws: shape_error when D is odd, the innermost
/// stride is not 1, an extent or stride is negative, data is null with elements, or an option is invalid.
/// Complexity: O(B·H·S·D) plus O(S·D) cos/sin. Thread safety: writes x only.
/// Example: `qkv::apply_rope(qkv::view_bshd(q_data, B, S, Hq, D), first_position);`
template <class T>
void apply_rope(TensorView4<T> x, Index first_position = 0, const RopeOptions& options = RopeOptions()) {
  static_assert(!std::is_const_v<T>, "qkv::apply_rope: the view must be writable (RoPE rotates in place)");
  detail::check_positional_scalar<T>();
  const char* function = "qkv::apply_rope";
  static constexpr const char* kAxes[4] = {"B", "H", "S", "D"};
  for (int axis = 0; axis < 4; ++axis) {
    detail::check_shape(x.extent(axis) >= 0, function, ": x axis ", axis, " (", kAxes[axis], ") has negative extent ",
                        x.extent(axis));
    detail::check_shape(x.extent(axis) <= 1 || x.stride(axis) >= 0, function, ": x axis ", axis, " (", kAxes[axis],
                        ") has negative stride ", x.stride(axis));
  }
  if (x.empty()) return;
  detail::check_shape(x.data() != nullptr, function, ": x has ", x.size(), " elements but null data");
  detail::check_shape(x.extent(3) <= 1 || x.stride(3) == 1, function, ": x axis 3 (D) has stride ", x.stride(3),
                      ", expected 1");
  const Index D = x.extent(3);
  const std::vector<double> frequencies = detail::rope_frequencies(function, D, options);
  std::vector<double> cosines(frequencies.size()), sines(frequencies.size());
  for (Index s = 0; s < x.extent(2); ++s) {
    detail::rope_angles(first_position + s, frequencies, cosines, sines);
    for (Index b = 0; b < x.extent(0); ++b)
      for (Index h = 0; h < x.extent(1); ++h) detail::rope_rotate(&x(b, h, s, 0), D, cosines, sines, options.layout);
  }
}

// ---- additive position biases --------------------------------------------------------------------------------------

/// An owning [1, H, Sq, Skv] score bias (H heads, Sq queries, Skv keys), to pass as `AttentionOptions::bias`:
///
///     qkv::PositionBias<float> bias = qkv::alibi_bias(slopes, Sq, Skv);
///     options.bias = bias;            // or bias.view(): a [1, H, Sq, Skv] view of its memory
///
/// H = 1 broadcasts over the query heads. It converts only as an lvalue (the view of a temporary would dangle: the
/// rvalue conversions are deleted), and must outlive the attention call.
/// Storage: contiguous, row-major over (h, i, j); head h is an Sq × Skv `Eigen::Map` (`head(h)`).
template <class Scalar>
class PositionBias {
 public:
  /// The empty bias (no heads, as an empty view: "no bias").
  PositionBias() = default;

  /// H × Sq × Skv zeros. Throws shape_error when an extent is negative. Allocates H·Sq·Skv scalars.
  PositionBias(Index n_heads, Index Sq, Index Skv) : n_heads_(n_heads), Sq_(Sq), Skv_(Skv) {
    const char* function = "qkv::PositionBias";
    detail::check_shape(n_heads >= 0 && Sq >= 0 && Skv >= 0, function, ": extents [", n_heads, ", ", Sq, ", ", Skv,
                        "] (H, Sq, Skv), expected none negative");
    data_.assign(static_cast<std::size_t>(n_heads * Sq * Skv), Scalar(0));
  }

  Index n_heads() const noexcept { return n_heads_; }
  Index rows() const noexcept { return Sq_; }
  Index cols() const noexcept { return Skv_; }

  /// The bias of head h, query i, key j (debug builds check the bounds).
  Scalar& operator()(Index h, Index i, Index j) noexcept { return data_[offset(h, i, j)]; }
  const Scalar& operator()(Index h, Index i, Index j) const noexcept { return data_[offset(h, i, j)]; }

  /// Head h as an Sq × Skv row-major map of this memory.
  Eigen::Map<Matrix<Scalar>> head(Index h) noexcept {
    QKV_ASSERT(h >= 0 && h < n_heads_);
    return Eigen::Map<Matrix<Scalar>>(data_.data() + h * Sq_ * Skv_, Sq_, Skv_);
  }
  Eigen::Map<const Matrix<Scalar>> head(Index h) const noexcept {
    QKV_ASSERT(h >= 0 && h < n_heads_);
    return Eigen::Map<const Matrix<Scalar>>(data_.data() + h * Sq_ * Skv_, Sq_, Skv_);
  }

  /// A [1, H, Sq, Skv] view of this memory, for `AttentionOptions::bias`. Empty when this bias is empty.
  TensorView4<const Scalar> view() const& noexcept {
    if (data_.empty()) return TensorView4<const Scalar>();
    return TensorView4<const Scalar>(data_.data(), {1, n_heads_, Sq_, Skv_});
  }
  TensorView4<const Scalar> view() const&& = delete;
  operator TensorView4<const Scalar>() const& noexcept { return view(); }  // NOLINT(google-explicit-constructor)
  operator TensorView4<const Scalar>() const&& = delete;

 private:
  std::size_t offset(Index h, Index i, Index j) const noexcept {
    QKV_ASSERT(h >= 0 && h < n_heads_ && i >= 0 && i < Sq_ && j >= 0 && j < Skv_);
    return static_cast<std::size_t>((h * Sq_ + i) * Skv_ + j);
  }

  Index n_heads_ = 0, Sq_ = 0, Skv_ = 0;
  std::vector<Scalar> data_;
};

// ---- ALiBi ---------------------------------------------------------------------------------------------------------

namespace detail {

inline std::vector<double> alibi_slopes_power_of_two(Index n) {
  std::vector<double> slopes(static_cast<std::size_t>(n));
  for (Index h = 0; h < n; ++h) slopes[static_cast<std::size_t>(h)] = std::exp2(-8.0 * double(h + 1) / double(n));
  return slopes;
}

}  // namespace detail

/// The ALiBi head slopes of Press et al., to feed `AttentionOptions::alibi_slopes` (one per query head):
///
///     n a power of two:  slope_h = 2^(−8(h+1)/n),  h = 0 … n−1   (8 heads: 1/2, 1/4, …, 1/256)
///     otherwise:         the slopes of p = 2^⌊log2 n⌋ heads, then every other slope of 2p heads (the 1st, 3rd, …),
///                        the first n − p of them  (12 heads: 2^−1 … 2^−8, then 2^−0.5, 2^−1.5, 2^−2.5, 2^−3.5)
///
/// — the rule of the authors' `get_slopes` (github.com/ofirpress/attention_with_linear_biases), also used by BLOOM,
/// MPT and FlashAttention's tests. The core adds −slope_h·|diag(i) − j| to visible scores.
/// Throws: shape_error when n_heads < 1. Complexity O(n_heads); allocates the result. Computed in double.
/// Example: `options.alibi_slopes = qkv::alibi_slopes<float>(12);`
/// Source: Press, Smith & Lewis 2022 (ICLR) §3 and their reference code.
template <class Scalar = double>
std::vector<Scalar> alibi_slopes(Index n_heads) {
  detail::check_positional_scalar<Scalar>();
  detail::check_shape(n_heads >= 1, "qkv::alibi_slopes: n_heads is ", n_heads, ", expected at least 1");
  Index p = 1;
  while (p * 2 <= n_heads) p *= 2;
  std::vector<double> slopes = detail::alibi_slopes_power_of_two(p);
  if (p < n_heads) {
    const std::vector<double> finer = detail::alibi_slopes_power_of_two(2 * p);
    for (Index k = 0; k < n_heads - p; ++k) slopes.push_back(finer[static_cast<std::size_t>(2 * k)]);
  }
  return std::vector<Scalar>(slopes.begin(), slopes.end());
}

/// ALiBi as an explicit bias: bias(h, i, j) = −slopes[h]·|diag(i) − j|, with diag(i) = i + (Skv − Sq) for
/// `bottom_right` and i for `top_left` (the core's rule). Passing it as `AttentionOptions::bias` gives the same
/// attention as `AttentionOptions::alibi_slopes = slopes` with the same alignment (tested), at the cost of
/// materializing H·Sq·Skv values — useful to combine ALiBi with another bias, to look at it, or to hand it to code
/// that only takes a bias.
/// Shapes: slopes H entries → [1, H, Sq, Skv]. Precondition: with `key_lengths`, the core places the diagonal with
/// Skv_b = key_lengths[b]: build the bias with that Skv and pad the key axis yourself, or use `alibi_slopes`.
/// Throws: shape_error when slopes is empty or not finite, or Sq, Skv < 0. Complexity O(H·Sq·Skv); allocates it.
/// Source: Press et al. 2022 §3 (the bias −m·|i − j| of their bidirectional variant; causal rows see j ≤ diag(i)).
template <class Scalar>
PositionBias<Scalar> alibi_bias(const std::vector<Scalar>& slopes, Index Sq, Index Skv,
                                CausalAlignment alignment = CausalAlignment::bottom_right) {
  detail::check_positional_scalar<Scalar>();
  const char* function = "qkv::alibi_bias";
  detail::check_shape(!slopes.empty(), function, ": slopes is empty, expected one slope per head");
  for (std::size_t h = 0; h < slopes.size(); ++h)
    detail::check_shape(std::isfinite(slopes[h]), function, ": slopes[", h, "] is ", slopes[h],
                        ", expected a finite number");
  detail::check_shape(Sq >= 0 && Skv >= 0, function, ": Sq is ", Sq, " and Skv is ", Skv, ", expected both ≥ 0");
  const Index n_heads = static_cast<Index>(slopes.size());
  PositionBias<Scalar> bias(n_heads, Sq, Skv);
  const Index shift = alignment == CausalAlignment::bottom_right ? Skv - Sq : 0;
  for (Index h = 0; h < n_heads; ++h)
    for (Index i = 0; i < Sq; ++i)
      for (Index j = 0; j < Skv; ++j) {
        const Index distance = i + shift >= j ? i + shift - j : j - i - shift;
        bias(h, i, j) = -slopes[static_cast<std::size_t>(h)] * static_cast<Scalar>(distance);
      }
  return bias;
}

// ---- T5 relative position bias -------------------------------------------------------------------------------------

/// T5's learned relative position bias: one scalar per (bucket, head), where the bucket of a (query, key) pair is a
/// function of the relative position key − query — exact for small distances, logarithmic up to `max_distance`,
/// clamped beyond. The bias goes to `AttentionOptions::bias` (T5 also uses scale = 1: set `options.scale = 1` to
/// match it; it does not divide by √D).
///
/// Shapes: `weights` num_buckets × n_heads (Hugging Face's `relative_attention_bias.weight`, an nn.Embedding
/// (num_buckets, n_heads): row = bucket, column = head; zero after construction). `bias(Sq, Skv)` → [1, H, Sq, Skv].
/// Config: `bidirectional` true for an encoder (keys on both sides get separate buckets), false for a decoder (keys
/// after the query all share bucket 0; they are masked anyway). Defaults are T5's: 32 buckets, max_distance 128.
/// Thread safety: const calls may run concurrently. Source: Raffel et al. 2020 (JMLR) §2.1, "Position embeddings";
/// Hugging Face transformers `T5Attention._relative_position_bucket` and `compute_bias`; seed 002 §6.2 ("直接在注意力
/// 分数里加入一个可学习的相对位置偏置").
template <class Scalar>
class RelativePositionBias {
 public:
  struct Config {
    Index n_heads = 1;
    Index num_buckets = 32;     ///< Hugging Face's relative_attention_num_buckets
    Index max_distance = 128;   ///< relative_attention_max_distance: distances ≥ it share the last bucket
    bool bidirectional = true;  ///< encoder: true; decoder (causal): false
  };

  /// Zero weights of num_buckets × n_heads. Throws shape_error when n_heads < 1, num_buckets is < 4 (bidirectional)
  /// or < 2, or max_distance ≤ the exact range (num_buckets / 4 bidirectional, num_buckets / 2 otherwise).
  explicit RelativePositionBias(const Config& config) : config_(config) {
    detail::check_positional_scalar<Scalar>();
    check_config("qkv::RelativePositionBias", config);
    weights = Matrix<Scalar>::Zero(config.num_buckets, config.n_heads);
  }

  /// Bucket × head bias values (row = bucket, column = head).
  Matrix<Scalar> weights;

  const Config& config() const noexcept { return config_; }

  /// The bucket of relative position r = key position − query position, exactly as T5:
  ///
  ///     bidirectional: n = num_buckets / 2, offset = n if r > 0 else 0, d = |r|;  else: n = num_buckets, offset = 0,
  ///                    d = max(−r, 0)
  ///     exact = n / 2;  bucket = offset + (d < exact ? d : min(n − 1, exact + ⌊ln(d / exact) / ln(max_distance /
  ///     exact) · (n − exact)⌋))
  ///
  /// The logarithmic branch is evaluated in float32, as T5's TensorFlow and Hugging Face's PyTorch code do, so the
  /// buckets match theirs. Defaults (32 buckets, 128, bidirectional): |r| = 0…7 → 0…7, 8–11 → 8, 12–15 → 9, 16–22 → 10,
  /// 23–31 → 11, 32–45 → 12, 46–63 → 13, 64–90 → 14, ≥ 91 → 15; +16 when the key is after the query.
  /// Throws: shape_error for an invalid configuration (as the constructor). Complexity O(1).
  static Index bucket(Index relative_position, bool bidirectional = true, Index num_buckets = 32,
                      Index max_distance = 128) {
    Config config;
    config.num_buckets = num_buckets;
    config.max_distance = max_distance;
    config.bidirectional = bidirectional;
    check_config("qkv::RelativePositionBias::bucket", config);
    return bucket_unchecked(relative_position, bidirectional, num_buckets, max_distance);
  }

  /// The bias for Sq queries at positions first_query_position + i and Skv keys at positions j:
  /// bias(h, i, j) = weights(bucket(j − (first_query_position + i)), h), as a [1, H, Sq, Skv] `PositionBias`.
  /// For KV-cache decoding, where the Sq new queries are the last of Skv positions, pass first_query_position =
  /// Skv − Sq (Hugging Face computes the full bias and keeps its last Sq rows: the same).
  /// Throws: shape_error when Sq or Skv < 0 or `weights` is not num_buckets × n_heads. Complexity O(H·Sq·Skv);
  /// allocates the result. Example: `qkv::PositionBias<float> b = t5.bias(T, T); options.bias = b; options.scale = 1;`
  PositionBias<Scalar> bias(Index Sq, Index Skv, Index first_query_position = 0) const {
    const char* function = "qkv::RelativePositionBias::bias";
    detail::check_shape(Sq >= 0 && Skv >= 0, function, ": Sq is ", Sq, " and Skv is ", Skv, ", expected both ≥ 0");
    detail::check_shape(weights.rows() == config_.num_buckets && weights.cols() == config_.n_heads, function,
                        ": weights is ", weights.rows(), " × ", weights.cols(), ", expected ", config_.num_buckets,
                        " × ", config_.n_heads, " (num_buckets × n_heads)");
    PositionBias<Scalar> result(config_.n_heads, Sq, Skv);
    for (Index i = 0; i < Sq; ++i)
      for (Index j = 0; j < Skv; ++j) {
        const Index b = bucket_unchecked(j - (first_query_position + i), config_.bidirectional, config_.num_buckets,
                                         config_.max_distance);
        for (Index h = 0; h < config_.n_heads; ++h) result(h, i, j) = weights(b, h);
      }
    return result;
  }

 private:
  static void check_config(const char* function, const Config& c) {
    detail::check_shape(c.n_heads >= 1, function, ": Config::n_heads is ", c.n_heads, ", expected at least 1");
    const Index minimum = c.bidirectional ? 4 : 2;
    detail::check_shape(c.num_buckets >= minimum, function, ": Config::num_buckets is ", c.num_buckets,
                        ", expected at least ", minimum, c.bidirectional ? " (bidirectional)" : "");
    const Index exact = (c.bidirectional ? c.num_buckets / 2 : c.num_buckets) / 2;
    detail::check_shape(c.max_distance > exact, function, ": Config::max_distance is ", c.max_distance,
                        ", expected more than the exact range ", exact);
  }

  static Index bucket_unchecked(Index relative_position, bool bidirectional, Index num_buckets, Index max_distance) {
    Index n = num_buckets, offset = 0, distance = 0;
    if (bidirectional) {
      n /= 2;
      offset = relative_position > 0 ? n : 0;
      distance = relative_position < 0 ? -relative_position : relative_position;
    } else {
      distance = relative_position < 0 ? -relative_position : 0;
    }
    const Index exact = n / 2;
    if (distance < exact) return offset + distance;
    // float32, in T5's order of operations: log(d / exact) / log(max_distance / exact) * (n - exact), truncated.
    const float log_ratio = std::log(static_cast<float>(distance) / static_cast<float>(exact));
    const float log_range =
        static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(exact)));
    const float scaled = log_ratio / log_range * static_cast<float>(n - exact);
    const Index large = exact + static_cast<Index>(scaled);
    return offset + (large < n - 1 ? large : n - 1);
  }

  Config config_;
};

}  // namespace qkv
