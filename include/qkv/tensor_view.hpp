// qkv/tensor_view.hpp — non-owning strided views: the inputs and outputs of the core entry point.
//
// A `TensorView<T, Rank>` is a pointer, `Rank` extents and `Rank` strides, all in elements (not bytes, as in
// Eigen and PyTorch). It never owns or copies memory. The core API takes q, k, v as `TensorView4<const T>`
// with axes [B, H, S, D] in that order, whatever the memory layout: a BSHD buffer (PyTorch's batch_first,
// FlashAttention's layout) and a BHSD buffer are both described by choosing the strides.
//
//   float* buffer;                                  // [B, S, H, D] in memory (BSHD)
//   qkv::TensorView4<float> q = qkv::view_bshd(buffer, B, S, H, D);
//   // the same as qkv::TensorView4<float>(buffer, {B, H, S, D}, {S * H * D, D, H * D, 1})
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>

#include "qkv/config.hpp"
#include "qkv/errors.hpp"

namespace qkv {

template <class T, int Rank>
class TensorView {
  static_assert(Rank >= 1, "qkv::TensorView: Rank must be at least 1");

 public:
  using element_type = T;
  using value_type = std::remove_const_t<T>;
  using Extents = std::array<Index, Rank>;
  static constexpr int rank = Rank;

  /// The empty view: null data, every extent 0. Optional inputs (`allowed`, `bias`) use it to mean "none".
  TensorView() noexcept {
    extents_.fill(0);
    strides_.fill(0);
  }

  /// A contiguous row-major view (the last axis varies fastest).
  TensorView(T* data, const Extents& extents) noexcept : data_(data), extents_(extents) {
    Index stride = 1;
    for (int axis = Rank - 1; axis >= 0; --axis) {
      strides_[axis] = stride;
      stride *= extents_[axis];
    }
  }

  /// A view with explicit strides, in elements. The public entry points check that the strides describe
  /// memory they may read (innermost stride 1, no negative stride, no self-overlap of an output).
  TensorView(T* data, const Extents& extents, const Extents& strides) noexcept
      : data_(data), extents_(extents), strides_(strides) {}

  /// A view of mutable elements converts to a view of const elements.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  TensorView(const TensorView<U, Rank>& other) noexcept  // NOLINT(google-explicit-constructor)
      : data_(other.data()), extents_(other.extents()), strides_(other.strides()) {}

  /// A row-major Eigen matrix or array lvalue (Rows × Cols) as a view of extents [1, …, 1, Rows, Cols], strides
  /// [Rows·Cols, …, Rows·Cols, Cols, 1]: zero-copy, O(1). The view does not keep the object alive: the caller
  /// does, for as long as the view is read (to let options own a mask or bias, see `AttentionOptions::set_bias`).
  /// Every other Eigen object fails to compile with a sentence that says why and what to write instead (see the
  /// rejecting constructors below): column-major objects (innermost stride not 1), expressions (no memory),
  /// temporaries (the view would dangle), blocks, another scalar type, or const data for a mutable view.
  template <class Derived, class = std::enable_if_t<Rank >= 2 && Derived::IsRowMajor &&
                                                    std::is_same_v<typename Derived::Scalar, value_type> &&
                                                    std::is_const_v<T>>>
  TensorView(const Eigen::PlainObjectBase<Derived>& matrix) noexcept  // NOLINT(google-explicit-constructor)
      : TensorView(matrix.data(), matrix_extents(matrix.rows(), matrix.cols()),
                   matrix_strides(matrix.rows(), matrix.cols(), matrix.cols())) {}

  /// Mutable form of the constructor above, for views of non-const elements.
  template <class Derived, class = std::enable_if_t<Rank >= 2 && Derived::IsRowMajor &&
                                                    std::is_same_v<typename Derived::Scalar, value_type> &&
                                                    !std::is_const_v<T>>,
            class = void>
  TensorView(Eigen::PlainObjectBase<Derived>& matrix) noexcept  // NOLINT(google-explicit-constructor)
      : TensorView(matrix.data(), matrix_extents(matrix.rows(), matrix.cols()),
                   matrix_strides(matrix.rows(), matrix.cols(), matrix.cols())) {}

  /// A row-major `Eigen::Map` (Rows × Cols, innermost stride 1, any outer stride) as a view of extents
  /// [1, …, 1, Rows, Cols] and row stride `map.outerStride()`: zero-copy, O(1). A Map owns nothing, so a
  /// temporary Map binds too (e.g. `PositionBias::head(h)`); the mapped memory must outlive the view.
  template <class Plain, int MapOptions, class Stride,
            class = std::enable_if_t<Rank >= 2 && Plain::IsRowMajor &&
                                     std::is_same_v<typename Plain::Scalar, value_type> &&
                                     (Stride::InnerStrideAtCompileTime == 0 || Stride::InnerStrideAtCompileTime == 1) &&
                                     (std::is_const_v<T> || !std::is_const_v<Plain>)>>
  TensorView(Eigen::Map<Plain, MapOptions, Stride> map) noexcept  // NOLINT(google-explicit-constructor)
      : TensorView(map.data(), matrix_extents(map.rows(), map.cols()),
                   matrix_strides(map.rows(), map.cols(), map.outerStride())) {}

  /// Rejects a temporary Eigen matrix or array at compile time: the view would point into memory freed at the
  /// end of the statement (heap-use-after-free when the call reads it). Keep the object in a named variable, or
  /// let the options own it: `options.set_bias(std::move(matrix))`.
  template <class Derived>
  TensorView(const Eigen::PlainObjectBase<Derived>&& temporary) {  // NOLINT(google-explicit-constructor)
    static_assert(Rank < 2 || !std::is_same_v<Derived, Derived>,
                  "qkv::TensorView: a view needs a row-major lvalue; this Eigen object is a temporary, destroyed "
                  "before the call reads it: keep it in a named qkv::Matrix<T>, or move it into the options with "
                  "options.set_allowed(std::move(m)) / options.set_bias(std::move(m))");
    if constexpr (Rank < 2) reject_eigen<Derived>();
    (void)temporary;
  }

  /// Rejects every other Eigen object at compile time with a sentence that says why, instead of the compiler's
  /// "no match for operator=" (the diagnostics are listed in `reject_eigen`).
  template <class Derived>
  TensorView(const Eigen::EigenBase<Derived>& object) {  // NOLINT(google-explicit-constructor)
    reject_eigen<Derived>();
    (void)object;
  }

  T* data() const noexcept { return data_; }
  const Extents& extents() const noexcept { return extents_; }
  const Extents& strides() const noexcept { return strides_; }
  Index extent(int axis) const noexcept {
    QKV_ASSERT(axis >= 0 && axis < Rank);
    return extents_[axis];
  }
  Index stride(int axis) const noexcept {
    QKV_ASSERT(axis >= 0 && axis < Rank);
    return strides_[axis];
  }

  /// Number of elements (the product of the extents).
  Index size() const noexcept {
    Index n = 1;
    for (Index e : extents_) n *= e;
    return n;
  }
  bool empty() const noexcept { return size() == 0; }

  /// Element at the given indices (one per axis). Debug builds check the bounds.
  template <class... Indices>
  T& operator()(Indices... indices) const noexcept {
    static_assert(sizeof...(Indices) == Rank, "qkv::TensorView: one index per axis");
    const std::array<Index, Rank> index{static_cast<Index>(indices)...};
    Index offset = 0;
    for (int axis = 0; axis < Rank; ++axis) {
      QKV_ASSERT(index[axis] >= 0 && index[axis] < extents_[axis]);
      offset += index[axis] * strides_[axis];
    }
    return data_[offset];
  }

 private:
  static Extents matrix_extents(Index rows, Index cols) noexcept {
    Extents e;
    e.fill(1);
    e[Rank - 2] = rows;
    e[Rank - 1] = cols;
    return e;
  }
  static Extents matrix_strides(Index rows, Index cols, Index row_stride) noexcept {
    Extents s;
    s.fill(rows * std::max(row_stride, cols));
    s[Rank - 2] = row_stride;
    s[Rank - 1] = 1;
    return s;
  }

  /// Why an Eigen object of type Derived does not bind to this view: one static_assert fires, the first whose
  /// rule the object breaks, in this order.
  template <class Derived>
  static constexpr void reject_eigen() noexcept {
    constexpr bool kDense = std::is_base_of_v<Eigen::DenseBase<Derived>, Derived>;
    constexpr int kFlags = flags_of<Derived>();
    constexpr bool kMemory = kDense && (kFlags & Eigen::DirectAccessBit) != 0;
    constexpr bool kRowMajor = (kFlags & Eigen::RowMajorBit) != 0;
    constexpr bool kPlain = std::is_base_of_v<Eigen::PlainObjectBase<Derived>, Derived>;
    constexpr bool kMap = is_map<Derived>::value;
    constexpr bool kUnitInner = !kMap || map_unit_inner<Derived>::value;
    constexpr bool kSameScalar = same_scalar<Derived>();
    static_assert(Rank >= 2,
                  "qkv::TensorView: an Eigen object converts only to a view of rank 2 or more (extents "
                  "[1, ..., 1, Rows, Cols]); describe other memory with TensorView(data, extents, strides)");
    static_assert(Rank < 2 || kMemory,
                  "qkv::TensorView: a view needs a row-major lvalue; this Eigen expression has no memory of its own "
                  "to view: copy it into a qkv::Matrix<T> first (qkv::Matrix<T> m = expression;), or let the "
                  "options own a copy with options.set_allowed(expression) / options.set_bias(expression)");
    static_assert(Rank < 2 || !kMemory || kRowMajor,
                  "qkv::TensorView: a view needs a row-major lvalue; this Eigen object is column-major (its innermost "
                  "stride is not 1): copy it into a qkv::Matrix<T> first, or let the options own a copy with "
                  "options.set_allowed(m) / options.set_bias(m)");
    static_assert(Rank < 2 || !kMemory || !kRowMajor || kPlain || kMap,
                  "qkv::TensorView: a view needs a row-major lvalue (a qkv::Matrix<T>, a row-major Eigen::Array or an "
                  "Eigen::Map); a block, Ref or other view of an Eigen object does not bind: copy it into a "
                  "qkv::Matrix<T> first, or describe its memory with TensorView(data, extents, strides)");
    static_assert(Rank < 2 || !kMemory || !kRowMajor || !kMap || kUnitInner,
                  "qkv::TensorView: a view needs a row-major lvalue with innermost stride 1; this Eigen::Map has "
                  "another inner stride: copy it into a qkv::Matrix<T> first");
    static_assert(Rank < 2 || !kMemory || !kRowMajor || !(kPlain || kMap) || !kUnitInner || kSameScalar,
                  "qkv::TensorView: a view needs a row-major lvalue of its own element type (bool for "
                  "options.allowed, T for options.bias); this Eigen object holds another scalar type: copy it into "
                  "a qkv::Matrix of the element type first (qkv::Matrix<float> m = other.cast<float>();)");
    static_assert(Rank < 2 || !kMemory || !kRowMajor || !(kPlain || kMap) || !kUnitInner || !kSameScalar ||
                      std::is_const_v<T>,
                  "qkv::TensorView: a view of mutable elements needs a mutable row-major lvalue; this Eigen object "
                  "is const: bind it to a TensorView<const T>");
  }

  template <class Derived>
  static constexpr int flags_of() noexcept {
    if constexpr (std::is_base_of_v<Eigen::DenseBase<Derived>, Derived>) {
      return Derived::Flags;
    } else {
      return 0;
    }
  }

  template <class Derived>
  static constexpr bool same_scalar() noexcept {
    if constexpr (std::is_base_of_v<Eigen::DenseBase<Derived>, Derived>) {
      return std::is_same_v<typename Derived::Scalar, value_type>;
    } else {
      return false;
    }
  }

  template <class Derived>
  struct is_map : std::false_type {};
  template <class Plain, int MapOptions, class Stride>
  struct is_map<Eigen::Map<Plain, MapOptions, Stride>> : std::true_type {};

  template <class Derived>
  struct map_unit_inner : std::false_type {};
  template <class Plain, int MapOptions, class Stride>
  struct map_unit_inner<Eigen::Map<Plain, MapOptions, Stride>>
      : std::bool_constant<Stride::InnerStrideAtCompileTime == 0 || Stride::InnerStrideAtCompileTime == 1> {};

  T* data_ = nullptr;
  Extents extents_;
  Extents strides_;
};

template <class T>
using TensorView4 = TensorView<T, 4>;
template <class T>
using TensorView3 = TensorView<T, 3>;

/// [B, H, S, D] view of a contiguous buffer laid out [B, H, S, D] (BHSD, PyTorch's default SDPA layout).
template <class T>
TensorView4<T> view_bhsd(T* data, Index B, Index H, Index S, Index D) noexcept {
  return TensorView4<T>(data, {B, H, S, D});
}

/// [B, H, S, D] view of a contiguous buffer laid out [B, S, H, D] (BSHD: batch_first, FlashAttention).
template <class T>
TensorView4<T> view_bshd(T* data, Index B, Index S, Index H, Index D) noexcept {
  return TensorView4<T>(data, {B, H, S, D}, {S * H * D, D, H * D, 1});
}

/// The (b, h) slice of a 4-D view [B, H, S, D] as an S × D row-major `Eigen::Map`: zero-copy, row stride
/// taken from the view. Requires the innermost stride to be 1 (checked in debug builds; the public entry
/// points check it in every build).
template <class T>
auto slice(const TensorView4<T>& view, Index b, Index h) noexcept {
  using Plain = Matrix<std::remove_const_t<T>>;
  using MapType = std::conditional_t<std::is_const_v<T>, Eigen::Map<const Plain, Eigen::Unaligned, Eigen::OuterStride<>>,
                                     Eigen::Map<Plain, Eigen::Unaligned, Eigen::OuterStride<>>>;
  QKV_ASSERT(b >= 0 && b < view.extent(0) && h >= 0 && h < view.extent(1));
  QKV_ASSERT(view.extent(3) <= 1 || view.stride(3) == 1);
  T* base = view.data() == nullptr ? nullptr : view.data() + b * view.stride(0) + h * view.stride(1);
  const Index outer = view.extent(2) > 1 ? view.stride(2) : view.extent(3);
  return MapType(base, view.extent(2), view.extent(3), Eigen::OuterStride<>(outer));
}

}  // namespace qkv
