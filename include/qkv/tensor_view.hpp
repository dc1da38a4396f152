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

  /// A row-major Eigen matrix or array lvalue (Rows × Cols) as a view of extents [1, …, 1, Rows, Cols].
  /// Column-major objects do not convert (their innermost stride is not 1); temporaries do not either, since
  /// the view would dangle (the overload taking an rvalue is deleted).
  template <class Derived, class = std::enable_if_t<Rank >= 2 && Derived::IsRowMajor &&
                                                    std::is_same_v<typename Derived::Scalar, value_type> &&
                                                    std::is_const_v<T>>>
  TensorView(const Eigen::PlainObjectBase<Derived>& matrix) noexcept  // NOLINT(google-explicit-constructor)
      : TensorView(matrix.data(), matrix_extents(matrix.rows(), matrix.cols()),
                   matrix_strides(matrix.rows(), matrix.cols())) {}

  /// Mutable form of the constructor above, for views of non-const elements.
  template <class Derived, class = std::enable_if_t<Rank >= 2 && Derived::IsRowMajor &&
                                                    std::is_same_v<typename Derived::Scalar, value_type> &&
                                                    !std::is_const_v<T>>,
            class = void>
  TensorView(Eigen::PlainObjectBase<Derived>& matrix) noexcept  // NOLINT(google-explicit-constructor)
      : TensorView(matrix.data(), matrix_extents(matrix.rows(), matrix.cols()),
                   matrix_strides(matrix.rows(), matrix.cols())) {}

  template <class Derived>
  TensorView(const Eigen::PlainObjectBase<Derived>&& temporary) = delete;

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
  static Extents matrix_strides(Index rows, Index cols) noexcept {
    Extents s;
    s.fill(rows * cols);
    s[Rank - 2] = cols;
    s[Rank - 1] = 1;
    return s;
  }

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
