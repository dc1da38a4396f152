// Tests of qkv/tensor_view.hpp: strides of the contiguous, BSHD and Eigen-built views (matrices, arrays, maps),
// const conversion and the zero-copy slice. What must not compile (column-major, expression, temporary Eigen
// objects) is checked with its message by the compile-fail tests (tests/compile_fail_views.cpp).
#include <gtest/gtest.h>

#include <type_traits>
#include <vector>

#include "qkv/tensor_view.hpp"

namespace {

using qkv::TensorView4;

TEST(TensorView, ContiguousStridesAndIndexing) {
  std::vector<float> data(2 * 3 * 4 * 5);
  for (std::size_t n = 0; n < data.size(); ++n) data[n] = static_cast<float>(n);
  TensorView4<float> v(data.data(), {2, 3, 4, 5});
  EXPECT_EQ(v.strides(), (TensorView4<float>::Extents{60, 20, 5, 1}));
  EXPECT_EQ(v(1, 2, 3, 4), 119.0f);
  EXPECT_EQ(v.size(), 120);
  TensorView4<const float> c = v;  // mutable converts to const
  EXPECT_EQ(c(1, 0, 2, 1), 60 + 10 + 1);
  static_assert(!std::is_convertible_v<TensorView4<const float>, TensorView4<float>>, "const must not drop");
}

TEST(TensorView, BshdAndBhsdDescribeTheSameTensor) {
  // Element (b, h, s, d) of a [B, S, H, D] buffer lives at ((b·S + s)·H + h)·D + d.
  const qkv::Index B = 2, S = 3, H = 4, D = 5;
  std::vector<int> data(static_cast<std::size_t>(B * S * H * D));
  for (std::size_t n = 0; n < data.size(); ++n) data[n] = static_cast<int>(n);
  const auto v = qkv::view_bshd(data.data(), B, S, H, D);
  EXPECT_EQ(v.extents(), (TensorView4<int>::Extents{B, H, S, D}));
  EXPECT_EQ(v(1, 2, 1, 3), ((1 * S + 1) * H + 2) * D + 3);
  EXPECT_EQ(qkv::view_bhsd(data.data(), B, H, S, D)(1, 2, 1, 3), ((1 * H + 2) * S + 1) * D + 3);
}

TEST(TensorView, FromRowMajorEigenLvalue) {
  qkv::Matrix<float> m(3, 4);
  m.setRandom();
  TensorView4<const float> v = m;
  EXPECT_EQ(v.extents(), (TensorView4<float>::Extents{1, 1, 3, 4}));
  EXPECT_EQ(v.stride(2), 4);
  EXPECT_EQ(v(0, 0, 2, 3), m(2, 3));
  Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> a(2, 2);
  a << true, false, false, true;
  TensorView4<const bool> b = a;
  EXPECT_FALSE(b(0, 0, 0, 1));
  static_assert(std::is_constructible_v<TensorView4<const float>, const qkv::Matrix<float>&>, "lvalue");
  static_assert(std::is_convertible_v<qkv::Matrix<float>&, TensorView4<float>>, "mutable lvalue");
  // Column-major objects (innermost stride ≠ 1), expressions, temporaries (the view would dangle), another scalar
  // type and const data for a mutable view are chosen by a constructor whose body is a static_assert with a
  // sentence ("a view needs a row-major lvalue; ..."), so they fail to compile with that sentence instead of "no
  // match for operator=". Traits cannot see a static_assert in a body: the compile-fail tests
  // (tests/compile_fail_views.cpp, ctest compile_fail_view_*) check those cases and their messages.
}

TEST(TensorView, FromRowMajorEigenMap) {
  // A Map owns nothing, so a temporary Map binds; the view takes the Map's outer stride.
  std::vector<float> data(3 * 7);
  for (std::size_t n = 0; n < data.size(); ++n) data[n] = static_cast<float>(n);
  using Strided = Eigen::Map<const qkv::Matrix<float>, Eigen::Unaligned, Eigen::OuterStride<>>;
  const TensorView4<const float> v = Strided(data.data() + 1, 3, 4, Eigen::OuterStride<>(7));
  EXPECT_EQ(v.extents(), (TensorView4<float>::Extents{1, 1, 3, 4}));
  EXPECT_EQ(v.stride(2), 7);
  EXPECT_EQ(v.stride(3), 1);
  EXPECT_EQ(v(0, 0, 2, 3), 2 * 7 + 1 + 3);
  EXPECT_EQ(v.data(), data.data() + 1);
  // A mutable Map gives a mutable view of the same memory, contiguous by default.
  TensorView4<float> w = Eigen::Map<qkv::Matrix<float>>(data.data(), 3, 7);
  w(0, 0, 1, 2) = -1.0f;
  EXPECT_EQ(data[7 + 2], -1.0f);
  EXPECT_EQ(w.stride(2), 7);
  // A one-row matrix is a [1, 1, 1, Skv] view (a mask broadcast over the queries).
  const Eigen::Matrix<bool, 1, Eigen::Dynamic> row = Eigen::Matrix<bool, 1, Eigen::Dynamic>::Constant(5, true);
  const TensorView4<const bool> r = row;
  EXPECT_EQ(r.extents(), (TensorView4<bool>::Extents{1, 1, 1, 5}));
}

TEST(TensorView, SliceIsAZeroCopyMap) {
  std::vector<float> data(2 * 3 * 4 * 5, 0.0f);
  const auto v = qkv::view_bshd(data.data(), 2, 4, 3, 5);  // [B=2, H=3, S=4, D=5] over BSHD memory
  auto head = qkv::slice(v, 1, 2);
  EXPECT_EQ(head.rows(), 4);
  EXPECT_EQ(head.cols(), 5);
  head(3, 4) = 42.0f;
  EXPECT_EQ(v(1, 2, 3, 4), 42.0f);
  EXPECT_EQ(&head(0, 0), &v(1, 2, 0, 0));
}

TEST(TensorView, DefaultIsEmpty) {
  TensorView4<const float> v;
  EXPECT_EQ(v.data(), nullptr);
  EXPECT_TRUE(v.empty());
}

}  // namespace
