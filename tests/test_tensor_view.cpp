// Tests of qkv/tensor_view.hpp: strides of the contiguous, BSHD and Eigen-built views, const conversion,
// what must not compile (column-major and temporary Eigen objects), and the zero-copy slice.
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
  // Column-major objects have innermost stride ≠ 1 and do not convert; temporaries would dangle and do not either.
  static_assert(!std::is_convertible_v<const Eigen::MatrixXf&, TensorView4<const float>>, "column-major");
  static_assert(!std::is_constructible_v<TensorView4<const float>, qkv::Matrix<float>&&>, "temporary");
  static_assert(std::is_constructible_v<TensorView4<const float>, const qkv::Matrix<float>&>, "lvalue");
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
